"""FakeEngine: AsyncEngine's interface over scripted outputs, for fast and deterministic API tests.

It uses a real tokenizer (the tiny checkpoints' byte-level BPE and Qwen3.5-style chat template), emits one token
per step as delta RequestOutputs, applies the stop rules the API relies on (eos, stop strings, stop_token_ids,
max_tokens, ignore_eos) and books KV blocks and state slots per sequence, so a test can see through /metrics that
an aborted or disconnected request gave its resources back. It reports what the real engine reports after the
rewrite: RequestOutput.num_cached_tokens and num_cache_creation_tokens (set `num_cached_tokens`,
`num_cache_creation_tokens`), RequestOutput.metrics with engine timestamps
(with `is_reporting_metrics`), prompt logprobs (computed once per request, as the real front end does for n > 1),
EngineStats' iteration-token histogram, waiting-by-reason counts and prefix-cache counters, and counts the prefix-cache
resets it is asked for.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from transformers import PreTrainedTokenizerFast

from deltaserve.engine.request import CompletionOutput, Logprob, RequestOutput
from deltaserve.engine.stats import ITERATION_TOKEN_BUCKETS, EngineStats, RequestMetrics
from deltaserve.sampling_params import SamplingParams

FILLER_TEXT = " the quick brown fox jumps over the lazy dog"


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The tiny checkpoints' tokenizer and chat template, without building a model."""
    from deltaserve.tiny.tokenizer import build_tokenizer as build_tiny_tokenizer
    from deltaserve.tiny.tokenizer import chat_template

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=build_tiny_tokenizer("Qwen3_5Tokenizer"), eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tokenizer.chat_template = chat_template()
    return tokenizer


class FakeEngine:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerFast,
        *,
        max_model_len: int = 2048,
        num_kv_blocks: int = 512,
        num_state_slots: int = 256,
        block_size: int = 16,
        step_delay: float = 0.0005,
    ) -> None:
        self.tokenizer = tokenizer
        # encoded once: encoding it for each request made a 2,048-prompt request hold the loop in the fake itself
        self.filler_ids: list[int] = tokenizer.encode(FILLER_TEXT, add_special_tokens=False)
        self.max_model_len = max_model_len
        self.default_sampling: dict[str, Any] = {}
        self.block_size = block_size
        self.num_total_kv_blocks = num_kv_blocks
        self.num_total_state_slots = num_state_slots
        self.num_used_blocks = 0
        self.num_used_slots = 0
        self.step_delay = step_delay
        # Each request pops one script: one text per sequence index (cycled), then eos. Without a script a
        # request generates the filler text until max_tokens, as a random-weight model would.
        self.scripts: deque[list[str]] = deque()
        self.fail_after_tokens: int | None = None  # raise mid-stream after this many tokens (error-event tests)
        self.is_dead = False
        self.is_hung = False
        self.mm_processor = None  # text only
        self.running: dict[str, SamplingParams] = {}
        self.last_params: SamplingParams | None = None
        self.last_prompt_ids: list[int] | None = None
        self.num_aborted = 0
        self.num_started = 0
        self.num_cached_tokens = 0  # prefix-cache hits every request reports
        self.num_cache_creation_tokens = 0  # prompt tokens every request reports it added to the cache
        # the scheduler's counters: each sequence's prompt is looked up once, hitting num_cached_tokens of it
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_prefix_cache_resets = 0
        self.is_prefix_cache_reset_whole = True  # what reset_prefix_cache answers (False: running requests kept some)
        self.is_reporting_metrics = False  # RequestOutput.metrics with engine timestamps
        self.num_preemptions = 0  # reported in each request's metrics
        self.iteration_tokens: list[int] = []  # tokens of each engine step, for vllm:iteration_tokens_total
        self._token_texts: dict[int, str] = {}  # decoded single tokens: big prompt-logprob requests stay cheap

    async def start(self) -> None:
        self.num_started += 1

    async def stop(self) -> None:
        pass

    async def abort(self, request_id: str) -> None:
        self.running.pop(request_id, None)

    async def reset_prefix_cache(self) -> bool:
        self.num_prefix_cache_resets += 1
        return self.is_prefix_cache_reset_whole

    def _iteration_counts(self) -> tuple[int, ...]:
        bounds = (*ITERATION_TOKEN_BUCKETS, float("inf"))
        return tuple(sum(1 for tokens in self.iteration_tokens if tokens <= bound) for bound in bounds)

    def stats(self) -> EngineStats:
        return EngineStats(
            iteration_token_counts=self._iteration_counts(),
            iteration_tokens_sum=sum(self.iteration_tokens),
            num_waiting_for_capacity=1,
            num_waiting_deferred=2,
            num_running=len(self.running),
            num_waiting=0,
            kv_cache_usage=self.num_used_blocks / self.num_total_kv_blocks,
            num_free_kv_blocks=self.num_total_kv_blocks - self.num_used_blocks,
            num_total_kv_blocks=self.num_total_kv_blocks,
            num_free_state_slots=self.num_total_state_slots - self.num_used_slots,
            num_total_state_slots=self.num_total_state_slots,
            num_preemptions_total=0,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
        )

    def _script_ids(self, texts: list[str] | None, index: int) -> list[int] | None:
        return None if texts is None else self.tokenizer.encode(texts[index % len(texts)], add_special_tokens=False)

    def _text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def _logprobs(self, token_id: int, num_top: int) -> dict[int, Logprob]:
        entry = {token_id: Logprob(-0.25, 1, self._text(token_id))}
        for rank, other in enumerate(range(num_top), start=2):
            other_id = (token_id + 1 + other) % len(self.tokenizer)
            entry.setdefault(other_id, Logprob(-1.0 * rank, rank, self._text(other_id)))
        return entry

    def _prompt_logprobs(self, prompt_token_ids: list[int], num_top: int | None) -> list | None:
        """vLLM's shape: None for the first prompt token, then one entry per token (the token itself first)."""
        if num_top is None:
            return None
        return [None] + [self._logprobs(token_id, num_top) for token_id in prompt_token_ids[1:]]

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str, cache_salt: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        self.last_cache_salt = cache_salt
        if self.is_dead:
            raise RuntimeError("the engine loop is not running")
        if request_id in self.running:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.last_params, self.last_prompt_ids = params, list(prompt_token_ids)
        texts = self.scripts.popleft() if self.scripts else None
        seqs = [_Seq(i, self._script_ids(texts, i)) for i in range(params.n)]
        filler = self.filler_ids
        eos = self.tokenizer.eos_token_id
        max_tokens = params.max_tokens or self.max_model_len - len(prompt_token_ids)
        self.running[request_id] = params
        num_prompt = len(prompt_token_ids)
        self.prefix_cache_queries += num_prompt * params.n
        self.prefix_cache_hits += min(self.num_cached_tokens, num_prompt) * params.n
        held_blocks = 0
        self.num_used_slots += params.n
        is_finished = False
        arrival = time.time()
        first_token_time: float | None = None
        prompt_logprobs = self._prompt_logprobs(list(prompt_token_ids), params.prompt_logprobs)
        try:
            step = 0
            while True:
                await asyncio.sleep(self.step_delay)
                if request_id not in self.running:  # aborted through abort()
                    break
                if self.fail_after_tokens is not None and step >= self.fail_after_tokens:
                    raise RuntimeError("scripted engine failure")
                outputs = []
                for seq in seqs:
                    if seq.finish_reason is None:
                        outputs.append(seq.advance(self, params, filler, eos, max_tokens))
                needed = sum(math.ceil((num_prompt + len(s.token_ids)) / self.block_size) for s in seqs)
                self.num_used_blocks += needed - held_blocks
                held_blocks = needed
                step += 1
                self.iteration_tokens.append(len(outputs) + (num_prompt if step == 1 else 0))
                is_finished = all(seq.finish_reason is not None for seq in seqs)
                now = time.time()
                first_token_time = first_token_time or now
                metrics = None
                if self.is_reporting_metrics:
                    metrics = RequestMetrics(arrival, arrival + 0.001, first_token_time, now, self.num_preemptions)
                yield RequestOutput(request_id, None, list(prompt_token_ids), outputs, is_finished,
                                    num_cached_tokens=self.num_cached_tokens,
                                    num_cache_creation_tokens=self.num_cache_creation_tokens, metrics=metrics,
                                    prompt_logprobs=prompt_logprobs)  # fmt: skip
                if is_finished:
                    return
        finally:
            # Runs on finish, on aclose() and on cancellation alike: the resources always come back.
            self.num_used_blocks -= held_blocks
            self.num_used_slots -= params.n
            self.running.pop(request_id, None)
            if not is_finished:
                self.num_aborted += 1


