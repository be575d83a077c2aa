"""`deltaserve bench serve`: an online benchmark client with `vllm bench serve`'s flags, metrics and JSON.

It builds the random dataset with a local tokenizer (from --tokenizer, else the `root` of GET /v1/models),
aligns every prompt to its exact length with the server's /tokenize and /detokenize, warms up, sends the
requests under --max-concurrency / --request-rate / --burstiness, and prints and optionally saves vLLM's
result fields plus `peak_gpu_memory_gib` (NVML, sampled during the run; null without NVML).

`--dataset-name random-mm` (dataset_mm.py) adds synthetic images to every random prompt and, as vLLM requires,
runs only with `--backend openai-chat --endpoint /v1/chat/completions`; its prompts are not aligned with the
server (vLLM aligns only `random` and `prefix_repetition`). Its input token counts are the server's
usage.prompt_tokens, so they include the chat template and every image's placeholder tokens.

`--dataset-name prefix_repetition` (dataset_prefix.py) is vLLM's: `--prefix-repetition-num-prefixes` random prefixes
of `--prefix-repetition-prefix-len` tokens, each shared by num_prompts // num_prefixes requests with their own
`--prefix-repetition-suffix-len` tokens, `--prefix-repetition-output-len` out (or `--output-len`, as in vLLM). Its
prompts are aligned with the server as vLLM 0.26 aligns them, and, as in vLLM, ignore_eos is not forced on.

`--dataset-name multi-turn` (multi_turn.py, our own) runs concurrent conversations that re-send their growing
history with the model's real answers, over the same chat backend; its record adds a per-turn breakdown.

Every record also carries the server's own prefix-cache hit rate over the measured requests (server_counters.py:
the deltas of vllm:prefix_cache_queries / _hits on its /metrics from after the warm-ups to the end; null for a
server without them), and, from the same two reads, a speculating server's drafts, accepted tokens and mean
acceptance length (vllm:spec_decode_*; null for a server that does not speculate). `failed_errors` (our own, kept
without --save-detailed) says why requests failed: each distinct last line of their errors with its count.

The grid calls `run_bench(parse_bench_args(argv))` with the same argv a person would type, so both engines
of a comparison are measured by this one client with one set of flags. The flags are declared and resolved in
serve_args.py, the requests drawn and aligned in serve_dataset.py, and the record's failure counts, file name and
printed summary made in serve_record.py; this module runs the load and assembles the record.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import sys
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from deltaserve.bench._extra import MissingExtraError, require
from deltaserve.bench.client import LoadOptions, SamplingOptions, run_load
from deltaserve.bench.dataset import warmup_seed
from deltaserve.bench.dataset_mm import mm_options
from deltaserve.bench.metrics import compute_metrics, parse_goodput, parse_metric_names, parse_percentiles
from deltaserve.bench.multi_turn import DATASET_NAME as MULTI_TURN
from deltaserve.bench.multi_turn import multi_turn_fields, multi_turn_options, run_conversations, sample_conversations
from deltaserve.bench.nvml import MemorySampler
from deltaserve.bench.serve_args import (
    IGNORE_EOS_DATASETS,
    add_arguments,
    check_endpoint,
    prefix_options,
    resolve_lengths,
)
from deltaserve.bench.serve_dataset import align_requests, sample_requests
from deltaserve.bench.serve_record import DETAILED_FIELDS, default_filename, failed_errors, summary
from deltaserve.bench.server_counters import (
    parse_prefix_counters,
    parse_spec_counters,
    prefix_cache_fields,
    read_metrics_text,
    spec_decode_fields,
)


def parse_bench_args(argv: list[str]) -> argparse.Namespace:
    """Parse a `deltaserve bench serve` argv (used by the grid to run the exact CLI client in-process)."""
    parser = argparse.ArgumentParser(prog="deltaserve bench serve")
    add_arguments(parser)
    return parser.parse_args(argv)


@functools.lru_cache(maxsize=8)
def load_tokenizer(name_or_path: str, is_remote_code_trusted: bool = False) -> Any:
    """A Hugging Face tokenizer, cached because a grid reuses one for every run."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=is_remote_code_trusted)


async def fetch_model_card(base_url: str) -> dict[str, Any]:
    """data[0] of GET /v1/models (its `id` and `root`)."""
    aiohttp = require("aiohttp")
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session, session.get(base_url + "/v1/models") as response:
        response.raise_for_status()
        body = await response.json()
    return body["data"][0]


