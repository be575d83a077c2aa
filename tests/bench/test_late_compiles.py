"""bench/server_logs.py's JIT lines of all three of vLLM's backends and their time stamps, and `deltaserve bench
late-compiles`: a committed record's server logs read again, each compile placed by time inside a run's measured
window, at its edge, or outside, the ratios flagged where either arm's run compiled and their figures untouched."""

from __future__ import annotations

import argparse
import io
import json
import tarfile
from datetime import datetime
from pathlib import Path

import pytest

from deltaserve.bench import late_compiles
from deltaserve.bench.server_logs import jit_compiles, placed_compiles, run_window, timed_compiles

VLLM_LOG = """\
(EngineCore pid=2449) INFO 12-06 19:04:12 [cutedsl_warmup.py:101] Skipping CuTeDSL warmup
(EngineCore pid=2449) WARNING 12-06 19:04:25 [jit_monitor.py:135] Triton kernel JIT compilation during inference: \
_compute_slot_mapping_kernel. This causes a latency spike; consider extending warmup to cover this shape/config.
(EngineCore pid=2449) WARNING 12-06 19:05:20 [jit_monitor.py:135] CuTeDSL JIT compilation during inference: \
_FullyFusedDeltaRuleSm90. This causes a latency spike; consider extending warmup to cover this shape/config.
(EngineCore pid=2449) WARNING 12-06 19:05:41 [jit_monitor.py:135] TileLang JIT compilation during inference: \
tl_kernel. This causes a latency spike; consider extending warmup to cover this shape/config.
"""
DELTASERVE_LOG = """\
2026-12-06 11:27:41,773 WARNING deltaserve.runner.jit_monitor [core]: Triton kernel JIT compilation during \
inference: _paged_attn_decode_kernel. This causes a latency spike; consider extending warmup to cover this shape/config.
WARNING Triton kernel JIT compilation during inference: _unstamped. This causes a latency spike
"""


def test_every_backend_of_vllms_monitor_is_read_and_stamped(tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    log.write_text(VLLM_LOG)
    names = ["_compute_slot_mapping_kernel", "_FullyFusedDeltaRuleSm90 (CuTeDSL)", "tl_kernel (TileLang)"]
    assert jit_compiles(log) == names
    assert timed_compiles(log, 2026) == [
        (datetime(2026, 12, 6, 19, 4, 25), names[0]),
        (datetime(2026, 12, 6, 19, 5, 20), names[1]),
        (datetime(2026, 12, 6, 19, 5, 41), names[2]),
    ]
    ours = tmp_path / "deltaserve.log"
    ours.write_text(DELTASERVE_LOG)
    # a line without a stamp it can read is counted by the live reading and left out of the timed one
    assert jit_compiles(ours) == ["_paged_attn_decode_kernel", "_unstamped"]
    assert timed_compiles(ours, 1999) == [(datetime(2026, 12, 6, 11, 27, 41), "_paged_attn_decode_kernel")]


def test_a_compile_is_inside_a_window_at_its_edge_or_outside() -> None:
    """Stamps and the window's end are whole seconds: a stamp S is a time in [S, S+1), the window ends in [E, E+1)
    and starts up to a second after E - duration."""
    window = run_window({"date": "20261206-190537", "duration": 24.65})  # 19:05:12.35 .. 19:05:37
    assert window == (datetime(2026, 12, 6, 19, 5, 12, 350000), datetime(2026, 12, 6, 19, 5, 37))

    def at(second: int) -> list[tuple[datetime, str]]:
        return [(datetime(2026, 12, 6, 19, 5, second), f"k{second}")]

    assert placed_compiles(at(11), window) == ([], [])  # ended before the window can have begun
    assert placed_compiles(at(12), window) == ([], ["k12"])  # its second overlaps the start
    assert placed_compiles(at(13), window) == ([], ["k13"])  # the start may be as late as 13.35
    assert placed_compiles(at(14), window) == (["k14"], [])
    assert placed_compiles(at(36), window) == (["k36"], [])
    assert placed_compiles(at(37), window) == ([], ["k37"])  # the end may be as late as 37.99
    assert placed_compiles(at(38), window) == ([], [])
    assert run_window({"date": "20261206-190537"}) is None


def _record(tmp_path: Path) -> Path:
    """A two-arm record of one point with its -raw.tgz: the peer's log has a CuTeDSL compile inside its run and a
    Triton one between the runs; the subject's log none."""
    ratio = {"subject": "deltaserve", "peer": "vllm", "model": "m", "isl": 16, "osl": 4, "concurrency": 4}
    ratio |= {"output_throughput": 1.431, "median_ttft_ms": 0.29}
    runs = [
        {"arm": arm, "model": "m", "isl": 16, "osl": 4, "concurrency": 4, "is_drift_check": False,
         "launch_index": index, "metrics": {"output_throughput": 1.0}, "error": None}
        for index, arm in enumerate(("deltaserve", "vllm"))
    ]  # fmt: skip
    launches = [{"arm": r["arm"], "model": "m", "log": f"raw/server-0{i}-{r['arm']}-m.log"} for i, r in enumerate(runs)]
    record = {"host": {"date": "2026-12-06T19:10:00+00:00"}, "launches": launches, "runs": runs, "ratios": [ratio]}
    path = tmp_path / "long-20261206.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    members = {
        "raw/server-00-deltaserve-m.log": "2026-12-06 19:00:01,000 INFO deltaserve.serve: loading\n",
        "raw/server-01-vllm-m.log": VLLM_LOG,
        "raw/deltaserve-m-16x4-c4.json": json.dumps({"date": "20261206-190140", "duration": 20.0}),
        "raw/vllm-m-16x4-c4.json": json.dumps({"date": "20261206-190537", "duration": 24.65}),
    }
    with tarfile.open(tmp_path / "long-20261206-raw.tgz", "w:gz") as archive:
        for name, text in members.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


