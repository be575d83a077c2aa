"""POST /inference/v1/generate: vLLM 0.26's tokens-in, tokens-out route (its scale_out/token_in_token_out), which
RL frameworks and disaggregated front ends call with prompts they tokenised themselves.

The body is {token_ids, sampling_params (vLLM's SamplingParams as JSON), request_id?, model?, stream?,
stream_options?, cache_salt?, priority?}; the reply carries token ids, never text: choices of {index, logprobs,
finish_reason, token_ids, routed_experts} (logprobs in chat's shape, each token named "token_id:N"), usage, and
prompt_logprobs. As in vLLM: sampling_params keys it does not know are ignored (logged here), an unset max_tokens is
the rest of the context (a generation_config max_new_tokens caps it), the server's generation_config defaults are not
applied to the other fields, with a reasoning parser a constraint starts after `</think>` when the prompt leaves a
thinking block open (chat's rule, which vLLM's engine applies on every route), the response id is
"generate-tokens-" + X-Request-Id (or the body's request_id), and a stream sends only choices with new tokens and,
with include_usage, a final usage chunk. `features` (pre-rendered multimodal inputs in vLLM's own serialisation) is
refused by name; kv_transfer_params / ec_transfer_params need a connector deltaserve does not have and are logged, as
vLLM without one ignores them.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import fields
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, field_validator

from deltaserve.api.body import parse_request
from deltaserve.api.errors import bad_request
from deltaserve.api.logprobs import prompt_logprobs_json
from deltaserve.api.protocol import APIModel, StreamOptions
from deltaserve.api.reasoning import THINK_END, THINK_START
from deltaserve.api.sampling import check_logprobs_cap
from deltaserve.api.serving_common import (
    DONE_EVENT,
    check_model,
    check_token_ids,
    engine_request_id,
    engine_stream,
    prompt_details,
    request_ids,
    respond,
    sse,
    stream_error_event,
    stream_usage_flags,
    usage,
    without_none,
)
from deltaserve.api.settings import MAX_N, ServerState
from deltaserve.engine.frontend import RequestError, check_cache_salt, check_priority, resolve_max_tokens
from deltaserve.engine.request import CompletionOutput, Logprob
from deltaserve.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)

LOWEST_LOGPROB = -9999.0  # vLLM's floor for a logprob in JSON (-inf has no JSON spelling)
# SamplingParams fields a request may set: vLLM's public ones. bad_words_token_ids is private in vLLM (the engine
# fills it from bad_words); output_text_buffer_length (streamed text) and routed_experts_prompt_start (routed-expert
# capture) are vLLM's and change no token here
SETTABLE = frozenset(f.name for f in fields(SamplingParams)) - {"bad_words_token_ids"}
NO_EFFECT = frozenset({"output_text_buffer_length", "routed_experts_prompt_start"})


class GenerateRequest(APIModel):
    """vLLM's GenerateRequest (the fields a text model reads; its render-side fields pass through)."""

    request_id: str | None = None
    token_ids: list[int] = Field(min_length=1)
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    priority: int = Field(default=0, ge=-(2**63), le=2**63 - 1)
    features: dict[str, Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None

    @field_validator("token_ids")
    @classmethod
    def _non_negative(cls, value: list[int]) -> list[int]:
        if any(token < 0 for token in value):
            raise ValueError("token_ids must not contain negative values")  # vLLM's words
        return value


def build_params(state: ServerState, request: GenerateRequest) -> SamplingParams:
    """The request's SamplingParams: vLLM's keys, its unset max_tokens resolved; any error a 400."""
    given = dict(request.sampling_params)
    unknown = sorted(set(given) - SETTABLE - NO_EFFECT)
    if unknown:
        logger.warning("sampling_params fields ignored (not SamplingParams fields): %s", unknown)
    values = {name: value for name, value in given.items() if name in SETTABLE}
    try:
        if isinstance(values.get("structured_outputs"), dict):
            # vLLM's private keys (`_backend`, ...) may ride along in a vLLM-rendered body: not fields of the request
            spec = {key: value for key, value in values["structured_outputs"].items() if not key.startswith("_")}
            values["structured_outputs"] = StructuredOutputsParams(**spec)
        if isinstance(values.get("output_kind"), int):
            values["output_kind"] = RequestOutputKind(values["output_kind"])
        params = SamplingParams(**values)
    except (TypeError, ValueError) as exc:
        raise bad_request(f"sampling_params: {exc}", getattr(exc, "param", None) or "sampling_params") from None
    if not 1 <= params.n <= MAX_N:
        raise bad_request(f"sampling_params.n must be between 1 and {MAX_N}, got {params.n}.", "n")
    try:
        if "max_tokens" not in given or params.max_tokens is None:
            cap = (state.engine.default_sampling or {}).get("max_tokens")
            params.max_tokens = resolve_max_tokens(
                None, len(request.token_ids), state.engine.max_model_len, cap, "token_ids"
            )
        check_priority(request.priority, state.settings.scheduling_policy)
        check_cache_salt(request.cache_salt)
    except RequestError as exc:
        raise bad_request(str(exc), exc.param) from None
    check_logprobs_cap(params.logprobs, params.prompt_logprobs, state)
    constraint = params.structured_outputs
    if constraint is not None and state.settings.reasoning_parser and opens_thinking(state, request.token_ids):
        # vLLM's engine leaves the reasoning section unconstrained on every route (its structured-output manager
        # asks the reasoning parser whether the prompt ended reasoning); chat's rule, on the token ids
        constraint.start_after_token_id = state.engine.tokenizer.convert_tokens_to_ids(THINK_END)
    return params


def opens_thinking(state: ServerState, token_ids: list[int]) -> bool:
    """The prompt's last `<think>` comes after its last `</think>` (chat's prompt_opens_thinking on token ids)."""
    tokenizer = state.engine.tokenizer
    start, end = tokenizer.convert_tokens_to_ids(THINK_START), tokenizer.convert_tokens_to_ids(THINK_END)
    for token in reversed(token_ids):
        if token == start:
            return True
        if token == end:
            return False
    return False


async def generate(state: ServerState, raw_request: Request) -> Response:
    """One tokens-in request, top to bottom: parse, check, SamplingParams, submit, respond."""
    arrival = time.perf_counter()
    request = await parse_request(state, raw_request, GenerateRequest)
    check_model(state, request.model)
    if request.features is not None:
        raise bad_request(
            "features is not supported: pre-rendered multimodal inputs come in vLLM's own serialisation; send "
            "images through /v1/chat/completions.",
            "features",
        )
    if request.kv_transfer_params or request.ec_transfer_params:
        logger.warning(
            "kv_transfer_params / ec_transfer_params ignored: no KV or encoder-cache connector is configured"
        )
    check_token_ids(state, request.token_ids, "token_ids")
    params = build_params(state, request)
    response_id = request_ids(raw_request, request.request_id, "generate-tokens")
    stream = engine_stream(
        state, request.token_ids, params, engine_request_id(response_id, 0), arrival, priority=request.priority,
        cache_salt=request.cache_salt,
    )  # fmt: skip
    job = GenerateJob(state, request, params, response_id, stream)
    return await respond(state, raw_request, bool(request.stream), job.stream_events, job.full)


def token_logprobs(token_ids: list[int], entries: Any, num_top: int | None) -> dict[str, list[dict[str, Any]]] | None:
    """vLLM's _create_tokens_logprobs: chat's logprobs shape with every token named "token_id:N", the step's first
    max(num_top, 1) entries as top_logprobs (the sampled token's first: vLLM's quirk, -1 too gives one)."""
    if num_top is None or entries is None:
        return None
    content = []
    for token_id, step in zip(token_ids, entries, strict=False):
        name = f"token_id:{token_id}"
        chosen: Logprob | None = step.get(token_id) if step else None
        if chosen is None:
            content.append({"token": name, "logprob": LOWEST_LOGPROB, "bytes": None, "top_logprobs": []})
            continue
        top = [
            {"token": f"token_id:{tok}", "logprob": max(entry.logprob, LOWEST_LOGPROB), "bytes": None}
            for rank, (tok, entry) in enumerate(step.items())
            if rank < max(num_top, 1)
        ]
        content.append({"token": name, "logprob": max(chosen.logprob, LOWEST_LOGPROB), "bytes": None,
                        "top_logprobs": top})  # fmt: skip
    return {"content": content}


class GenerateJob:
    """A submitted tokens-in request and what its response needs."""

    def __init__(
        self, state: ServerState, request: GenerateRequest, params: SamplingParams, response_id: str, stream: Any
    ) -> None:
        self.state, self.request, self.params, self.response_id, self.stream = (
            state,
            request,
            params,
            response_id,
            stream,
        )
        self.num_cached_tokens = 0

    def usage(self, num_generated: int) -> dict[str, Any]:
        details = prompt_details(self.num_cached_tokens) if self.state.settings.enable_prompt_tokens_details else None
        return usage(len(self.request.token_ids), num_generated, prompt_tokens_details=details)

    def choice(self, seq: CompletionOutput, token_ids: list[int], finish_reason: str | None) -> dict[str, Any]:
        logprobs = token_logprobs(token_ids, seq.logprobs, self.params.logprobs)
        return {"index": seq.index, "logprobs": logprobs, "finish_reason": finish_reason, "token_ids": token_ids,
                "routed_experts": None}  # fmt: skip

    async def full(self) -> Response:
        sequences: dict[int, CompletionOutput] = {}
        prompt_logprobs = None
        async with contextlib.aclosing(self.stream) as outputs:
            async for output in outputs:
                self.num_cached_tokens = output.num_cached_tokens
                if output.prompt_logprobs is not None:
                    prompt_logprobs = output.prompt_logprobs
                for seq in output.outputs:
                    known = sequences.get(seq.index)
                    if known is None:
                        sequences[seq.index] = CompletionOutput(seq.index, "", list(seq.token_ids),
                                                                logprobs=list(seq.logprobs or []) or None,
                                                                finish_reason=seq.finish_reason)  # fmt: skip
                        continue
                    known.token_ids.extend(seq.token_ids)
                    if seq.logprobs:
                        known.logprobs = [*(known.logprobs or []), *seq.logprobs]
                    known.finish_reason = seq.finish_reason
        choices = [self.choice(seq, seq.token_ids, seq.finish_reason or "stop") for _, seq in sorted(sequences.items())]
        num_generated = sum(len(seq.token_ids) for seq in sequences.values())
        body = {"request_id": self.response_id, "model": self.state.settings.model_name, "created": int(time.time()),
                "choices": choices, "usage": self.usage(num_generated),
                "prompt_logprobs": prompt_logprobs_json(prompt_logprobs), "kv_transfer_params": None,
                "ec_transfer_params": None}  # fmt: skip
        return JSONResponse(body)

    async def stream_events(self) -> Any:
        include_usage, is_continuous = stream_usage_flags(self.request.stream_options)
        num_generated: dict[int, int] = {}
        try:
            async with contextlib.aclosing(self.stream) as outputs:
                async for output in outputs:
                    self.num_cached_tokens = output.num_cached_tokens
                    for seq in output.outputs:
                        num_generated[seq.index] = num_generated.get(seq.index, 0) + len(seq.token_ids)
                        if not seq.token_ids:
                            continue  # vLLM sends only choices with new tokens
                        chunk = {"request_id": self.response_id,
                                 "choices": [self.choice(seq, list(seq.token_ids), seq.finish_reason)],
                                 "usage": None}  # fmt: skip
                        if is_continuous:
                            chunk["usage"] = without_none(usage(len(self.request.token_ids), num_generated[seq.index]))
                        yield sse(chunk)
            if include_usage:
                final = {"request_id": self.response_id, "choices": []}
                yield sse(final | {"usage": without_none(self.usage(sum(num_generated.values())))})
        except Exception as exc:
            yield stream_error_event(exc)
        yield DONE_EVENT
