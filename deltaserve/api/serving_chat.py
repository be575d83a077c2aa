"""POST /v1/chat/completions: template the messages, generate, parse reasoning and tool calls, stream or not.

create_chat_completion reads top to bottom: parse (body.py), validate (every field check; the constraint parsed by
structured.py), render (chat.render_prompt: template, tokens, media), SamplingParams (sampling.py: max_tokens and
the length rules, once), submit (serving_common.engine_stream), respond (streamed or not).

Streaming follows vLLM's chunk pattern: when a choice's first token exists, a role chunk
(`{"role": "assistant", "content": ""}`), with `echo` the continued message's text, and then its deltas; never a
chunk before the first token, so a client's TTFT is honest. Usage goes in a final `choices: []` chunk only with
stream_options.include_usage (on every chunk too with continuous_usage_stats), as vLLM's should_include_usage
decides. `echo` prepends the final message's content when its role is the response's role (the assistant turn
that continue_final_message continues); the response role is --response-role, or the final message's role when
add_generation_prompt is false.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import Response

from deltaserve.api.body import parse_request
from deltaserve.api.chat import ChatPrompt, check_request_template, check_tool_choice, content_text, render_prompt
from deltaserve.api.chat_job import ChatJob, chat_job, collect_choices
from deltaserve.api.chat_output import ChoiceProcessor, merge_deltas
from deltaserve.api.json_body import JSONPiecesResponse, render_json
from deltaserve.api.logprobs import prompt_logprobs_json
from deltaserve.api.protocol import ChatCompletionRequest
from deltaserve.api.reasoning import THINK_END, prompt_opens_thinking
from deltaserve.api.sampling import (
    build_sampling_params,
    cache_salt_of,
    check_sampling_request,
    sample_logprobs,
    tokenize_bad_words,
)
from deltaserve.api.serving_common import (
    DONE_EVENT,
    check_model,
    engine_request_id,
    engine_stream,
    request_ids,
    respond,
    sse,
    stream_error_event,
    stream_usage_flags,
    usage,
    without_none,
)
from deltaserve.api.settings import ServerState
from deltaserve.api.structured import resolve_chat_constraint
from deltaserve.sampling_params import SamplingParams, StructuredOutputsParams


async def create_chat_completion(
    state: ServerState, raw_request: Request, body: tuple[dict[str, Any], bool] | None = None
) -> Response:
    """One chat request, top to bottom: parse, validate, render, SamplingParams, submit, respond."""
    arrival = time.perf_counter()
    request = await parse_request(state, raw_request, ChatCompletionRequest, body)
    constraint, tool_choice = await validate(state, request)
    prompt = await render_prompt(state, request)
    params = sampling_params(state, request, prompt, constraint, await tokenize_bad_words(state, request))
    response_id = request_ids(raw_request, request.request_id, "chatcmpl")
    role = response_role(state, request)
    job = submit(state, request, prompt, params, tool_choice, response_id, arrival, role, echo_prefix(request, role))
    return await respond(state, raw_request, bool(request.stream), lambda: stream_chat(job), lambda: full_chat(job))


def submit(
    state: ServerState,
    request: ChatCompletionRequest,
    prompt: ChatPrompt,
    params: SamplingParams,
    tool_choice: str | None,
    response_id: str,
    arrival: float,
    role: str,
    echo_text: str,
    prompt_index: int = 0,
) -> ChatJob:
    """The request's engine stream (submitted on its first iteration) and the job that turns it into choices; the
    chat, batch chat and Responses handlers all end here (prompt_index: the conversation's place in a batch).

    tool_choice "none" (tool_choice None here; with no tools it is the default, and batch chat's only one) still runs
    the qwen3_coder parser when --enable-auto-tool-choice gave the server one: vLLM's DelegatingParser runs an
    engine-based tool parser then and returns its content without the calls (_extract_tool_calls and
    _extract_tool_calls_streaming in vllm/parser/abstract_parser.py). hermes is not engine-based: the text stays."""
    stream = engine_stream(
        state, prompt.token_ids, params, engine_request_id(response_id, prompt_index), arrival, prompt.mm_input,
        request.priority, cache_salt_of(request),
    )  # fmt: skip
    return chat_job(state, request, prompt, params, tool_choice, response_id, role, echo_text, stream)


async def validate(
    state: ServerState, request: ChatCompletionRequest
) -> tuple[StructuredOutputsParams | None, str | None]:
    """Every check of the request's fields, before any work (each a 400 naming its field): the model, the
    sampling fields, the template, the tools; then its constraint, parsed. Returns (the constraint, the effective
    tool_choice: None when tool calls are not parsed)."""
    check_model(state, request.model)
    check_sampling_request(state, request)
    check_request_template(state, request.chat_template, request.chat_template_kwargs)
    tool_choice = check_tool_choice(state, request.tools, request.tool_choice)
    constraint = await resolve_chat_constraint(request, tool_choice, state.settings.tool_call_parser)
    return constraint, tool_choice


def sampling_params(
    state: ServerState,
    request: ChatCompletionRequest,
    prompt: ChatPrompt,
    constraint: StructuredOutputsParams | None,
    bad_words_ids: list[list[int]] | None,
) -> SamplingParams:
    """The request's SamplingParams for the rendered prompt (max_tokens from max_completion_tokens, else
    max_tokens, else the rest of the context). bad_words_ids: sampling.tokenize_bad_words's."""
    if (
        constraint is not None
        and state.settings.reasoning_parser
        and not prompt.is_thinking_disabled
        and prompt_opens_thinking(prompt.text)
    ):
        # vLLM leaves the reasoning section unconstrained: the constraint starts after </think>
        constraint.start_after_token_id = state.engine.tokenizer.convert_tokens_to_ids(THINK_END)
    requested = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    return build_sampling_params(
        state,
        request,
        num_prompt_tokens=len(prompt.token_ids),
        max_tokens=requested,
        prompt_param="messages",
        logprobs=sample_logprobs(request),
        prompt_logprobs=request.prompt_logprobs,
        structured_outputs=constraint,
        bad_words_ids=bad_words_ids,
    )


def response_role(state: ServerState, request: ChatCompletionRequest) -> str:
    """vLLM's get_chat_request_role."""
    return state.settings.response_role if request.add_generation_prompt else request.messages[-1].role


def echo_prefix(request: ChatCompletionRequest, role: str) -> str:
    last = request.messages[-1]
    if not request.echo or last.role != role:
        return ""
    return content_text(last, len(request.messages) - 1) or ""


def _chunk(job: ChatJob, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": job.response_id, "object": "chat.completion.chunk", "created": job.created,
            "model": job.state.settings.model_name, "choices": choices}  # fmt: skip


def only_first_call(delta: dict[str, Any]) -> dict[str, Any]:
    """vLLM's parallel_tool_calls=false: every tool call after the first is dropped."""
    if "tool_calls" not in delta:
        return delta
    calls = [call for call in delta["tool_calls"] if call["index"] == 0]
    trimmed = {key: value for key, value in delta.items() if key != "tool_calls"}
    return {**trimmed, "tool_calls": calls} if calls else trimmed


def _choice(index: int, delta: dict[str, Any], logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": None if logprobs is None else {"content": logprobs},
            "finish_reason": None}  # fmt: skip


async def stream_chat(job: ChatJob) -> AsyncIterator[str]:
    include_usage, is_continuous = stream_usage_flags(
        job.request.stream_options, job.state.settings.enable_force_include_usage
    )
    processors: dict[int, ChoiceProcessor] = {}
    has_logprobs = job.num_top_logprobs is not None
    fingerprint = job.state.settings.system_fingerprint

    def event(choice: dict[str, Any], extra: dict[str, Any] | None = None) -> str:
        chunk = _chunk(job, [choice]) | (extra or {})
        if is_continuous:  # vLLM counts the chunk's own choice, not all n
            num_tokens = processors[choice["index"]].num_tokens
            chunk["usage"] = without_none(usage(job.num_prompt_tokens, num_tokens))
        return sse(chunk)

    try:
        async with contextlib.aclosing(job.stream) as stream:
            async for output in stream:
                job.note_output(output)
                for seq in output.outputs:
                    processor = processors.get(seq.index)
                    if processor is None:
                        processor = processors[seq.index] = job.new_processor(is_streamed=True)
                        yield event(_choice(seq.index, {"role": job.role, "content": ""}, None), first_extra(job))
                        if job.echo_text:
                            yield event(_choice(seq.index, {"content": job.echo_text}, None))
                    processor.count(seq.token_ids)
                    delta = processor.feed(seq.text)
                    if job.request.return_token_ids:
                        processor.pending_token_ids += seq.token_ids
                    processor.pending_logprobs += job.logprobs_of(seq)
                    if seq.finish_reason is None and not delta and not processor.is_plain:
                        continue  # everything is held back by a parser; its logprobs go with the next chunk
                    logprobs, processor.pending_logprobs = processor.pending_logprobs, []
                    choice = _choice(seq.index, delta, logprobs if has_logprobs else None)
                    if job.request.return_token_ids:
                        choice["token_ids"], processor.pending_token_ids = processor.pending_token_ids, []
                    if seq.finish_reason is not None:
                        choice["delta"] = merge_deltas(delta, processor.finish())
                        choice["finish_reason"] = processor.finish_reason(seq.finish_reason)
                        choice["stop_reason"] = seq.stop_reason
                    if job.request.parallel_tool_calls is False:
                        choice["delta"] = only_first_call(choice["delta"])
                        if not choice["delta"] and seq.finish_reason is None:
                            continue
                    # vLLM stamps the fingerprint on a choice's last chunk when no usage chunk follows
                    is_stamped = fingerprint is not None and seq.finish_reason is not None and not include_usage
                    yield event(choice, {"system_fingerprint": fingerprint} if is_stamped else None)
        if include_usage:
            chunk = _chunk(job, [])
            chunk["usage"] = without_none(job.usage(list(processors.values())))
            timing = job.timing(list(processors.values()))
            chunk |= without_none({"system_fingerprint": fingerprint, "metrics": timing and without_none(timing)})
            yield sse(chunk)
    except Exception as exc:
        yield stream_error_event(exc)
    yield DONE_EVENT


def first_extra(job: ChatJob) -> dict[str, Any] | None:
    """The fields a stream's first chunk of each choice adds, as vLLM's: the prompt's token ids (return_token_ids)
    and its rendered text (return_prompt_text)."""
    extra = {}
    if job.request.return_token_ids:
        extra["prompt_token_ids"] = job.prompt_token_ids
    if job.request.return_prompt_text:
        extra["prompt_text"] = job.prompt_text
    return extra or None


async def full_chat(job: ChatJob) -> JSONPiecesResponse:
    result = await collect_choices(job)
    # vLLM's response model serialised whole, in its field order: prompt_logprobs, prompt_token_ids, prompt_text and
    # metrics are null unless asked for; the transfer parameters of its KV / encoder-cache connectors always are here
    body = {"id": job.response_id, "object": "chat.completion", "created": job.created,
            "model": job.state.settings.model_name, "choices": result.choices, "service_tier": None,
            "system_fingerprint": job.state.settings.system_fingerprint, "usage": job.usage(result.processors),
            "prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None, "kv_transfer_params": None,
            "ec_transfer_params": None, "metrics": job.timing(result.processors)}  # fmt: skip

    def render() -> list[bytes]:
        # a long prompt's logprobs make a body of many MB: built and rendered off the event loop (json_body.py)
        if job.request.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs_json(result.prompt_logprobs)
        if job.request.return_token_ids:
            body["prompt_token_ids"] = job.prompt_token_ids
        if job.request.return_prompt_text:
            body["prompt_text"] = job.prompt_text
        return render_json(body)

    return JSONPiecesResponse(await anyio.to_thread.run_sync(render))
