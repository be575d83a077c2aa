"""The server's own prefix-cache hit rate around a benchmark run, read from its Prometheus /metrics.

Both engines export vLLM's token counters `vllm:prefix_cache_queries` (prompt tokens looked up) and
`vllm:prefix_cache_hits` (those the cache served), as `*_total` samples labelled per engine. The client reads them
once the warm-ups are done and again when the last request has finished; the deltas give the run's hit rate as the
server counted it (cached / prompt tokens, preempted requests looked up again as the engine counts them), the same
definition for every arm of a grid whatever the server reports in its responses. A server without /metrics or without
the counters gives None, never a guessed 0.
"""

from __future__ import annotations

from typing import Any

from deltaserve.bench._extra import require

QUERIES = "vllm:prefix_cache_queries_total"
HITS = "vllm:prefix_cache_hits_total"
METRICS_TIMEOUT_S = 30.0


def parse_prefix_counters(text: str) -> tuple[float, float] | None:
    """(queries, hits) summed over every sample (engines) in Prometheus text; None if either counter is absent."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in (QUERIES, HITS):
            totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    if QUERIES not in totals or HITS not in totals:
        return None
    return totals[QUERIES], totals[HITS]


async def read_prefix_counters(base_url: str) -> tuple[float, float] | None:
    """The server's (queries, hits) now; None when /metrics cannot be read or lacks them."""
    aiohttp = require("aiohttp")
    try:
        timeout = aiohttp.ClientTimeout(total=METRICS_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as session, session.get(base_url + "/metrics") as response:
            if response.status != 200:
                return None
            return parse_prefix_counters(await response.text())
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None


def prefix_cache_fields(before: tuple[float, float] | None, after: tuple[float, float] | None) -> dict[str, Any]:
    """The record's fields: the run's query and hit deltas and their ratio (None where unknown or nothing queried)."""
    if before is None or after is None:
        return {"server_prefix_cache_queries": None, "server_prefix_cache_hits": None,
                "server_prefix_cache_hit_rate": None}  # fmt: skip
    queries, hits = int(after[0] - before[0]), int(after[1] - before[1])
    return {
        "server_prefix_cache_queries": queries,
        "server_prefix_cache_hits": hits,
        "server_prefix_cache_hit_rate": hits / queries if queries > 0 else None,
    }
