"""benchmarks/oracle/gdn_prefill_kernels.py `--cases`: the sizes the GDN prefill side by side times (the crossover
between deltaserve's kernel and the libraries lies between its default cases), parsed on the CPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


def _tool() -> ModuleType:
    path = REPO / "benchmarks/oracle/gdn_prefill_kernels.py"
    spec = importlib.util.spec_from_file_location("gdn_prefill_kernels", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cases_name_single_sequences_and_batches() -> None:
    cases = _tool().parse_cases("2048, 4096,4x2048,8192")
    assert cases == (
        ("isl2048", (2048,)),
        ("isl4096", (4096,)),
        ("4x2048", (2048, 2048, 2048, 2048)),
        ("isl8192", (8192,)),
    )


@pytest.mark.parametrize("spec", ["", "x2048", "4x", "2048tokens", "0", "0x64", "-4x2048", "4x2x64"])
def test_malformed_cases_are_refused_by_name(spec: str) -> None:
    with pytest.raises(ValueError, match="--cases"):
        _tool().parse_cases(spec)


def test_the_default_cases_are_the_recorded_ones() -> None:
    # the committed record's rows (benchmarks/results/kernels/gdn-prefill-ab-h200-20261206-s28.json) used these
    labels = [label for label, _ in _tool().CASES]
    assert labels == ["isl1024", "isl3072", "8x1024", "isl16384"]
