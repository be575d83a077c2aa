"""`deltaserve bench report`: regenerate docs/BENCHMARKS.md (plots in docs/plots/) and benchmarks/results/INDEX.md.

Input: every `*.json` grid record in benchmarks/results/grids/ (schema deltaserve-grid-record/1), oldest first.
The Markdown opens with the current standing: one table per grid and model from its NEWEST record (every
subject/peer ratio of output throughput, median TTFT and median TPOT per concurrency, or each arm's own figures
where the grid has no peer; both engines' prefix-cache hit rates beside each ratio where the record has them, and
both arms' mean acceptance length where an arm speculates), with
the record it comes from. A grid whose workload (the client's flags for that
model) a newer grid with a peer has measured since is left to the history. Then the notes, each printed once and
referenced by mark from every cell it concerns: a peer's denominator note, a registry deviation that can move
the ratio (`†`: a backend production would not pick, e.g. vLLM's GDN prefill on Triton; recognised from the
record's arm entry or its launch argv), outputs that differ between the arms (`‡`). Then the history: per grid
and model the output-throughput ratio of every record, and every record in full (provenance, exact launches,
metrics, ratios, drift check, plot), newest first.
The output is deterministic (no generation timestamp), so `--check` can tell whether the docs are stale.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

from deltaserve.bench import records_index
from deltaserve.bench.deviations import DEVIATIONS, Deviation, deviations_in
from deltaserve.bench.grid import DEFAULT_RESULT_DIR, RECORD_SCHEMA, REPO_ROOT
from deltaserve.bench.grid_ratios import HIT_RATE as RUN_HIT_RATE
from deltaserve.bench.grid_ratios import format_percent

DEFAULT_RESULTS = DEFAULT_RESULT_DIR
DEFAULT_OUTPUT = REPO_ROOT / "docs" / "BENCHMARKS.md"
PLOT_DIR = "plots"  # next to the Markdown file
# Client flags that differ between the runs of one workload (server, label, load level; a multi-turn grid's clients
# follow its concurrency): not part of a workload.
PER_RUN_FLAGS = ("--base-url", "--label", "--num-prompts", "--max-concurrency", "--tokenizer",
                 "--multi-turn-num-clients")  # fmt: skip
Records = list[tuple[str, dict[str, Any]]]


def load_records(results_dir: Path) -> Records:
    """(stem, record) for every grid record in `results_dir`, ordered by record date then name."""
    records = []
    for path in sorted(results_dir.glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and record.get("schema") == RECORD_SCHEMA:
            records.append((path.stem, record))
    records.sort(key=lambda item: (item[1].get("host", {}).get("date") or "", item[0]))
    return records


def _num(value: Any, digits: int = 1) -> str:
    if value is None:
        return "–"
    if isinstance(value, int | float):
        return f"{value:.{digits}f}"
    return str(value)


def _ratio(value: Any) -> str:
    return "–" if value is None else f"{value:.3f}"


def _has_hit_rates(entries: list[dict[str, Any]]) -> bool:
    """Whether the ratios carry both engines' prefix-cache hit rates (grids since issue 36)."""
    return any("subject_prefix_cache_hit_rate" in e for e in entries)


def _hit_rates(entry: dict[str, Any]) -> str:
    """Both engines' prefix-cache hit rates (cached / prompt tokens, from their /metrics) at a ratio's point."""
    subject, peer = entry.get("subject_prefix_cache_hit_rate"), entry.get("peer_prefix_cache_hit_rate")
    return f"{format_percent(subject)} / {format_percent(peer)}"


def _has_acceptance(entries: list[dict[str, Any]]) -> bool:
    """Whether any ratio has an MTP arm (its mean acceptance length, from /metrics: grids since issue 41)."""
    return any("subject_mean_acceptance_length" in e for e in entries)


