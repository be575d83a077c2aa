"""POST /v1/responses: OpenAI's Responses API served through the chat path, as vLLM serves it for text models.

create_response reads top to bottom: parse (ResponsesRequest), refuse what is not served (responses_protocol),
translate into a chat request, then the chat path's own steps: validate, render, SamplingParams, submit. The
generated text goes through the chat path's ChoiceProcessor (reasoning parser, tool-call parser) twice over, as
vLLM parses it: non-streamed, for the Response's output (responses_output.output_items), and, when streaming,
streamed, for the events (responses_output.StreamEvents). The id is the body's request_id, else `resp_` and 16 hex
digits (vLLM's ResponsesRequest reads no X-Request-Id).

Streamed, the events are vLLM's: `response.created` and `response.in_progress` (the response with status
in_progress and no output) at once, then each item's events, then `response.completed` with the whole response
(its output built again from the whole text, so its ids are not the streamed items'); every event carries
`sequence_number`, counting from 0, and goes out as `event: <type>` + `data: <json>` with no [DONE]. A response cut
off by max_output_tokens has status "incomplete" (incomplete_details.reason "max_output_tokens"), in the completed
event too, as in vLLM. GET /v1/responses/{id} and its /cancel answer 404: responses are never stored (vLLM's
default, without VLLM_ENABLE_RESPONSES_API_STORE).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from deltaserve.api import serving_chat
from deltaserve.api.body import parse_request
from deltaserve.api.chat import render_prompt
from deltaserve.api.chat_job import ChatJob
from deltaserve.api.chat_output import ChoiceProcessor, MessageBuilder, merge_deltas
from deltaserve.api.errors import APIError
from deltaserve.api.logprobs import TokenNamer, response_logprobs, stream_logprobs
from deltaserve.api.responses_output import Event, StreamEvents, output_items, random_id
from deltaserve.api.responses_protocol import ResponsesRequest, check_unsupported, function_tools, to_chat_request
from deltaserve.api.sampling import tokenize_bad_words
from deltaserve.api.serving_common import check_model, checked_request_id, respond, stream_error_event
from deltaserve.api.settings import ServerState
from deltaserve.engine.request import RequestOutput
from deltaserve.sampling_params import SamplingParams


def response_not_found(response_id: str) -> APIError:
    """vLLM's answer for an id its store does not hold."""
    return APIError(f"Response with id '{response_id}' not found.", status=404, err_type="invalid_request_error",
                    param="response_id")  # fmt: skip


async def create_response(state: ServerState, raw_request: Request) -> Response:
    """One Responses request, top to bottom: parse, refuse, translate, the chat path's steps, respond."""
    arrival = time.perf_counter()
    request = await parse_request(state, raw_request, ResponsesRequest)
    check_model(state, request.model)
    check_unsupported(request)
    chat_request = to_chat_request(request)
    constraint, tool_choice = await serving_chat.validate(state, chat_request)
    prompt = await render_prompt(state, chat_request)
    params = serving_chat.sampling_params(
        state, chat_request, prompt, constraint, await tokenize_bad_words(state, chat_request)
    )
    # vLLM's ResponsesRequest.request_id: the body's, else resp_ and 16 hex digits (no X-Request-Id here)
    response_id = checked_request_id(request.request_id or f"resp_{random_id()}")
    # output items are always the assistant's, and Responses has no `echo`
    chat_job = serving_chat.submit(
        state, chat_request, prompt, params, tool_choice, response_id, arrival, role="assistant", echo_text=""
    )
    if chat_job.is_tool_choice_none and request.tools:
        # the prompt had no tools, but vLLM's parser reads the Responses request's own: with tools sent, tool_choice
        # "none" ignores the calls' events (ParserEngine._check_skip_tool_parsing)
        chat_job.tools = function_tools(request)
    job = ResponseJob(chat_job, request, params)
    return await respond(state, raw_request, bool(request.stream), job.events, job.full)