def _base_url(args: argparse.Namespace) -> str:
    return (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")


async def _run_async(
    args: argparse.Namespace, tokenizer: Any | None, on_measuring: Callable[[], None] | None = None
) -> dict[str, Any]:
    is_chat = check_endpoint(args)
    base_url = _base_url(args)
    model_id = args.model
    tokenizer_id = args.tokenizer
    if model_id is None or (tokenizer_id is None and tokenizer is None):
        card = await fetch_model_card(base_url)
        model_id = model_id or card["id"]
        tokenizer_id = tokenizer_id or card.get("root") or card["id"]
    tokenizer_id = tokenizer_id or model_id
    if tokenizer is None:
        tokenizer = load_tokenizer(tokenizer_id, args.trust_remote_code)
    request_model = args.served_model_name or model_id

    percentile_metrics = parse_metric_names(args.percentile_metrics)
    percentiles = parse_percentiles(args.metric_percentiles)
    goodput = parse_goodput(args.goodput)
    input_len, output_len = resolve_lengths(args)
    is_ignore_eos = (args.dataset_name in IGNORE_EOS_DATASETS) if args.ignore_eos is None else args.ignore_eos
    request_id_prefix = args.request_id_prefix
    load = LoadOptions(
        api_url=base_url + args.endpoint,
        model=request_model,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        num_warmups=args.num_warmups,
        seed=args.seed,
        is_tqdm_disabled=args.disable_tqdm,
        is_chat=is_chat,
    )
    if request_id_prefix is not None:
        load.request_id_prefix = request_id_prefix
    counters: dict[str, str | None] = {}  # the server's /metrics after the warm-ups

    async def read_counters_before() -> None:
        if on_measuring is not None:  # the caller's mark: the measured requests go out next
            on_measuring()
        counters["before"] = await read_metrics_text(base_url)

    load.after_warmups = read_counters_before

    is_mm = args.dataset_name == "random-mm"
    is_multi_turn = args.dataset_name == MULTI_TURN
    is_prefix = args.dataset_name == "prefix_repetition"
    prefix = prefix_options(args)
    if is_multi_turn:  # its warm-up message shares nothing with the conversations already
        turn_options = multi_turn_options(args)
        conversations = sample_conversations(tokenizer, turn_options, args.seed)
        requests = []
    else:
        requests = sample_requests(args, tokenizer, args.num_prompts, args.seed, input_len, output_len)
        if args.warmup_distinct and args.num_warmups > 0:
            load.warmup_requests = sample_requests(
                args, tokenizer, args.num_warmups, warmup_seed(args.seed), input_len, output_len
            )
    is_server_aligned = False
    # vLLM aligns the text-only random and prefix_repetition datasets with the server's tokenizer
    if not args.no_server_tokenize and not is_mm and not is_multi_turn:
        requests, is_server_aligned = await align_requests(
            args, base_url, request_model, requests, tokenizer, args.seed
        )
        if load.warmup_requests:
            load.warmup_requests, _ = await align_requests(
                args, base_url, request_model, load.warmup_requests, tokenizer, warmup_seed(args.seed)
            )

    sampling = SamplingOptions(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        is_ignore_eos=is_ignore_eos,
        extra_body=dict(args.extra_body or {}),
    )
    if args.temperature is None:
        print("warning: no --temperature; the server's generation_config defaults apply", file=sys.stderr)
    device_indices = [int(i) for i in args.gpu_indices.split(",")] if args.gpu_indices else None
    sampler = MemorySampler(device_indices=device_indices).start()
    try:
        if is_multi_turn:
            turns, duration = await run_conversations(conversations, turn_options, sampling, load)
            results = [turn.result for turn in turns]
        else:
            results, duration = await run_load(requests, sampling, load)
    finally:
        peak_gib = sampler.stop()
    texts = (counters.get("before"), await read_metrics_text(base_url))
    server_prefix_cache = prefix_cache_fields(*(None if t is None else parse_prefix_counters(t) for t in texts))
    server_spec_decode = spec_decode_fields(*(None if t is None else parse_spec_counters(t) for t in texts))

    # Requests without a usage chunk: count the text with the local tokenizer (vLLM's fallback).
    for result in results:
        if result.is_success and result.output_tokens is None:
            result.output_tokens = len(tokenizer.encode(result.generated_text, add_special_tokens=False))

    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    record: dict[str, Any] = {
        "date": date,
        "endpoint_type": args.backend,
        "backend": args.backend,
        "label": args.label,
        "model_id": model_id,
        "tokenizer_id": tokenizer_id,
        "num_prompts": len(results) if is_multi_turn else args.num_prompts,
    }
    for item in args.metadata or []:
        key, _, value = item.partition("=")
        record[key] = value
    record.update(
        {
            "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
            "burstiness": args.burstiness,
            "max_concurrency": args.max_concurrency,
        }
    )
    record.update(compute_metrics(results, duration, percentile_metrics, percentiles, goodput or None))
    record.update(
        {
            "peak_gpu_memory_gib": peak_gib,
            "latencies": [r.latency for r in results],
            "input_lens": [r.prompt_len for r in results],
            "output_lens": [(r.output_tokens or 0) if r.is_success else 0 for r in results],
            "start_times": [r.start_time for r in results],
            "ttfts": [r.ttft for r in results],
            "itls": [r.itl for r in results],
            "generated_texts": [r.generated_text for r in results],
            "errors": [r.error for r in results],
            # Our own provenance fields, next to vLLM's:
            "failed_errors": failed_errors(results),
            "dataset_name": args.dataset_name,
            "endpoint": args.endpoint,
            "random_input_len": input_len,
            "random_output_len": output_len,
            "random_range_ratio": args.random_range_ratio,
            "random_prefix_len": args.random_prefix_len,
            "num_warmups": args.num_warmups,
            "warmup_distinct": bool(args.warmup_distinct and args.num_warmups > 0 and not is_multi_turn),
            "seed": args.seed,
            "temperature": args.temperature,
            "ignore_eos": is_ignore_eos,
            "is_server_tokenize_aligned": is_server_aligned,
            "goodput_slos_ms": goodput or None,
            # how alike the outputs are: on dummy weights, identical outputs route every decode row to the same
            # experts, so two arms whose counts differ did different MoE work (grid.compute_ratios flags it)
            "num_distinct_generated_texts": len({r.generated_text for r in results if r.is_success}),
            **server_prefix_cache,
            **server_spec_decode,
        }
    )
    if is_prefix:
        record.update(prefix.as_record())
        record["total_text_prompt_tokens"] = sum(request.prompt_len for request in requests)
    if is_mm:
        urls = [part["image_url"]["url"] for request in requests for part in request.mm_content]
        record.update(mm_options(args).as_record())
        # what was sent, per measured request (warm-ups excluded): items and base64 JPEG bytes
        record["mm_items_per_request"] = [len(request.mm_content) for request in requests]
        record["total_mm_items"] = len(urls)
        record["total_mm_data_url_bytes"] = sum(len(url) for url in urls)
        record["total_text_prompt_tokens"] = sum(request.prompt_len for request in requests)
    if is_multi_turn:
        record.update(multi_turn_fields(turns, turn_options, conversations, args.save_detailed))
    if not args.save_detailed:
        for name in DETAILED_FIELDS:
            record.pop(name, None)
    return record


def run_bench(
    args: argparse.Namespace,
    tokenizer: Any | None = None,
    timeout_s: float | None = None,
    on_measuring: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Run one benchmark and save it if asked; returns the result dict (vLLM's fields + ours).

    `timeout_s` (the grid's per-run budget) raises TimeoutError when the whole run takes longer. `on_measuring` is
    called once the warm-up requests are done, just before the measured ones (the grid marks the server log there).
    """
    record = asyncio.run(asyncio.wait_for(_run_async(args, tokenizer, on_measuring), timeout_s))
    if args.save_result or args.result_filename:
        result_dir = Path(args.result_dir or ".")
        result_dir.mkdir(parents=True, exist_ok=True)
        filename = args.result_filename or default_filename(args, record["model_id"], record["date"])
        (result_dir / filename).write_text(json.dumps(record, indent=2) + "\n")
    return record


def run(args: argparse.Namespace) -> int:
    """CLI entry: run, print the summary, exit 1 if every request failed."""
    try:
        aiohttp = require("aiohttp")
    except MissingExtraError as exc:
        print(f"deltaserve bench serve: {exc}", file=sys.stderr)
        return 1
    try:
        record = run_bench(args)
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        print(f"deltaserve bench serve: {exc}", file=sys.stderr)
        return 1
    print(summary(record))
    if record["completed"] == 0:
        print("deltaserve bench serve: every request failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    main_parser = argparse.ArgumentParser(prog="deltaserve bench serve")
    add_arguments(main_parser)
    sys.exit(run(main_parser.parse_args()))