def _acceptance(entry: dict[str, Any]) -> str:
    """Both arms' mean acceptance length at a ratio's point ("–" for an arm that does not speculate)."""
    a, b = (entry.get(f"{side}_mean_acceptance_length") for side in ("subject", "peer"))
    return f"{'–' if a is None else f'{a:.2f}'} / {'–' if b is None else f'{b:.2f}'}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return lines


class Notes:
    """Every note the document cites, numbered in order of first use and printed once under `## Notes`."""

    def __init__(self) -> None:
        self.texts: dict[str, int] = {}

    def ref(self, text: str, mark: str = "") -> str:
        """A link to the note's heading, e.g. `[†1](#note-1)`."""
        number = self.texts.setdefault(text, len(self.texts) + 1)
        return f"[{mark}{number}](#note-{number})"

    def render(self) -> list[str]:
        if not self.texts:
            return []
        lines = ["## Notes", ""]
        for text, number in self.texts.items():
            lines += [f"### Note {number}", "", text, ""]
        return lines


def arm_deviations(record: dict[str, Any], arm: str) -> list[Deviation]:
    """The registry deviations an arm ran with: named in the record, or recognised in its recorded launches
    (a record written before the registry named them still gets marked)."""
    names = list((record.get("arms", {}).get(arm) or {}).get("deviations") or [])
    for entry in record.get("launches", []):
        if entry.get("arm") == arm:
            names += [d.name for d in deviations_in(entry.get("argv") or [], entry.get("env") or {})]
    return [DEVIATIONS[name] for name in dict.fromkeys(names) if name in DEVIATIONS]


def _deviation_text(record: dict[str, Any], peer: str, deviation: Deviation) -> str:
    note = (record.get("arms", {}).get(peer) or {}).get("denominator_note") or ""
    is_carried = any(text in note for text in deviation.notes)  # a record may carry an earlier wording
    return deviation.note if is_carried else f"{deviation.note} (the record itself lacks this note)"


def _own_note(record: dict[str, Any], arm: str) -> str:
    """An arm's denominator note less the registry deviations' notes (those are marked on the cells they move)."""
    note = (record.get("arms", {}).get(arm) or {}).get("denominator_note") or ""
    for deviation in DEVIATIONS.values():
        for text in deviation.notes:
            note = note.replace(text, "")
    return note.strip()


def _arm_marks(record: dict[str, Any], arm: str, notes: Notes, metric: str | None = None) -> list[str]:
    """`*` for the arm's own denominator note, `†` per registry deviation of the arm that can move `metric` (any
    metric when None)."""
    own = _own_note(record, arm)
    marks = [notes.ref(own, "*")] if own and metric is None else []
    for deviation in arm_deviations(record, arm):
        if (metric in deviation.affects) if metric else deviation.affects:
            marks.append(notes.ref(_deviation_text(record, arm, deviation), "†"))
    return marks


def _pair(record: dict[str, Any], subject: str, peer: str, notes: Notes) -> str:
    """`subject / peer`, marked with the peer's own denominator note."""
    own = _own_note(record, peer)
    return f"{subject} / {peer}" + (f" {notes.ref(own, '*')}" if own else "")


def _ratio_cell(record: dict[str, Any], entry: dict[str, Any], metric: str, notes: Notes) -> str:
    """A ratio with a `†` mark per peer deviation that can move this metric, `‡` on output throughput when the
    arms' outputs differ, and `§` where either arm's server compiled a kernel while the point was measured."""
    if entry.get("excluded"):
        return "– (failed requests)"
    text = " ".join([_ratio(entry.get(metric)), *_arm_marks(record, entry["peer"], notes, metric)])
    if metric == "output_throughput" and entry.get("unequal_outputs"):
        text += " " + notes.ref(f"{entry['model']} c{entry['concurrency']}: {entry['unequal_outputs']}", "‡")
    if entry.get("compiles_while_measured"):  # a server stalled for a kernel compile during this point's run
        point = f"{entry['model']} {entry['isl']}/{entry['osl']} c{entry['concurrency']}"
        text += " " + notes.ref(f"{point}: {entry['compiles_while_measured']}", "§")
    return text


