"""What the engine reports about itself and about each request, as plain frozen data (it crosses processes).

EngineStats is polled by the server's /metrics collector; RequestMetrics rides on each RequestOutput so the server
can observe vLLM's per-request histograms (queue, prefill, decode and inference time, preemptions). IterationTokens
is the engine core's own accumulator behind EngineStats' vllm:iteration_tokens_total fields (it stays in the core).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

# vLLM's buckets for vllm:iteration_tokens_total (tokens of one engine step's outputs).
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class IterationTokens:
    """vllm:iteration_tokens_total, kept by the engine core: one observation per step that produced outputs.

    vLLM observes, per batch of engine outputs, the prompt length of every request whose first token is in it plus
    every generated token (vllm/v1/metrics/stats.py IterationStats), not the tokens the step scheduled: a request
    of P prompt and G output tokens adds P + G to the sum, where scheduled tokens add up to P + G - 1.
    """

    def __init__(self) -> None:
        self._per_bucket = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)  # the last one is +Inf
        self.sum = 0

    def observe(self, num_tokens: int) -> None:
        self._per_bucket[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, num_tokens)] += 1
        self.sum += num_tokens

    def cumulative_counts(self) -> tuple[int, ...]:
        """Observations <= each bound of ITERATION_TOKEN_BUCKETS, then the total (+Inf), as Prometheus buckets."""
        counts, running = [], 0
        for count in self._per_bucket:
            running += count
            counts.append(running)
        return tuple(counts)


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_kv_blocks: int
    num_total_kv_blocks: int
    num_free_state_slots: int
    num_total_state_slots: int
    num_preemptions_total: int
    # vllm:num_requests_waiting_by_reason: waiting for KV blocks / state slots, or deferred for another reason
    num_waiting_for_capacity: int = 0
    num_waiting_deferred: int = 0
    # vllm:iteration_tokens_total as a cumulative histogram: counts per ITERATION_TOKEN_BUCKETS bound (le), then +Inf
    iteration_token_counts: tuple[int, ...] = (0,) * (len(ITERATION_TOKEN_BUCKETS) + 1)
    iteration_tokens_sum: int = 0
    # vllm:prefix_cache_queries / vllm:prefix_cache_hits: cumulative prompt tokens looked up in the prefix cache at
    # admission and those it served (the scheduler's counters, vLLM's definition)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # vllm:cache_config_info
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = False


@dataclass(frozen=True)
class RequestMetrics:
    """Engine-side timestamps of one request (time.time() seconds), for vLLM's per-request histograms."""

    arrival_time: float
    first_scheduled_time: float | None = None  # queue time = first_scheduled - arrival
    first_token_time: float | None = None  # prefill time = first_token - first_scheduled
    last_token_time: float | None = None  # decode time = last_token - first_token
    num_preemptions: int = 0