@dataclass
class ResponseJob:
    """A submitted Responses request: the chat job that runs it, its two parses and what the Response echoes back.

    The Response's output is the non-streamed parse of the generation (vLLM builds it from the whole text, the
    completed event of a stream too); a stream's events come from a second, streamed parse of the same text, as
    vLLM's come from its streamed parser."""

    chat: ChatJob
    request: ResponsesRequest
    params: SamplingParams
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    parse: ChoiceProcessor | None = None  # the non-streamed parse: output items and usage
    message: MessageBuilder | None = None  # its deltas, folded
    streamed: ChoiceProcessor | None = None  # the streamed parse, when streaming
    events_of: StreamEvents = field(default_factory=StreamEvents)
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # every generated token's, for the message
    namer: TokenNamer | None = None

    @property
    def shows_logprobs(self) -> bool:
        # vLLM hides the logprobs too when include_reasoning is false (they would show the reasoning tokens)
        return self.chat.num_top_logprobs is not None and self.request.include_reasoning

    def body(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        """vLLM's ResponsesResponse.from_request."""
        request, params = self.request, self.params
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.chat.response_id, "created_at": self.chat.created, "incomplete_details": incomplete,
            "instructions": request.instructions, "metadata": request.metadata,
            "model": self.chat.state.settings.model_name, "object": "response", "output": output,
            "parallel_tool_calls": request.parallel_tool_calls is not False, "temperature": params.temperature,
            "tool_choice": request.tool_choice, "tools": request.tools, "top_p": params.top_p, "background": False,
            "max_output_tokens": params.max_tokens, "max_tool_calls": request.max_tool_calls,
            "previous_response_id": None, "prompt": None,
            "reasoning": request.reasoning.model_dump() if request.reasoning else None,
            "service_tier": request.service_tier, "status": status, "text": request.text,
            "top_logprobs": params.logprobs, "truncation": request.truncation or "disabled", "usage": usage,
            "user": request.user, "presence_penalty": params.presence_penalty,
            "frequency_penalty": params.frequency_penalty, "kv_transfer_params": None, "ec_transfer_params": None,
            "input_messages": None, "output_messages": None,
        }  # fmt: skip

    def usage(self) -> dict[str, Any]:
        """vLLM's ResponseUsage for a text model: its per-turn lists stay empty (vLLM's SimpleContext keeps no turn
        metrics)."""
        num_input = self.chat.num_prompt_tokens
        num_output = self.parse.num_tokens if self.parse else 0
        num_reasoning = self.parse.num_reasoning_tokens if self.parse else 0
        return {
            "input_tokens": num_input,
            "input_tokens_details": {"cached_tokens": self.num_cached_tokens, "input_tokens_per_turn": [],
                                     "cached_tokens_per_turn": []},
            "output_tokens": num_output,
            "output_tokens_details": {"reasoning_tokens": num_reasoning, "tool_output_tokens": 0,
                                      "output_tokens_per_turn": [], "tool_output_tokens_per_turn": []},
            "total_tokens": num_input + num_output,
        }  # fmt: skip

    def final_body(self) -> dict[str, Any]:
        status = "incomplete" if self.finish_reason == "length" else "completed"
        output: list[dict[str, Any]] = []
        if self.message is not None and self.parse is not None:
            calls = [call for _, call in sorted(self.message.calls.items())]
            output = output_items("".join(self.message.reasoning), "".join(self.message.content), calls,
                                  self.logprobs or None, is_parsed=not self.parse.is_plain)  # fmt: skip
        return self.body(status, output, self.usage())

    def consume(self, output: RequestOutput) -> list[Event]:
        """One engine output -> the stream events of its delta (the last one closes the open item)."""
        if output.num_cached_tokens:
            self.num_cached_tokens = output.num_cached_tokens
        events: list[Event] = []
        for seq in output.outputs:  # one sequence: a Responses request has no n
            if self.parse is None:
                self.parse = self.chat.new_processor(is_streamed=False)
                self.message = MessageBuilder(self.parse)
                self.streamed = self.chat.new_processor(is_streamed=True) if self.request.stream else None
                self.namer = self.chat.token_namer()
            assert self.message is not None and self.namer is not None
            is_last = seq.finish_reason is not None
            if is_last:
                self.finish_reason = seq.finish_reason
            self.parse.count(seq.token_ids)
            self.message.add(self._delta(self.parse, seq.text, is_last))
            logprobs: list[dict[str, Any]] = []
            if self.shows_logprobs:
                logprobs = response_logprobs(self.namer, seq.token_ids, seq.logprobs, self.request.top_logprobs or 0)
                self.logprobs += logprobs
            if self.streamed is not None:
                delta = self._delta(self.streamed, seq.text, is_last)
                events += self.events_of.feed(delta, stream_logprobs(logprobs))
                if is_last:
                    events += self.events_of.close()
        return events

    def _delta(self, processor: ChoiceProcessor, text: str, is_last: bool) -> dict[str, Any]:
        """The step's delta, the parsers' flush merged into the last one (vLLM parses the last step with
        finished=True: one delta)."""
        delta = processor.feed(text)
        if is_last:
            delta = merge_deltas(delta, processor.finish())
        if self.request.parallel_tool_calls is False:
            delta = serving_chat.only_first_call(delta)
        return delta

    async def full(self) -> JSONResponse:
        async with contextlib.aclosing(self.chat.stream) as stream:
            async for output in stream:
                self.consume(output)
        return JSONResponse(self.final_body())

    async def events(self) -> AsyncIterator[str]:
        sequence_number = 0

        def sse(event: Event) -> str:
            nonlocal sequence_number
            event = {"type": event["type"], "sequence_number": sequence_number, **event}
            sequence_number += 1
            return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"

        started = self.body("in_progress", [], None)
        yield sse({"type": "response.created", "response": started})
        yield sse({"type": "response.in_progress", "response": started})
        try:
            async with contextlib.aclosing(self.chat.stream) as stream:
                async for output in stream:
                    for event in self.consume(output):
                        yield sse(event)
            yield sse({"type": "response.completed", "response": self.final_body()})
        except Exception as exc:
            # vLLM's envelope as the data of an `error` event: the openai client raises it as an APIError
            yield "event: error\n" + stream_error_event(exc)