def _runs(record: dict[str, Any], model: str) -> list[dict[str, Any]]:
    return [r for r in record.get("runs", []) if r["model"] == model and not r["is_drift_check"]]


def _models(record: dict[str, Any]) -> list[str]:
    return [m["name"] for m in record.get("models", []) if _runs(record, m["name"])]


def workload(record: dict[str, Any], model: str) -> str:
    """The client's flags for a model's runs, less those that differ per run: two records with the same
    workload measured the same traffic."""
    for run in _runs(record, model):
        words = shlex.split(run.get("client_command_line") or "")
        kept = [
            w for i, w in enumerate(words) if w not in PER_RUN_FLAGS and (i == 0 or words[i - 1] not in PER_RUN_FLAGS)
        ]
        return " ".join(kept)
    return ""


def _subjects(record: dict[str, Any], model: str) -> set[str]:
    return {e["subject"] for e in record.get("ratios", []) if e["model"] == model}


def _card(record: dict[str, Any]) -> str:
    """The GPU a record ran on (its first), or "no GPU": records of one grid on different cards stand apart."""
    gpus = record.get("host", {}).get("gpus") or []
    return gpus[0] if gpus else "no GPU"


def standing(records: Records) -> tuple[list[tuple[str, str, str, Records]], list[tuple[str, str, str]]]:
    """([(grid, model, card, its records oldest first)] that stand, [(grid, model, the newer grid)] left to history),
    per card: an H100 run of an H200 grid stands beside the H200's, never in its place.

    A grid with a peer is left to history once a newer record of another grid with a peer measured the same
    workload on the same model with one of the same subjects (e.g. a first grid that a later core grid repeats; not
    a grid that compares two peers with each other)."""
    groups: dict[tuple[str, str, str], Records] = {}
    for stem, record in records:
        for model in _models(record):
            groups.setdefault((record["grid"], model, _card(record)), []).append((stem, record))
    date = {key: members[-1][1].get("host", {}).get("date") or "" for key, members in groups.items()}
    stands, superseded = [], []
    for (grid, model, card), members in groups.items():
        newest = members[-1][1]
        newer = [
            other
            for other in groups
            if other[1] == model
            and other[2] == card
            and other[0] != grid
            and date[other] > date[(grid, model, card)]
            and newest.get("ratios")
            and groups[other][-1][1].get("ratios")
            and workload(groups[other][-1][1], model) == workload(newest, model)
            and _subjects(groups[other][-1][1], model) & _subjects(newest, model)
        ]
        if newer:
            superseded.append((grid, model, min(newer)[0]))
        else:
            stands.append((grid, model, card, members))
    # grids with a peer first, then by grid name; within a grid the larger model name first (35B-A3B before 27B),
    # the H200's before another card's
    stands.sort(key=lambda item: (item[1], "H200" in item[2]), reverse=True)
    stands.sort(key=lambda item: (not item[3][-1][1].get("ratios"), item[0]))
    return stands, sorted(superseded)


def _source(record: dict[str, Any]) -> str:
    """date, commit and GPU of a record, as one phrase."""
    host = record.get("host", {})
    commit = (host.get("git") or {}).get("commit") or "unknown"
    gpus = ", ".join(host.get("gpus") or []) or "no GPU"
    return f"{(host.get('date') or '–')[:10]}, commit `{commit[:7]}`, {gpus}"


def _metric(record: dict[str, Any], model: str, arm: str, isl: int, osl: int, concurrency: int, key: str) -> Any:
    for run in _runs(record, model):
        if (run["arm"], run["isl"], run["osl"], run["concurrency"]) == (arm, isl, osl, concurrency):
            return (run.get("metrics") or {}).get(key)
    return None


