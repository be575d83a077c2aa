"""Prometheus metrics under vLLM's names (labels model_name and engine), in a registry owned by one app.

Gauges that mirror the engine (running/waiting requests, KV usage, free blocks and state slots, preemptions) are
read from engine.stats() at scrape time by a collector; per-request counters and histograms (tokens, TTFT,
inter-token latency, end-to-end latency) are recorded by a RequestTracker as the server streams the outputs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from deltaserve.engine.request import RequestOutput

logger = logging.getLogger(__name__)

LABELS = ("model_name", "engine")
ENGINE_INDEX = "0"  # one engine per server; vLLM labels data-parallel engines 0..N-1

# vLLM's histogram buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)  # fmt: skip


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


class EngineStatsCollector(Collector):
    """Reads engine.stats() at every scrape, so the gauges are never stale."""

    def __init__(self, engine: Any, model_name: str) -> None:
        self.engine = engine
        self.label_values = [model_name, ENGINE_INDEX]

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=LABELS)
        family.add_metric(self.label_values, value)
        return family

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self.engine.stats()
        except Exception:  # a dead engine must not break /metrics
            logger.exception("engine.stats() failed")
            return
        yield self._gauge("vllm:num_requests_running", "Requests in the running batch.", stats.num_running)
        yield self._gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting)
        yield self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 1 means 100 percent.", stats.kv_cache_usage)
        yield self._gauge("deltaserve:num_free_kv_blocks", "Free KV-cache blocks.", stats.num_free_kv_blocks)
        yield self._gauge("deltaserve:num_total_kv_blocks", "KV-cache blocks in total.", stats.num_total_kv_blocks)
        yield self._gauge("deltaserve:num_free_state_slots", "Free recurrent-state slots.", stats.num_free_state_slots)
        yield self._gauge(
            "deltaserve:num_total_state_slots", "Recurrent-state slots in total.", stats.num_total_state_slots
        )
        preemptions = CounterMetricFamily("vllm:num_preemptions", "Cumulative preemptions.", labels=LABELS)
        preemptions.add_metric(self.label_values, stats.num_preemptions_total)
        yield preemptions


class ServerMetrics:
    def __init__(self, engine: Any, model_name: str, max_model_len: int) -> None:
        # vLLM does the same: no *_created series next to every counter and histogram (a process-wide switch).
        disable_created_metrics()
        self.registry = CollectorRegistry()
        self.label_values = (model_name, ENGINE_INDEX)
        registry, labels = self.registry, LABELS
        token_buckets = build_1_2_5_buckets(max(max_model_len, 1))
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed.", labels, registry=registry)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Generation tokens processed.", labels, registry=registry
        )
        self.request_success = Counter(
            "vllm:request_success", "Finished requests.", (*labels, "finished_reason"), registry=registry
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", labels, buckets=TTFT_BUCKETS, registry=registry
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds", "Inter-token latency.", labels, buckets=ITL_BUCKETS, registry=registry
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "End-to-end latency.", labels, buckets=E2E_BUCKETS, registry=registry
        )
        self.request_prompt_tokens = Histogram(
            "vllm:request_prompt_tokens", "Prompt tokens per request.", labels, buckets=token_buckets,
            registry=registry,
        )  # fmt: skip
        self.request_generation_tokens = Histogram(
            "vllm:request_generation_tokens", "Generated tokens per request.", labels, buckets=token_buckets,
            registry=registry,
        )  # fmt: skip
        self.request_params_n = Histogram(
            "vllm:request_params_n", "The n request parameter.", labels, buckets=(1, 2, 5, 10, 20), registry=registry
        )
        self.request_params_max_tokens = Histogram(
            "vllm:request_params_max_tokens", "The max_tokens request parameter.", labels, buckets=token_buckets,
            registry=registry,
        )  # fmt: skip
        registry.register(EngineStatsCollector(engine, model_name))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def track(self, num_prompt_tokens: int, n: int, max_tokens: int, arrival: float) -> RequestTracker:
        labels = self.label_values
        self.request_params_n.labels(*labels).observe(n)
        self.request_params_max_tokens.labels(*labels).observe(max_tokens)
        return RequestTracker(self, num_prompt_tokens, arrival)


class RequestTracker:
    """One engine request's timeline: first token, gaps between outputs, finish reasons."""

    def __init__(self, metrics: ServerMetrics, num_prompt_tokens: int, arrival: float) -> None:
        self.metrics = metrics
        self.num_prompt_tokens = num_prompt_tokens
        self.arrival = arrival
        self.last_output: float | None = None
        self.num_generation_tokens = 0
        self.is_done = False

    def on_output(self, output: RequestOutput) -> None:
        metrics, labels, now = self.metrics, self.metrics.label_values, time.perf_counter()
        if self.last_output is None:
            metrics.ttft.labels(*labels).observe(now - self.arrival)
            metrics.prompt_tokens.labels(*labels).inc(self.num_prompt_tokens)
        else:
            metrics.itl.labels(*labels).observe(now - self.last_output)
        self.last_output = now
        num_new = sum(len(seq.token_ids) for seq in output.outputs)
        self.num_generation_tokens += num_new
        if num_new:
            metrics.generation_tokens.labels(*labels).inc(num_new)
        for seq in output.outputs:
            if seq.finish_reason is not None:
                metrics.request_success.labels(*labels, str(seq.finish_reason)).inc()
        if output.finished:
            self._close()

    def on_abort(self) -> None:
        """The client went away (or the stream failed) before the engine finished the request."""
        if not self.is_done:
            self.metrics.request_success.labels(*self.metrics.label_values, "abort").inc()
            self._close()

    def _close(self) -> None:
        metrics, labels = self.metrics, self.metrics.label_values
        self.is_done = True
        metrics.e2e.labels(*labels).observe(time.perf_counter() - self.arrival)
        metrics.request_prompt_tokens.labels(*labels).observe(self.num_prompt_tokens)
        metrics.request_generation_tokens.labels(*labels).observe(self.num_generation_tokens)
