"""A prepared chat request (ChatJob) and how a stream of its RequestOutputs becomes its choices: the parsers each
choice runs (reasoning, tool calls), its usage and per-request metrics, and the non-streamed choices themselves
(collect_choices). The chat, batch chat and Responses routes build their jobs here over the engine's stream; the
derender route over the tokens it is given (api/serving_derender.py).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from deltaserve.api.chat import ChatPrompt
from deltaserve.api.chat_output import ChoiceProcessor, MessageBuilder, ReasoningTokenCounter
from deltaserve.api.logprobs import TokenNamer, chat_logprobs
from deltaserve.api.protocol import ChatCompletionRequest
from deltaserve.api.reasoning import Qwen3ReasoningParser, prompt_opens_thinking
from deltaserve.api.serving_common import multimodal_tokens, prompt_details, request_timing, usage
from deltaserve.api.settings import ServerState
from deltaserve.api.tool_parser import QWEN3_TOOL_PARSERS, Qwen3XMLToolParser
from deltaserve.api.tool_parser_hermes import HermesToolParser
from deltaserve.engine.request import CompletionOutput, RequestOutput
from deltaserve.engine.stats import RequestMetrics
from deltaserve.sampling_params import ALL_LOGPROBS, SamplingParams


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
    role: str
    echo_text: str  # prepended to each choice's content with `echo`
    stream: AsyncGenerator[RequestOutput, None]
    num_cached_tokens: int | None = field(default=None)
    num_cache_creation_tokens: int | None = field(default=None)
    prompt_token_ids: list[int] = field(default_factory=list)
    multimodal_tokens: dict[str, int] | None = None  # placeholder tokens per modality (usage details)
    metrics: RequestMetrics | None = None  # the engine's timestamps, from the finished output
    is_named_tool_choice: bool = False  # vLLM ends a named function's forced call with "stop", not "tool_calls"
    is_tool_choice_none: bool = False  # tool_choice "none" under qwen3_coder: calls are read and dropped

    def new_processor(self, *, is_streamed: bool) -> ChoiceProcessor:
        """A choice's parsers; is_streamed picks vLLM's streamed or non-streamed content around tool calls."""
        settings = self.state.settings
        reasoning, counter = None, None
        if settings.reasoning_parser is not None:
            is_open = prompt_opens_thinking(self.prompt_text) and not self.is_thinking_disabled
            reasoning = Qwen3ReasoningParser(is_prompt_thinking=is_open, is_thinking_disabled=self.is_thinking_disabled)
            counter = ReasoningTokenCounter(self.state.engine.tokenizer, is_open=is_open)
        tool_parser: Any = None
        if self.is_tool_choice_none:
            tool_parser = Qwen3XMLToolParser(self.tools, is_streamed=is_streamed, is_tool_choice_none=True)
        elif self.tools is not None:
            if settings.tool_call_parser == "hermes":
                tool_parser = HermesToolParser(self.tools)
            else:
                tool_parser = Qwen3XMLToolParser(self.tools, is_streamed=is_streamed)
        processor = ChoiceProcessor(reasoning, tool_parser, self.request.include_reasoning, counter)
        processor.is_tool_call_finish = not self.is_named_tool_choice
        return processor

    def token_namer(self) -> TokenNamer:
        as_ids = bool(self.request.return_tokens_as_token_ids or self.state.settings.return_tokens_as_token_ids)
        return TokenNamer(self.state.engine.tokenizer, as_ids)

    def logprobs_of(self, seq: CompletionOutput) -> list[dict[str, Any]]:
        if self.num_top_logprobs is None:
            return []
        return chat_logprobs(self.token_namer(), seq.token_ids, seq.logprobs, self.num_top_logprobs)

    def note_output(self, output: RequestOutput) -> None:
        if output.outputs:  # set with the first token, unchanged after it
            self.num_cached_tokens = output.num_cached_tokens
            self.num_cache_creation_tokens = output.num_cache_creation_tokens
        if output.metrics is not None:
            self.metrics = output.metrics

    def usage(self, processors: list[ChoiceProcessor]) -> dict[str, Any]:
        has_reasoning = self.state.settings.reasoning_parser is not None
        details = None
        if self.state.settings.enable_prompt_tokens_details:
            cached = self.num_cached_tokens or 0
            details = prompt_details(cached, self.num_cache_creation_tokens or 0, self.multimodal_tokens)
        return usage(
            self.num_prompt_tokens,
            sum(p.num_tokens for p in processors),
            prompt_tokens_details=details,
            num_reasoning_tokens=sum(p.num_reasoning_tokens for p in processors) if has_reasoning else None,
        )

    def timing(self, processors: list[ChoiceProcessor]) -> dict[str, float | None] | None:
        """The response's `metrics` under --enable-per-request-metrics: one sequence's timestamps, so None for n > 1
        (vLLM suppresses them there: they would be one of the n sequences')."""
        if not self.state.settings.enable_per_request_metrics or self.request.n != 1:
            return None
        return request_timing(self.metrics, sum(p.num_tokens for p in processors))


def chat_job(
    state: ServerState,
    request: ChatCompletionRequest,
    prompt: ChatPrompt,
    params: SamplingParams,
    tool_choice: str | None,
    response_id: str,
    role: str,
    echo_text: str,
    stream: AsyncGenerator[RequestOutput, None],
) -> ChatJob:
    """The job that turns `stream` (the engine's, or a derendered response's: api/serving_derender.py) into the
    request's choices."""
    settings = state.settings
    is_tool_choice_none = (
        tool_choice is None and settings.enable_auto_tool_choice and settings.tool_call_parser in QWEN3_TOOL_PARSERS
    )
    is_parsed = tool_choice is not None or is_tool_choice_none
    return ChatJob(
        state=state,
        request=request,
        response_id=response_id,
        created=int(time.time()),
        prompt_text=prompt.text,
        num_prompt_tokens=len(prompt.token_ids),
        # logprob_token_ids: every listed id, as vLLM's return_all
        num_top_logprobs=ALL_LOGPROBS if params.logprob_token_ids else params.logprobs,
        tools=[tool.model_dump() for tool in request.tools] if request.tools and is_parsed else None,
        is_thinking_disabled=prompt.is_thinking_disabled,
        role=role,
        echo_text=echo_text,
        stream=stream,
        prompt_token_ids=prompt.token_ids,
        multimodal_tokens=multimodal_tokens(prompt.mm_input),
        is_named_tool_choice=tool_choice not in (None, "auto", "required"),
        is_tool_choice_none=bool(is_tool_choice_none),
    )


@dataclass
class ChatChoices:
    """A finished request's non-streamed choices, the processors that counted their tokens, its prompt logprobs."""

    choices: list[dict[str, Any]]
    processors: list[ChoiceProcessor]
    prompt_logprobs: Any  # the engine's, as the last output carried them; None unless asked for


async def collect_choices(job: ChatJob) -> ChatChoices:
    """Runs the job's engine stream to its end and builds its choices (one per sequence, by index)."""
    builders: dict[int, MessageBuilder] = {}
    prompt_logprobs = None
    async with contextlib.aclosing(job.stream) as stream:
        async for output in stream:
            job.note_output(output)
            for seq in output.outputs:
                builder = builders.get(seq.index)
                if builder is None:
                    builder = builders[seq.index] = MessageBuilder(job.new_processor(is_streamed=False))
                processor = builder.processor
                processor.count(seq.token_ids)
                builder.add(processor.feed(seq.text))
                builder.logprobs += job.logprobs_of(seq)
                builder.token_ids += seq.token_ids
                if output.prompt_logprobs is not None:
                    prompt_logprobs = output.prompt_logprobs
                if seq.finish_reason is not None:
                    builder.add(processor.finish())
                    builder.finish_reason = processor.finish_reason(seq.finish_reason)
                    builder.stop_reason = seq.stop_reason
    choices = []
    for index, builder in sorted(builders.items()):
        message = {**builder.message(), "role": job.role}
        if job.request.parallel_tool_calls is False and message.get("tool_calls"):
            message["tool_calls"] = message["tool_calls"][:1]
        if job.echo_text:
            message["content"] = job.echo_text + (message["content"] or "")
        choices.append({
            "index": index,
            "message": message,
            "logprobs": {"content": builder.logprobs} if job.num_top_logprobs is not None else None,
            "finish_reason": builder.finish_reason,
            "stop_reason": builder.stop_reason,
            "token_ids": builder.token_ids if job.request.return_token_ids else None,
            "routed_experts": None,  # vLLM's --enable-return-routed-experts, which deltaserve does not serve
        })  # fmt: skip
    return ChatChoices(choices, [builder.processor for builder in builders.values()], prompt_logprobs)