def _standing_table(stem: str, record: dict[str, Any], model: str, notes: Notes) -> list[str]:
    """Every ratio of one model in one record, or each arm's own figures where the grid has no peer."""
    entries = [e for e in record.get("ratios", []) if e["model"] == model]
    if entries:
        rows = []
        for e in sorted(entries, key=lambda e: (e["isl"], e["osl"], e["concurrency"], e["subject"], e["peer"])):
            point = (model, e["isl"], e["osl"], e["concurrency"])
            ours = _metric(record, point[0], e["subject"], *point[1:], "output_throughput")
            theirs = _metric(record, point[0], e["peer"], *point[1:], "output_throughput")
            rows.append(
                [
                    f"{e['isl']}/{e['osl']}",
                    str(e["concurrency"]),
                    _pair(record, e["subject"], e["peer"], notes),
                    f"{_num(ours)} / {_num(theirs)}",
                    *(
                        _ratio_cell(record, e, m, notes)
                        for m in ("output_throughput", "median_ttft_ms", "median_tpot_ms")
                    ),
                ]
            )
        header = ["ISL/OSL", "conc", "subject / peer", "out tok/s (subject / peer)", "out tok/s ratio"]
        header += ["TTFT med ratio", "TPOT med ratio"]
        if _has_hit_rates(entries):
            ordered = sorted(entries, key=lambda e: (e["isl"], e["osl"], e["concurrency"], e["subject"], e["peer"]))
            rows = [[*row, _hit_rates(e)] for row, e in zip(rows, ordered, strict=True)]
            header.append("prefix cache hit rate (subject / peer)")
        if _has_acceptance(entries):
            ordered = sorted(entries, key=lambda e: (e["isl"], e["osl"], e["concurrency"], e["subject"], e["peer"]))
            rows = [[*row, _acceptance(e)] for row, e in zip(rows, ordered, strict=True)]
            header.append("mean acceptance length (subject / peer)")
        return _table(header, rows)
    rows = []
    runs = sorted(_runs(record, model), key=lambda r: (r["isl"], r["osl"], r["concurrency"], r["arm"]))
    # the server's own hit rate, where it reported one: a cache hit on random data is a measured prompt sent before
    has_hits = any(RUN_HIT_RATE in (r.get("metrics") or {}) for r in runs)
    for r in runs:
        m = r.get("metrics") or {}
        cells = [_num(m.get("output_throughput")), _num(m.get("median_ttft_ms")), _num(m.get("median_tpot_ms"), 2)]
        cells += [format_percent(m.get(RUN_HIT_RATE))] if has_hits else []
        rows.append([f"{r['isl']}/{r['osl']}", str(r["concurrency"]), r["arm"], *cells])
    header = ["ISL/OSL", "conc", "arm (no peer)", "out tok/s", "TTFT med ms", "TPOT med ms"]
    return _table([*header, *(["prefix cache hit rate"] if has_hits else [])], rows)


def _standing(records: Records, notes: Notes, cite: Callable[[str], str]) -> list[str]:
    stands, superseded = standing(records)
    lines = [
        "## Current standing",
        "",
        "One table per grid, model and GPU, from its newest record. Ratios are subject / peer: above 1 favours the "
        "subject for throughput, below 1 for TTFT and TPOT. Marks link to the notes below: `*` the peer's "
        "denominator note, `†` a registry deviation of the peer (a backend its production defaults would not "
        "pick) that can move the ratio, `‡` the arms' outputs differ in how many are distinct (on dummy weights "
        "they may have done different expert work).",
        "",
    ]
    for grid, model, card, members in stands:
        stem, record = members[-1]
        title = record.get("title", stem)
        if card != "no GPU" and "H200" not in card:  # the grid's title names the H200 it was written for
            title += f" (this record: {card})"
        lines += [f"### {grid}: {model}, {card}", "", title, ""]
        older = f"; {len(members) - 1} older in the history" if len(members) > 1 else ""
        details = f"[provenance, launches, metrics](#{stem.lower()})"
        lines += [f"Newest record {cite(stem)} ({_source(record)}; {details}){older}.", ""]
        lines += [*_standing_table(stem, record, model, notes), ""]
    for grid, model, newer in superseded:
        lines += [f"`{grid}` on {model}: the same workload as the newer `{newer}` records above; in the history.", ""]
    return lines


