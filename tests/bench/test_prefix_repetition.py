"""vLLM 0.26's `prefix_repetition` dataset: the client's requests equal the ones vLLM's algorithm gives, step by step.

The expected sequences are derived here the way vLLM 0.26.0's PrefixRepetitionRandomDataset (with
gen_prompt_decode_to_target_len, vllm/benchmarks/datasets/datasets.py) does it: it seeds numpy's and Python's
global generators, draws each prefix and then each of its suffixes with `np.random.randint`, pads short
re-encodings with more global draws, and shuffles with `random.shuffle`. The globals are restored afterwards.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from deltaserve.bench.dataset import SampleRequest
from deltaserve.bench.dataset_prefix import PrefixOptions, align_like_vllm, sample_prefix_repetition
from deltaserve.bench.serve_cli import parse_bench_args, run_bench

from .bench_helpers import WordTokenizer, serve_in_thread
from .fake_server import build_app


@pytest.fixture
def global_generators() -> Iterator[None]:
    """vLLM draws from the process-wide generators; leave them as they were."""
    numpy_state, python_state = np.random.get_state(), random.getstate()
    yield
    np.random.set_state(numpy_state)
    random.setstate(python_state)


def vllm_exact(tokenizer: WordTokenizer, target: int, pads: list[int]) -> list[int]:
    """vLLM's _generate_exact_length_tokens: global randint, then decode/encode with global-randint pads."""
    ids = np.random.randint(0, tokenizer.vocab_size, size=target).tolist()
    retries = 10
    while True:
        ids = tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False)
        if retries <= 0 or len(ids) == target:
            return ids
        if len(ids) < target:
            pads.append(target - len(ids))
            ids.extend(np.random.randint(0, tokenizer.vocab_size, size=target - len(ids)).tolist())
        else:
            ids = ids[:target]
        retries -= 1


def vllm_requests(
    tokenizer: WordTokenizer, num_requests: int, options: PrefixOptions, seed: int, pads: list[int]
) -> list[list[int]]:
    """The token ids of vLLM's requests, in vLLM's order (seed, prefixes with their suffixes, shuffle); `pads`
    gets the size of every padding draw."""
    random.seed(seed)
    np.random.seed(seed)
    requests = []
    for _ in range(options.num_prefixes):
        prefix = vllm_exact(tokenizer, options.prefix_len, pads)
        for _ in range(num_requests // options.num_prefixes):
            requests.append(prefix + vllm_exact(tokenizer, options.suffix_len, pads))
    random.shuffle(requests)
    return requests


class LossyTokenizer(WordTokenizer):
    """Decoding drops every id below 40, so re-encodings come back short and vLLM's padding path runs."""

    def decode(self, token_ids: list[int]) -> str:
        return super().decode([i for i in token_ids if i >= 40])


@pytest.mark.parametrize("is_lossy", [False, True])
def test_requests_equal_vllm_026_for_the_same_seed(word_model: Path, global_generators: None, is_lossy: bool) -> None:
    tokenizer = LossyTokenizer(word_model) if is_lossy else WordTokenizer(word_model)
    options = PrefixOptions(prefix_len=48, suffix_len=16, num_prefixes=3, output_len=7)
    ours = sample_prefix_repetition(tokenizer, 14, options, seed=5, request_id_prefix="p")
    pads: list[int] = []
    expected = vllm_requests(tokenizer, 14, options, seed=5, pads=pads)
    assert len(ours) == len(expected) == 12  # 14 // 3 per prefix: vLLM drops the remainder
    for request, ids in zip(ours, expected, strict=True):
        assert request.prompt == tokenizer.decode(ids) and request.prompt_len == len(ids)
        assert request.expected_output_len == 7 and request.target_len == 64
    assert [r.request_id for r in ours] == [f"p{i}" for i in range(12)]
    assert all(r.token_mismatch == 0 and r.prompt_len == 64 for r in ours)
    if is_lossy:  # the ids below 40 were dropped and replaced by padding draws from the same stream
        assert len(pads) >= 5
    else:
        assert not pads
        assert len({tuple(ids[:48]) for ids in expected}) == 3  # three prefixes, four requests each
    assert ours != sample_prefix_repetition(tokenizer, 14, options, seed=6)


def test_too_few_requests_for_the_prefixes_is_refused(word_tokenizer: WordTokenizer) -> None:
    with pytest.raises(ValueError, match="must be greater than or equal to num_prefixes"):
        sample_prefix_repetition(word_tokenizer, 3, PrefixOptions(num_prefixes=4))


def test_bench_serve_runs_prefix_repetition_with_vllm_flags(fake_server: str, patch_tokenizer: WordTokenizer) -> None:
    argv = [
        "--base-url", fake_server, "--dataset-name", "prefix_repetition",
        "--prefix-repetition-prefix-len", "40", "--prefix-repetition-suffix-len", "8",
        "--prefix-repetition-num-prefixes", "2", "--prefix-repetition-output-len", "5",
        "--num-prompts", "9", "--max-concurrency", "3", "--temperature", "0", "--disable-tqdm",
    ]  # fmt: skip
    record = run_bench(parse_bench_args(argv))
    assert record["completed"] == 8 and record["failed"] == 0  # 2 prefixes x 9 // 2
    assert record["total_input_tokens"] == 8 * 48 and record["total_output_tokens"] == 8 * 5
    assert record["prefix_repetition_prefix_len"] == 40 and record["prefix_repetition_num_prefixes"] == 2
    assert record["is_server_tokenize_aligned"] is True
    assert record["ignore_eos"] is False  # vLLM forces it only for random and random-mm
    assert run_bench(parse_bench_args([*argv, "--output-len", "3"]))["total_output_tokens"] == 8 * 3


@pytest.fixture
def splitting_server(word_model: Path) -> Iterator[str]:
    """A server whose tokenizer counts the word "t7" twice (as a real BPE might split it)."""
    app = build_app(word_model, has_tokenize=False)
    tokenizer = WordTokenizer(word_model)

    async def tokenize(request: web.Request) -> web.Response:
        ids = tokenizer.encode((await request.json())["prompt"])
        return web.json_response({"tokens": [j for i in ids for j in ([i, i] if i == 7 else [i])]})

    async def detokenize(request: web.Request) -> web.Response:
        return web.json_response({"prompt": tokenizer.decode((await request.json())["tokens"])})

    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    yield from serve_in_thread(app)


def test_alignment_cuts_long_prompts_only_when_the_first_one_mismatches(splitting_server: str) -> None:
    """vLLM 0.26's rule: the first prompt decides whether to align; then only prompts the server counts longer
    are cut to prompt_len tokens (shorter or exact ones stay)."""
    split = SampleRequest("t5 t7 t9 t11", 4, 2, 4, "0")
    plain = SampleRequest("t1 t2 t3", 3, 2, 3, "1")

    async def align(requests: list[SampleRequest]) -> tuple[list[SampleRequest], bool]:
        async with aiohttp.ClientSession() as session:
            return await align_like_vllm(session, splitting_server, "m", requests)

    aligned, is_aligned = asyncio.run(align([split, plain]))
    assert is_aligned and aligned[1] == plain
    assert aligned[0].prompt == "t5 t7 t7 t9" and aligned[0].prompt_len == 4
    assert asyncio.run(align([plain, split])) == ([plain, split], True)  # the first matches: nothing changes
