"""POST /v1/chat/completions/render and /v1/completions/render: vLLM 0.26's render routes (its scale_out/render),
which turn a chat or completions request into what POST /inference/v1/generate takes, without generating.

A client renders once (the chat template, the tokens, the SamplingParams the route would build: the generation_config
defaults and max_tokens applied), may edit the token ids, and posts the result to the generate route. The chat route
answers one GenerateRequest, the completions route a list (one per prompt), each serialised as vLLM's: {request_id
("chatcmpl-" / "cmpl-" and a fresh id), token_ids, assistant_tokens_mask, token_offsets, features, sampling_params,
model, stream, stream_options (only with stream), cache_salt, priority, kv_transfer_params, ec_transfer_params}, with
sampling_params in vLLM's msgspec form: only the fields that differ from SamplingParams' defaults. Every check of
the route it renders for applies, in its words (the same functions run); beam search is refused as vLLM refuses it
here. Not served: prompts with images or videos (vLLM sends their processed inputs as `features` in its own
serialisation, which the generate route would need back), refused by name; assistant_tokens_mask and token_offsets
(vLLM fills them only on request, from templates with generation markers and fast tokenizers) are null.
"""

from __future__ import annotations

import dataclasses
import enum
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from deltaserve.api import serving_chat, serving_completion
from deltaserve.api.body import parse_request
from deltaserve.api.chat import render_prompt
from deltaserve.api.errors import bad_request
from deltaserve.api.protocol import ChatCompletionRequest, CompletionRequest
from deltaserve.api.sampling import cache_salt_of, tokenize_bad_words
from deltaserve.api.settings import ServerState
from deltaserve.sampling_params import SamplingParams, StructuredOutputsParams

# SamplingParams fields vLLM keeps private (the engine fills them), never rendered
PRIVATE_FIELDS = frozenset({"bad_words_token_ids"})
# vLLM's StructuredOutputsParams fields (deltaserve's own, start_after_token_id and is_checked, stay server-side:
# the generate route derives the first from the prompt)
STRUCTURED_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace",
                     "disable_additional_properties", "whitespace_pattern", "structural_tag")  # fmt: skip


def _builtin(value: Any) -> Any:
    """A field value as msgspec's to_builtins writes it: enums by value, nested dataclasses as dicts."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, StructuredOutputsParams):
        return {name: getattr(value, name) for name in STRUCTURED_FIELDS}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value


def sampling_json(params: SamplingParams) -> dict[str, Any]:
    """vLLM's SamplingParams as its render serialises it (msgspec, omit_defaults): the fields that differ from their
    declared defaults."""
    found: dict[str, Any] = {}
    for spec in dataclasses.fields(params):
        if spec.name in PRIVATE_FIELDS:
            continue
        value = getattr(params, spec.name)
        default = spec.default_factory() if spec.default_factory is not dataclasses.MISSING else spec.default
        if value != default:
            found[spec.name] = _builtin(value)
    return found


def generate_request(
    prefix: str, token_ids: list[int], params: SamplingParams, request: ChatCompletionRequest | CompletionRequest
) -> dict[str, Any]:
    """One rendered request in vLLM's GenerateRequest field order."""
    is_stream = bool(request.stream)
    options = request.stream_options.model_dump() if is_stream and request.stream_options is not None else None
    return {"request_id": f"{prefix}-{uuid.uuid4().hex}", "token_ids": token_ids, "assistant_tokens_mask": None,
            "token_offsets": None, "features": None, "sampling_params": sampling_json(params), "model": request.model,
            "stream": is_stream, "stream_options": options, "cache_salt": cache_salt_of(request),
            "priority": request.priority, "kv_transfer_params": None, "ec_transfer_params": None}  # fmt: skip


def _no_beam_search(request: ChatCompletionRequest | CompletionRequest) -> None:
    if request.use_beam_search:
        raise bad_request("Beam search is not supported by the render endpoint", "use_beam_search")  # vLLM's words


async def render_chat(state: ServerState, raw_request: Request) -> Response:
    """The chat route's steps up to its submit: parse, validate, render, SamplingParams."""
    request = await parse_request(state, raw_request, ChatCompletionRequest)
    _no_beam_search(request)  # first, as vLLM's render checks it before the chat route's checks
    constraint, _ = await serving_chat.validate(state, request)
    prompt = await render_prompt(state, request)
    if prompt.mm_input is not None:
        raise bad_request(
            "Rendering prompts with images or videos is not supported: their processed inputs would go in "
            "`features`, in vLLM's own serialisation. Send them to /v1/chat/completions.",
            "messages",
        )
    bad_words = await tokenize_bad_words(state, request)
    params = serving_chat.sampling_params(state, request, prompt, constraint, bad_words)
    return JSONResponse(generate_request("chatcmpl", prompt.token_ids, params, request))


async def render_completion(state: ServerState, raw_request: Request) -> Response:
    """The completions route's steps up to its submit: one rendered request per prompt."""
    request = await parse_request(state, raw_request, CompletionRequest)
    _no_beam_search(request)
    constraint = await serving_completion.validate(state, request)
    prompts = await serving_completion.resolve_prompts(state, request)
    params = await serving_completion.build_params(state, request, prompts, constraint)
    rendered = [
        generate_request("cmpl", prompt.token_ids, each, request) for prompt, each in zip(prompts, params, strict=True)
    ]
    return JSONResponse(rendered)
