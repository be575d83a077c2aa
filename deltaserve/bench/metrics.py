"""Benchmark metric math with `vllm bench serve`'s definitions, as pure functions over per-request timings.

Nothing here touches the network or a clock: the client records one `RequestResult` per request, and
`compute_metrics` turns the list plus the benchmark duration into the flat dict of vLLM's saved-JSON fields
(`request_throughput`, `mean_ttft_ms`, `p99_itl_ms`, ...). Definitions (vLLM's
vllm/benchmarks/serve.py, calculate_metrics):

- TTFT: first SSE event with non-empty `choices`, minus the request's start. E2EL: last such event minus start.
- ITL: gaps between successive choice-bearing events, pooled over all requests.
- TPOT: (E2EL - TTFT) / (output_tokens - 1), only for requests with more than one output token.
- Throughputs divide by the whole benchmark duration (ramp and tail included); only successful requests count.
- Goodput: a request is good when every given SLO holds (<=); TPOT counts as 0 for requests with <= 1 token.
- Peak output tokens/s: token arrivals (start + TTFT + cumulative ITLs) in 1-second bins, the fullest bin.
- Peak concurrent requests: sweep line over the half-open intervals [start, start + E2EL), as current vLLM
  defines it (vLLM 0.26 counted requests per 1-second bin, which overstates the peak at short latencies).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

MS_PER_S = 1000.0
GOODPUT_KEYS = ("ttft", "tpot", "e2el")
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestResult:
    """What the client saw for one request; times are `time.perf_counter()` seconds."""

    prompt_len: int
    is_success: bool = False
    start_time: float = 0.0
    ttft: float = 0.0
    latency: float = 0.0  # E2EL: last choice-bearing event minus start
    itl: list[float] = field(default_factory=list)
    output_tokens: int | None = None  # usage.completion_tokens when the server sent usage
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when the server sent it
    generated_text: str = ""
    error: str = ""


def parse_goodput(specs: Sequence[str] | None) -> dict[str, float]:
    """`["ttft:200", "tpot:50"]` -> {"ttft": 200.0, "tpot": 50.0} (milliseconds), validating keys and values."""
    slos: dict[str, float] = {}
    for spec in specs or ():
        key, sep, value = spec.partition(":")
        key = key.strip().lower()
        if not sep or key not in GOODPUT_KEYS:
            raise ValueError(f"goodput spec {spec!r}: expected KEY:MS with KEY in {', '.join(GOODPUT_KEYS)}")
        try:
            slo_ms = float(value)
        except ValueError as exc:
            raise ValueError(f"goodput spec {spec!r}: {value!r} is not a number of milliseconds") from exc
        if slo_ms < 0:
            raise ValueError(f"goodput spec {spec!r}: the SLO must be non-negative")
        slos[key] = slo_ms
    return slos


def parse_percentiles(text: str) -> list[float]:
    """`"50,90,99"` -> [50.0, 90.0, 99.0]; each must lie in (0, 100]."""
    percentiles = [float(p) for p in text.split(",") if p.strip()]
    for p in percentiles:
        if not 0.0 < p <= 100.0:
            raise ValueError(f"percentile {p} is outside (0, 100]")
    return percentiles


def parse_metric_names(text: str) -> list[str]:
    """`"ttft,tpot,itl,e2el"` -> the names, validated against the metrics vLLM can report percentiles for."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    for name in names:
        if name not in PERCENTILE_METRICS:
            raise ValueError(f"unknown percentile metric {name!r}; choose from {', '.join(PERCENTILE_METRICS)}")
    return names


def percentile_key(percentile: float) -> str:
    """vLLM's spelling of a percentile in a field name: 99 -> "99", 99.9 -> "99.9"."""
    return str(int(percentile)) if int(percentile) == percentile else str(percentile)


