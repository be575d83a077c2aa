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
of a comparison are measured by this one client with one set of flags.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import sys
from collections import Counter
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from deltaserve.bench._extra import MissingExtraError, require
from deltaserve.bench.client import LoadOptions, RequestResult, SamplingOptions, run_load
from deltaserve.bench.dataset import SampleRequest, align_with_server, sample_random, warmup_seed
from deltaserve.bench.dataset_mm import add_mm_arguments, mm_options, sample_random_mm
from deltaserve.bench.dataset_prefix import PrefixOptions, align_like_vllm, sample_prefix_repetition
from deltaserve.bench.metrics import compute_metrics, parse_goodput, parse_metric_names, parse_percentiles
from deltaserve.bench.multi_turn import DATASET_NAME as MULTI_TURN
from deltaserve.bench.multi_turn import (
    add_multi_turn_arguments,
    check_multi_turn,
    multi_turn_fields,
    multi_turn_options,
    multi_turn_summary,
    run_conversations,
    sample_conversations,
)
from deltaserve.bench.nvml import MemorySampler
from deltaserve.bench.server_counters import (
    parse_prefix_counters,
    parse_spec_counters,
    prefix_cache_fields,
    read_metrics_text,
    spec_decode_fields,
)

# Per-request arrays kept in the JSON only with --save-detailed, as in vLLM.
DETAILED_FIELDS = ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts", "errors")
CHAT_BACKENDS = ("openai-chat",)
# the datasets whose requests are sent with ignore_eos unless told otherwise: vLLM's random ones, and our multi-turn
# mode (its answers have exact lengths, so every engine re-sends the same history)
IGNORE_EOS_DATASETS = ("random", "random-mm", MULTI_TURN)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """vLLM's flag names for everything this client supports."""
    server = parser.add_argument_group("server")
    server.add_argument(
        "--backend",
        default="vllm",
        choices=["vllm", "openai", "openai-chat"],
        help="vllm/openai: /v1/completions; openai-chat: chat payloads (pass --endpoint /v1/chat/completions)",
    )
    server.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:8000 (overrides --host/--port)")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--endpoint", default="/v1/completions")
    server.add_argument("--model", default=None, help="default: data[0].id of GET /v1/models")
    server.add_argument("--served-model-name", default=None, help="the request's model field, if not --model")
    server.add_argument("--tokenizer", default=None, help="default: data[0].root of GET /v1/models")
    server.add_argument("--trust-remote-code", action="store_true")
    server.add_argument(
        "--no-server-tokenize",
        action="store_true",
        help="do not align prompt lengths with the server's /tokenize and /detokenize",
    )

    data = parser.add_argument_group("dataset")
    data.add_argument(
        "--dataset-name", default="random", choices=["random", "random-mm", "prefix_repetition", MULTI_TURN]
    )
    data.add_argument("--random-input-len", type=int, default=1024)
    data.add_argument("--random-output-len", type=int, default=128)
    data.add_argument("--random-range-ratio", type=float, default=0.0)
    data.add_argument("--random-prefix-len", type=int, default=0)
    data.add_argument("--input-len", type=int, default=None, help="alias of --random-input-len")
    data.add_argument("--output-len", type=int, default=None, help="alias of --random-output-len")
    add_mm_arguments(data)
    add_multi_turn_arguments(data)
    defaults = PrefixOptions()
    data.add_argument("--prefix-repetition-prefix-len", type=int, default=defaults.prefix_len)
    data.add_argument("--prefix-repetition-suffix-len", type=int, default=defaults.suffix_len)
    data.add_argument("--prefix-repetition-num-prefixes", type=int, default=defaults.num_prefixes)
    data.add_argument("--prefix-repetition-output-len", type=int, default=defaults.output_len)
    data.add_argument("--num-prompts", type=int, default=1000)
    data.add_argument("--seed", type=int, default=0)

    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=math.inf, help="requests/s; inf sends all at once")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 is Poisson")
    load.add_argument("--max-concurrency", type=int, default=None)
    load.add_argument("--num-warmups", type=int, default=0)
    load.add_argument(
        "--warmup-distinct",
        action="store_true",
        help="warm-ups send prompts drawn apart from the measured ones (vLLM's client sends the first measured "
        "prompt, which a server with prefix caching then serves from its cache)",
    )
    load.add_argument("--request-id-prefix", default=None)
    load.add_argument("--disable-tqdm", action="store_true")

    sampling = parser.add_argument_group("sampling")
    sampling.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="default: on for random and random-mm (as vLLM forces it), off for prefix_repetition",
    )
    sampling.add_argument("--temperature", type=float, default=None)
    sampling.add_argument("--top-p", type=float, default=None)
    sampling.add_argument("--top-k", type=int, default=None)
    sampling.add_argument("--min-p", type=float, default=None)
    sampling.add_argument("--extra-body", type=json.loads, default=None, help="JSON merged into every request")

    metrics = parser.add_argument_group("metrics and results")
    metrics.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS", help="SLOs: ttft/tpot/e2el in ms")
    metrics.add_argument("--percentile-metrics", default="ttft,tpot,itl")
    metrics.add_argument("--metric-percentiles", default="99")
    metrics.add_argument("--save-result", action="store_true")
    metrics.add_argument("--save-detailed", action="store_true")
    metrics.add_argument("--result-dir", default=None)
    metrics.add_argument("--result-filename", default=None)
    metrics.add_argument("--label", default=None)
    metrics.add_argument("--metadata", nargs="*", default=None, metavar="KEY=VALUE")
    metrics.add_argument("--gpu-indices", default=None, help="comma-separated NVML indices to sample (default all)")


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