def _history(records: Records, notes: Notes | None = None) -> list[str]:
    """Per grid, model and lengths, the output-throughput ratio of every record (one row per subject / peer pair),
    oldest first."""
    notes = notes if notes is not None else Notes()
    tables: dict[tuple[str, str, int, int], list[tuple[str, dict[str, Any], dict[str, Any]]]] = {}
    for stem, record in records:
        for entry in record.get("ratios", []):
            key = (record["grid"], entry["model"], entry["isl"], entry["osl"])
            tables.setdefault(key, []).append((stem, record, entry))
    if not tables:
        return []
    lines = ["## Ratio history: output throughput, subject / peer", ""]
    for (grid, model, isl, osl), points in sorted(tables.items()):
        concurrencies = sorted({entry["concurrency"] for _, _, entry in points})
        rows: dict[tuple[str, str, str], list[str]] = {}
        for stem, record, entry in points:
            pair = _pair(record, entry["subject"], entry["peer"], notes)  # a grid may hold several subjects
            row = rows.setdefault(
                (stem, entry["subject"], entry["peer"]),
                [f"[{stem}](#{stem.lower()})", _source(record), pair, *["–"] * len(concurrencies)],
            )
            row[3 + concurrencies.index(entry["concurrency"])] = _ratio_cell(record, entry, "output_throughput", notes)
        header = ["record", "date, commit, GPU", "subject / peer", *[f"c{c}" for c in concurrencies]]
        lines += [f"### {grid}: {model}, {isl}/{osl}", "", *_table(header, list(rows.values())), ""]
    return lines


