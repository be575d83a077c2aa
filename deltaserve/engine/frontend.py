"""The engine front end: what runs beside the tokenizer, wherever the engine core runs.

It checks a request (token ids, sampling parameters, and the length rules with the max_tokens they imply:
resolve_max_tokens, which the API applies too) in one place, fans a request with n > 1 out into n core requests, and
turns the core's outputs into RequestOutputs (OutputProcessor). LLMEngine uses it next to an in-process core; the
server's AsyncEngine uses it in the API process, next to a core in its own process.
"""

from __future__ import annotations

import copy
import threading
import time
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from deltaserve import env
from deltaserve.config import ModelConfig
from deltaserve.engine.detokenizer import IncrementalDetokenizer, TokenIdsOnly
from deltaserve.engine.flat_logprobs import new_logprobs
from deltaserve.engine.generation_config import load_eos_token_ids, load_generation_defaults
from deltaserve.engine.output import RequestState, SequenceProgress
from deltaserve.engine.protocol import EngineCoreOutput, EngineCoreRequest
from deltaserve.engine.request import RequestOutput
from deltaserve.engine.thinking_budget import ThinkingStart, open_section
from deltaserve.engine_config import EngineConfig
from deltaserve.model.preflight import check_generation_config, load_tokenizer
from deltaserve.multimodal.inputs import MultimodalInput
from deltaserve.multimodal.processor import MultimodalProcessor
from deltaserve.multimodal.prompt import VisionTokenIds
from deltaserve.reasoning_config import NOT_CONFIGURED, resolve_markers
from deltaserve.sampling_params import (
    ParamError,
    RequestOutputKind,
    SamplingParams,
    child_seed,
    resolve_num_logprobs,
)


