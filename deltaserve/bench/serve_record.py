"""What a `deltaserve bench serve` record keeps of its failures and per-request arrays, its file name, and how it
prints.

`DETAILED_FIELDS` are the per-request arrays dropped from the JSON unless --save-detailed, as in vLLM;
`failed_errors` (our own, kept without --save-detailed) says why requests failed, each distinct last line of their
errors with its count; `default_filename` names a saved record, in vLLM's pattern, when --result-filename is not given;
`summary` is the human-readable block the CLI prints, in vLLM's order.
"""

from __future__ import annotations

import argparse
import math
from collections import Counter
from pathlib import Path
from typing import Any

from deltaserve.bench.client import RequestResult
from deltaserve.bench.multi_turn import multi_turn_summary

# Per-request arrays kept in the JSON only with --save-detailed, as in vLLM.
DETAILED_FIELDS = ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts", "errors")


def failed_errors(results: list[RequestResult]) -> dict[str, int]:
    """Each distinct last line (300 characters at most) of the failed requests' errors -> how many failed so: the
    cause of a failure stays in a record whose per-request arrays are dropped."""
    lines = [(r.error or "no error text").strip().splitlines()[-1][:300] for r in results if not r.is_success]
    return dict(Counter(line or "no error text" for line in lines).most_common())


def default_filename(args: argparse.Namespace, model_id: str, date: str) -> str:
    rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}"
    concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
    return f"{args.label or args.backend}-{rate}qps{concurrency}-{Path(model_id).name}-{date}.json"


def summary(record: dict[str, Any]) -> str:
    """The human-readable block, in vLLM's order: totals, throughputs, then TTFT, TPOT, ITL, E2EL."""
    lines = ["{:=^60}".format(" Serving Benchmark Result ")]

    def row(name: str, value: Any, fmt: str = "{:<40} {:<10.2f}") -> None:
        if value is not None:
            lines.append(fmt.format(name, value))

    row("Successful requests:", record["completed"], "{:<40} {:<10}")
    row("Failed requests:", record["failed"], "{:<40} {:<10}")
    row("Maximum request concurrency:", record["max_concurrency"], "{:<40} {:<10}")
    row("Benchmark duration (s):", record["duration"])
    row("Total input tokens:", record["total_input_tokens"], "{:<40} {:<10}")
    row("Total generated tokens:", record["total_output_tokens"], "{:<40} {:<10}")
    row("Request throughput (req/s):", record["request_throughput"])
    row("Request goodput (req/s):", record["request_goodput"])
    row("Output token throughput (tok/s):", record["output_throughput"])
    row("Peak output token throughput (tok/s):", record["max_output_tokens_per_s"])
    row("Peak concurrent requests:", record["max_concurrent_requests"])
    row("Total token throughput (tok/s):", record["total_token_throughput"])
    row("Peak GPU memory (GiB):", record.get("peak_gpu_memory_gib"))
    row("Server prefix cache hit rate:", record.get("server_prefix_cache_hit_rate"), "{:<40} {:<10.4f}")
    row("Server mean acceptance length:", record.get("server_mean_acceptance_length"), "{:<40} {:<10.2f}")
    lines.extend(multi_turn_summary(record))
    titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)"}
    titles.update({"itl": "Inter-token Latency", "e2el": "End-to-end Latency"})
    for name, title in titles.items():
        keys = [k for k in record if k.endswith(f"_{name}_ms")]
        if not keys:
            continue
        lines.append(f"{title:-^60}")
        for key in keys:
            stat = key.split("_")[0]
            label = {"mean": "Mean", "median": "Median", "std": "Std"}.get(stat, stat.upper())
            row(f"{label} {name.upper()} (ms):", record[key])
    lines.append("=" * 60)
    return "\n".join(lines)
