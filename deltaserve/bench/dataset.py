"""The `random` dataset of `vllm bench serve`: fixed or ranged lengths, consecutive token ids, exact lengths.

As vLLM's vllm/benchmarks/datasets/random.py (with arg_utils.py) builds it: lengths are uniform integers in
[floor(L(1-r)), ceil(L(1+r))] (output floored at 1; r = 0 means fixed), where the input L excludes the tokenizer's
special tokens. Allowed ids are the vocabulary minus the special ids; one random prefix of `prefix_len` allowed ids is
shared by all requests, then request i gets the consecutive run of allowed ids starting at (offset_i + i) modulo the
allowed count. The ids are decoded to text and re-encoded, padding with random ids or truncating, until the length
matches (at most 10 retries). One `numpy.random.default_rng(seed)` drives it all, in vLLM's order: input lengths, output
lengths, offsets, prefix, pads.

`align_with_server` then does what vLLM's client does against servers that expose POST /tokenize: it counts
the prompt with the server's tokenizer and, on a mismatch, rewrites the prompt through POST /detokenize so
the server sees exactly the requested number of tokens.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from deltaserve.bench._extra import require

if TYPE_CHECKING:
    import aiohttp

log = logging.getLogger(__name__)

MAX_DECODE_RETRIES = 10
MAX_SERVER_RETRIES = 5
NUM_ALIGN_IN_FLIGHT = 32
# Warm-ups drawn apart (the client's --warmup-distinct, the grid's warm-up point) use their seed moved by this, so
# they share no prompt (and, for prefix_repetition, no prefix) with the measured requests of any point.
WARMUP_SEED_SHIFT = 1_000_000_007


def warmup_seed(seed: int) -> int:
    """`seed` moved by WARMUP_SEED_SHIFT, within numpy's legacy RandomState range (prefix_repetition draws with it)."""
    return (seed + WARMUP_SEED_SHIFT) % 2**32


class Tokenizer(Protocol):
    """The slice of a Hugging Face tokenizer the dataset needs (tests pass hand-made ones)."""

    vocab_size: int
    all_special_ids: list[int]

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...

    def num_special_tokens_to_add(self) -> int: ...


@dataclass(frozen=True)
class SampleRequest:
    """One prompt of the dataset; `prompt_len` is the count the client believes, `target_len` the request."""

    prompt: str
    prompt_len: int
    expected_output_len: int
    target_len: int
    request_id: str
    token_mismatch: int = 0  # final length minus target after the decode/encode retries
    # chat content parts sent after the text (random-mm: image_url parts with base64 data URLs); empty for text
    mm_content: tuple[dict[str, Any], ...] = ()


def length_bounds(length: int, range_ratio: float, floor_at: int = 0) -> tuple[int, int]:
    """[floor(L(1-r)), ceil(L(1+r))], each at least `floor_at`."""
    low = max(math.floor(length * (1.0 - range_ratio)), floor_at)
    high = max(math.ceil(length * (1.0 + range_ratio)), floor_at)
    return low, high


def allowed_token_ids(vocab_size: int, special_ids: list[int]) -> np.ndarray:
    """Every id below `vocab_size` that is not a special token, ascending."""
    return np.setdiff1d(np.arange(vocab_size), np.asarray(special_ids, dtype=np.int64))


def decode_to_target_len(
    tokenizer: Tokenizer, token_ids: list[int], target_len: int, rng: np.random.Generator
) -> tuple[str, list[int], int]:
    """Decode, re-encode and pad (random ids) or truncate until the text encodes to `target_len` ids.

    Returns (prompt, its ids, mismatch) where mismatch is len(ids) - target after the last retry (0 on success).
    """
    ids = list(token_ids)
    num_retries_left = MAX_DECODE_RETRIES
    while True:
        prompt = tokenizer.decode(ids)
        ids = list(tokenizer.encode(prompt, add_special_tokens=False))
        if num_retries_left <= 0:
            return prompt, ids, len(ids) - target_len
        if len(ids) == target_len:
            return prompt, ids, 0
        if len(ids) < target_len:
            ids.extend(int(x) for x in rng.integers(0, tokenizer.vocab_size, size=target_len - len(ids)))
        else:
            ids = ids[:target_len]
        num_retries_left -= 1