def render_record(
    stem: str,
    record: dict[str, Any],
    plot_name: str | None,
    notes: Notes | None = None,
    cite: Callable[[str], str] | None = None,
) -> list[str]:
    """The Markdown section of one grid record."""
    notes = notes if notes is not None else Notes()
    host = record.get("host", {})
    git = host.get("git", {})
    commit = git.get("commit") or "unknown"
    dirty = " (uncommitted changes)" if git.get("is_dirty") else ""
    lines = [f"### {stem}", "", f"**{record.get('title', stem)}**", "", f"Record {(cite or _plain)(stem)}", ""]
    if record.get("description"):
        lines += [record["description"], ""]
    lines += [
        f"- date: {host.get('date', '–')}; host: {host.get('host', '–')}; python {host.get('python', '–')}",
        f"- GPU: {', '.join(host.get('gpus') or []) or 'none'}; driver: {host.get('driver') or '–'}",
        f"- project commit: `{commit}`{dirty}",
        f"- schedule: {record.get('schedule')}; complete: {record.get('is_complete')}; "
        f"config: `{record.get('config_path')}`",
    ]
    dataset = record.get("dataset")
    if dataset and dataset.get("name") != "random":
        # the lengths column counts text tokens only: say what else every prompt carried
        settings = ", ".join(f"{k.removeprefix('random_mm_')}={v}" for k, v in dataset.items() if k != "name")
        lines.append(f"- dataset: {dataset['name']}" + (f" ({settings})" if settings else ""))
    for facts in record.get("resumed") or []:
        later = (facts.get("git") or {}).get("commit") or "unknown"
        later_dirty = " (uncommitted changes)" if (facts.get("git") or {}).get("is_dirty") else ""
        lines.append(f"- continued (`--resume`) on {facts.get('date', '–')}, commit `{later}`{later_dirty}")
    for key in ("error", "interrupted", "provenance_note"):
        if record.get(key):
            lines.append(f"- {key.replace('_', ' ')}: {record[key]}")
    if record.get("skipped"):
        skipped = ", ".join(f"{s['arm']} on {s['model']} ({s['reason']})" for s in record["skipped"])
        lines.append(f"- skipped: {skipped}")
    lines.append("")

    lines += ["#### Arms", ""]
    rows = []
    for name, arm in record.get("arms", {}).items():
        versions = sorted({e.get("engine_version") or "–" for e in record["launches"] if e["arm"] == name})
        exemption = next(
            (e.get("exemption") for e in record["launches"] if e["arm"] == name and e.get("exemption")), None
        )
        rows.append(
            [
                name,
                arm.get("role", "–"),
                arm.get("oracle") or "–",
                ", ".join(versions) or "–",
                exemption or arm.get("exemption") or "–",
                " ".join(_arm_marks(record, name, notes)) or "–",
            ]
        )
    lines += _table(["arm", "role", "oracle", "engine version", "exemption", "denominator notes"], rows)
    lines += ["", "Exact launches (environment overrides, then the command line):", "", "```"]
    for entry in record.get("launches", []):
        env = " ".join(f"{k}={v}" for k, v in (entry.get("env") or {}).items())
        drift = " [drift re-run]" if entry.get("is_drift_check") else ""
        status = f" -> {entry['error']}" if entry.get("error") else f" (healthy after {_num(entry.get('startup_s'))} s)"
        kernels = entry.get("prefill_kernels")
        if kernels:  # a deltaserve server's resolved prefill kernels (its defaults depend on the libraries installed)
            status += f"; prefill kernels: attention {kernels['attention']}, GDN {kernels['gdn']}"
        if entry.get("late_compiles"):  # the server's JIT monitor named kernels compiled during measured runs
            status += f"; compiled while measured: {', '.join(entry['late_compiles'])}"
        lines.append(f"# {entry['arm']} on {entry['model']}{drift}{status}")
        lines.append(f"{env + ' ' if env else ''}{entry['command_line']}")
    lines += ["```", ""]
    client = next((r["client_command_line"] for r in record.get("runs", [])), None)
    if client:
        lines += ["Client (same flags for every arm; only the URL differs):", "", "```", client, "```", ""]

    runs = record.get("runs", [])
    for model in [m["name"] for m in record.get("models", [])]:
        model_runs = [r for r in runs if r["model"] == model]
        if not model_runs:
            continue
        lines += [f"#### Results: {model}", ""]
        rows = []
        for r in sorted(model_runs, key=lambda r: (r["isl"], r["osl"], r["concurrency"], r["is_drift_check"])):
            m = r.get("metrics") or {}
            name = r["arm"] + (" (drift)" if r["is_drift_check"] else "")
            if r.get("error"):
                rows.append([name, f"{r['isl']}/{r['osl']}", str(r["concurrency"]), f"error: {r['error']}"] + [""] * 8)
                continue
            rows.append(
                [
                    name,
                    f"{r['isl']}/{r['osl']}",
                    str(r["concurrency"]),
                    _num(m.get("output_throughput")),
                    _num(m.get("request_throughput"), 2),
                    _num(m.get("median_ttft_ms")),
                    _num(m.get("p99_ttft_ms")),
                    _num(m.get("median_tpot_ms"), 2),
                    _num(m.get("p99_itl_ms"), 2),
                    _num(m.get("median_e2el_ms")),
                    _num(m.get("peak_gpu_memory_gib"), 2),
                    f"{m.get('completed', '–')}/{m.get('failed', '–')}",
                ]
            )
        header = ["arm", "ISL/OSL", "conc", "out tok/s", "req/s", "TTFT med ms", "TTFT p99 ms", "TPOT med ms"]
        header += ["ITL p99 ms", "E2EL med ms", "peak GPU GiB", "ok/failed"]
        lines += _table(header, rows)
        lines.append("")

    if record.get("ratios"):
        lines += [
            "#### Ratios subject / peer",
            "",
            "Throughput above 1 and latency or memory below 1 favour the subject.",
            "",
        ]
        rows = []
        fields = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "peak_gpu_memory_gib")
        for e in record["ratios"]:
            cells = [_ratio_cell(record, e, name, notes) for name in fields]
            if e.get("excluded"):
                cells = [f"no ratio: {e['excluded']}", *["–"] * (len(fields) - 1)]
            pair = _pair(record, e["subject"], e["peer"], notes)
            rows.append([pair, e["model"], f"{e['isl']}/{e['osl']}", str(e["concurrency"]), *cells])
            if _has_hit_rates(record["ratios"]):
                rows[-1].append(_hit_rates(e))
            if _has_acceptance(record["ratios"]):
                rows[-1].append(_acceptance(e))
        header = ["ratio", "model", "ISL/OSL", "conc", "out tok/s", "TTFT med", "TTFT p99", "TPOT med", "peak mem"]
        if _has_hit_rates(record["ratios"]):
            header.append("prefix cache hit rate (subject / peer)")
        if _has_acceptance(record["ratios"]):
            header.append("mean acceptance length (subject / peer)")
        lines += _table(header, rows)
        lines.append("")

    if record.get("drift"):
        lines += ["#### Drift check (first arm launched again at the end)", ""]
        rows = []
        for d in record["drift"]:
            change = d.get("output_throughput_change")
            rows.append(
                [
                    d["arm"],
                    d["model"],
                    str(d["concurrency"]),
                    _num(d["first"].get("output_throughput")),
                    _num(d["rerun"].get("output_throughput")),
                    "–" if change is None else f"{100 * change:+.1f} %",
                ]
            )
        lines += _table(["arm", "model", "conc", "first out tok/s", "re-run out tok/s", "change"], rows)
        lines.append("")
    if plot_name:
        lines += [f"![{stem}]({plot_name})", ""]
    return lines