def peak_output_tokens_per_s(results: Sequence[RequestResult]) -> float:
    """The fullest 1-second bin of token arrivals (one arrival per choice-bearing chunk, as vLLM counts)."""
    successes = [r for r in results if r.is_success]
    if not successes:
        return 0.0
    t0 = min(r.start_time for r in successes)
    t_end = max(r.start_time + r.latency for r in successes)
    num_bins = int(math.ceil(t_end - t0)) + 1
    counts = np.zeros(num_bins)
    for r in successes:
        arrival = r.start_time + r.ttft
        arrivals = [arrival]
        for gap in r.itl:
            arrival += gap
            arrivals.append(arrival)
        for t in arrivals:
            bin_index = int(t - t0)
            if 0 <= bin_index < num_bins:
                counts[bin_index] += 1
    return float(counts.max())


def peak_concurrent_requests(results: Sequence[RequestResult]) -> int:
    """Exact peak of simultaneously open requests over half-open [start, start + latency) intervals."""
    events: list[tuple[float, int]] = []
    for r in results:
        if r.is_success:
            events.append((r.start_time, 1))
            events.append((r.start_time + r.latency, -1))
    # An end and a start at the same instant do not overlap: sorting -1 before +1 closes first.
    events.sort()
    num_open = 0
    peak = 0
    for _, delta in events:
        num_open += delta
        peak = max(peak, num_open)
    return peak


def _stats(values_s: Sequence[float], name: str, percentiles: Sequence[float]) -> dict[str, float]:
    """mean/median/std/pNN of a list of seconds, in ms, with vLLM's empty-list convention (all 0)."""
    data = np.asarray(values_s if len(values_s) else [0.0], dtype=np.float64)
    stats = {
        f"mean_{name}_ms": float(np.mean(data) * MS_PER_S),
        f"median_{name}_ms": float(np.median(data) * MS_PER_S),
        f"std_{name}_ms": float(np.std(data) * MS_PER_S),
    }
    for p in percentiles:
        stats[f"p{percentile_key(p)}_{name}_ms"] = float(np.percentile(data, p) * MS_PER_S)
    return stats


def compute_metrics(
    results: Sequence[RequestResult],
    duration_s: float,
    percentile_metrics: Sequence[str] = ("ttft", "tpot", "itl"),
    percentiles: Sequence[float] = (99.0,),
    goodput_slos_ms: dict[str, float] | None = None,
) -> dict[str, float | int | None]:
    """The aggregate fields of vLLM's result JSON for one benchmark run.

    Requests whose `output_tokens` is None must have been resolved by the caller (re-tokenized text); here a
    missing count is treated as 0 so the math stays pure.
    """
    if duration_s <= 0:
        raise ValueError(f"duration must be positive, got {duration_s}")
    num_completed = 0
    total_input = 0
    total_output = 0
    ttfts: list[float] = []
    tpots: list[float] = []
    tpots_for_goodput: list[float] = []
    itls: list[float] = []
    e2els: list[float] = []
    for r in results:
        if not r.is_success:
            continue
        num_output = int(r.output_tokens or 0)
        num_completed += 1
        total_input += r.prompt_len
        total_output += num_output
        tpot = 0.0
        if num_output > 1:
            tpot = (r.latency - r.ttft) / (num_output - 1)
            tpots.append(tpot)
        tpots_for_goodput.append(tpot)
        itls.extend(r.itl)
        ttfts.append(r.ttft)
        e2els.append(r.latency)

    request_goodput: float | None = None
    if goodput_slos_ms:
        per_metric = {"ttft": ttfts, "tpot": tpots_for_goodput, "e2el": e2els}
        num_good = 0
        for i in range(num_completed):
            if all(per_metric[key][i] * MS_PER_S <= slo for key, slo in goodput_slos_ms.items()):
                num_good += 1
        request_goodput = num_good / duration_s

    metrics: dict[str, float | int | None] = {
        "duration": duration_s,
        "completed": num_completed,
        "failed": sum(1 for r in results if not r.is_success),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": num_completed / duration_s,
        "request_goodput": request_goodput,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "max_output_tokens_per_s": peak_output_tokens_per_s(results),
        "max_concurrent_requests": peak_concurrent_requests(results),
    }
    per_name = {"ttft": ttfts, "tpot": tpots, "itl": itls, "e2el": e2els}
    for name in PERCENTILE_METRICS:
        if name in percentile_metrics:
            metrics.update(_stats(per_name[name], name, percentiles))
    return metrics
