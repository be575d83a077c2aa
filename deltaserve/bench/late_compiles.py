"""`deltaserve bench late-compiles RECORD.json ...`: read a committed grid record's server logs again for the kernels
each server compiled while a run was measured, and write them into the record (`runs[].compiles`, the launches'
`late_compiles`, the ratios' `compiles_while_measured`).

A grid made since the runs' compiles were read live (bench/grid_launch.py: the log's size at the start of a run's
measured requests and at its end) needs none of this. Records made before it knew only Triton's JIT lines, per launch: a
CuTeDSL compile (FlashInfer's GDN prefill for several sequences, `_FullyFusedDeltaRuleSm90`, which stalls a vLLM step
~8-10 s) went unrecorded, and a Triton compile was not tied to the run it stalled. Here each JIT line of a launch's
log (server_logs.py reads all three of vLLM's backends) is placed by its time stamp in the window of the run it fell
in: the run's client result (its `raw/` JSON, in the record's `-raw.tgz` beside it or a resumed call's) ends at its
"date" and lasted its "duration". Both stamps have whole seconds, so a compile is inside a window
(`runs[].compiles`), at its edge (`runs[].edge_compiles`: within a second of its start or end, which a stall then
has to tell) or outside. The record says it was read this way (`compiles_placed_by`); its ratios keep their figures
and gain the flag where either arm's run compiled (bench/grid_ratios.py's `compiles_text`, as a new grid writes it).
"""

from __future__ import annotations

import argparse
import json
import tarfile
import tempfile
from datetime import datetime
from pathlib import Path
from typing import Any

from deltaserve.bench.grid_launch import run_raw_name
from deltaserve.bench.grid_ratios import flag_compiles, runs_by_point
from deltaserve.bench.server_logs import placed_compiles, run_window, timed_compiles

PLACED_BY = (
    "time: each JIT line of a launch's server log placed by its time stamp against each run's measured window (the "
    "client result's end date less its duration), inside it (runs[].compiles) or within a second of its start or end "
    "(runs[].edge_compiles), both stamps whole seconds (bench/late_compiles.py)"
)


def raw_name(run: dict[str, Any]) -> str:
    """The client result's file stem of a recorded run (bench/grid_launch.py's run_raw_name)."""
    return run_raw_name(run["arm"], run["model"], run["isl"], run["osl"], run["concurrency"],
                        bool(run.get("is_drift_check")))  # fmt: skip


def place(record: dict[str, Any], base: Path) -> list[str]:
    """Write each run's placed compiles into `record` (`base`: the folder the record's `raw/...` paths start from);
    returns a line per run that compiled while measured. A run whose log or client result is missing is left as it
    was."""
    year = _record_year(record)
    logs: dict[int, list[tuple[datetime, str]]] = {}
    found = []
    for index, launch in enumerate(record.get("launches", [])):
        log = launch.get("log")
        logs[index] = timed_compiles(base / log, year) if log else []
    for run in record.get("runs", []):
        result_path = base / "raw" / f"{raw_name(run)}.json"
        index = run.get("launch_index")
        if index not in logs or not result_path.is_file():
            continue
        window = run_window(json.loads(result_path.read_text()))
        if window is None:
            continue
        run["compiles"], edge = placed_compiles(logs[index], window)
        if edge:
            run["edge_compiles"] = edge
        else:
            run.pop("edge_compiles", None)
        if run["compiles"] or edge:
            found.append(f"{raw_name(run)}: {', '.join(run['compiles']) or '-'}; at the edge: {', '.join(edge) or '-'}")
    for index, launch in enumerate(record.get("launches", [])):
        runs = [r for r in record.get("runs", []) if r.get("launch_index") == index and "compiles" in r]
        if runs:  # every compile a measured run of this launch met, in order, once each
            launch["late_compiles"] = list(dict.fromkeys(name for r in runs for name in r["compiles"]))
    record["compiles_placed_by"] = PLACED_BY
    flag_ratios(record)
    return found


def flag_ratios(record: dict[str, Any]) -> None:
    """Each ratio whose subject's or peer's run compiled while measured (or at the edge) gets
    `compiles_while_measured` (grid_ratios.flag_compiles, as a new grid's ratios get it); its figures stay as the
    record has them (a record's ratios may predate later rules of grid_ratios.py)."""
    runs = runs_by_point(record)
    for entry in record.get("ratios") or []:
        flag_compiles(entry, runs)


def _record_year(record: dict[str, Any]) -> int:
    """The year vLLM's stamps lack: the record's date's (an ISO date or bench serve's %Y%m%d-...)."""
    date = str((record.get("host") or {}).get("date") or "")
    return int(date[:4]) if date[:4].isdigit() else datetime.now().year


def _indent(text: str) -> int:
    """The indent the record was written with (older records 1, newer 2), so a rewrite changes only what it adds."""
    second = text.split("\n", 2)[1] if text.count("\n") > 1 else ""
    return (len(second) - len(second.lstrip(" "))) or 2


def raw_tarballs(path: Path) -> list[Path]:
    """The record's raw files: `STEM-raw.tgz`, then those of the calls that resumed it, `STEMb-raw.tgz`,
    `STEMc-raw.tgz`, ... (a resumed call's console log and raw files are committed under the next letter, e.g.
    h200_prefix-35b-a3b-20261206-s28b-raw.tgz holds vllm-pc's), less any that have a record of their own."""
    first = path.with_name(f"{path.stem}-raw.tgz")
    if not first.is_file():
        return []
    later = sorted(path.parent.glob(f"{path.stem}[b-z]-raw.tgz"))
    return [first, *(p for p in later if not p.with_name(p.name.removesuffix("-raw.tgz") + ".json").is_file())]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("records", nargs="+", type=Path, help="grid record JSONs, each with its -raw.tgz beside it")


def run(args: argparse.Namespace) -> int:
    status = 0
    for path in args.records:
        tarballs = raw_tarballs(path)
        if not tarballs:
            print(f"{path}: no {path.stem}-raw.tgz beside it: nothing to read")
            status = 2
            continue
        text = path.read_text()
        record = json.loads(text)
        with tempfile.TemporaryDirectory() as tmp:
            for tgz in tarballs:  # in call order: a resumed call's files complete the first's
                with tarfile.open(tgz) as archive:
                    archive.extractall(tmp, filter="data")
            found = place(record, Path(tmp))
        path.write_text(json.dumps(record, indent=_indent(text), default=str) + "\n")
        print(f"{path.name}: {len(found)} run(s) with a compile inside or at the edge of its measured window")
        for line in found:
            print(f"  {line}")
    return status
