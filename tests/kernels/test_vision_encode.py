"""benchmarks/vision_encode.py on the CPU: the record's rows for each image count and arm, and the bit-equality check
against a baseline tower file (here the current one). Host and GPU times need the H200."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.support.scripts import load_script
from tests.support.threads import one_thread  # noqa: F401 (module-scoped autouse fixture)
from tests.support.vision import tiny_vision_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def _load() -> object:
    return load_script("vision_encode")


def test_rows_per_arm_and_image_count(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    vision_encode = _load()
    out = tmp_path / "vision-encode.json"
    argv = ["vision_encode.py", "--model", str(tiny_vision_checkpoint("dense-vl")), "--device", "cpu",
            "--images", "1,3", "--side", "64", "--reps", "1", "--out", str(out),
            "--baseline", str(ROOT / "deltaserve" / "model" / "vision.py")]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    assert vision_encode.main() == 0
    record = json.loads(out.read_text())
    assert record["kind"] == "vision-encode" and record["device"] == "cpu"
    rows = record["rows"]
    assert [(r["arm"], r["images"], r["patches"]) for r in rows] == [
        ("current", 1, 16), ("baseline", 1, 16), ("current", 3, 48), ("baseline", 3, 48),
    ]  # fmt: skip
    assert all(r["host_ms"] > 0 and r["ops"] > 0 and r["gpu_ms"] is None for r in rows)
    assert [r["is_bit_equal"] for r in rows if r["arm"] == "baseline"] == [True, True]
