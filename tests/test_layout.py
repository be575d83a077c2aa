"""The test suite's own layout: tests/ mirrors deltaserve/'s folders, and nothing under tests/ can stand in for an
installed distribution of the same top-level name.

tests/ and every folder under it that holds Python files are packages, so a test module imports as tests.kernels...,
tests.bench..., never as `kernels` (Hugging Face's `kernels`, which transformers >= 5.25 imports, is a distribution
of that name) or under any other bare name. The one deliberate stand-in is tests/bench/fake_vllm (a fake `vllm` that
the bench tests put on a subprocess's path in place of the peer).
"""

import importlib.metadata
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
PACKAGE = TESTS.parent / "deltaserve"
STAND_INS = (TESTS / "bench" / "fake_vllm",)
# test folders with no package folder of that name: shared helpers
HELPER_FOLDERS = {"support"}


def _top_level_names() -> set[str]:
    return set(importlib.metadata.packages_distributions())


def _is_stand_in(path: Path) -> bool:
    return any(path.is_relative_to(folder) for folder in STAND_INS)


def test_test_packages_import_under_tests() -> None:
    assert (TESTS / "__init__.py").is_file()
    assert __name__ == "tests.test_layout", __name__
    folders = {p.parent for p in TESTS.rglob("*.py") if not _is_stand_in(p)}
    assert len(folders) > 1
    missing = sorted(str(folder) for folder in folders if not (folder / "__init__.py").is_file())
    assert not missing, f"folders that would import outside the tests package: {missing}"


def test_test_folders_mirror_the_package() -> None:
    """Each folder of tests/ is named for a package folder of deltaserve/ (or holds shared helpers), and every
    package folder with code has its test folder."""
    test_folders = {p.name for p in TESTS.iterdir() if (p / "__init__.py").is_file()}
    package_folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert {"engine", "model"} <= package_folders  # the lookup works here
    assert test_folders - HELPER_FOLDERS <= package_folders, sorted(test_folders - HELPER_FOLDERS - package_folders)
    assert package_folders <= test_folders, sorted(package_folders - test_folders)


def test_no_test_module_imports_under_a_bare_name() -> None:
    top_level = _top_level_names()
    assert {"torch", "transformers"} <= top_level  # the lookup works here
    # whatever this process has imported from tests/ is named under tests., so no name of it is a distribution's
    loaded = [
        name
        for name, module in list(sys.modules.items())
        if getattr(module, "__file__", None)
        and Path(module.__file__).resolve().is_relative_to(TESTS)
        and not _is_stand_in(Path(module.__file__).resolve())
    ]
    assert "tests.test_layout" in loaded
    bare = [name for name in loaded if name != "tests" and not name.startswith("tests.")]
    assert not bare, f"modules of tests/ imported under a bare name: {bare}"