def _plain(stem: str) -> str:
    return f"`{stem}.json`"


def render(records: Records, plot_names: dict[str, str], cite: Callable[[str], str] = _plain) -> str:
    """The whole document: standing, notes, history, records newest first."""
    lines = [
        "# Benchmarks",
        "",
        "Generated by `deltaserve bench report` from the grid records in `benchmarks/results/grids/`; do not edit by",
        "hand. Every speed claim is a ratio against a peer engine measured in the same grid, with the same client",
        "(`deltaserve bench serve`, vLLM's metric definitions), the peer in its production configuration as",
        "defined by `deltaserve/bench/registry.py` and checked by `deltaserve check oracle-flags`. How the records",
        "are made and read: `benchmarks/README.md`; every record: `benchmarks/results/INDEX.md`.",
        "",
    ]
    if not records:
        lines += ["No grid records yet.", ""]
        return "\n".join(lines)
    notes = Notes()
    body = _standing(records, notes, cite)
    history = _history(records, notes)
    sections = ["## Records, newest first", ""]
    for stem, record in reversed(records):
        sections += render_record(stem, record, plot_names.get(stem), notes, cite)
    lines += body + notes.render() + history + sections
    return "\n".join(lines).rstrip() + "\n"


def _has_plot(record: dict[str, Any]) -> bool:
    return any(r.get("metrics") and not r.get("is_drift_check") for r in record.get("runs", []))


def _pyplot() -> Any:
    """matplotlib's pyplot on the file backend, or a clear error naming the extra that installs it."""
    from deltaserve.bench._extra import MissingExtraError, require

    try:
        require("matplotlib").use("Agg")
        return require("matplotlib.pyplot")
    except MissingExtraError as exc:  # the command line ends with the message, not a traceback
        raise SystemExit(f"deltaserve bench report draws its plots with matplotlib: {exc}") from exc