def test_a_record_is_read_again_and_its_ratio_flagged(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _record(tmp_path)
    before = json.loads(path.read_text())
    parser = argparse.ArgumentParser()
    late_compiles.add_arguments(parser)
    assert late_compiles.run(parser.parse_args([str(path)])) == 0
    record = json.loads(path.read_text())
    subject, peer = record["runs"]
    assert subject["compiles"] == [] and "edge_compiles" not in subject
    assert peer["compiles"] == ["_FullyFusedDeltaRuleSm90 (CuTeDSL)"]  # 19:05:20; 19:04:25 and 19:05:41 outside
    assert record["launches"][1]["late_compiles"] == ["_FullyFusedDeltaRuleSm90 (CuTeDSL)"]
    (ratio,) = record["ratios"]
    assert ratio["compiles_while_measured"].startswith(
        "vllm compiled _FullyFusedDeltaRuleSm90 (CuTeDSL) while measured"
    )
    # the figures stay as they were; only the flag and the reading's provenance are new
    assert {k: v for k, v in ratio.items() if k != "compiles_while_measured"} == before["ratios"][0]
    assert record["compiles_placed_by"].startswith("time:")
    assert path.read_text().startswith('{\n "host"')  # written with the record's own indent
    assert "vllm-m-16x4-c4: _FullyFusedDeltaRuleSm90 (CuTeDSL)" in capsys.readouterr().out


def test_a_record_without_its_raw_logs_has_nothing_to_read(tmp_path: Path) -> None:
    path = tmp_path / "alone.json"
    path.write_text("{}")
    parser = argparse.ArgumentParser()
    late_compiles.add_arguments(parser)
    assert late_compiles.run(parser.parse_args([str(path)])) == 2
    assert path.read_text() == "{}"


def test_a_resumed_calls_raw_files_are_read_too(tmp_path: Path) -> None:
    """A grid resumed in a later call commits that call's raw files under the next letter (STEMb-raw.tgz); a
    tarball with a record of its own is that record's."""
    record = tmp_path / "prefix-s28.json"
    record.write_text("{}")
    assert late_compiles.raw_tarballs(record) == []
    for name in ("prefix-s28-raw.tgz", "prefix-s28b-raw.tgz", "prefix-s28c-raw.tgz", "prefix-s28-other-raw.tgz"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "prefix-s28c.json").write_text("{}")
    assert [p.name for p in late_compiles.raw_tarballs(record)] == ["prefix-s28-raw.tgz", "prefix-s28b-raw.tgz"]
