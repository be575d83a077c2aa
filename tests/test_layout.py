"""The test suite's own layout: nothing under tests/ can stand in for an installed distribution of the same
top-level name. tests/ is a package, so its package folders import as tests.kernels, tests.model, ...; stop 29's CI
failed when tests/kernels imported as `kernels`, which transformers >= 5.25 then took for Hugging Face's `kernels`.
Plain helper modules in folders without an __init__.py (tests/bench puts its folder on sys.path) import by their bare
names, so those names must not be any installed distribution's. The one deliberate stand-in is tests/bench/fake_vllm
(a fake `vllm` that the bench tests put on a subprocess's path in place of the peer)."""

import importlib.metadata
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
STAND_INS = (TESTS / "bench" / "fake_vllm",)


def _top_level_names() -> set[str]:
    return set(importlib.metadata.packages_distributions())


def test_test_packages_import_under_tests() -> None:
    assert (TESTS / "__init__.py").is_file()
    assert __name__ == "tests.test_layout", __name__
    for init in TESTS.rglob("__init__.py"):
        if any(init.is_relative_to(folder) for folder in STAND_INS):
            continue
        chain = init.parent
        while chain != TESTS:  # every folder up to tests/ is a package, so the name starts with tests.
            assert (chain / "__init__.py").is_file(), f"{init.parent} imports outside the tests package"
            chain = chain.parent


def test_no_bare_test_module_shares_a_distribution_name() -> None:
    top_level = _top_level_names()
    assert {"torch", "transformers"} <= top_level  # the lookup works here
    bare = [
        p
        for p in TESTS.rglob("*.py")
        if not (p.parent / "__init__.py").is_file() and not any(p.is_relative_to(f) for f in STAND_INS)
    ]
    assert bare, "expected the helper modules of tests/bench"
    clashes = sorted(str(p) for p in bare if p.stem in top_level)
    assert not clashes, clashes
    # and whatever this process has imported from tests/ under a bare name is no distribution's
    loaded = [
        name
        for name, module in list(sys.modules.items())
        if getattr(module, "__file__", None)
        and Path(module.__file__).resolve().is_relative_to(TESTS)
        and not any(Path(module.__file__).resolve().is_relative_to(f) for f in STAND_INS)
    ]
    assert not [n for n in loaded if n.split(".")[0] in top_level and not n.startswith("tests")], loaded
