"""The single-GPU non-regression check of tensor parallelism: a short benchmarks/profile_decode.py run at
--tensor-parallel-size 1 against the committed H200 records of main before the TP work.

    python3 scripts/tp1_decode_compare.py NEW.json [--profile-record P] [--decode-step-record D] [--out S.json]

Per batch size it prints before -> after (and the change in %) of
- from the profile_decode record (the same harness, so these are the gated numbers): `step_ms` (wall time of one
  LLMEngine.step(), the executor abstraction included), `host_ms` (the host's own work per step) and `graph_ms`
  (GPU time of the captured decode graph alone);
- from the decode_step record (benchmarks/decode_step.py, variant `model`): its `graph_ms`, measured by another
  harness at exactly --context tokens per sequence (profile_decode's sequences hold a few dozen more), shown for
  reference only: the two harnesses differ by up to ~3.5 % on the same tree.
It fails (exit 1) when a gated number is slower than the record by more than its tolerance (graph_ms 5 %, step_ms
10 %: the step also carries the host's speed, which varies more between machines), and exits 2 when there is
nothing to compare (no batch size in common, another GPU, or a run at another tensor-parallel size).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PROFILE_RECORD = RESULTS / "profile-decode-35b-a3b-h200-20261201.json"
DECODE_STEP_RECORD = RESULTS / "decode-step-h200-20261201.json"


def _change_pct(before: float | None, after: float | None) -> float | None:
    if before is None or after is None or before <= 0:
        return None
    return 100.0 * (after - before) / before


def _cell(before: float | None, after: float | None) -> str:
    change = _change_pct(before, after)
    if change is None:
        return (
            f"{'-' if before is None else f'{before:.3f}':>8} -> {'-' if after is None else f'{after:.3f}':>8}        "
        )
    return f"{before:8.3f} -> {after:8.3f} {change:+6.1f}%"


def decode_step_graph_ms(record: dict[str, Any], shape: str) -> dict[int, float]:
    """graph_ms by batch size of the record's `model` variant of `shape` (the run measured, not its baseline)."""
    for run in record.get("runs", []):
        if run.get("shape") == shape and run.get("variant") == "model":
            return {int(row["batch"]): float(row["graph_ms"]) for row in run["rows"] if row.get("graph_ms")}
    return {}


def compare(
    new: dict[str, Any],
    profile: dict[str, Any],
    decode_step: dict[str, Any] | None,
    shape: str,
    graph_tolerance_pct: float,
    step_tolerance_pct: float,
) -> tuple[list[dict[str, Any]], list[str]]:
    """(one row per batch size of `new` found in the profile record, the failures)."""
    before = {int(row["batch_size"]): row for row in profile.get("batches", [])}
    reference = decode_step_graph_ms(decode_step, shape) if decode_step else {}
    rows, failures = [], []
    for row in new.get("batches", []):
        batch = int(row["batch_size"])
        if batch not in before:
            continue
        old = before[batch]
        entry = {
            "batch_size": batch,
            "step_ms": (old.get("step_ms"), row.get("step_ms")),
            "host_ms": (old.get("host_ms"), row.get("host_ms")),
            "graph_ms": (old.get("graph_ms"), row.get("graph_ms")),
            "decode_step_graph_ms": (reference.get(batch), row.get("graph_ms")),
        }
        for key, tolerance in (("graph_ms", graph_tolerance_pct), ("step_ms", step_tolerance_pct)):
            change = _change_pct(*entry[key])
            entry[f"{key}_change_pct"] = None if change is None else round(change, 2)
            if entry[key][1] is None:
                failures.append(f"B={batch}: no {key} measured")
            elif change is not None and change > tolerance:
                failures.append(f"B={batch}: {key} {entry[key][0]:.3f} -> {entry[key][1]:.3f} ms ({change:+.1f}% > "
                                f"+{tolerance:g}%)")  # fmt: skip
        rows.append(entry)
    return rows, failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("new", type=Path, help="profile_decode.py's --out of the run to check")
    parser.add_argument("--profile-record", type=Path, default=PROFILE_RECORD)
    parser.add_argument("--decode-step-record", type=Path, default=DECODE_STEP_RECORD)
    parser.add_argument("--shape", default="35b-a3b", help="the decode_step record's shape name")
    parser.add_argument("--graph-tolerance-pct", type=float, default=5.0)
    parser.add_argument("--step-tolerance-pct", type=float, default=10.0)
    parser.add_argument("--out", type=Path, default=None, help="also write the comparison as JSON")
    args = parser.parse_args()
    if not args.new.is_file():
        print(f"tp1 decode check: no run to check: {args.new} does not exist", file=sys.stderr)
        return 2
    new = json.loads(args.new.read_text())
    profile = json.loads(args.profile_record.read_text())
    decode_step = json.loads(args.decode_step_record.read_text()) if args.decode_step_record.is_file() else None
    print(f"after:  {args.new} (commit {str(new.get('commit'))[:12]}, {new.get('gpu')}, torch {new.get('torch')})")
    print(f"before: {args.profile_record.name} (commit {str(profile.get('commit'))[:12]}, {profile.get('gpu')})")
    if decode_step:
        print(f"        {args.decode_step_record.name} (commit {str(decode_step.get('commit'))[:12]}, reference only)")
    if new.get("tensor_parallel_size", 1) != 1:
        print(f"tp1 decode check: the run is at --tensor-parallel-size {new['tensor_parallel_size']}, not 1")
        return 2
    if new.get("gpu") != profile.get("gpu"):
        print(f"tp1 decode check: nothing comparable: the run's GPU {new.get('gpu')!r} is not the record's "
              f"{profile.get('gpu')!r}")  # fmt: skip
        return 2
    rows, failures = compare(new, profile, decode_step, args.shape, args.graph_tolerance_pct, args.step_tolerance_pct)
    if not rows:
        print("tp1 decode check: no batch size of the run is in the record: nothing compared")
        return 2
    print(f"{'B':>4}  {'step_ms (wall per step)':<28}  {'host_ms':<28}  {'graph_ms (decode graph)':<28}  "
          "graph_ms vs decode_step record (reference)")  # fmt: skip
    for entry in rows:
        cells = [_cell(*entry[key]) for key in ("step_ms", "host_ms", "graph_ms", "decode_step_graph_ms")]
        print(f"{entry['batch_size']:>4}  " + "  ".join(cells))
    if args.out:
        args.out.write_text(json.dumps({"rows": rows, "failures": failures}, indent=2) + "\n")
    checked = f"graph_ms within +{args.graph_tolerance_pct:g}%, step_ms within +{args.step_tolerance_pct:g}%"
    if failures:
        print(f"FAIL ({checked} of the profile record):")
        for failure in failures:
            print("  " + failure)
        return 1
    print(f"PASS: {len(rows)} batch sizes, {checked} of the profile record")
    return 0


if __name__ == "__main__":
    sys.exit(main())
