"""The server's periodic stats line, in vLLM's LoggingStatLogger wording, every VLLM_LOG_STATS_INTERVAL seconds.

  Engine 000: Avg prompt throughput: 1234.5 tokens/s, Avg generation throughput: 456.7 tokens/s, Running: 8 reqs,
  Waiting: 0 reqs, GPU KV cache usage: 12.3%, Prefix cache hit rate: 61.9%

(one line; "Deferred: N reqs" after Waiting when some wait for another reason than capacity, and "Preemptions: N"
when the interval preempted, as vLLM adds them). The throughputs are the prompt tokens of the requests that got
their first token and the tokens generated in the interval, over its length; the rest is the engine's latest stats.
The hit rate is vLLM's: hits over queries of the prefix cache across the most recent ~1,000 requests (intervals are
dropped whole, oldest first, while the window holds more), read from the scheduler's counters; a prefix-cache
reset starts it afresh. An idle interval after an idle one logs at DEBUG, so an idle server stays quiet.
`--disable-log-stats` turns the line off.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any

logger = logging.getLogger(__name__)

MAX_RECENT_REQUESTS = 1000  # vLLM's PrefixCachingMetrics window
LOG_PREFIX = "Engine 000: "  # one engine per server: vLLM's index 0


class PrefixHitRate:
    """Hits / queries over the most recent intervals that together hold about MAX_RECENT_REQUESTS requests."""

    def __init__(self, max_recent_requests: int = MAX_RECENT_REQUESTS) -> None:
        self.max_recent_requests = max_recent_requests
        self._intervals: deque[tuple[int, int, int]] = deque()  # (requests, queries, hits)
        self._requests = self._queries = self._hits = 0

    def observe(self, requests: int, queries: int, hits: int) -> None:
        if requests <= 0 and queries <= 0:
            return  # nothing was looked up: the window keeps its intervals
        self._intervals.append((requests, queries, hits))
        self._requests += requests
        self._queries += queries
        self._hits += hits
        while len(self._intervals) > 1 and self._requests > self.max_recent_requests:
            old_requests, old_queries, old_hits = self._intervals.popleft()
            self._requests -= old_requests
            self._queries -= old_queries
            self._hits -= old_hits

    def reset(self) -> None:
        self._intervals.clear()
        self._requests = self._queries = self._hits = 0

    @property
    def hit_rate(self) -> float:
        return self._hits / self._queries if self._queries > 0 else 0.0


class LoggingStatLogger:
    """Reads the server's token totals (ServerMetrics) and the engine's stats; log() writes one line."""

    def __init__(self, engine: Any, metrics: Any, interval_s: float) -> None:
        self.engine = engine
        self.metrics = metrics
        self.interval_s = interval_s
        self.prefix_hit_rate = PrefixHitRate()
        self._last = self._snapshot()
        self._last_time = time.monotonic()
        self._was_busy = False

    def _snapshot(self) -> tuple[int, int, int, int, int, int]:
        stats = self.engine.stats()
        metrics = self.metrics
        return (metrics.num_requests_total, metrics.num_prompt_tokens_total, metrics.num_generation_tokens_total,
                stats.prefix_cache_queries, stats.prefix_cache_hits, stats.num_preemptions_total)  # fmt: skip

    def reset_prefix_hit_rate(self) -> None:
        """After a prefix-cache reset (vLLM clears its window too)."""
        self.prefix_hit_rate.reset()

    def log(self) -> None:
        now, current = time.monotonic(), self._snapshot()
        elapsed = now - self._last_time
        requests, prompt, generation, queries, hits, preemptions = (a - b for a, b in zip(current, self._last,
                                                                                           strict=True))  # fmt: skip
        self._last, self._last_time = current, now
        self.prefix_hit_rate.observe(requests, queries, hits)
        prompt_throughput = prompt / elapsed if elapsed > 0 else 0.0
        generation_throughput = generation / elapsed if elapsed > 0 else 0.0
        is_busy = bool(prompt or generation)
        # vLLM logs at DEBUG when this interval and the one before both moved no token
        log = logger.info if is_busy or self._was_busy else logger.debug
        self._was_busy = is_busy
        stats = self.engine.stats()
        parts = ["Avg prompt throughput: %.1f tokens/s", "Avg generation throughput: %.1f tokens/s",
                 "Running: %d reqs", "Waiting: %d reqs"]  # fmt: skip
        values: list[float] = [prompt_throughput, generation_throughput, stats.num_running, stats.num_waiting]
        if stats.num_waiting_deferred > 0:
            parts.append("Deferred: %d reqs")
            values.append(stats.num_waiting_deferred)
        if preemptions > 0:
            parts.append("Preemptions: %d")
            values.append(preemptions)
        parts += ["GPU KV cache usage: %.1f%%", "Prefix cache hit rate: %.1f%%"]
        values += [stats.kv_cache_usage * 100, self.prefix_hit_rate.hit_rate * 100]
        log(LOG_PREFIX + ", ".join(parts), *values)

    async def run(self) -> None:
        """Logs every interval_s until cancelled; a failing read (a dead engine) skips one line, never the loop."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.log()
            except Exception:
                logger.debug("the stats line failed", exc_info=True)
