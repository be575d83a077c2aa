"""What the engine reports about itself and about each request, as plain frozen data (it crosses processes).

EngineStats is polled by the server's /metrics collector; RequestMetrics rides on each RequestOutput so the server
can observe vLLM's per-request histograms (queue, prefill, decode and inference time, preemptions). IterationTokens
is the engine core's own accumulator behind EngineStats' vllm:iteration_tokens_total fields, and SpecDecodeCounts
the one behind its vllm:spec_decode_* fields and vLLM's periodic "SpecDecoding metrics" log line (both stay in the
core).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the chat-template workers import this module and must not load torch
    from deltaserve.step import StepPlan, StepResult

logger = logging.getLogger(__name__)

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


# vLLM's VLLM_LOG_STATS_INTERVAL default: its stat loggers write one line per interval
SPEC_DECODE_LOG_INTERVAL_S = 10.0


class SpecDecodeCounts:
    """vLLM's speculative-decoding counters (vllm/v1/spec_decode/metrics.py), kept by the engine core from each
    step's plan and result: a sequence planned with num_draft_tokens = n > 0 is one draft of n tokens, and of the
    tokens its result accepted (StepResult.token_ids: the accepted drafts, then the target's own token) all but the
    last are accepted drafts, counted at their positions 0 .. accepted - 1.

    Cumulative totals feed /metrics; the same counts since the last log line feed vLLM's periodic INFO line
    ("SpecDecoding metrics: Mean acceptance length: ..., Per-position acceptance rate: ..."), written at most once
    per SPEC_DECODE_LOG_INTERVAL_S and only when the interval saw a draft, as vLLM's does."""

    def __init__(
        self,
        num_speculative_tokens: int,
        log_interval_s: float = SPEC_DECODE_LOG_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.log_interval_s = log_interval_s
        self.clock = clock
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * num_speculative_tokens
        self._logged = (0, 0, 0, tuple(self.accepted_per_pos))  # the totals at the last log line
        self._last_log_time = clock()

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        num_accepted = max(0, min(num_accepted_tokens, num_draft_tokens, self.num_speculative_tokens))
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_pos[position] += 1

    def observe_step(self, plan: StepPlan, result: StepResult, unfinished: tuple[bool, ...] | None = None) -> None:
        """Every drafted sequence of one collected step (plan order: result.token_ids follows plan.seqs); unfinished:
        per sequence, False where it finished (stopped, aborted) since the step was planned, whose result is not
        counted, as vLLM skips a finished request's output; None: none did."""
        for index, (seq, tokens) in enumerate(zip(plan.seqs, result.token_ids, strict=False)):
            if seq.num_draft_tokens > 0 and tokens and (unfinished is None or unfinished[index]):
                self.observe_draft(seq.num_draft_tokens, len(tokens) - 1)

    def fields(self) -> dict[str, object]:
        """EngineStats' spec-decode fields."""
        return {
            "num_speculative_tokens": self.num_speculative_tokens,
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": tuple(self.accepted_per_pos),
        }

    def log_line(self) -> str | None:
        """vLLM's line over the counts since the last one (None when no draft was made since); starts a new
        interval."""
        now = self.clock()
        drafts, draft_tokens, accepted, per_pos = self._logged
        drafts = self.num_drafts - drafts
        draft_tokens = self.num_draft_tokens - draft_tokens
        accepted = self.num_accepted_tokens - accepted
        per_pos = [total - before for total, before in zip(self.accepted_per_pos, per_pos, strict=True)]
        elapsed = now - self._last_log_time
        self._logged = (self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, tuple(self.accepted_per_pos))
        self._last_log_time = now
        if drafts == 0:
            return None
        rate = accepted / draft_tokens * 100 if draft_tokens else float("nan")
        # vLLM's convention: the mean acceptance length counts the target's own (bonus) token
        rates = ", ".join(f"{count / drafts:.3f}" for count in per_pos)
        return (
            f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / drafts:.2f}, "
            f"Accepted throughput: {accepted / elapsed if elapsed > 0 else 0.0:.2f} tokens/s, "
            f"Drafted throughput: {draft_tokens / elapsed if elapsed > 0 else 0.0:.2f} tokens/s, "
            f"Accepted: {accepted} tokens, Drafted: {draft_tokens} tokens, Per-position acceptance rate: {rates}, "
            f"Avg Draft acceptance rate: {rate:.1f}%"
        )

    def maybe_log(self) -> None:
        """Writes vLLM's line when an interval has passed since the last one (and a draft was made in it)."""
        if self.clock() - self._last_log_time < self.log_interval_s:
            return
        line = self.log_line()
        if line is not None:
            logger.info("%s", line)


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
    kv_cache_memory_bytes: int | None = None
    enable_prefix_caching: bool = False
    # vllm:spec_decode_* (SpecDecodeCounts): cumulative; num_speculative_tokens 0 means speculative decoding is off,
    # and then /metrics has none of these series, as vLLM's
    num_speculative_tokens: int = 0
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()  # one count per draft position 0 .. k-1


@dataclass(frozen=True)
class RequestMetrics:
    """Engine-side timestamps of one request (time.time() seconds), for vLLM's per-request histograms."""

    arrival_time: float
    first_scheduled_time: float | None = None  # queue time = first_scheduled - arrival
    first_token_time: float | None = None  # prefill time = first_token - first_scheduled
    last_token_time: float | None = None  # decode time = last_token - first_token
    num_preemptions: int = 0
