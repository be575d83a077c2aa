"""The benchmark scripts under benchmarks/ imported as modules, and an importer on which the field's libraries are
absent, for the CPU tests of those scripts."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_script(name: str) -> ModuleType:
    """benchmarks/NAME.py as module NAME (benchmarks/ on sys.path first, as when the script runs)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def absent(*libraries: str) -> Callable[[str], Any]:
    """An importer on which none of `libraries` is installed, whatever this machine has."""

    def importer(name: str) -> Any:
        top = name.split(".")[0]
        if top in libraries:
            raise ModuleNotFoundError(f"No module named '{top}'")
        return importlib.import_module(name)

    return importer
