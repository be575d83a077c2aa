"""Tokenisation and detokenisation for the API, off the event loop and bounded as vLLM bounds them.

Every encode and decode runs on a small thread pool. Inputs above LARGE_CHARS characters (or LARGE_TOKENS tokens)
go to a pool of their own, NUM_LARGE_THREADS threads: four 15 MB /tokenize bodies take ~13 s each, and queued on the
shared pool they held every thread while an ordinary completion waited behind them (issue 39). Large inputs now
wait only behind other large inputs; the small pool stays free for everything else.

A fast tokenizer is driven through `encode_batch_fast`, which releases the GIL while Rust works; its result is
converted to Python ints in slices (`Encoding.truncate` splits it in Rust), so no single step holds the GIL for long
and the event loop keeps answering /health.

vLLM's bounds apply before any work: a prompt longer than max_input_tokens * max_chars_per_token characters (the
longest token's length, so it cannot fit) is refused without tokenising, and with truncation the text is pre-cut
to that many characters from the truncated side. Truncation keeps the last tokens by default (vLLM loads
generation tokenizers with truncation_side "left"); `truncation_side: "right"` keeps the first ones.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from deltaserve.api.errors import bad_request

T = TypeVar("T")

NUM_THREADS = 4
# Inputs at least this large run on the large pool: about 0.2 s of encoding, more than any chat turn needs.
LARGE_CHARS = 1 << 18
LARGE_TOKENS = 1 << 16
NUM_LARGE_THREADS = 2
# Tokens converted to Python ints (or to JSON) per GIL-holding step.
SLICE_TOKENS = 1 << 16
DEFAULT_TRUNCATION_SIDE = "left"


def truncation_length(truncate_prompt_tokens: int | None, max_model_len: int) -> int | None:
    """vLLM's truncate_prompt_tokens: k tokens kept, -1 meaning max_model_len; None: no truncation."""
    if truncate_prompt_tokens is None:
        return None
    if truncate_prompt_tokens == -1:
        return max_model_len
    if truncate_prompt_tokens < 1 or truncate_prompt_tokens > max_model_len:
        raise bad_request(
            f"truncate_prompt_tokens must be -1 or in [1, {max_model_len}], got {truncate_prompt_tokens}.",
            "truncate_prompt_tokens",
        )
    return truncate_prompt_tokens


def truncate_ids(token_ids: list[int], keep: int | None, side: str | None) -> list[int]:
    """Token-id prompts are truncated as text prompts are: the last `keep` tokens, or the first with side right."""
    if keep is None or len(token_ids) <= keep:
        return token_ids
    return token_ids[:keep] if side == "right" else token_ids[-keep:]


def longest_token_chars(tokenizer: Any) -> int:
    """vLLM's max_chars_per_token: the longest vocabulary entry, an upper bound on characters per token."""
    vocab = tokenizer.get_vocab()
    return max((len(token) for token in vocab), default=1) or 1


