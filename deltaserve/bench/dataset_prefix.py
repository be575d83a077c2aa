"""The `prefix_repetition` dataset of `vllm bench serve`: a few random prefixes, each shared by many requests.

Restated from vLLM 0.26.0's PrefixRepetitionRandomDataset and gen_prompt_decode_to_target_len
(vllm/benchmarks/datasets/datasets.py of the vllm-0.26.0 wheel) and the alignment step of
vllm/benchmarks/serve.py (`_align_prompts_to_server_tokenizer`). For a seed, vLLM seeds numpy's legacy global
generator and Python's `random`, then:

- for each of `num_prefixes` prefixes: `prefix_len` ids uniform in [0, vocab_size) (special ids included), made
  to decode and re-encode to exactly `prefix_len` ids (at most 10 retries; a short text is padded with more draws
  from the same generator, a long one truncated);
- for each of `num_requests // num_prefixes` requests of that prefix: `suffix_len` ids made exact the same way;
  the prompt is the decoded text of prefix ids + suffix ids, its length their count (not re-encoded);
- every request asks for `output_len` tokens; the list is shuffled with Python's `random.shuffle`.

So `num_requests` must be at least `num_prefixes`, and the remainder of the division is dropped (vLLM does not
oversample this dataset). Request ids are this client's own (`request_id_prefix` + position after the shuffle);
vLLM leaves them unset. numpy's `RandomState(seed)` and `random.Random(seed)` below are the same streams as the
seeded globals vLLM draws from, without touching this process's globals.

vLLM aligns these prompts with the server's tokenizer (as it does `random` ones): if the server counts the first
prompt at its `prompt_len`, nothing changes; otherwise every prompt the server counts longer is cut to
`prompt_len` tokens through POST /detokenize (shorter ones stay), and a failing request keeps its prompt.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from deltaserve.bench.dataset import SampleRequest, Tokenizer, decode_to_target_len

if TYPE_CHECKING:
    import aiohttp

log = logging.getLogger(__name__)

DEFAULT_PREFIX_LEN = 256
DEFAULT_SUFFIX_LEN = 256
DEFAULT_NUM_PREFIXES = 10
DEFAULT_OUTPUT_LEN = 128
NUM_ALIGN_IN_FLIGHT = 64  # vLLM's semaphore


@dataclass(frozen=True)
class PrefixOptions:
    """The four `--prefix-repetition-*` flags, with vLLM's defaults."""

    prefix_len: int = DEFAULT_PREFIX_LEN
    suffix_len: int = DEFAULT_SUFFIX_LEN
    num_prefixes: int = DEFAULT_NUM_PREFIXES
    output_len: int = DEFAULT_OUTPUT_LEN

    def as_record(self) -> dict[str, int]:
        """The result record's provenance fields, named as vLLM's argparse names them."""
        return {
            "prefix_repetition_prefix_len": self.prefix_len,
            "prefix_repetition_suffix_len": self.suffix_len,
            "prefix_repetition_num_prefixes": self.num_prefixes,
            "prefix_repetition_output_len": self.output_len,
        }


class _LegacyIntegers:
    """numpy's legacy `randint` behind the `integers` name decode_to_target_len draws its pads with."""

    def __init__(self, state: np.random.RandomState) -> None:
        self._state = state

    def integers(self, low: int, high: int, size: int) -> np.ndarray:
        return self._state.randint(low, high, size=size)


def sample_prefix_repetition(
    tokenizer: Tokenizer,
    num_requests: int,
    options: PrefixOptions = PrefixOptions(),
    seed: int = 0,
    request_id_prefix: str = "",
    is_shuffled: bool = True,
) -> list[SampleRequest]:
    """vLLM 0.26's requests for `seed` and `tokenizer`: num_prefixes x (num_requests // num_prefixes)."""
    prompts_per_prefix = num_requests // options.num_prefixes
    if prompts_per_prefix == 0:
        raise ValueError(
            f"num_requests ({num_requests}) must be greater than or equal to num_prefixes ({options.num_prefixes})"
        )
    state = np.random.RandomState(seed)
    draws: Any = _LegacyIntegers(state)

    def exact_ids(length: int) -> tuple[list[int], int]:
        ids = state.randint(0, tokenizer.vocab_size, size=length).tolist()
        _, ids, mismatch = decode_to_target_len(tokenizer, ids, length, draws)
        return ids, mismatch

    requests: list[SampleRequest] = []
    total_mismatch = 0
    target_len = options.prefix_len + options.suffix_len
    for _ in range(options.num_prefixes):
        prefix_ids, mismatch = exact_ids(options.prefix_len)
        total_mismatch += mismatch
        for _ in range(prompts_per_prefix):
            suffix_ids, mismatch = exact_ids(options.suffix_len)
            total_mismatch += mismatch
            ids = prefix_ids + suffix_ids
            requests.append(
                SampleRequest(
                    prompt=tokenizer.decode(ids),
                    prompt_len=len(ids),
                    expected_output_len=options.output_len,
                    target_len=target_len,
                    request_id="",
                    token_mismatch=len(ids) - target_len,
                )
            )
    if total_mismatch:
        log.warning("prefix_repetition prompts: %+d tokens against their targets after decode/encode", total_mismatch)
    if is_shuffled:
        random.Random(seed).shuffle(requests)
    return [replace(request, request_id=f"{request_id_prefix}{i}") for i, request in enumerate(requests)]


async def _tokens(session: aiohttp.ClientSession, base_url: str, model: str, prompt: str) -> list[int]:
    body = {"model": model, "prompt": prompt, "add_special_tokens": False}
    async with session.post(base_url + "/tokenize", json=body) as response:
        response.raise_for_status()
        return list((await response.json())["tokens"])


async def align_like_vllm(
    session: aiohttp.ClientSession, base_url: str, model: str, requests: list[SampleRequest]
) -> tuple[list[SampleRequest], bool]:
    """vLLM 0.26's alignment of prefix_repetition prompts; returns (requests, whether the server was asked)."""
    if not requests:
        return requests, False
    try:
        first = await _tokens(session, base_url, model, requests[0].prompt)
    except Exception as exc:  # vLLM skips alignment on any failure of the first /tokenize
        log.warning("/tokenize unavailable (%s), skipping alignment", exc)
        return requests, False
    if len(first) == requests[0].prompt_len:
        return requests, True
    log.warning("tokenizer mismatch (server=%d, expected=%d), re-aligning prompts", len(first), requests[0].prompt_len)
    semaphore = asyncio.Semaphore(NUM_ALIGN_IN_FLIGHT)

    async def fix(request: SampleRequest) -> SampleRequest:
        async with semaphore:
            tokens = await _tokens(session, base_url, model, request.prompt)
        if len(tokens) <= request.prompt_len:
            return request
        body = {"model": model, "tokens": tokens[: request.prompt_len]}
        async with semaphore, session.post(base_url + "/detokenize", json=body) as response:
            response.raise_for_status()
            prompt = (await response.json())["prompt"]
        return replace(request, prompt=prompt)

    results = await asyncio.gather(*(fix(r) for r in requests), return_exceptions=True)
    return [r if isinstance(r, SampleRequest) else orig for orig, r in zip(requests, results, strict=True)], True
