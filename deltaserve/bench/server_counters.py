"""The server's own prefix-cache hit rate and speculative-decoding acceptance around a benchmark run, read from its
Prometheus /metrics.

Both engines export vLLM's token counters `vllm:prefix_cache_queries` (prompt tokens looked up) and
`vllm:prefix_cache_hits` (those the cache served), as `*_total` samples labelled per engine. The client reads them
once the warm-ups are done and again when the last request has finished; the deltas give the run's hit rate as the
server counted it (cached / prompt tokens, preempted requests looked up again as the engine counts them), the same
definition for every arm of a grid whatever the server reports in its responses. A server without /metrics or without
the counters gives None, never a guessed 0.

A server that speculates (both engines with `--speculative-config`) also exports vLLM's spec-decode counters
`vllm:spec_decode_num_drafts` (sequences verified with drafts, one a step), `_num_draft_tokens` and
`_num_accepted_tokens`; the same two reads give the run's mean acceptance length, 1 + accepted / drafts (vLLM's
convention: the target's own token counts), and the draft acceptance rate, accepted / draft tokens. A server that
does not speculate has no such series: its fields are None.
"""

from __future__ import annotations

from typing import Any

from deltaserve.bench._extra import require

QUERIES = "vllm:prefix_cache_queries_total"
HITS = "vllm:prefix_cache_hits_total"
SPEC_DRAFTS = "vllm:spec_decode_num_drafts_total"
SPEC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
SPEC_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
SPEC_COUNTERS = (SPEC_DRAFTS, SPEC_DRAFT_TOKENS, SPEC_ACCEPTED)
SPEC_FIELDS = (
    "server_spec_decode_num_drafts",
    "server_spec_decode_num_draft_tokens",
    "server_spec_decode_num_accepted_tokens",
    "server_mean_acceptance_length",
    "server_draft_acceptance_rate",
)
METRICS_TIMEOUT_S = 30.0


def _totals(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """Each of `names` summed over its samples (engines) in Prometheus text; absent names are left out."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def parse_prefix_counters(text: str) -> tuple[float, float] | None:
    """(queries, hits) summed over every sample (engines) in Prometheus text; None if either counter is absent."""
    totals = _totals(text, (QUERIES, HITS))
    if QUERIES not in totals or HITS not in totals:
        return None
    return totals[QUERIES], totals[HITS]


def parse_spec_counters(text: str) -> tuple[float, float, float] | None:
    """(drafts, draft tokens, accepted tokens) summed over engines; None when the server does not speculate."""
    totals = _totals(text, SPEC_COUNTERS)
    if any(name not in totals for name in SPEC_COUNTERS):
        return None
    return totals[SPEC_DRAFTS], totals[SPEC_DRAFT_TOKENS], totals[SPEC_ACCEPTED]


async def read_metrics_text(base_url: str) -> str | None:
    """The server's /metrics now; None when it cannot be read."""
    aiohttp = require("aiohttp")
    try:
        timeout = aiohttp.ClientTimeout(total=METRICS_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as session, session.get(base_url + "/metrics") as response:
            if response.status != 200:
                return None
            return await response.text()
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None


async def read_prefix_counters(base_url: str) -> tuple[float, float] | None:
    """The server's (queries, hits) now; None when /metrics cannot be read or lacks them."""
    text = await read_metrics_text(base_url)
    return None if text is None else parse_prefix_counters(text)


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


def spec_decode_fields(
    before: tuple[float, float, float] | None, after: tuple[float, float, float] | None
) -> dict[str, Any]:
    """The record's fields: the run's draft, draft-token and accepted-token deltas, its mean acceptance length and its
    draft acceptance rate (None where unknown, or where no draft was made)."""
    if before is None or after is None:
        return dict.fromkeys(SPEC_FIELDS)
    drafts, draft_tokens, accepted = (int(a - b) for a, b in zip(after, before, strict=True))
    return {
        "server_spec_decode_num_drafts": drafts,
        "server_spec_decode_num_draft_tokens": draft_tokens,
        "server_spec_decode_num_accepted_tokens": accepted,
        "server_mean_acceptance_length": 1 + accepted / drafts if drafts > 0 else None,
        "server_draft_acceptance_rate": accepted / draft_tokens if draft_tokens > 0 else None,
    }