class _Seq:
    def __init__(self, index: int, script: list[int] | None) -> None:
        self.index = index
        self.is_scripted = script is not None
        self.script = script or []
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None

    def advance(
        self, engine: FakeEngine, params: SamplingParams, filler: list[int], eos: int, max_tokens: int
    ) -> CompletionOutput:
        """One token: the script, then eos (unless ignore_eos), then filler; stop rules as vLLM applies them."""
        position = len(self.token_ids)
        if position < len(self.script):
            token = self.script[position]
        elif self.is_scripted and not params.ignore_eos and position >= params.min_tokens:
            token = eos
        else:
            token = filler[(position - len(self.script)) % len(filler)]
        self.token_ids.append(token)
        stop_reason: str | int | None = None
        decoded = engine.tokenizer.decode(self.token_ids, skip_special_tokens=params.skip_special_tokens)
        new_text = decoded[len(self.text) :]
        if token == eos and not params.ignore_eos:
            self.finish_reason = "stop"
        elif token in params.stop_token_ids:
            self.finish_reason, stop_reason = "stop", token
        else:
            for stop in params.stop:
                at = decoded.find(stop, max(0, len(self.text) - len(stop) + 1))
                if at != -1:
                    end = at + len(stop) if params.include_stop_str_in_output else at
                    new_text = decoded[len(self.text) : end]
                    self.finish_reason, stop_reason = "stop", stop
                    break
        if self.finish_reason is None and len(self.token_ids) >= max_tokens:
            self.finish_reason = "length"
        self.text += new_text
        logprobs = [engine._logprobs(token, params.logprobs)] if params.logprobs is not None else None
        return CompletionOutput(self.index, new_text, [token], None, logprobs, self.finish_reason, stop_reason)
