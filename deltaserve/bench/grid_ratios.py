"""A grid record's ratios: subject over peer (and arm over baseline) at every point both arms measured, the flag on
points where the two arms may not have done the same work, and the figures' console formats (bench/grid_launch.py
prints them, bench/report_record.py renders the record)."""

from __future__ import annotations

from typing import Any

RATIO_FIELDS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "peak_gpu_memory_gib")
HIT_RATE = "server_prefix_cache_hit_rate"  # a run's field (server_counters.py)
ACCEPTANCE = "server_mean_acceptance_length"  # a speculating run's field (server_counters.py)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, None where either is missing or the denominator is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


# Two arms whose shares of distinct outputs differ by more than this factor did visibly different work.
UNEQUAL_OUTPUTS_FACTOR = 2.0


def unequal_outputs(subject: str, metrics: dict[str, Any], peer: str, peer_metrics: dict[str, Any]) -> str | None:
    """Why a point's two arms may not have done the same work, or None. On dummy weights a decode can collapse to
    the same tokens in every sequence (vLLM's U(-1e-3, 1e-3) weights do on prompts with a common ending), and then
    every decode row routes to the same experts: a MoE step then reads 8 experts per layer instead of up to 256.
    The ratio stays in the record, flagged; records from before the count existed carry no flag."""
    shares = []
    for m in (metrics, peer_metrics):
        distinct, completed = m.get("num_distinct_generated_texts"), m.get("completed")
        if distinct is None or not completed:
            return None
        shares.append(max(distinct, 1) / completed)
    if max(shares) <= UNEQUAL_OUTPUTS_FACTOR * min(shares):
        return None
    return (f"unequal outputs: {subject} {metrics['num_distinct_generated_texts']} distinct of {metrics['completed']}, "
            f"{peer} {peer_metrics['num_distinct_generated_texts']} of {peer_metrics['completed']}: the arms may have "
            f"done different expert work")  # fmt: skip


def compute_ratios(record: dict[str, Any]) -> list[dict[str, Any]]:
    """subject / peer for every peer arm, and arm / baseline, at every point both measured (drift re-runs excluded)."""
    roles = {name: arm["role"] for name, arm in record["arms"].items()}
    subjects = [name for name, role in roles.items() if role == "subject"]
    peers = [name for name, role in roles.items() if role == "peer"]
    measured: dict[tuple[str, str, int, int, int], dict[str, Any]] = {}
    for run in record["runs"]:
        if run["metrics"] is None or run["is_drift_check"]:
            continue
        measured[(run["arm"], run["model"], run["isl"], run["osl"], run["concurrency"])] = run["metrics"]
    runs = runs_by_point(record)
    pairs = [(subject, peer) for subject in subjects for peer in peers]
    # An arm with a baseline is also compared with it (e.g. vLLM at a forced backend / vLLM at its own choice).
    pairs += [(name, arm["baseline"]) for name, arm in record["arms"].items() if arm.get("baseline")]
    ratios = []
    for subject, peer in pairs:
        for (arm, model, isl, osl, concurrency), metrics in measured.items():
            if arm != subject:
                continue
            peer_metrics = measured.get((peer, model, isl, osl, concurrency))
            if peer_metrics is None:
                continue
            entry: dict[str, Any] = {"subject": subject, "peer": peer, "model": model, "isl": isl, "osl": osl}
            entry["concurrency"] = concurrency
            # a point where either side failed requests compares different work (the failed ones' time counts, their
            # tokens do not): no ratio, and the record says why
            failures = [f"{name} failed {m['failed']} of {m['failed'] + m.get('completed', 0)} requests"
                        for name, m in ((subject, metrics), (peer, peer_metrics)) if m.get("failed")]  # fmt: skip
            for name in RATIO_FIELDS:
                entry[name] = None if failures else ratio(metrics.get(name), peer_metrics.get(name))
            if failures:
                entry["excluded"] = "; ".join(failures)
            # each engine's own prefix-cache hit rate at this point (cached / prompt tokens from its /metrics), next
            # to the ratio: a ratio between arms that cached differently says so
            if HIT_RATE in metrics or HIT_RATE in peer_metrics:
                entry["subject_prefix_cache_hit_rate"] = metrics.get(HIT_RATE)
                entry["peer_prefix_cache_hit_rate"] = peer_metrics.get(HIT_RATE)
            # each MTP arm's own mean acceptance length at this point (its /metrics), next to the ratio: speed with
            # speculation is speed at that acceptance
            if metrics.get(ACCEPTANCE) is not None or peer_metrics.get(ACCEPTANCE) is not None:
                entry["subject_mean_acceptance_length"] = metrics.get(ACCEPTANCE)
                entry["peer_mean_acceptance_length"] = peer_metrics.get(ACCEPTANCE)
            unequal = unequal_outputs(subject, metrics, peer, peer_metrics)
            if unequal:
                entry["unequal_outputs"] = unequal
            flag_compiles(entry, runs)
            ratios.append(entry)
    return ratios