def plot_record(stem: str, record: dict[str, Any], out_dir: Path) -> Path | None:
    """Output tok/s and median TPOT against concurrency, one column per model, one line per arm."""
    if not _has_plot(record):
        return None
    plt = _pyplot()
    runs = [r for r in record.get("runs", []) if r.get("metrics") and not r.get("is_drift_check")]
    models = [m["name"] for m in record.get("models", []) if any(r["model"] == m["name"] for r in runs)]
    fig, axes = plt.subplots(2, len(models), figsize=(5 * len(models), 7), squeeze=False)
    for column, model in enumerate(models):
        for arm in record.get("arms", {}):
            for isl, osl in sorted({(r["isl"], r["osl"]) for r in runs if r["model"] == model and r["arm"] == arm}):
                points = sorted(
                    (r["concurrency"], r["metrics"])
                    for r in runs
                    if r["model"] == model and r["arm"] == arm and r["isl"] == isl and r["osl"] == osl
                )
                xs = [c for c, _ in points]
                label = f"{arm} ({isl}/{osl})"
                axes[0][column].plot(xs, [m.get("output_throughput") for _, m in points], "o-", label=label)
                axes[1][column].plot(xs, [m.get("median_tpot_ms") for _, m in points], "o-", label=label)
        concurrencies = sorted({r["concurrency"] for r in runs if r["model"] == model})
        for row, ylabel in enumerate(("output tok/s", "median TPOT (ms)")):
            ax = axes[row][column]
            ax.set_xscale("log", base=2)
            ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
            ax.minorticks_off()
            ax.set_xlabel("max concurrency")
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        axes[0][column].set_title(model)
    title = textwrap.fill(record.get("title", stem), width=60)  # the figure is narrow: wrap, never clip
    fig.suptitle(f"{title}\n{stem}", fontsize=10)
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"bench-{stem}.png"
    fig.savefig(path, dpi=90, metadata={"Software": None})
    plt.close(fig)
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--results-dir", type=Path, default=DEFAULT_RESULTS, help="the grid records")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help=f"the Markdown file (plots in {PLOT_DIR}/)")
    parser.add_argument("--index", type=Path, default=records_index.DEFAULT_INDEX, help="the records index")
    parser.add_argument("--check", action="store_true", help="exit 1 if the Markdown (or the index) is not up to date")


def _citer(results_dir: Path, output: Path) -> Callable[[str], str]:
    """A record's citation: its path in the repository (or its file name), linked relative to the output."""

    def cite(stem: str) -> str:
        path = (results_dir / f"{stem}.json").resolve()
        shown = path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path.name
        return f"[`{shown}`]({Path(os.path.relpath(path, output.resolve().parent)).as_posix()})"

    return cite


def run(args: argparse.Namespace) -> int:
    records = load_records(args.results_dir)
    plot_dir = args.output.parent / PLOT_DIR
    plot_names: dict[str, str] = {}
    if not args.check:
        for stem, record in records:
            path = plot_record(stem, record, plot_dir)
            if path is not None:
                plot_names[stem] = f"{PLOT_DIR}/{path.name}"
    else:
        plot_names = {stem: f"{PLOT_DIR}/bench-{stem}.png" for stem, record in records if _has_plot(record)}
    text = render(records, plot_names, _citer(args.results_dir, args.output))
    index = getattr(args, "index", None)  # None: a report of other records (a test's) leaves the index alone
    if args.check:
        stale = [] if (args.output.read_text() if args.output.exists() else "") == text else [args.output]
        if index is not None and not records_index.is_current(index):
            stale.append(index)
        for path in stale:
            print(f"{path} is stale: run `deltaserve bench report`", file=sys.stderr)
        return 1 if stale else 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    print(f"wrote {args.output} ({len(records)} records, {len(plot_names)} plots)")
    if index is not None:
        records_index.write(index)
        print(f"wrote {index}")
    return 0
