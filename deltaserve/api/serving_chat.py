"""POST /v1/chat/completions: template the messages, generate, parse reasoning and tool calls, stream or not.

Streaming follows vLLM's chunk pattern: when a choice's first token exists, a role chunk
(`{"role": "assistant", "content": ""}`) and then its first delta; never a chunk before the first token, so a
client's TTFT is honest. With stream_options.include_usage a final chunk carries usage and `choices: []`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from deltaserve.api.chat import check_tool_choice, encode_prompt, render_chat, template_kwargs
from deltaserve.api.chat_output import ChoiceProcessor, MessageBuilder, merge_deltas
from deltaserve.api.errors import bad_request
from deltaserve.api.logprobs import TokenNamer, chat_logprobs
from deltaserve.api.protocol import ChatCompletionRequest
from deltaserve.api.reasoning import Qwen3ReasoningParser, prompt_opens_thinking
from deltaserve.api.sampling import check_logprobs, check_unsupported, params_for_prompt
from deltaserve.api.serving_common import (
    DONE_EVENT,
    SSEResponse,
    check_model,
    engine_request_id,
    engine_stream,
    parse_body,
    read_json,
    request_ids,
    run_until_disconnect,
    sse,
    stream_error_event,
    stream_usage_flags,
    truncate_prompt,
    usage,
)
from deltaserve.api.settings import ServerState
from deltaserve.api.tool_parser import Qwen3XMLToolParser
from deltaserve.engine.request import CompletionOutput, RequestOutput


@dataclass
class ChatJob:
    """Everything a prepared chat request needs to run."""

    state: ServerState
    request: ChatCompletionRequest
    response_id: str
    created: int
    prompt_text: str
    num_prompt_tokens: int
    num_top_logprobs: int | None  # None: no logprobs
    tools: list[dict[str, Any]] | None  # set when tool calls are parsed
    is_thinking_disabled: bool
    stream: AsyncGenerator[RequestOutput, None]

    def new_processor(self) -> ChoiceProcessor:
        settings = self.state.settings
        reasoning = None
        if settings.reasoning_parser is not None:
            reasoning = Qwen3ReasoningParser(
                is_prompt_thinking=prompt_opens_thinking(self.prompt_text),
                is_thinking_disabled=self.is_thinking_disabled,
            )
        tool_parser = Qwen3XMLToolParser(self.tools) if self.tools is not None else None
        return ChoiceProcessor(reasoning, tool_parser, is_reasoning_included=self.request.include_reasoning)

    def logprobs_of(self, seq: CompletionOutput) -> list[dict[str, Any]]:
        if self.num_top_logprobs is None:
            return []
        namer = TokenNamer(self.state.engine.tokenizer, bool(self.request.return_tokens_as_token_ids))
        return chat_logprobs(namer, seq.token_ids, seq.logprobs, self.num_top_logprobs)


async def create_chat_completion(state: ServerState, raw_request: Request) -> Response:
    arrival = time.perf_counter()
    request = parse_body(ChatCompletionRequest, await read_json(raw_request))
    job = prepare(state, raw_request, request, arrival)
    state.num_inflight += 1
    if request.stream:
        return SSEResponse(stream_chat(job), on_close=lambda: _release(state))
    try:
        return await run_until_disconnect(raw_request, full_chat(job))
    finally:
        _release(state)


def _release(state: ServerState) -> None:
    state.num_inflight -= 1


def prepare(state: ServerState, raw_request: Request, request: ChatCompletionRequest, arrival: float) -> ChatJob:
    check_model(state, request.model)
    check_unsupported(request)
    response_format = (request.response_format or {}).get("type", "text")
    if response_format != "text":
        raise bad_request(f"response_format {response_format!r} needs structured outputs, which deltaserve lacks.")
    check_logprobs(request.top_logprobs, "top_logprobs")
    if request.top_logprobs and not request.logprobs:
        raise bad_request("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
    tool_choice = check_tool_choice(state, request.tools, request.tool_choice)
    kwargs = template_kwargs(state, request.chat_template_kwargs)
    prompt_text = render_chat(
        state,
        request.messages,
        tools=request.tools,
        chat_template=request.chat_template,
        kwargs=kwargs,
        add_generation_prompt=request.add_generation_prompt,
        continue_final_message=request.continue_final_message,
        documents=request.documents,
    )
    prompt_ids = encode_prompt(state, prompt_text, request.add_special_tokens)
    prompt_ids = truncate_prompt(prompt_ids, request.truncate_prompt_tokens, state.engine.max_model_len)
    max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    num_top_logprobs = (request.top_logprobs or 0) if request.logprobs else None
    params = params_for_prompt(
        state,
        request,
        num_prompt_tokens=len(prompt_ids),
        max_tokens=max_tokens,
        logprobs=num_top_logprobs,
        prompt_param="messages",
    )
    response_id = request_ids(raw_request, request.request_id, "chatcmpl")
    stream = engine_stream(state, prompt_ids, params, engine_request_id(response_id, 0), arrival)
    return ChatJob(
        state=state,
        request=request,
        response_id=response_id,
        created=int(time.time()),
        prompt_text=prompt_text,
        num_prompt_tokens=len(prompt_ids),
        num_top_logprobs=num_top_logprobs,
        tools=[tool.model_dump() for tool in request.tools] if tool_choice and request.tools else None,
        is_thinking_disabled=kwargs.get("enable_thinking") is False or kwargs.get("thinking") is False,
        stream=stream,
    )


def _chunk(job: ChatJob, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": job.response_id, "object": "chat.completion.chunk", "created": job.created,
            "model": job.state.settings.model_name, "choices": choices}  # fmt: skip


def _choice(index: int, delta: dict[str, Any], logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": None if logprobs is None else {"content": logprobs},
            "finish_reason": None}  # fmt: skip


async def stream_chat(job: ChatJob) -> AsyncIterator[str]:
    include_usage, is_continuous = stream_usage_flags(job.request.stream_options)
    processors: dict[int, ChoiceProcessor] = {}
    has_logprobs = job.num_top_logprobs is not None

    def running_usage() -> dict[str, int]:
        return usage(job.num_prompt_tokens, sum(p.num_tokens for p in processors.values()))

    def event(choice: dict[str, Any]) -> str:
        chunk = _chunk(job, [choice])
        if is_continuous:
            chunk["usage"] = running_usage()
        return sse(chunk)

    try:
        async with contextlib.aclosing(job.stream) as stream:
            async for output in stream:
                for seq in output.outputs:
                    processor = processors.get(seq.index)
                    if processor is None:
                        processor = processors[seq.index] = job.new_processor()
                        yield event(_choice(seq.index, {"role": "assistant", "content": ""}, None))
                    processor.num_tokens += len(seq.token_ids)
                    delta = processor.feed(seq.text)
                    processor.pending_logprobs += job.logprobs_of(seq)
                    if seq.finish_reason is None and not delta and not processor.is_plain:
                        continue  # everything is held back by a parser; its logprobs go with the next chunk
                    logprobs, processor.pending_logprobs = processor.pending_logprobs, []
                    choice = _choice(seq.index, delta, logprobs if has_logprobs else None)
                    if seq.finish_reason is not None:
                        choice["delta"] = merge_deltas(delta, processor.finish())
                        choice["finish_reason"] = processor.finish_reason(seq.finish_reason)
                        choice["stop_reason"] = seq.stop_reason
                    yield event(choice)
        if include_usage:
            chunk = _chunk(job, [])
            chunk["usage"] = running_usage()
            yield sse(chunk)
    except Exception as exc:
        yield stream_error_event(exc)
    yield DONE_EVENT


async def full_chat(job: ChatJob) -> JSONResponse:
    builders: dict[int, MessageBuilder] = {}
    async with contextlib.aclosing(job.stream) as stream:
        async for output in stream:
            for seq in output.outputs:
                builder = builders.get(seq.index)
                if builder is None:
                    builder = builders[seq.index] = MessageBuilder(job.new_processor())
                processor = builder.processor
                processor.num_tokens += len(seq.token_ids)
                builder.add(processor.feed(seq.text))
                builder.logprobs += job.logprobs_of(seq)
                if seq.finish_reason is not None:
                    builder.add(processor.finish())
                    builder.finish_reason = processor.finish_reason(seq.finish_reason)
                    builder.stop_reason = seq.stop_reason
    choices = [
        {
            "index": index,
            "message": builder.message(),
            "logprobs": {"content": builder.logprobs} if job.num_top_logprobs is not None else None,
            "finish_reason": builder.finish_reason,
            "stop_reason": builder.stop_reason,
        }
        for index, builder in sorted(builders.items())
    ]
    num_completion_tokens = sum(builder.processor.num_tokens for builder in builders.values())
    body = {"id": job.response_id, "object": "chat.completion", "created": job.created,
            "model": job.state.settings.model_name, "choices": choices,
            "usage": usage(job.num_prompt_tokens, num_completion_tokens)}  # fmt: skip
    return JSONResponse(body)