def _default_filename(args: argparse.Namespace, model_id: str, date: str) -> str:
    rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}"
    concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
    return f"{args.label or args.backend}-{rate}qps{concurrency}-{Path(model_id).name}-{date}.json"


def _resolve_lengths(args: argparse.Namespace) -> tuple[int, int]:
    input_len = args.input_len if args.input_len is not None else args.random_input_len
    output_len = args.output_len if args.output_len is not None else args.random_output_len
    return input_len, output_len


def prefix_options(args: argparse.Namespace) -> PrefixOptions:
    """The prefix_repetition flags; `--output-len` overrides the output length, as in vLLM."""
    output_len = args.output_len if args.output_len is not None else args.prefix_repetition_output_len
    return PrefixOptions(
        args.prefix_repetition_prefix_len,
        args.prefix_repetition_suffix_len,
        args.prefix_repetition_num_prefixes,
        output_len,
    )


def _sample(
    args: argparse.Namespace, tokenizer: Any, num_requests: int, seed: int, input_len: int, output_len: int
) -> list[SampleRequest]:
    """`num_requests` requests of the chosen dataset (not multi-turn) drawn with `seed`."""
    if args.dataset_name == "prefix_repetition":
        prefix = prefix_options(args)
        # the dataset needs a request a prefix at least: a few warm-ups take the first of a full draw
        drawn = sample_prefix_repetition(tokenizer, max(num_requests, prefix.num_prefixes), prefix, seed=seed)
        return drawn[:num_requests]
    common = {"input_len": input_len, "output_len": output_len, "range_ratio": args.random_range_ratio}
    if args.dataset_name == "random-mm":
        return sample_random_mm(
            tokenizer, num_requests, mm_options(args), prefix_len=args.random_prefix_len, seed=seed, **common
        )
    return sample_random(tokenizer, num_requests, prefix_len=args.random_prefix_len, seed=seed, **common)


async def _align(
    args: argparse.Namespace,
    base_url: str,
    request_model: str,
    requests: list[SampleRequest],
    tokenizer: Any,
    seed: int,
) -> tuple[list[SampleRequest], bool]:
    """vLLM's alignment of text-only prompts with the server's tokenizer; returns (requests, whether it ran)."""
    aiohttp = require("aiohttp")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        if args.dataset_name == "prefix_repetition":
            return await align_like_vllm(session, base_url, request_model, requests)
        return await align_with_server(session, base_url, request_model, requests, tokenizer, seed)


def check_endpoint(args: argparse.Namespace) -> bool:
    """vLLM's pairing rules: random-mm needs openai-chat, whose URL must end in chat/completions (a chat payload
    sent to /v1/completions would fail every request). Returns whether the run is a chat run; raises ValueError."""
    is_chat = args.backend in CHAT_BACKENDS
    if args.dataset_name == MULTI_TURN:
        check_multi_turn(args)
    if args.dataset_name == "random-mm" and not is_chat:
        raise ValueError("Multi-modal content (images) is only supported on 'openai-chat' backend.")
    if is_chat and not args.endpoint.rstrip("/").endswith("chat/completions"):
        raise ValueError(f"OpenAI Chat Completions API URL must end with chat/completions, got {args.endpoint}")
    return is_chat


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
    input_len, output_len = _resolve_lengths(args)
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
        requests = _sample(args, tokenizer, args.num_prompts, args.seed, input_len, output_len)
        if args.warmup_distinct and args.num_warmups > 0:
            load.warmup_requests = _sample(
                args, tokenizer, args.num_warmups, warmup_seed(args.seed), input_len, output_len
            )
    is_server_aligned = False
    # vLLM aligns the text-only random and prefix_repetition datasets with the server's tokenizer
    if not args.no_server_tokenize and not is_mm and not is_multi_turn:
        requests, is_server_aligned = await _align(args, base_url, request_model, requests, tokenizer, args.seed)
        if load.warmup_requests:
            load.warmup_requests, _ = await _align(
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


def failed_errors(results: list[RequestResult]) -> dict[str, int]:
    """Each distinct last line (300 characters at most) of the failed requests' errors -> how many failed so: the
    cause of a failure stays in a record whose per-request arrays are dropped."""
    lines = [(r.error or "no error text").strip().splitlines()[-1][:300] for r in results if not r.is_success]
    return dict(Counter(line or "no error text" for line in lines).most_common())


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
        filename = args.result_filename or _default_filename(args, record["model_id"], record["date"])
        (result_dir / filename).write_text(json.dumps(record, indent=2) + "\n")
    return record


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
