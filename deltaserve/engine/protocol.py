"""What crosses between the engine front end (tokenizer, detokeniser, streams) and the engine core (scheduler and
runner), possibly between two processes: plain frozen dataclasses, picklable, with no tensors.

A request with n > 1 reaches the core as n requests (child seeds seed + i, as vLLM does, wrapped into int64); the
front end merges their outputs under the one request id.
"""

from __future__ import annotations

from dataclasses import dataclass

from deltaserve.engine.stats import EngineStats, RequestMetrics
from deltaserve.engine.thinking_budget import ThinkingStart
from deltaserve.multimodal.inputs import MultimodalInput
from deltaserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class EngineCoreRequest:
    request_id: str  # unique in the core: the request id, or "{id}#{i}" for the i-th of n sequences
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams  # n is 1 here; seed is the child's
    max_tokens: int  # output-token cap, already bounded by max_model_len
    eos_token_ids: frozenset[int]
    arrival_time: float  # time.time()
    mm_input: MultimodalInput | None = None  # the prompt's images and videos, processed (API side)
    # prefill only (LLMEngine.prefill_logits): the prompt runs in these chunk sizes, nothing is sampled and the
    # logits of every prompt position come back; None for a generating request
    logits_chunks: tuple[int, ...] | None = None
    priority: int = 0  # under --scheduling-policy priority: lower first (0 otherwise; the front end checks)
    # vLLM's per-request prefix-cache salt: only requests with the same salt (or none) share cached prefixes
    cache_salt: str | None = None
    # the tokenizer's eos, vLLM's primary one: it ends a sequence with no stop_reason, the other eos_token_ids
    # (generation_config's) with their id, as vLLM adds those to stop_token_ids (None: every eos is primary)
    eos_token_id: int | None = None
    # a request with a thinking_token_budget: the engine's reasoning markers and the prompt's open thinking section
    thinking: ThinkingStart | None = None


@dataclass(frozen=True)
class EngineCoreOutput:
    """New tokens of one core request since its last output, and how it finished (token rules only)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_logprobs: tuple[tuple[tuple[int, float, int], ...] | None, ...] | None  # per token, as StepResult's
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    metrics: RequestMetrics | None = None  # set on the finishing output
    # prompt logprobs computed since the last output, in prompt order from the first not yet reported (position 1
    # first): per prompt token ((token_id, logprob, rank), top-1, ..., top-N)
    prompt_logprobs: tuple[tuple[tuple[int, float, int], ...], ...] | None = None
    # a prefill-only request's finishing output: the fp32 logits [prompt_len, V] of its prompt, row-major bytes
    logits: bytes | None = None
    # prompt tokens the prefix cache served at the request's admission (vLLM's Request.num_cached_tokens); the
    # front end keeps the value of a sequence's first output, as vLLM sets it once, at the first admission
    num_cached_tokens: int = 0
    # prompt tokens past those hits that its prefill left in the prefix cache (vLLM's num_cache_creation_tokens): kept
    # from the first output, as num_cached_tokens
    num_cache_creation_tokens: int = 0


@dataclass(frozen=True)
class EngineCoreInfo:
    """What the core decided at start-up that the front end must know."""

    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    num_blocks: int
    block_size: int
    num_slots: int
    device: str
    dtype: str
    is_async_scheduling: bool
    enable_prefix_caching: bool = False
    num_speculative_tokens: int = 0  # k of speculative decoding (0: off): /metrics exports vLLM's spec-decode series


@dataclass(frozen=True)
class EngineCoreOutputs:
    outputs: tuple[EngineCoreOutput, ...]
    stats: EngineStats
    errors: tuple[tuple[str, str], ...] = ()  # (core request id, message) of requests the core refused
    # answers to the client's utility calls since the last batch: (call id, result), e.g. reset_prefix_cache's bool
    replies: tuple[tuple[int, object], ...] = ()