class Tokens:
    """The server's tokenizer front: async encode/decode on worker threads, with the prompt bounds."""

    def __init__(
        self, tokenizer: Any, num_threads: int = NUM_THREADS, num_large_threads: int = NUM_LARGE_THREADS
    ) -> None:
        self.tokenizer = tokenizer
        self.executor = ThreadPoolExecutor(num_threads, thread_name_prefix="deltaserve-tokenize")
        self.large_executor = ThreadPoolExecutor(num_large_threads, thread_name_prefix="deltaserve-tokenize-large")
        self.large_chars = LARGE_CHARS
        self.large_tokens = LARGE_TOKENS
        self._max_chars_per_token: int | None = None
        backend = getattr(tokenizer, "_tokenizer", None)
        # The Rust backend directly, unless the wrapper changes how special tokens are split.
        self.backend = (
            backend
            if hasattr(backend, "encode_batch_fast") and not getattr(tokenizer, "split_special_tokens", False)
            else None
        )

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, functools.partial(fn, *args, **kwargs))

    async def run_large(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """run() on the large-input pool: for work that takes seconds, so it never holds the shared threads."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.large_executor, functools.partial(fn, *args, **kwargs))

    async def _run_sized(self, is_large: bool, fn: Callable[..., T], *args: Any) -> T:
        return await (self.run_large(fn, *args) if is_large else self.run(fn, *args))

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.large_executor.shutdown(wait=False, cancel_futures=True)

    @property
    def max_chars_per_token(self) -> int:
        if self._max_chars_per_token is None:
            self._max_chars_per_token = longest_token_chars(self.tokenizer)
        return self._max_chars_per_token

    async def warm_up(self) -> None:
        """Computes the vocabulary bound once, before the first request needs it."""
        await self.run(lambda: self.max_chars_per_token)

    # -- encoding ----------------------------------------------------------------------------------------

    def _encode_sync(self, text: str, add_special_tokens: bool, keep: int | None, side: str) -> tuple[list[int], int]:
        """(token ids, untruncated count); with keep, only `keep` tokens from the kept side are converted."""
        if self.backend is None:
            ids = list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
            count = len(ids)
            if keep is not None and count > keep:
                ids = ids[-keep:] if side == "left" else ids[:keep]
            return ids, count
        encoding = self.backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0]
        count = len(encoding)
        if keep is not None and count > keep:
            encoding.truncate(keep, 0, side)
        return sliced_ids(encoding), count

    async def encode(
        self,
        text: str,
        *,
        add_special_tokens: bool,
        max_input_tokens: int | None = None,
        truncate: int | None = None,
        truncation_side: str | None = None,
        param: str = "prompt",
    ) -> tuple[list[int], int]:
        """Token ids of a prompt (truncated to `truncate` if given) and its full token count.

        max_input_tokens is the most a prompt may have: text that cannot fit is refused before tokenising.
        """
        side = truncation_side or DEFAULT_TRUNCATION_SIDE
        if max_input_tokens is not None:
            max_chars = max_input_tokens * self.max_chars_per_token
            if len(text) > max_chars:
                if truncate is None:
                    raise bad_request(
                        f"This model's maximum context length is {max_input_tokens} tokens. However, your prompt "
                        f"contains {len(text)} characters (more than {max_chars} characters, which is the upper "
                        f"bound for {max_input_tokens} input tokens). Please reduce the length of the input.",
                        param,
                    )
                # Cut from the truncated side; what is left still holds at least `truncate` tokens' worth.
                text = text[-max_chars:] if side == "left" else text[:max_chars]
        is_large = len(text) >= self.large_chars
        return await self._run_sized(is_large, self._encode_sync, text, add_special_tokens, truncate, side)

    # -- decoding ----------------------------------------------------------------------------------------

    def _decode_sync(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        if self.backend is None:
            return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
        # decode_batch releases the GIL (decode does not): half a million tokens take a while.
        text = self.backend.decode_batch([token_ids], skip_special_tokens=skip_special_tokens)[0]
        if getattr(self.tokenizer, "clean_up_tokenization_spaces", False):
            text = self.tokenizer.clean_up_tokenization(text)
        return text

    async def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """tokenizer.decode(token_ids, skip_special_tokens=...), off the event loop."""
        is_large = len(token_ids) >= self.large_tokens
        return await self._run_sized(is_large, self._decode_sync, list(token_ids), skip_special_tokens)

    async def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        is_large = len(token_ids) >= self.large_tokens
        return await self._run_sized(is_large, self.tokenizer.convert_ids_to_tokens, list(token_ids))


def sliced_ids(encoding: Any) -> list[int]:
    """encoding.ids, converted SLICE_TOKENS at a time so that no one conversion holds the GIL for long."""
    if len(encoding) <= SLICE_TOKENS:
        return list(encoding.ids)
    encoding.truncate(SLICE_TOKENS, 0, "right")
    ids = list(encoding.ids)
    for part in encoding.overflowing:
        ids.extend(part.ids)
    return ids


def json_int_list(values: Sequence[int]) -> str:
    """A JSON array of ints, built slice by slice (json.dumps of millions of ints holds the GIL throughout)."""
    parts = [",".join(map(str, values[i : i + SLICE_TOKENS])) for i in range(0, len(values), SLICE_TOKENS)]
    return "[" + ",".join(parts) + "]"
