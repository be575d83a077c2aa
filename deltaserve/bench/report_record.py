"""One grid record's section of docs/BENCHMARKS.md (`deltaserve bench report`): render_record.

Provenance (date, host, GPU, commit, dataset, resumed runs, errors, skipped arms), the arms with their denominator
notes, the exact launches with their environment overrides and each deltaserve server's resolved prefill kernels, the
client's command line, every run's metrics per model, the subject / peer ratios, the drift check and the record's plot.
plain_citation cites a record by its file name where the caller gives no citer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from deltaserve.bench.report_cells import (
    Notes,
    acceptance_cell,
    arm_marks,
    has_acceptance,
    has_hit_rates,
    hit_rates_cell,
    markdown_table,
    num_cell,
    pair_cell,
    ratio_cell,
)


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
    lines = [f"### {stem}", "", f"**{record.get('title', stem)}**", "", f"Record {(cite or plain_citation)(stem)}", ""]
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
                " ".join(arm_marks(record, name, notes)) or "–",
            ]
        )
    lines += markdown_table(["arm", "role", "oracle", "engine version", "exemption", "denominator notes"], rows)
    lines += ["", "Exact launches (environment overrides, then the command line):", "", "```"]
    for entry in record.get("launches", []):
        env = " ".join(f"{k}={v}" for k, v in (entry.get("env") or {}).items())
        drift = " [drift re-run]" if entry.get("is_drift_check") else ""
        status = (
            f" -> {entry['error']}" if entry.get("error") else f" (healthy after {num_cell(entry.get('startup_s'))} s)"
        )
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
                    num_cell(m.get("output_throughput")),
                    num_cell(m.get("request_throughput"), 2),
                    num_cell(m.get("median_ttft_ms")),
                    num_cell(m.get("p99_ttft_ms")),
                    num_cell(m.get("median_tpot_ms"), 2),
                    num_cell(m.get("p99_itl_ms"), 2),
                    num_cell(m.get("median_e2el_ms")),
                    num_cell(m.get("peak_gpu_memory_gib"), 2),
                    f"{m.get('completed', '–')}/{m.get('failed', '–')}",
                ]
            )
        header = ["arm", "ISL/OSL", "conc", "out tok/s", "req/s", "TTFT med ms", "TTFT p99 ms", "TPOT med ms"]
        header += ["ITL p99 ms", "E2EL med ms", "peak GPU GiB", "ok/failed"]
        lines += markdown_table(header, rows)
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
            cells = [ratio_cell(record, e, name, notes) for name in fields]
            if e.get("excluded"):
                cells = [f"no ratio: {e['excluded']}", *["–"] * (len(fields) - 1)]
            pair = pair_cell(record, e["subject"], e["peer"], notes)
            rows.append([pair, e["model"], f"{e['isl']}/{e['osl']}", str(e["concurrency"]), *cells])
            if has_hit_rates(record["ratios"]):
                rows[-1].append(hit_rates_cell(e))
            if has_acceptance(record["ratios"]):
                rows[-1].append(acceptance_cell(e))
        header = ["ratio", "model", "ISL/OSL", "conc", "out tok/s", "TTFT med", "TTFT p99", "TPOT med", "peak mem"]
        if has_hit_rates(record["ratios"]):
            header.append("prefix cache hit rate (subject / peer)")
        if has_acceptance(record["ratios"]):
            header.append("mean acceptance length (subject / peer)")
        lines += markdown_table(header, rows)
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
                    num_cell(d["first"].get("output_throughput")),
                    num_cell(d["rerun"].get("output_throughput")),
                    "–" if change is None else f"{100 * change:+.1f} %",
                ]
            )
        lines += markdown_table(["arm", "model", "conc", "first out tok/s", "re-run out tok/s", "change"], rows)
        lines.append("")
    if plot_name:
        lines += [f"![{stem}]({plot_name})", ""]
    return lines


def plain_citation(stem: str) -> str:
    return f"`{stem}.json`"
