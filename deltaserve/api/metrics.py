"""Prometheus metrics under vLLM 0.26's names (labels model_name and engine), in a registry owned by one app.

Engine-side state is read from engine.stats() at scrape time by a collector: running/waiting requests and
waiting-by-reason, KV usage, free blocks and state slots, preemptions, the prefix cache's queries and hits (the
scheduler's token counters: a preempted request's second lookup counts again, as in vLLM), the per-step token
histogram (vllm:iteration_tokens_total), cache_config_info, the sleep state, and with speculative decoding configured
vLLM's vllm:spec_decode_* counters; the vllm:* series among these are the offline LLM.get_metrics' own records
(engine/metrics_snapshot.py engine_metrics), rendered as Prometheus families. Per-request series are recorded by a
RequestTracker as the server streams each request: token counters and histograms, cached prompt tokens by source
(from RequestOutput.num_cached_tokens), TTFT, inter-token latency, end-to-end latency, time per output token, and the
phase histograms (queue, prefill, decode, inference) and preemptions from RequestOutput.metrics, the engine's own
timestamps; a request whose outputs carry no metrics observes no phase histogram. Counters vLLM exports for features
deltaserve has not (external KV connector, multimodal cache) are exported at zero, as vLLM does when unused. The
registry also holds vLLM's HTTP request families (http_requests_total, ...), which api/http_metrics.py's middleware
records into, so /metrics renders them in the same exposition.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from deltaserve.engine import metrics_snapshot as snapshot
from deltaserve.engine.metrics_snapshot import ENGINE_INDEX, FINISH_REASONS, LABELS, PROMPT_SOURCES
from deltaserve.engine.request import RequestOutput
from deltaserve.engine.stats import RequestMetrics

logger = logging.getLogger(__name__)


# vLLM's histogram buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)  # fmt: skip
PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
# vLLM's help strings (vllm/v1/metrics/loggers.py) of the engine series that engine/metrics_snapshot.py names
ENGINE_HELP = {
    "vllm:num_requests_running": "Requests in the running batch.",
    "vllm:num_requests_waiting": "Requests waiting to be scheduled.",
    "vllm:num_requests_waiting_by_reason": "Waiting requests by reason: capacity (KV blocks or state slots) or "
    "deferred.",
    "vllm:kv_cache_usage_perc": "KV-cache usage, 1 means 100 percent.",
    "vllm:num_preemptions": "Cumulative preemptions.",
    "vllm:prefix_cache_queries": "Prefix cache queries, in terms of number of queried tokens.",
    "vllm:prefix_cache_hits": "Prefix cache hits, in terms of number of cached tokens.",
    "vllm:iteration_tokens_total": "Histogram of number of tokens per engine_step.",
    "vllm:spec_decode_num_drafts": "Number of spec decoding drafts.",
    "vllm:spec_decode_num_draft_tokens": "Number of draft tokens.",
    "vllm:spec_decode_num_accepted_tokens": "Number of accepted tokens.",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "Accepted tokens per draft position.",
}


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value, as vLLM buckets token counts."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


def engine_families(metrics: list[snapshot.Metric]) -> Iterator[Metric]:
    """Prometheus families of the engine series that engine/metrics_snapshot.py builds (the offline get_metrics'
    records), one family per name in their order, so /metrics and the offline snapshot name and count alike."""
    families: dict[str, Metric] = {}
    for metric in metrics:
        names, values = list(metric.labels), list(metric.labels.values())
        family = families.get(metric.name)
        doc = ENGINE_HELP[metric.name]
        if isinstance(metric, snapshot.Vector):  # Prometheus has no vector: a counter per position label
            family = family or CounterMetricFamily(metric.name, doc, labels=[*names, "position"])
            for position, count in enumerate(metric.values):
                family.add_metric([*values, str(position)], count)
        elif isinstance(metric, snapshot.Counter):
            family = family or CounterMetricFamily(metric.name, doc, labels=names)
            family.add_metric(values, metric.value)
        elif isinstance(metric, snapshot.Gauge):
            family = family or GaugeMetricFamily(metric.name, doc, labels=names)
            family.add_metric(values, metric.value)
        elif isinstance(metric, snapshot.Histogram):
            family = family or HistogramMetricFamily(metric.name, doc, labels=names)
            family.add_metric(values, list(metric.buckets.items()), metric.sum)
        else:
            raise TypeError(f"{metric.name}: no Prometheus family for {type(metric).__name__}")
        families[metric.name] = family
    yield from families.values()


class EngineStatsCollector(Collector):
    """Reads engine.stats() at every scrape, so the gauges are never stale."""

    def __init__(self, engine: Any, model_name: str) -> None:
        self.engine = engine
        self.label_values = [model_name, ENGINE_INDEX]

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=LABELS)
        family.add_metric(self.label_values, value)
        return family

    def _cache_config(self, stats: Any) -> GaugeMetricFamily:
        # vLLM labels the gauge with its CacheConfig fields (CacheConfig.metrics_info) and the engine index; these
        # are the ones deltaserve has values for. The KV cache is kept in the model dtype, which is vLLM's "auto",
        # and no KV block lives on the CPU (vLLM's v1 engine reports 0 too). kv_cache_size_tokens and
        # kv_cache_max_concurrency are vLLM's capacity figures: the tokens the KV blocks hold, and how many requests
        # of max_model_len tokens fit in them at once (a GDN state slot per request is sized apart, never fewer).
        blocks_per_request = -(-max(self.engine.max_model_len, 1) // stats.block_size)
        info = {"block_size": str(stats.block_size), "cache_dtype": "auto",
                "gpu_memory_utilization": str(stats.gpu_memory_utilization),
                "kv_cache_memory_bytes": str(stats.kv_cache_memory_bytes),
                "enable_prefix_caching": str(stats.enable_prefix_caching),
                "num_gpu_blocks": str(stats.num_total_kv_blocks), "num_cpu_blocks": "0",
                "kv_cache_size_tokens": str(stats.num_total_kv_blocks * stats.block_size),
                "kv_cache_max_concurrency": str(stats.num_total_kv_blocks / blocks_per_request),
                "engine": ENGINE_INDEX}  # fmt: skip
        family = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=list(info)
        )
        family.add_metric(list(info.values()), 1)
        return family

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self.engine.stats()
        except Exception:  # a dead engine must not break /metrics
            logger.exception("engine.stats() failed")
            return
        # running / waiting (by reason) requests, KV usage, preemptions, prefix-cache queries and hits, the per-step
        # token histogram and, when speculating, vLLM's vllm:spec_decode_* counters: the offline snapshot's series
        yield from engine_families(snapshot.engine_metrics(stats, dict(zip(LABELS, self.label_values, strict=True))))
        sleep = GaugeMetricFamily("vllm:engine_sleep_state", "Engine sleep state (awake = 1: awake).",
                                  labels=(*LABELS, "sleep_state"))  # fmt: skip
        for state in SLEEP_STATES:
            sleep.add_metric([*self.label_values, state], 1 if state == "awake" else 0)
        yield sleep
        # blocks and slots only the prefix cache holds count free (it gives them up on demand), as vLLM counts them
        yield self._gauge("deltaserve:num_free_kv_blocks", "Free KV-cache blocks.", stats.num_free_kv_blocks)
        yield self._gauge("deltaserve:num_total_kv_blocks", "KV-cache blocks in total.", stats.num_total_kv_blocks)
        yield self._gauge("deltaserve:num_free_state_slots", "Free recurrent-state slots.", stats.num_free_state_slots)
        yield self._gauge(
            "deltaserve:num_total_state_slots", "Recurrent-state slots in total.", stats.num_total_state_slots
        )
        yield self._cache_config(stats)


class ServerMetrics:
    def __init__(self, engine: Any, model_name: str, max_model_len: int) -> None:
        # vLLM does the same: no *_created series next to every counter and histogram (a process-wide switch).
        disable_created_metrics()
        self.registry = CollectorRegistry()
        self.label_values = (model_name, ENGINE_INDEX)
        # plain totals for the periodic stats line (api/stat_logger.py): requests tracked, prompt tokens of those
        # that got their first token, generated tokens
        self.num_requests_total = 0
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0
        token_buckets = build_1_2_5_buckets(max(max_model_len, 1))

        # Every series exists from the start at zero, as vLLM creates them per engine.
        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            metric = Counter(name, doc, (*LABELS, *extra), registry=self.registry)
            if not extra:
                metric.labels(*self.label_values)
            return metric

        def histogram(name: str, doc: str, buckets: Any) -> Histogram:
            metric = Histogram(name, doc, LABELS, buckets=buckets, registry=self.registry)
            metric.labels(*self.label_values)
            return metric

        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefill tokens processed.")
        self.prompt_tokens_by_source = counter("vllm:prompt_tokens_by_source", "Prompt tokens by source.", ("source",))
        for source in PROMPT_SOURCES:
            self.prompt_tokens_by_source.labels(*self.label_values, source)
        self.prompt_tokens_cached = counter("vllm:prompt_tokens_cached", "Cached prompt tokens (local + external).")
        self.generation_tokens = counter("vllm:generation_tokens", "Generation tokens processed.")
        self.request_success = counter("vllm:request_success", "Finished requests.", ("finished_reason",))
        for reason in FINISH_REASONS:
            self.request_success.labels(*self.label_values, reason)
        unused = (("vllm:external_prefix_cache_queries", "External prefix cache queries, in tokens."),
                  ("vllm:external_prefix_cache_hits", "External prefix cache hits, in tokens."),
                  ("vllm:mm_cache_queries", "Multi-modal cache queries, in items."),
                  ("vllm:mm_cache_hits", "Multi-modal cache hits, in items."))  # fmt: skip
        # Exported at zero: the features behind them are absent.
        for name, doc in unused:
            counter(name, doc)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Inter-token latency.", ITL_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds", "Time per output token per request.",
                              ITL_BUCKETS)  # fmt: skip
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "End-to-end latency.", E2E_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds", "Time waiting before scheduling.",
                                    E2E_BUCKETS)  # fmt: skip
        self.prefill_time = histogram("vllm:request_prefill_time_seconds", "Time in prefill.", E2E_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds", "Time in decode.", E2E_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds", "Time running (prefill + decode).",
                                        E2E_BUCKETS)  # fmt: skip
        self.num_preemptions = histogram("vllm:request_num_preemptions", "Preemptions per finished request.",
                                         PREEMPTION_BUCKETS)  # fmt: skip
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Prompt tokens per request.",
                                               token_buckets)  # fmt: skip
        self.request_generation_tokens = histogram("vllm:request_generation_tokens", "Generated tokens per request.",
                                                   token_buckets)  # fmt: skip
        self.request_max_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens", "Most tokens generated by one sequence of a request.",
            token_buckets,
        )  # fmt: skip
        self.request_prefill_kv_computed = histogram(
            "vllm:request_prefill_kv_computed_tokens", "New KV tokens computed in prefill (cached tokens excluded).",
            token_buckets,
        )  # fmt: skip
        self.request_params_n = histogram("vllm:request_params_n", "The n request parameter.", (1, 2, 5, 10, 20))
        self.request_params_max_tokens = histogram("vllm:request_params_max_tokens", "The max_tokens parameter.",
                                                   token_buckets)  # fmt: skip
        self.registry.register(EngineStatsCollector(engine, model_name))
        # vLLM's /metrics is prometheus_client's default registry (one API server), which carries the process_*,
        # python_gc_* and python_info families next to the vllm:* ones.
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def track(self, num_prompt_tokens: int, n: int, max_tokens: int, arrival: float) -> RequestTracker:
        labels = self.label_values
        self.num_requests_total += 1
        self.request_params_n.labels(*labels).observe(n)
        self.request_params_max_tokens.labels(*labels).observe(max_tokens)
        return RequestTracker(self, num_prompt_tokens, arrival)


def _elapsed(start: float | None, end: float | None) -> float | None:
    return end - start if start is not None and end is not None and end >= start else None


class RequestTracker:
    """One engine request's timeline: first token, gaps between outputs, finish reasons, engine phase times."""

    def __init__(self, metrics: ServerMetrics, num_prompt_tokens: int, arrival: float) -> None:
        self.metrics = metrics
        self.num_prompt_tokens = num_prompt_tokens
        self.arrival = arrival
        self.first_output: float | None = None
        self.last_output: float | None = None
        self.num_generation_tokens = 0
        self.seq_tokens: dict[int, int] = {}
        self.engine_metrics: RequestMetrics | None = None
        self.is_done = False

    def _on_first_output(self, output: RequestOutput) -> None:
        metrics, labels = self.metrics, self.metrics.label_values
        num_cached = min(max(int(output.num_cached_tokens or 0), 0), self.num_prompt_tokens)
        metrics.prompt_tokens.labels(*labels).inc(self.num_prompt_tokens)
        metrics.num_prompt_tokens_total += self.num_prompt_tokens
        metrics.prompt_tokens_cached.labels(*labels).inc(num_cached)
        metrics.prompt_tokens_by_source.labels(*labels, "local_compute").inc(self.num_prompt_tokens - num_cached)
        metrics.prompt_tokens_by_source.labels(*labels, "local_cache_hit").inc(num_cached)
        metrics.prompt_tokens_by_source.labels(*labels, "external_kv_transfer").inc(0)
        metrics.request_prefill_kv_computed.labels(*labels).observe(self.num_prompt_tokens - num_cached)

    def on_output(self, output: RequestOutput) -> None:
        metrics, labels, now = self.metrics, self.metrics.label_values, time.perf_counter()
        if self.last_output is None:
            metrics.ttft.labels(*labels).observe(now - self.arrival)
            self.first_output = now
            self._on_first_output(output)
        else:
            metrics.itl.labels(*labels).observe(now - self.last_output)
        self.last_output = now
        if output.metrics is not None:
            self.engine_metrics = output.metrics
        num_new = 0
        for seq in output.outputs:
            num_new += len(seq.token_ids)
            self.seq_tokens[seq.index] = self.seq_tokens.get(seq.index, 0) + len(seq.token_ids)
        self.num_generation_tokens += num_new
        if num_new:
            metrics.generation_tokens.labels(*labels).inc(num_new)
            metrics.num_generation_tokens_total += num_new
        for seq in output.outputs:
            if seq.finish_reason is not None:
                metrics.request_success.labels(*labels, str(seq.finish_reason)).inc()
        if output.finished:
            self._close()

    def on_abort(self) -> None:
        """The client went away (or the stream failed) before the engine finished the request: nothing is observed,
        as in vLLM, whose frontend drops an aborted request's state without recording it as finished
        (v1/engine/output_processor.py abort_requests), so its request_success `abort` series, e2e latency and
        per-request token histograms do not count client disconnects. Its tokens stay counted."""
        self.is_done = True

    def _observe_phases(self) -> None:
        """vLLM's per-request phase histograms, from the engine's timestamps (nothing when it reported none)."""
        stats, metrics, labels = self.engine_metrics, self.metrics, self.metrics.label_values
        if stats is None:
            return
        phases = (
            (metrics.queue_time, _elapsed(stats.arrival_time, stats.first_scheduled_time)),
            (metrics.prefill_time, _elapsed(stats.first_scheduled_time, stats.first_token_time)),
            (metrics.decode_time, _elapsed(stats.first_token_time, stats.last_token_time)),
            (metrics.inference_time, _elapsed(stats.first_scheduled_time, stats.last_token_time)),
        )
        for histogram, value in phases:
            if value is not None:
                histogram.labels(*labels).observe(value)
        metrics.num_preemptions.labels(*labels).observe(stats.num_preemptions)

    def _close(self) -> None:
        metrics, labels = self.metrics, self.metrics.label_values
        self.is_done = True
        metrics.e2e.labels(*labels).observe(time.perf_counter() - self.arrival)
        metrics.request_prompt_tokens.labels(*labels).observe(self.num_prompt_tokens)
        metrics.request_generation_tokens.labels(*labels).observe(self.num_generation_tokens)
        metrics.request_max_generation_tokens.labels(*labels).observe(max(self.seq_tokens.values(), default=0))
        decode = None
        if self.engine_metrics is not None:
            decode = _elapsed(self.engine_metrics.first_token_time, self.engine_metrics.last_token_time)
        if decode is None:
            decode = _elapsed(self.first_output, self.last_output)
        num_seq_tokens = max(self.seq_tokens.values(), default=0)
        # vLLM observes every finished request, 0 when there is no decode (one token or less: FinishedRequestStats'
        # mean_time_per_output_token), so the histogram counts what vllm:e2e_request_latency_seconds counts
        tpot = decode / (num_seq_tokens - 1) if decode is not None and num_seq_tokens > 1 else 0.0
        metrics.tpot.labels(*labels).observe(tpot)
        self._observe_phases()
