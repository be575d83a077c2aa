"""The test suite's own layout: every test module imports under the `tests.` package, so a folder such as
tests/kernels can never stand in for a distribution of the same top-level name (Hugging Face's `kernels`, which
transformers >= 5.25 imports when it is installed: stop 29's CI failed on exactly that)."""

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_every_module_from_the_test_folder_is_under_the_tests_package() -> None:
    stray = []
    for name, module in list(sys.modules.items()):
        origin = getattr(module, "__file__", None)
        if origin is None:
            continue
        path = Path(origin).resolve()
        if path.is_relative_to(TESTS) and not (name == "tests" or name.startswith("tests.")):
            stray.append(f"{name} -> {path}")
    assert __name__.startswith("tests."), __name__
    assert not stray, stray
