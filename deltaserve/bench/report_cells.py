"""The cells of docs/BENCHMARKS.md's tables and the notes their marks link to (`deltaserve bench report`).

Figures and ratios as the tables print them ("–" where a record has none), both engines' prefix-cache hit rates and
both arms' mean acceptance lengths where a record has them, and the Markdown table itself. Notes numbers every note in
order of first use; a cell carries a mark per note that concerns it: `*` an arm's own denominator note, `†` a registry
deviation (bench/deviations.py) that can move that metric, recognised from the record's arm entry or its launch argv,
`‡` outputs that differ between the arms, `§` a kernel compiled while the point was measured. report_standing.py and
report_record.py build their tables from these.
"""

from __future__ import annotations

from typing import Any

from deltaserve.bench.deviations import DEVIATIONS, Deviation, deviations_in
from deltaserve.bench.grid_ratios import format_percent


def num_cell(value: Any, digits: int = 1) -> str:
    if value is None:
        return "–"
    if isinstance(value, int | float):
        return f"{value:.{digits}f}"
    return str(value)


def _ratio(value: Any) -> str:
    return "–" if value is None else f"{value:.3f}"


def has_hit_rates(entries: list[dict[str, Any]]) -> bool:
    """Whether the ratios carry both engines' prefix-cache hit rates (grids since issue 36)."""
    return any("subject_prefix_cache_hit_rate" in e for e in entries)


def hit_rates_cell(entry: dict[str, Any]) -> str:
    """Both engines' prefix-cache hit rates (cached / prompt tokens, from their /metrics) at a ratio's point."""
    subject, peer = entry.get("subject_prefix_cache_hit_rate"), entry.get("peer_prefix_cache_hit_rate")
    return f"{format_percent(subject)} / {format_percent(peer)}"


def has_acceptance(entries: list[dict[str, Any]]) -> bool:
    """Whether any ratio has an MTP arm (its mean acceptance length, from /metrics: grids since issue 41)."""
    return any("subject_mean_acceptance_length" in e for e in entries)


def acceptance_cell(entry: dict[str, Any]) -> str:
    """Both arms' mean acceptance length at a ratio's point ("–" for an arm that does not speculate)."""
    a, b = (entry.get(f"{side}_mean_acceptance_length") for side in ("subject", "peer"))
    return f"{'–' if a is None else f'{a:.2f}'} / {'–' if b is None else f'{b:.2f}'}"


def markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
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


def arm_marks(record: dict[str, Any], arm: str, notes: Notes, metric: str | None = None) -> list[str]:
    """`*` for the arm's own denominator note, `†` per registry deviation of the arm that can move `metric` (any
    metric when None)."""
    own = _own_note(record, arm)
    marks = [notes.ref(own, "*")] if own and metric is None else []
    for deviation in arm_deviations(record, arm):
        if (metric in deviation.affects) if metric else deviation.affects:
            marks.append(notes.ref(_deviation_text(record, arm, deviation), "†"))
    return marks


def pair_cell(record: dict[str, Any], subject: str, peer: str, notes: Notes) -> str:
    """`subject / peer`, marked with the peer's own denominator note."""
    own = _own_note(record, peer)
    return f"{subject} / {peer}" + (f" {notes.ref(own, '*')}" if own else "")


def ratio_cell(record: dict[str, Any], entry: dict[str, Any], metric: str, notes: Notes) -> str:
    """A ratio with a `†` mark per peer deviation that can move this metric, `‡` on output throughput when the
    arms' outputs differ, and `§` where either arm's server compiled a kernel while the point was measured."""
    if entry.get("excluded"):
        return "– (failed requests)"
    text = " ".join([_ratio(entry.get(metric)), *arm_marks(record, entry["peer"], notes, metric)])
    if metric == "output_throughput" and entry.get("unequal_outputs"):
        text += " " + notes.ref(f"{entry['model']} c{entry['concurrency']}: {entry['unequal_outputs']}", "‡")
    if entry.get("compiles_while_measured"):  # a server stalled for a kernel compile during this point's run
        point = f"{entry['model']} {entry['isl']}/{entry['osl']} c{entry['concurrency']}"
        text += " " + notes.ref(f"{point}: {entry['compiles_while_measured']}", "§")
    return text
