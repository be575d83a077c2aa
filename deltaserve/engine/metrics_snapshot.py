"""LLM.get_metrics' snapshot: vLLM 0.26's metric records (vllm/v1/metrics/reader.py: Counter, Gauge, Histogram,
Vector, each a name, its labels and its value(s)) for what deltaserve counts, under vLLM's names and labels.

Two sources. The engine's own counters and gauges come from EngineStats (engine/stats.py), the same object the
server's /metrics collector reads at each scrape: running and waiting requests, KV-cache usage, preemptions, the
prefix cache's queried and hit tokens, the per-step token histogram, and with speculative decoding configured the
spec-decode counters. The per-request counters (prompt and generated tokens, cached prompt tokens, finished requests
by reason) are counted where the requests' outputs are seen: by the server's RequestTracker as it streams them
(api/metrics.py), offline by RequestCounts here as LLM's run loop returns them. The label names, the engine index and
the finish reasons are defined here once and the server imports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deltaserve.engine.request import RequestOutput
from deltaserve.engine.stats import ITERATION_TOKEN_BUCKETS, EngineStats

LABELS = ("model_name", "engine")
ENGINE_INDEX = "0"  # one engine per LLM or server; vLLM labels data-parallel engines 0..N-1
# vllm:request_success's finished_reason values, each from zero: vLLM's FinishReason strings (vllm/v1/engine
# FINISH_REASON_STRINGS), so error and repetition read 0 rather than being absent
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


@dataclass
class Metric:
    """One series: its name and its labels (vLLM's reader.Metric)."""

    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Vector(Metric):
    """Counters by position (vLLM's form of vllm:spec_decode_num_accepted_tokens_per_pos)."""

    values: list[int]


@dataclass
class Histogram(Metric):
    """count and sum of the observations; buckets: cumulative count per upper bound ("1.0", ..., "+Inf")."""

    count: int
    sum: float
    buckets: dict[str, int]


@dataclass
class RequestCounts:
    """The per-request counters of the offline LLM, from each finished request's final output."""

    prompt_tokens: int = 0
    prompt_tokens_cached: int = 0
    generation_tokens: int = 0
    success: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0))

    def observe(self, output: RequestOutput) -> None:
        num_prompt = len(output.prompt_token_ids)
        self.prompt_tokens += num_prompt
        self.prompt_tokens_cached += min(max(int(output.num_cached_tokens or 0), 0), num_prompt)
        for seq in output.outputs:  # n > 1: every sequence's tokens, one finished request per sequence
            self.generation_tokens += len(seq.token_ids)
            if seq.finish_reason is not None:
                self.success[str(seq.finish_reason)] = self.success.get(str(seq.finish_reason), 0) + 1


def iteration_token_buckets(stats: EngineStats) -> dict[str, int]:
    """vllm:iteration_tokens_total's cumulative buckets by Prometheus' le strings ("1.0", ..., "+Inf")."""
    bounds = [str(float(bound)) for bound in ITERATION_TOKEN_BUCKETS] + ["+Inf"]
    counts = tuple(stats.iteration_token_counts)
    if len(counts) != len(bounds):
        counts = (0,) * len(bounds)
    return dict(zip(bounds, counts, strict=True))


def engine_metrics(stats: EngineStats, labels: dict[str, str]) -> list[Metric]:
    """The engine's series from one EngineStats, as vLLM names them."""
    buckets = iteration_token_buckets(stats)
    metrics: list[Metric] = [
        Gauge("vllm:num_requests_running", dict(labels), float(stats.num_running)),
        Gauge("vllm:num_requests_waiting", dict(labels), float(stats.num_waiting)),
        Gauge("vllm:num_requests_waiting_by_reason", {**labels, "reason": "capacity"},
              float(stats.num_waiting_for_capacity)),
        Gauge("vllm:num_requests_waiting_by_reason", {**labels, "reason": "deferred"},
              float(stats.num_waiting_deferred)),
        Gauge("vllm:kv_cache_usage_perc", dict(labels), float(stats.kv_cache_usage)),
        Counter("vllm:num_preemptions", dict(labels), stats.num_preemptions_total),
        Counter("vllm:prefix_cache_queries", dict(labels), stats.prefix_cache_queries),
        Counter("vllm:prefix_cache_hits", dict(labels), stats.prefix_cache_hits),
        Histogram("vllm:iteration_tokens_total", dict(labels), buckets["+Inf"], float(stats.iteration_tokens_sum),
                  buckets),
    ]  # fmt: skip
    if stats.num_speculative_tokens > 0:  # as vLLM: the spec-decode series exist only when speculating
        per_pos = list(stats.spec_decode_num_accepted_tokens_per_pos)
        per_pos += [0] * (stats.num_speculative_tokens - len(per_pos))
        metrics += [
            Counter("vllm:spec_decode_num_drafts", dict(labels), stats.spec_decode_num_drafts),
            Counter("vllm:spec_decode_num_draft_tokens", dict(labels), stats.spec_decode_num_draft_tokens),
            Counter("vllm:spec_decode_num_accepted_tokens", dict(labels), stats.spec_decode_num_accepted_tokens),
            Vector("vllm:spec_decode_num_accepted_tokens_per_pos", labels,
                   per_pos[: stats.num_speculative_tokens]),
        ]  # fmt: skip
    return metrics


def request_metrics(counts: RequestCounts, labels: dict[str, str]) -> list[Metric]:
    """The per-request counters' series, as vLLM names them."""
    computed = counts.prompt_tokens - counts.prompt_tokens_cached
    by_source = {"local_compute": computed, "local_cache_hit": counts.prompt_tokens_cached, "external_kv_transfer": 0}
    return [
        Counter("vllm:prompt_tokens", dict(labels), counts.prompt_tokens),
        *(Counter("vllm:prompt_tokens_by_source", {**labels, "source": source}, by_source[source])
          for source in PROMPT_SOURCES),
        Counter("vllm:prompt_tokens_cached", dict(labels), counts.prompt_tokens_cached),
        Counter("vllm:generation_tokens", dict(labels), counts.generation_tokens),
        *(Counter("vllm:request_success", {**labels, "finished_reason": reason}, count)
          for reason, count in counts.success.items()),
    ]  # fmt: skip


def snapshot(stats: EngineStats, counts: RequestCounts, model_name: str) -> list[Metric]:
    """Every series of the offline LLM's get_metrics(), labelled model_name and engine as vLLM labels them."""
    labels = {"model_name": model_name, "engine": ENGINE_INDEX}
    return request_metrics(counts, labels) + engine_metrics(stats, labels)
