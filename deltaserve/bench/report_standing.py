"""The opening of docs/BENCHMARKS.md: the current standing and the ratio history (`deltaserve bench report`).

standing groups the records by grid, model and GPU and keeps the newest record of each group, unless a newer grid with
a peer measured the same workload (the client's flags less PER_RUN_FLAGS) on the same model and card with one of the
same subjects: that group is left to the history. render_standing renders one table per group that stands (every
subject/peer ratio, or each arm's own figures where the grid has no peer); render_history one table per grid, model and
lengths with the output-throughput ratio of every record, oldest first.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from typing import Any

from deltaserve.bench.grid_ratios import HIT_RATE as RUN_HIT_RATE
from deltaserve.bench.grid_ratios import format_percent
from deltaserve.bench.report_cells import (
    Notes,
    acceptance_cell,
    has_acceptance,
    has_hit_rates,
    hit_rates_cell,
    markdown_table,
    num_cell,
    pair_cell,
    ratio_cell,
)

# Client flags that differ between the runs of one workload (server, label, load level; a multi-turn grid's clients
# follow its concurrency): not part of a workload.
PER_RUN_FLAGS = ("--base-url", "--label", "--num-prompts", "--max-concurrency", "--tokenizer",
                 "--multi-turn-num-clients")  # fmt: skip
Records = list[tuple[str, dict[str, Any]]]


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
                    pair_cell(record, e["subject"], e["peer"], notes),
                    f"{num_cell(ours)} / {num_cell(theirs)}",
                    *(
                        ratio_cell(record, e, m, notes)
                        for m in ("output_throughput", "median_ttft_ms", "median_tpot_ms")
                    ),
                ]
            )
        header = ["ISL/OSL", "conc", "subject / peer", "out tok/s (subject / peer)", "out tok/s ratio"]
        header += ["TTFT med ratio", "TPOT med ratio"]
        if has_hit_rates(entries):
            ordered = sorted(entries, key=lambda e: (e["isl"], e["osl"], e["concurrency"], e["subject"], e["peer"]))
            rows = [[*row, hit_rates_cell(e)] for row, e in zip(rows, ordered, strict=True)]
            header.append("prefix cache hit rate (subject / peer)")
        if has_acceptance(entries):
            ordered = sorted(entries, key=lambda e: (e["isl"], e["osl"], e["concurrency"], e["subject"], e["peer"]))
            rows = [[*row, acceptance_cell(e)] for row, e in zip(rows, ordered, strict=True)]
            header.append("mean acceptance length (subject / peer)")
        return markdown_table(header, rows)
    rows = []
    runs = sorted(_runs(record, model), key=lambda r: (r["isl"], r["osl"], r["concurrency"], r["arm"]))
    # the server's own hit rate, where it reported one: a cache hit on random data is a measured prompt sent before
    has_hits = any(RUN_HIT_RATE in (r.get("metrics") or {}) for r in runs)
    for r in runs:
        m = r.get("metrics") or {}
        cells = [
            num_cell(m.get("output_throughput")),
            num_cell(m.get("median_ttft_ms")),
            num_cell(m.get("median_tpot_ms"), 2),
        ]
        cells += [format_percent(m.get(RUN_HIT_RATE))] if has_hits else []
        rows.append([f"{r['isl']}/{r['osl']}", str(r["concurrency"]), r["arm"], *cells])
    header = ["ISL/OSL", "conc", "arm (no peer)", "out tok/s", "TTFT med ms", "TPOT med ms"]
    return markdown_table([*header, *(["prefix cache hit rate"] if has_hits else [])], rows)


def render_standing(records: Records, notes: Notes, cite: Callable[[str], str]) -> list[str]:
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


def render_history(records: Records, notes: Notes | None = None) -> list[str]:
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
            pair = pair_cell(record, entry["subject"], entry["peer"], notes)  # a grid may hold several subjects
            row = rows.setdefault(
                (stem, entry["subject"], entry["peer"]),
                [f"[{stem}](#{stem.lower()})", _source(record), pair, *["–"] * len(concurrencies)],
            )
            row[3 + concurrencies.index(entry["concurrency"])] = ratio_cell(record, entry, "output_throughput", notes)
        header = ["record", "date, commit, GPU", "subject / peer", *[f"c{c}" for c in concurrencies]]
        lines += [f"### {grid}: {model}, {isl}/{osl}", "", *markdown_table(header, list(rows.values())), ""]
    return lines