class RequestError(ValueError):
    """A request the engine cannot serve (a 400 in the API); `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def check_token_ids(prompt_token_ids: list[int], vocab_size: int, prompt_param: str = "prompt") -> None:
    """Every prompt token id inside the model's vocabulary (config vocab_size)."""
    bad = next((t for t in prompt_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError(f"Token id {bad} is out of vocabulary (vocab size {vocab_size}).", prompt_param)


def resolve_max_tokens(
    requested: int | None,
    num_prompt_tokens: int,
    max_model_len: int,
    cap: int | None = None,
    prompt_param: str = "prompt",
    clamp: bool = False,
) -> int:
    """A request's max_tokens under vLLM's length rules, the one place both live: the prompt leaves room for one
    token; an unset max_tokens is the rest of the context; `cap` (a generation_config max_new_tokens, which the API
    applies as vLLM's server does) caps even an explicit value; prompt + max_tokens fits the context: past it the
    API refuses (vLLM's server), and with `clamp` the engine cuts it to the rest of the context (vLLM's engine, which
    stops the sequence at max_model_len, "length"). Raises RequestError (a 400 in the API) naming the field."""
    if num_prompt_tokens == 0:
        raise RequestError("The prompt cannot be empty.", prompt_param)
    if num_prompt_tokens >= max_model_len:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{num_prompt_tokens} input tokens. Please reduce the length of the input.",
            prompt_param,
        )
    max_tokens = max_model_len - num_prompt_tokens if requested is None else requested
    if isinstance(cap, int) and cap > 0:
        max_tokens = min(max_tokens, cap)
    if clamp:
        max_tokens = min(max_tokens, max_model_len - num_prompt_tokens)
    if num_prompt_tokens + max_tokens > max_model_len:
        raise RequestError(
            f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum context "
            f"length is {max_model_len} tokens and your request has {num_prompt_tokens} input tokens "
            f"({max_tokens} > {max_model_len} - {num_prompt_tokens}).",
            "max_tokens",
        )
    return max_tokens


def check_cache_salt(salt: Any) -> None:
    """vLLM's rule for a request's cache_salt: absent, or a non-empty string; and one that encodes as UTF-8 (JSON's
    escapes can spell a lone surrogate, which the engine core's prefix-cache hash could not encode: the core died)."""
    if salt is not None and not (isinstance(salt, str) and salt):
        raise RequestError("Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt")
    if salt is not None and not is_utf8_encodable(salt):
        raise RequestError(
            "Parameter 'cache_salt' must be valid Unicode text: it holds a lone surrogate.", "cache_salt"
        )


def is_utf8_encodable(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def check_priority(priority: int, scheduling_policy: str) -> None:
    """vLLM's rule (and its words): a priority other than 0 needs --scheduling-policy priority."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise RequestError(f"priority must be an integer, got {priority!r}", "priority")
    if priority != 0 and scheduling_policy != "priority":
        raise RequestError(f"Got priority {priority} but Priority scheduling is not enabled.", "priority")


def bad_words_token_ids(tokenizer: PreTrainedTokenizerBase, words: list[str]) -> list[list[int]]:
    """vLLM's rule: each word's tokens as written (stripped of leading spaces), and with one leading space when
    that spelling starts with another token and has as many tokens (so a word is banned mid-text too)."""
    sequences: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        sequences.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    return [ids for ids in sequences if ids]


class OutputProcessor:
    """Request states by id; turns core outputs into RequestOutputs. Thread-safe: one lock guards the states."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stream_interval: int = 1) -> None:
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval  # vLLM's: deltas of at least this many tokens (first and last aside)
        self.requests: dict[str, RequestState] = {}
        self._by_core_id: dict[str, tuple[RequestState, int]] = {}
        self._lock = threading.Lock()

    def add(self, state: RequestState) -> None:
        with self._lock:
            if state.request_id in self.requests:
                raise RequestError(f"request id {state.request_id!r} is already in use")
            self.requests[state.request_id] = state
            for index, progress in enumerate(state.sequences):
                self._by_core_id[progress.core_id] = (state, index)

    def _drop(self, state: RequestState) -> None:
        self.requests.pop(state.request_id, None)
        for progress in state.sequences:
            self._by_core_id.pop(progress.core_id, None)

    def abort(self, request_id: str) -> tuple[RequestOutput | None, list[str]]:
        """(the request's final delta, its unfinished core ids) or (None, []) when it is unknown."""
        with self._lock:
            state = self.requests.get(request_id)
            if state is None:
                return None, []
            core_ids = [p.core_id for p in state.sequences if not p.is_finished]
            state.abort()
            self._drop(state)
            return state.delta_output(), core_ids

    def process(
        self, outputs: list[EngineCoreOutput], by_output_kind: bool = False
    ) -> tuple[list[RequestOutput], list[str]]:
        """(RequestOutputs of the requests that progressed, core ids to abort because a stop string ended them).
        The outputs are deltas (the server's streams and bodies read them so), or with by_output_kind each request's
        as its params' output_kind asks, as vLLM's LLMEngine.step gives them: CUMULATIVE (vLLM's default) the
        whole output so far, DELTA what is new, FINAL_ONLY the whole output once finished and nothing before."""
        touched: dict[str, RequestState] = {}
        to_abort: list[str] = []
        with self._lock:
            for output in outputs:
                entry = self._by_core_id.get(output.request_id)
                if entry is None:
                    continue  # aborted meanwhile
                state, index = entry
                if state.apply(index, output):
                    to_abort.append(output.request_id)
                touched[state.request_id] = state
            results = []
            for state in touched.values():
                kind = state.params.output_kind if by_output_kind else RequestOutputKind.DELTA
                # vLLM's stream interval holds back deltas only (a cumulative output is sent every step)
                interval = self.stream_interval if kind == RequestOutputKind.DELTA else 1
                delta = state.delta_output(interval)  # advances what has been reported, whatever is returned
                if interval > 1 and not delta.outputs and not delta.finished:
                    # every progressed sequence held back; prompt logprobs, cumulative, go with the next delta
                    continue
                if kind == RequestOutputKind.DELTA:
                    results.append(delta)
                elif kind == RequestOutputKind.CUMULATIVE or state.is_finished:
                    results.append(state.final_output())
                if state.is_finished:
                    self._drop(state)
        return results, to_abort


class EngineFrontend:
    """Tokenizer, sampling defaults, eos ids and the output processor of one served model."""

    def __init__(self, config: EngineConfig, model_dir: Path, max_model_len: int) -> None:
        self.model_dir = model_dir
        self.model_config = ModelConfig.from_pretrained(model_dir)
        self.tokenizer: PreTrainedTokenizerBase = load_tokenizer(model_dir, config.tokenizer)
        self.max_model_len = max_model_len
        self.scheduling_policy = config.scheduling_policy
        check_generation_config(model_dir, config.generation_config)
        if config.generation_config == "vllm":
            self.default_sampling: dict[str, Any] = {}
        else:
            source = model_dir if config.generation_config == "auto" else Path(config.generation_config)
            self.default_sampling = load_generation_defaults(source)
        eos = set(load_eos_token_ids(model_dir)) | set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.processor = OutputProcessor(self.tokenizer, config.stream_interval)
        # thinking-token budgets: the reasoning start / end token ids (None: budgets are refused)
        tokenizer = self.tokenizer
        self.reasoning_markers = resolve_markers(
            config.reasoning_parser, config.reasoning_config,
            lambda text: tokenizer.encode(text, add_special_tokens=False),
        )  # fmt: skip
        # images and videos: only when the vision tower is built (a multimodal checkpoint, not language-model-only)
        self.mm_processor: MultimodalProcessor | None = None
        vision = self.model_config.vision
        if vision is not None and not config.language_model_only:
            tokens = VisionTokenIds(vision.image_token_id, vision.video_token_id, vision.vision_start_token_id,
                                    vision.vision_end_token_id)  # fmt: skip
            tokenizer = self.tokenizer
            self.mm_processor = MultimodalProcessor.from_model_dir(
                model_dir,
                tokens,
                encode=lambda text: tokenizer.encode(text, add_special_tokens=False),
                allowed_local_media_path=config.allowed_local_media_path,
                limit_mm_per_prompt=config.limit_mm_per_prompt,
                mm_processor_kwargs=config.mm_processor_kwargs,
            )
            self.mm_processor.check_vision_geometry(vision.patch_size, vision.temporal_patch_size,
                                                    vision.spatial_merge_size)  # fmt: skip

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Raises RequestError (a 400 in the API) for prompts and limits the engine cannot serve; returns the
        request's max_tokens (the rest of the context where params leave it unset, as vLLM's engine does)."""
        check_token_ids(prompt_token_ids, self.vocab_size)
        # the API has refused a max_tokens past the context already (api/sampling.py), as vLLM's server does
        max_tokens = resolve_max_tokens(params.max_tokens, len(prompt_token_ids), self.max_model_len, clamp=True)
        try:
            params.validate()
            if params.bad_words and params.bad_words_token_ids is None:
                params.bad_words_token_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
            params.validate_vocab(self.vocab_size)
        except ParamError as exc:
            raise RequestError(str(exc), exc.param) from None
        spec = params.structured_outputs
        if spec is not None and not spec.is_checked:
            from deltaserve.engine.grammar import GrammarError, check_structured_outputs

            try:
                check_structured_outputs(spec)
            except GrammarError as exc:
                raise RequestError(str(exc), exc.param) from None
        return max_tokens

    def new_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        mm_input: MultimodalInput | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> list[EngineCoreRequest]:
        """Validates a request, registers its state and returns its core requests (n of them). cache_salt: vLLM's
        per-request prefix-cache salt (a non-empty string, or None); arrival_time: vLLM's (None: now)."""
        check_priority(priority, self.scheduling_policy)
        check_cache_salt(cache_salt)
        max_tokens = self.validate(prompt_token_ids, params)
        if mm_input is not None:
            if self.mm_processor is None:
                raise RequestError("this model serves text only (no vision tower): images and videos are refused")
            if not env.fuse_attn_preamble():
                # the four-op preamble has no MRoPE spelling: it would fail the whole batch mid-step
                raise RequestError(
                    "images and videos need 3-D MRoPE positions, which only the fused attention preamble applies; "
                    "unset DELTASERVE_FUSE_ATTN_PREAMBLE=0 to serve them"
                )
            if mm_input.prompt_len != len(prompt_token_ids):
                raise RequestError(f"the multimodal input covers {mm_input.prompt_len} tokens, the prompt has "
                                   f"{len(prompt_token_ids)}")  # fmt: skip
        thinking = self._thinking_start(prompt_token_ids, params)
        now = time.time() if arrival_time is None else arrival_time
        state = RequestState(request_id, prompt, list(prompt_token_ids), params, [], arrival_time=now)
        core_requests = []
        for index in range(params.n):
            core_id = request_id if params.n == 1 else f"{request_id}#{index}"
            seed = None if params.seed is None else child_seed(params.seed, index)
            # The n sequences share the prompt: only the first computes its logprobs (RequestState reports those).
            # A count of -1 (the whole vocabulary) is resolved here, once for every caller: the runner reads -1 as
            # "not asked".
            prompt_logprobs = resolve_num_logprobs(params.prompt_logprobs, self.vocab_size) if index == 0 else None
            logprobs = resolve_num_logprobs(params.logprobs, self.vocab_size)
            # A shallow copy, as vLLM's ParentRequest makes: the parent is validated above, and dataclasses.replace
            # would validate each child again on the event loop (n x a full-vocabulary logit_bias held it ~30 s).
            child = copy.copy(params)
            child.n, child.seed, child.logprobs, child.prompt_logprobs = 1, seed, logprobs, prompt_logprobs
            detokenizer = (
                IncrementalDetokenizer(self.tokenizer, list(prompt_token_ids), params)
                if params.detokenize
                else TokenIdsOnly()
            )
            state.sequences.append(SequenceProgress(core_id, detokenizer, logprobs=new_logprobs(params.flat_logprobs)))
            core_requests.append(
                EngineCoreRequest(
                    core_id,
                    tuple(prompt_token_ids),
                    child,
                    max_tokens,
                    self.eos_token_ids,
                    now,
                    mm_input,
                    priority=priority,
                    cache_salt=cache_salt,
                    eos_token_id=self.tokenizer.eos_token_id,
                    thinking=thinking,
                )
            )
        self.processor.add(state)
        return core_requests

    def _thinking_start(self, prompt_token_ids: list[int], params: SamplingParams) -> ThinkingStart | None:
        """A budgeted request's markers and its prompt's open thinking section; vLLM's refusal where the engine has
        no markers (neither --reasoning-parser nor --reasoning-config gives both strings)."""
        if params.thinking_token_budget is None:
            return None
        if self.reasoning_markers is None:
            raise RequestError(NOT_CONFIGURED)
        return ThinkingStart(self.reasoning_markers, open_section(prompt_token_ids, self.reasoning_markers))

    def prefill_request(
        self,
        request_id: str,
        token_ids: list[int],
        prefill_chunks: list[int] | None = None,
        mm_input: MultimodalInput | None = None,
    ) -> EngineCoreRequest:
        """A prefill-only core request (LLMEngine.prefill_logits): token_ids in prefill chunks of the given sizes
        (default: one chunk of everything), then the remaining tokens one at a time, nothing sampled. The media
        refusals of new_request do not apply: with the four-op preamble the model's own check refuses 3-D
        positions, and the media gate checks that it does."""
        check_token_ids(token_ids, self.vocab_size)
        if not token_ids or len(token_ids) > self.max_model_len:
            raise RequestError(f"prefill_logits takes 1 to {self.max_model_len} tokens, got {len(token_ids)}")
        chunks = list(prefill_chunks or [len(token_ids)])
        if sum(chunks) > len(token_ids) or min(chunks) < 1:
            raise RequestError(f"prefill chunks {chunks} do not fit {len(token_ids)} tokens")
        chunks += [1] * (len(token_ids) - sum(chunks))
        params = SamplingParams(temperature=0.0, max_tokens=1)
        return EngineCoreRequest(
            request_id, tuple(token_ids), params, 1, frozenset(), time.time(), mm_input, logits_chunks=tuple(chunks)
        )
