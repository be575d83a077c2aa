"""The requests of one `deltaserve bench serve` run: drawn from the chosen dataset, then aligned with the server.

`sample_requests` draws the measured (or the distinct warm-up) requests of the random, random-mm or prefix_repetition
dataset with a seed; multi-turn conversations are drawn by multi_turn.py instead. `align_requests` then runs vLLM's
alignment of the text-only prompts with the server's /tokenize and /detokenize: the random dataset's exact lengths
(dataset.py), or prefix_repetition's as vLLM 0.26 aligns it (dataset_prefix.py). serve_cli.py calls it for those two
datasets only, as vLLM aligns no others, and not at all with --no-server-tokenize.
"""

from __future__ import annotations

import argparse
from typing import Any

from deltaserve.bench._extra import require
from deltaserve.bench.dataset import SampleRequest, align_with_server, sample_random
from deltaserve.bench.dataset_mm import mm_options, sample_random_mm
from deltaserve.bench.dataset_prefix import align_like_vllm, sample_prefix_repetition
from deltaserve.bench.serve_args import prefix_options


def sample_requests(
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


async def align_requests(
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
