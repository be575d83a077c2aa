"""The request-side types of the engine, shaped like vLLM's: RequestOutput and its parts (SamplingParams,
which every stage shares, lives in `deltaserve.sampling_params`).

These are plain dataclasses with no tensors; the api stage builds them, the engine stage consumes them.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NotRequired, TypedDict

from deltaserve.engine.stats import RequestMetrics


class TextPrompt(TypedDict):
    """vLLM's TextPrompt (a plain dict at run time): a text prompt for LLM.generate."""

    prompt: str
    multi_modal_data: NotRequired[dict[str, Any] | None]
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    """vLLM's TokensPrompt (a plain dict at run time): a prompt of token ids, its text optional."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    multi_modal_data: NotRequired[dict[str, Any] | None]
    cache_salt: NotRequired[str]


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    REPETITION = "repetition"  # repetition_detection ended it (stop_reason "repetition_detected")


@dataclass
class Logprob:
    """One token's log-probability, its rank among the vocabulary and its decoded text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One of a request's n sequences. In delta mode text/token_ids/logprobs hold only what is new.
    cumulative_logprob is None unless logprobs were asked for, as vLLM's. lora_request and routed_experts are
    vLLM's fields, always None here (no LoRA adapters, no enable_return_routed_experts)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: Sequence[dict[int, Logprob]] | None = None  # a list, or FlatLogprobs with flat_logprobs
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    lora_request: None = None
    routed_experts: None = None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def finished(self) -> bool:
        """vLLM's CompletionOutput.finished() (a method there)."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What the engine reports for a request: cumulative for LLM.generate, deltas for AsyncEngine streams."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # prompt tokens past num_cached_tokens that this request's prefill left in the prefix cache (vLLM's field)
    num_cache_creation_tokens: int = 0
    metrics: RequestMetrics | None = None  # engine-side timestamps; set on the outputs the engine reports
    # prompt_logprobs: per prompt token, None for the first (vLLM's shape), cumulative so far; None if not asked
    prompt_logprobs: Sequence[dict[int, Logprob] | None] | None = None
    # vLLM's fields for what deltaserve does not serve, None as vLLM has them for a decoder-only model without LoRA
    # adapters or a KV / encoder-cache connector
    lora_request: None = None
    encoder_prompt: None = None
    encoder_prompt_token_ids: None = None
    kv_transfer_params: None = None
    ec_transfer_params: None = None