def runs_by_point(record: dict[str, Any]) -> dict[tuple[str, str, int, int, int], dict[str, Any]]:
    """The record's measured runs (drift re-runs left out) by (arm, model, isl, osl, concurrency)."""
    return {
        (r["arm"], r["model"], r["isl"], r["osl"], r["concurrency"]): r
        for r in record.get("runs", [])
        if not r.get("is_drift_check")
    }


def flag_compiles(entry: dict[str, Any], runs: dict[tuple[str, str, int, int, int], dict[str, Any]]) -> None:
    """Set a ratio's `compiles_while_measured` from its subject's and peer's runs (`runs`: runs_by_point), or drop
    it where neither compiled: each arm's `compiles`, and `edge_compiles` (a record read back by time,
    bench/late_compiles.py) with that run's TTFT median and p99 beside them, where a stall would show."""
    point = (entry["model"], entry["isl"], entry["osl"], entry["concurrency"])
    arms = [(arm, runs.get((arm, *point)) or {}) for arm in (entry["subject"], entry["peer"])]
    text = compiles_text({arm: r.get("compiles") or [] for arm, r in arms},
                         {arm: _with_ttft(r.get("edge_compiles") or [], r) for arm, r in arms})  # fmt: skip
    if text:
        entry["compiles_while_measured"] = text
    else:
        entry.pop("compiles_while_measured", None)


def _with_ttft(names: list[str], run: dict[str, Any]) -> list[str]:
    """Edge compiles with what tells whether they stalled the run: its TTFT median and p99 (a stall of a compile's
    seconds shows in the p99)."""
    metrics = run.get("metrics") or {}
    median, p99 = metrics.get("median_ttft_ms"), metrics.get("p99_ttft_ms")
    if not names or median is None or p99 is None:
        return names
    return [*names[:-1], f"{names[-1]} (that run's TTFT median {median:.0f} ms, p99 {p99:.0f} ms)"]


def compiles_text(compiles: dict[str, list[str]], edge: dict[str, list[str]] | None = None) -> str | None:
    """What the arms' servers compiled while a point's measured requests ran (runs[].compiles), and, in a record
    read back by time, within a second of the run's start or end (runs[].edge_compiles), or None: a server that met
    a kernel its warm-up missed stalled a step for the compile (seconds, for a CuTeDSL kernel), so that arm's
    figures at the point are not steady state and the ratio leans against it."""
    named = [f"{arm} compiled {', '.join(names)} while measured" for arm, names in compiles.items() if names]
    named += [
        f"{arm} compiled {', '.join(names)} within a second of the run's start or end (log stamps), maybe measured"
        for arm, names in (edge or {}).items()
        if names
    ]
    return "; ".join(named) + " (JIT monitor): not steady state where it stalled a measured step" if named else None


def format_ratio(value: float | None) -> str:
    """A ratio as the console prints it (n/a where either side measured none)."""
    return "n/a" if value is None else f"{value:.3f}"


def format_percent(value: float | None) -> str:
    """A rate in [0, 1] as the records' tables print it (n/a where a server reported none)."""
    return "n/a" if value is None else f"{100 * value:.1f} %"


def acceptance_text(value: float | None) -> str:
    """A run's MTP mean acceptance length as the console line's tail ("" when it did not speculate)."""
    return "" if value is None else f", mean acceptance length {value:.2f}"


def acceptance_pair(entry: dict[str, Any]) -> str:
    """A ratio's MTP acceptance, subject / peer ("" when neither arm speculated; "–" for the one that did not)."""
    if "subject_mean_acceptance_length" not in entry:
        return ""
    a, b = (entry.get(f"{side}_mean_acceptance_length") for side in ("subject", "peer"))
    return f", mean acceptance length {'–' if a is None else f'{a:.2f}'} / {'–' if b is None else f'{b:.2f}'}"
