"""POST /v1/chat/completions/derender and /v1/completions/derender: vLLM 0.26's derender routes (its scale_out/
derender), which turn what /inference/v1/generate answered back into a chat or completions body, without a model.

The chat route takes {model, generate_response, prompt_tokens?, chat_request?}: each choice's token ids become the
assistant message (with chat_request, through the chat route's own reasoning and tool-call parsing, the request's
template rendered to know whether the prompt opened a thinking block; without it, the text decoded with special
tokens skipped, as vLLM's), its "token_id:N" logprobs are named by their text again (a token that decodes to a
partial UTF-8 character is decoded with up to four tokens before it, as vLLM does), and the finish reason is the one
given. The completions route takes {model, generate_responses, prompt_tokens?, completion_request?}: one choice per
generated choice, numbered across the responses, logprobs in completions' parallel lists. Bodies are vLLM's response
models serialised whole; vLLM's bounds on the payload (token ids and logprob entries within max_model_len, top
logprobs within --max-logprobs, at most 16,384 responses or choices) are checked first, in its words. The decoding
runs on the large-input pool, never on the event loop: a body of millions of token ids takes seconds to decode.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, model_validator

from deltaserve.api import serving_chat
from deltaserve.api.body import parse_body, parse_request
from deltaserve.api.chat import render_prompt
from deltaserve.api.chat_job import chat_job, collect_choices
from deltaserve.api.errors import bad_request
from deltaserve.api.protocol import APIModel, ChatCompletionRequest
from deltaserve.api.serving_common import check_model, usage
from deltaserve.api.settings import ServerState
from deltaserve.engine.detokenizer import REPLACEMENT_CHAR, decode_in_context
from deltaserve.engine.request import CompletionOutput, RequestOutput
from deltaserve.sampling_params import SamplingParams

MAX_RESPONSES = 16384  # vLLM's VLLM_MAX_N_SEQUENCES default: its bound on responses and on choices per response


class TopLogprob(APIModel):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class Logprobs(APIModel):
    content: list[TokenLogprob] | None = None


class GeneratedChoice(APIModel):
    index: int
    logprobs: Logprobs | None = None
    finish_reason: str | None = "stop"
    token_ids: list[int] | None = None


class GenerateResponse(APIModel):
    """vLLM's GenerateResponse, as /inference/v1/generate answers it (the fields derender reads)."""

    request_id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    choices: list[GeneratedChoice]
    prompt_logprobs: list[Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None


class DerenderChatRequest(APIModel):
    model: str
    generate_response: GenerateResponse
    prompt_tokens: int | None = None
    chat_request: dict[str, Any] | None = None


class DerenderCompletionRequest(APIModel):
    model: str
    generate_responses: list[GenerateResponse]
    prompt_tokens: list[int] | None = None
    completion_request: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_count_per_response(self) -> DerenderCompletionRequest:
        if self.prompt_tokens is not None and len(self.prompt_tokens) != len(self.generate_responses):
            raise ValueError(
                f"prompt_tokens length ({len(self.prompt_tokens)}) must equal generate_responses length "
                f"({len(self.generate_responses)})"
            )  # vLLM's words
        return self


def check_bounds(state: ServerState, responses: list[GenerateResponse]) -> None:
    """vLLM's payload bounds, before any decoding (its _validate_derender_bounds, in its words)."""
    max_len, max_logprobs = state.engine.max_model_len, state.settings.max_logprobs
    if len(responses) > MAX_RESPONSES:
        raise bad_request(
            f"generate_responses count ({len(responses)}) exceeds server maximum ({MAX_RESPONSES}). Set "
            "VLLM_MAX_N_SEQUENCES to increase this limit."
        )
    for gen in responses:
        if len(gen.choices) > MAX_RESPONSES:
            raise bad_request(
                f"choices count ({len(gen.choices)}) in response '{gen.request_id}' exceeds server maximum "
                f"({MAX_RESPONSES})."
            )
        for choice in gen.choices:
            if choice.token_ids and len(choice.token_ids) > max_len:
                raise bad_request(
                    f"token_ids length ({len(choice.token_ids)}) in choice {choice.index} exceeds max_model_len "
                    f"({max_len})."
                )
            content = choice.logprobs.content if choice.logprobs is not None else None
            if content and len(content) > max_len:
                raise bad_request(
                    f"logprobs.content length ({len(content)}) in choice {choice.index} exceeds max_model_len "
                    f"({max_len})."
                )
            for entry in content or []:
                if max_logprobs >= 0 and len(entry.top_logprobs) > max_logprobs:
                    raise bad_request(
                        f"top_logprobs count ({len(entry.top_logprobs)}) in choice {choice.index} exceeds "
                        f"max_logprobs ({max_logprobs})."
                    )
        if gen.prompt_logprobs and len(gen.prompt_logprobs) > max_len:
            raise bad_request(
                f"prompt_logprobs length ({len(gen.prompt_logprobs)}) in response '{gen.request_id}' exceeds "
                f"max_model_len ({max_len})."
            )
    for gen in responses:
        for choice in gen.choices:
            if not choice.token_ids:
                raise bad_request(f"choice {choice.index} has empty or null token_ids")  # vLLM's words


class TokenNames:
    """ "token_id:N" back to the token's text and UTF-8 bytes (vLLM's resolve_token_id_placeholder)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size

    @staticmethod
    def token_id(name: str) -> int | None:
        digits = name.removeprefix("token_id:")
        if digits == name:
            return None
        try:
            return int(digits)
        except ValueError:
            return None

    def text(self, name: str, context: list[int]) -> tuple[str, list[int] | None]:
        token_id = self.token_id(name)
        if token_id is None:
            return name, None  # not a placeholder: kept as given
        if not 0 <= token_id < self.vocab_size:
            return "", None
        piece = self.tokenizer.convert_tokens_to_string(self.tokenizer.convert_ids_to_tokens([token_id]))
        if piece.endswith(REPLACEMENT_CHAR):
            # a partial UTF-8 character: what it adds after up to four tokens before it, as vLLM
            piece = decode_in_context(self.tokenizer, token_id, context[-4:])
        return piece, list(piece.encode("utf-8", errors="replace"))

    def chat_logprobs(self, logprobs: Logprobs) -> dict[str, Any]:
        """Chat's logprobs with every placeholder named by its text (the sampled tokens so far as context)."""
        if logprobs.content is None:
            return {"content": None}
        context: list[int] = []
        content = []
        for entry in logprobs.content:
            token, data = self.text(entry.token, context)
            top = []
            for each in entry.top_logprobs:
                name, raw = self.text(each.token, context)
                top.append({"token": name, "logprob": each.logprob, "bytes": raw})
            content.append({"token": token, "logprob": entry.logprob, "bytes": data, "top_logprobs": top})
            sampled = self.token_id(entry.token)
            if sampled is not None:
                context.append(sampled)
        return {"content": content}


def completion_choices(state: ServerState, responses: list[GenerateResponse]) -> list[dict[str, Any]]:
    """Every generated choice as a completions choice, numbered across the responses (decoding: off the loop)."""
    names = TokenNames(state.engine.tokenizer, state.vocab_size)
    decode = state.engine.tokenizer.decode
    choices: list[dict[str, Any]] = []
    for gen in responses:
        for choice in gen.choices:
            logprobs = completion_logprobs(names.chat_logprobs(choice.logprobs)) if choice.logprobs else None
            choices.append({"index": len(choices), "text": decode(choice.token_ids or [], skip_special_tokens=True),
                            "logprobs": logprobs, "finish_reason": choice.finish_reason, "stop_reason": None,
                            "token_ids": None, "prompt_logprobs": None, "prompt_token_ids": None,
                            "routed_experts": None})  # fmt: skip
    return choices


def completion_logprobs(chat: dict[str, Any]) -> dict[str, Any]:
    """Chat's per-token logprobs as completions' parallel lists (vLLM's conversion: offsets by token length)."""
    merged: dict[str, list[Any]] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    offset = 0
    for entry in chat["content"] or []:
        merged["text_offset"].append(offset)
        merged["tokens"].append(entry["token"])
        merged["token_logprobs"].append(entry["logprob"])
        top = {each["token"]: each["logprob"] for each in entry["top_logprobs"]}
        merged["top_logprobs"].append(top or None)
        offset += len(entry["token"])
    return merged


async def derender_chat(state: ServerState, raw_request: Request) -> Response:
    request = await parse_request(state, raw_request, DerenderChatRequest)
    check_model(state, request.model)
    gen = request.generate_response
    check_bounds(state, [gen])
    names = TokenNames(state.engine.tokenizer, state.vocab_size)
    if request.chat_request is None:
        # decoding a large payload takes seconds: on the large-input pool, never on the event loop
        messages = await state.tokens.run_large(
            lambda: {choice.index: plain_message(state, choice.token_ids or []) for choice in gen.choices}
        )
    else:
        messages = await parsed_messages(state, parse_body(ChatCompletionRequest, request.chat_request), gen)
    logprobs = await state.tokens.run_large(
        lambda: [names.chat_logprobs(c.logprobs) if c.logprobs is not None else None for c in gen.choices]
    )
    choices = [
        {"index": choice.index, "message": messages[choice.index], "logprobs": logprobs[i],
         "finish_reason": choice.finish_reason, "stop_reason": None, "token_ids": None, "routed_experts": None}
        for i, choice in enumerate(gen.choices)
    ]  # fmt: skip
    num_generated = sum(len(choice.token_ids or []) for choice in gen.choices)
    body = {"id": gen.request_id, "object": "chat.completion", "created": int(time.time()), "model": request.model,
            "choices": choices, "service_tier": None, "system_fingerprint": None,
            "usage": usage(request.prompt_tokens or 0, num_generated), "prompt_logprobs": gen.prompt_logprobs,
            "prompt_token_ids": None, "prompt_text": None, "kv_transfer_params": gen.kv_transfer_params,
            "ec_transfer_params": None, "metrics": None}  # fmt: skip
    return JSONResponse(body)


def plain_message(state: ServerState, token_ids: list[int]) -> dict[str, Any]:
    """vLLM's message without parsing: the text with special tokens skipped."""
    text = state.engine.tokenizer.decode(token_ids, skip_special_tokens=True)
    return {"role": "assistant", "content": text, "refusal": None, "annotations": None, "audio": None,
            "function_call": None, "reasoning": None}  # fmt: skip


async def parsed_messages(
    state: ServerState, request: ChatCompletionRequest, gen: GenerateResponse
) -> dict[int, dict[str, Any]]:
    """Each choice's message as the chat route builds it for these tokens: the request's checks and template (whether
    its prompt opens a thinking block), its reasoning and tool-call parsing."""
    _, tool_choice = await serving_chat.validate(state, request)
    prompt = await render_prompt(state, request)
    if prompt.mm_input is not None:
        raise bad_request("Derendering a chat with images or videos is not supported.", "chat_request")
    tokenizer = state.engine.tokenizer

    def decoded() -> list[CompletionOutput]:
        sequences = []
        for choice in gen.choices:
            ids = list(choice.token_ids or [])
            text = tokenizer.decode(ids, skip_special_tokens=request.skip_special_tokens)
            sequences.append(CompletionOutput(choice.index, text, ids, finish_reason=choice.finish_reason or "stop"))
        return sequences

    sequences = await state.tokens.run_large(decoded)  # off the event loop, as the plain path

    async def outputs() -> AsyncGenerator[RequestOutput, None]:
        yield RequestOutput(gen.request_id, prompt.text, prompt.token_ids, sequences, finished=True)

    # no logprobs asked of the job: the given ones are named separately (chat_logprobs)
    job = chat_job(state, request, prompt, SamplingParams(), tool_choice, gen.request_id, "assistant", "", outputs())
    result = await collect_choices(job)
    return {choice["index"]: choice["message"] for choice in result.choices}


async def derender_completion(state: ServerState, raw_request: Request) -> Response:
    request = await parse_request(state, raw_request, DerenderCompletionRequest)
    check_model(state, request.model)
    if not request.generate_responses:
        raise bad_request("generate_responses must not be empty")  # vLLM's words
    check_bounds(state, request.generate_responses)
    choices = await state.tokens.run_large(completion_choices, state, request.generate_responses)
    num_generated = sum(len(choice.token_ids or []) for gen in request.generate_responses for choice in gen.choices)
    first = request.generate_responses[0]
    transfer = first.kv_transfer_params
    if any(gen.kv_transfer_params != transfer for gen in request.generate_responses[1:]):
        transfer = None  # vLLM's rule: differing parameters are not aggregated
    num_prompt = sum(request.prompt_tokens or [])
    body = {"id": first.request_id, "object": "text_completion", "created": int(time.time()), "model": request.model,
            "choices": choices, "service_tier": None, "system_fingerprint": None,
            "usage": usage(num_prompt, num_generated), "kv_transfer_params": transfer, "ec_transfer_params": None,
            "metrics": None}  # fmt: skip
    return JSONResponse(body)
