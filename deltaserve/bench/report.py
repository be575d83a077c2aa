"""`deltaserve bench report`: regenerate docs/BENCHMARKS.md (and one PNG per grid record) from the records.

Input: every `*.json` grid record in benchmarks/results/ (schema deltaserve-grid-record/1), oldest first.
Output: for each record its provenance (date, commit, GPU, driver, schedule), every launch's exact command
line, the per-run metrics, the subject/peer ratios, the drift check and a plot; above them a ratio history
across records in which every ratio whose denominator arm carries a `denominator_note` is marked and the
note printed, so a ratio that moved because the denominator was repaired never reads as a regression. A ratio
that a registry deviation of its peer can move (a backend production would not pick, e.g. vLLM's GDN prefill on
Triton; recognised from the record's arm entry or its launch argv) carries a dagger and the deviation's note.
The output is deterministic (no generation timestamp), so `--check` can tell whether the docs are stale.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path
from typing import Any

from deltaserve.bench.deviations import DEVIATIONS, Deviation, deviations_in
from deltaserve.bench.grid import RECORD_SCHEMA, REPO_ROOT

DEFAULT_RESULTS = REPO_ROOT / "benchmarks" / "results"
DEFAULT_OUTPUT = REPO_ROOT / "docs" / "BENCHMARKS.md"


def load_records(results_dir: Path) -> list[tuple[str, dict[str, Any]]]:
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


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return lines


def arm_deviations(record: dict[str, Any], arm: str) -> list[Deviation]:
    """The registry deviations an arm ran with: named in the record, or recognised in its recorded launches
    (a record written before the registry named them still gets marked)."""
    names = list((record.get("arms", {}).get(arm) or {}).get("deviations") or [])
    for entry in record.get("launches", []):
        if entry.get("arm") == arm:
            names += [d.name for d in deviations_in(entry.get("argv") or [], entry.get("env") or {})]
    return [DEVIATIONS[name] for name in dict.fromkeys(names) if name in DEVIATIONS]


def _marked(record: dict[str, Any], peer: str, metric: str, text: str) -> str:
    """A ratio cell, with a dagger when a deviation of the peer arm can move that metric."""
    return text + " †" if any(metric in d.affects for d in arm_deviations(record, peer)) else text


def _has_plot(record: dict[str, Any]) -> bool:
    return any(r.get("metrics") and not r.get("is_drift_check") for r in record.get("runs", []))


def plot_record(stem: str, record: dict[str, Any], out_dir: Path) -> Path | None:
    """Output tok/s and median TPOT against concurrency, one column per model, one line per arm."""
    from deltaserve.bench._extra import require

    matplotlib = require("matplotlib")
    matplotlib.use("Agg")
    plt = require("matplotlib.pyplot")

    if not _has_plot(record):
        return None
    runs = [r for r in record.get("runs", []) if r.get("metrics") and not r.get("is_drift_check")]
    models = [m["name"] for m in record.get("models", []) if any(r["model"] == m["name"] for r in runs)]
    fig, axes = plt.subplots(2, len(models), figsize=(5 * len(models), 7), squeeze=False)
    for column, model in enumerate(models):
        for arm in record.get("arms", {}):
            for isl, osl in {(r["isl"], r["osl"]) for r in runs if r["model"] == model and r["arm"] == arm}:
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


def _history(records: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """One row per (grid, model, lengths, concurrency, subject/peer) with the ratio in every record."""
    rows: dict[tuple[Any, ...], dict[str, str]] = {}
    notes: dict[str, str] = {}
    for stem, record in records:
        arms = record.get("arms", {})
        for entry in record.get("ratios", []):
            pair = f"{entry['subject']} / {entry['peer']}"  # a grid may hold several subjects (configurations)
            key = (record["grid"], entry["model"], entry["isl"], entry["osl"], entry["concurrency"], pair)
            cell = _marked(record, entry["peer"], "output_throughput", _ratio(entry.get("output_throughput")))
            if entry.get("unequal_outputs"):
                cell += " ‡"
            if entry.get("excluded"):
                cell = "– (failed requests)"
            note = arms.get(entry["peer"], {}).get("denominator_note")
            if note:
                note_key = f"{stem}/{entry['peer']}"
                notes.setdefault(note_key, note)
                cell += f" [{list(notes).index(note_key) + 1}]"
            rows.setdefault(key, {})[stem] = cell
    if not rows:
        return []
    stems = [stem for stem, _ in records if any(stem in cells for cells in rows.values())]
    lines = ["## Ratio history: output throughput, subject / peer", ""]
    lines.append(
        "Above 1: deltaserve is faster. `[n]`: the peer arm of that record carries a denominator note; `†`: a "
        "registry deviation of the peer (a backend its production defaults would not pick) can move this ratio; `‡`: "
        "the two arms' outputs differ in how many are distinct (grid.unequal_outputs), so on dummy weights they may "
        "have done different expert work."
    )
    lines.append("")
    header = ["grid", "model", "ISL/OSL", "conc", "subject / peer", *stems]
    body = []
    for (grid, model, isl, osl, concurrency, pair), cells in sorted(rows.items(), key=lambda kv: kv[0]):
        body.append([grid, model, f"{isl}/{osl}", str(concurrency), pair, *[cells.get(s, "–") for s in stems]])
    lines += _table(header, body)
    if notes:
        lines.append("")
        for index, (key, note) in enumerate(notes.items(), start=1):
            lines.append(f"[{index}] `{key}`: {note}")
    lines.append("")
    return lines


def render_record(stem: str, record: dict[str, Any], plot_name: str | None) -> list[str]:
    """The Markdown section of one grid record."""
    host = record.get("host", {})
    git = host.get("git", {})
    commit = git.get("commit") or "unknown"
    dirty = " (uncommitted changes)" if git.get("is_dirty") else ""
    lines = [f"## {record.get('title', stem)}", "", f"Record `benchmarks/results/{stem}.json`", ""]
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

    lines += ["### Arms", ""]
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
                arm.get("denominator_note") or "–",
            ]
        )
    lines += _table(["arm", "role", "oracle", "engine version", "exemption", "denominator note"], rows)
    lines += ["", "Exact launches (environment overrides, then the command line):", "", "```"]
    for entry in record.get("launches", []):
        env = " ".join(f"{k}={v}" for k, v in (entry.get("env") or {}).items())
        drift = " [drift re-run]" if entry.get("is_drift_check") else ""
        status = f" -> {entry['error']}" if entry.get("error") else f" (healthy after {_num(entry.get('startup_s'))} s)"
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
        lines += [f"### Results: {model}", ""]
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
            "### Ratios subject / peer",
            "",
            "Throughput above 1 and latency or memory below 1 favour the subject.",
            "",
        ]
        rows = []
        arms = record.get("arms", {})
        fields = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "peak_gpu_memory_gib")
        for e in record["ratios"]:
            note = arms.get(e["peer"], {}).get("denominator_note")
            cells = [_marked(record, e["peer"], name, _ratio(e.get(name))) for name in fields]
            if e.get("unequal_outputs"):
                cells[0] += " ‡"
            if e.get("excluded"):
                cells = [f"no ratio: {e['excluded']}", *["–"] * (len(fields) - 1)]
            rows.append(
                [
                    f"{e['subject']} / {e['peer']}" + (" *" if note else ""),
                    e["model"],
                    f"{e['isl']}/{e['osl']}",
                    str(e["concurrency"]),
                    *cells,
                ]
            )
        header = ["ratio", "model", "ISL/OSL", "conc", "out tok/s", "TTFT med", "TTFT p99", "TPOT med", "peak mem"]
        lines += _table(header, rows)
        noted = {e["peer"] for e in record["ratios"] if arms.get(e["peer"], {}).get("denominator_note")}
        for peer in sorted(noted):
            lines.append("")
            lines.append(f"\\* denominator note for `{peer}`: {arms[peer]['denominator_note']}")
        for peer in sorted({e["peer"] for e in record["ratios"]}):
            for deviation in arm_deviations(record, peer):
                if not deviation.affects:
                    continue
                is_noted = deviation.note in (arms.get(peer, {}).get("denominator_note") or "")
                missing = "" if is_noted else " (the record itself lacks this note)"
                lines.append("")
                lines.append(f"† `{peer}` ran with registry deviation {deviation.note}{missing}")
        for e in record["ratios"]:
            if e.get("unequal_outputs"):
                lines.append("")
                lines.append(f"‡ {e['model']} c{e['concurrency']}: {e['unequal_outputs']}")
        lines.append("")

    if record.get("drift"):
        lines += ["### Drift check (first arm launched again at the end)", ""]
        rows = []
        for d in record["drift"]:
            rows.append(
                [
                    d["arm"],
                    d["model"],
                    str(d["concurrency"]),
                    _num(d["first"].get("output_throughput")),
                    _num(d["rerun"].get("output_throughput")),
                    "–"
                    if d.get("output_throughput_change") is None
                    else f"{100 * d['output_throughput_change']:+.1f} %",
                ]
            )
        lines += _table(["arm", "model", "conc", "first out tok/s", "re-run out tok/s", "change"], rows)
        lines.append("")
    if plot_name:
        lines += [f"![{stem}]({plot_name})", ""]
    return lines


def render(records: list[tuple[str, dict[str, Any]]], plot_names: dict[str, str]) -> str:
    lines = [
        "# Benchmarks",
        "",
        "Generated by `deltaserve bench report` from the grid records in `benchmarks/results/`; do not edit by hand.",
        "Every speed claim is a ratio against a peer engine measured in the same grid, with the same client",
        "(`deltaserve bench serve`, vLLM's metric definitions), the peer in its production configuration as",
        "defined by `deltaserve/bench/registry.py` and checked by `deltaserve check oracle-flags`.",
        "",
    ]
    if not records:
        lines += ["No grid records yet.", ""]
        return "\n".join(lines)
    lines += _history(records)
    for stem, record in reversed(records):
        lines += render_record(stem, record, plot_names.get(stem))
    return "\n".join(lines).rstrip() + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--results-dir", type=Path, default=DEFAULT_RESULTS)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="the Markdown file (plots go next to it)")
    parser.add_argument("--check", action="store_true", help="exit 1 if the Markdown is not up to date")


def run(args: argparse.Namespace) -> int:
    records = load_records(args.results_dir)
    plot_names: dict[str, str] = {}
    if not args.check:
        for stem, record in records:
            path = plot_record(stem, record, args.output.parent)
            if path is not None:
                plot_names[stem] = path.name
    else:
        plot_names = {stem: f"bench-{stem}.png" for stem, record in records if _has_plot(record)}
    text = render(records, plot_names)
    if args.check:
        current = args.output.read_text() if args.output.exists() else ""
        if current != text:
            print(f"{args.output} is stale: run `deltaserve bench report`", file=sys.stderr)
            return 1
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    print(f"wrote {args.output} ({len(records)} records, {len(plot_names)} plots)")
    return 0
