"""A decode-step run against a committed decode-step record: graph_ms per shape and batch size, before -> after.

    python3 scripts/decode_step_compare.py NEW.json [--against RECORD.json] [--tolerance-pct 5] [--variant model]

NEW.json is benchmarks/decode_step.py's --out (scripts/h200.sh decode-step runs both). Without --against, the
record is the newest `benchmarks/results/kernels/decode-step-*.json` (by its `date` field) that measured the same
variant on every shape of the run and is on the run's GPU. Each (shape, batch size) the two share is printed with
its change; the check passes when none is slower than +tolerance % (the two newest committed records, a day and a
few kernel changes apart, differ by -5.7 % to +3.5 % point by point, so the default is 5 %; faster is reported).
Exit 0 when every shared point is within tolerance, 1 when one is slower beyond it, 2 when nothing was compared.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

RECORDS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "kernels"


def graph_ms(record: dict[str, Any], variant: str) -> dict[str, dict[int, float]]:
    """shape -> batch size -> graph_ms of the record's runs of `variant` (not its `before` half)."""
    out: dict[str, dict[int, float]] = {}
    for run in record.get("runs", []):
        if run.get("variant") == variant:
            rows = {int(row["batch"]): float(row["graph_ms"]) for row in run.get("rows", []) if row.get("graph_ms")}
            out.setdefault(run["shape"], {}).update(rows)
    return out


def newest_record(shapes: set[str], variant: str, gpu: str | None, exclude: Path) -> Path | None:
    """The newest committed decode-step record with `variant` on every one of `shapes`, on `gpu`."""
    best: tuple[str, Path] | None = None
    for path in sorted(RECORDS.glob("decode-step-*.json")):
        if path.resolve() == exclude.resolve():
            continue
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if record.get("kind") != "decode_step" or (gpu and record.get("gpu") != gpu):
            continue
        if not shapes <= set(graph_ms(record, variant)):
            continue
        key = (str(record.get("date") or ""), path)
        if best is None or key > best:
            best = key
    return best[1] if best else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("new", type=Path, help="decode_step.py's --out of the run to check")
    parser.add_argument("--against", type=Path, default=None, help="the record to compare with (default: newest)")
    parser.add_argument("--variant", default="model")
    parser.add_argument("--tolerance-pct", type=float, default=5.0)
    args = parser.parse_args()
    if not args.new.is_file():
        print(f"decode-step compare: no run to check: {args.new} does not exist")
        return 2
    new = json.loads(args.new.read_text())
    after = graph_ms(new, args.variant)
    if not after:
        print(f"decode-step compare: the run has no `{args.variant}` rows: nothing to compare")
        return 2
    against = args.against or newest_record(set(after), args.variant, new.get("gpu"), args.new)
    if against is None:
        print(f"decode-step compare: no committed record of `{args.variant}` on {', '.join(sorted(after))} "
              f"on {new.get('gpu')}: nothing to compare")  # fmt: skip
        return 2
    old = json.loads(against.read_text())
    before = graph_ms(old, args.variant)
    print(f"after:  {args.new.name} (commit {str(new.get('commit'))[:7]}, {new.get('gpu')}, {new.get('date')})")
    print(f"before: {against.name} (commit {str(old.get('commit'))[:7]}, {old.get('gpu')}, {old.get('date')})")
    compared, slower = 0, []
    for shape in sorted(after):
        for batch in sorted(set(after[shape]) & set(before.get(shape, {}))):
            b, a = before[shape][batch], after[shape][batch]
            change = 100.0 * (a - b) / b
            compared += 1
            flag = "" if change <= args.tolerance_pct else f"  SLOWER than +{args.tolerance_pct:g}%"
            print(f"  {shape:>8} B={batch:<4} {b:8.3f} -> {a:8.3f} ms  {change:+6.1f}%{flag}")
            if flag:
                slower.append(f"{shape} B={batch} {change:+.1f}%")
    if not compared:
        print("decode-step compare: no (shape, batch size) in common with the record: nothing compared")
        return 2
    print(f"decode-step compare: {compared - len(slower)}/{compared} within +{args.tolerance_pct:g}% of {against.name}")
    for item in slower:
        print(f"  slower: {item}")
    return 1 if slower else 0


if __name__ == "__main__":
    sys.exit(main())