def sample_random(
    tokenizer: Tokenizer,
    num_requests: int,
    input_len: int = 1024,
    output_len: int = 128,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
    request_id_prefix: str = "",
) -> list[SampleRequest]:
    """The random dataset, reproducible from `seed` for a given tokenizer."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    num_special = int(tokenizer.num_special_tokens_to_add())
    real_input_len = max(0, int(input_len) - num_special)
    input_low, input_high = length_bounds(real_input_len, range_ratio)
    output_low, output_high = length_bounds(int(output_len), range_ratio, floor_at=1)
    if prefix_len + input_low < 1:
        raise ValueError(f"every prompt needs at least one token: prefix {prefix_len} + minimum input {input_low}")
    input_lens = rng.integers(input_low, input_high + 1, size=num_requests)
    output_lens = rng.integers(output_low, output_high + 1, size=num_requests)
    offsets = rng.integers(0, tokenizer.vocab_size, size=num_requests)

    allowed = allowed_token_ids(tokenizer.vocab_size, list(tokenizer.all_special_ids))
    num_allowed = len(allowed)
    prefix_ids = allowed[rng.integers(0, num_allowed, size=prefix_len)].tolist() if prefix_len > 0 else []

    requests: list[SampleRequest] = []
    num_mismatched = 0
    for i in range(num_requests):
        inner = allowed[(int(offsets[i]) + i + np.arange(int(input_lens[i]))) % num_allowed].tolist()
        target_len = prefix_len + int(input_lens[i])
        prompt, ids, mismatch = decode_to_target_len(tokenizer, prefix_ids + inner, target_len, rng)
        num_mismatched += mismatch != 0
        requests.append(
            SampleRequest(
                prompt=prompt,
                prompt_len=len(ids),
                expected_output_len=int(output_lens[i]),
                target_len=target_len,
                request_id=f"{request_id_prefix}{i}",
                token_mismatch=mismatch,
            )
        )
    if num_mismatched:
        log.warning("%d of %d random prompts missed their target length locally", num_mismatched, num_requests)
    return requests


async def _post_json(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with session.post(url, json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"POST {url}: HTTP {response.status}")
        return await response.json()


async def _align_one(
    session: aiohttp.ClientSession,
    base_url: str,
    model: str,
    request: SampleRequest,
    allowed: np.ndarray,
    rng_seed: int,
) -> SampleRequest:
    prompt = request.prompt
    rng = np.random.default_rng(rng_seed)
    for _ in range(MAX_SERVER_RETRIES):
        body = {"model": model, "prompt": prompt, "add_special_tokens": False}
        tokens = list((await _post_json(session, base_url + "/tokenize", body))["tokens"])
        if len(tokens) == request.target_len:
            return replace(request, prompt=prompt, prompt_len=len(tokens), token_mismatch=0)
        if len(tokens) > request.target_len:
            tokens = tokens[: request.target_len]
        else:
            pad = allowed[rng.integers(0, len(allowed), size=request.target_len - len(tokens))]
            tokens.extend(int(x) for x in pad)
        prompt = (await _post_json(session, base_url + "/detokenize", {"model": model, "tokens": tokens}))["prompt"]
    body = {"model": model, "prompt": prompt, "add_special_tokens": False}
    num_tokens = len((await _post_json(session, base_url + "/tokenize", body))["tokens"])
    return replace(request, prompt=prompt, prompt_len=num_tokens, token_mismatch=num_tokens - request.target_len)


async def align_with_server(
    session: aiohttp.ClientSession,
    base_url: str,
    model: str,
    requests: list[SampleRequest],
    tokenizer: Tokenizer,
    seed: int = 0,
) -> tuple[list[SampleRequest], bool]:
    """Make each prompt encode to its target length with the server's tokenizer.

    Returns (requests, is_aligned); is_aligned is False when the server has no usable /tokenize, in which
    case the requests come back unchanged, as vLLM's client does after a warning.
    """
    aiohttp = require("aiohttp")
    allowed = allowed_token_ids(tokenizer.vocab_size, list(tokenizer.all_special_ids))
    semaphore = asyncio.Semaphore(NUM_ALIGN_IN_FLIGHT)

    async def one(index: int, request: SampleRequest) -> SampleRequest:
        async with semaphore:
            return await _align_one(session, base_url, model, request, allowed, seed * 1_000_003 + index)

    try:
        aligned = await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
    except (RuntimeError, KeyError, aiohttp.ClientError, ValueError) as exc:
        log.warning("server-side prompt alignment skipped (%s); using the local tokenizer's lengths", exc)
        return requests, False
    num_mismatched = sum(1 for r in aligned if r.token_mismatch)
    if num_mismatched:
        log.warning("%d of %d prompts still miss their target length on the server", num_mismatched, len(aligned))
    return list(aligned), True
