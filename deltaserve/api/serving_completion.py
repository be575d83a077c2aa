"""POST /v1/completions: text or token-id prompts (one or a batch), echo, logprobs, n, streamed or not.

create_completion reads top to bottom: parse (body.py), validate (every field check; the constraint parsed by
structured.py), tokenise (resolve_prompts), SamplingParams per prompt (sampling.py: max_tokens and the length rules,
once each), submit (serving_common.engine_stream), respond (streamed or not).

A batch of P prompts with n sequences each yields choices indexed prompt * n + sequence, as vLLM numbers them.
Every prompt is its own engine request; their streams are interleaved as outputs arrive. Text prompts are
tokenised off the event loop (tokens.py), with truncate_prompt_tokens / truncation_side applied as vLLM applies them.
The non-streamed body is built and rendered off the event loop, and the prompt-logprob work a request may ask for is
bounded (completion_body.py, docs/limits.md).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import Response

from deltaserve.api.beam_search import beam_search_streams
from deltaserve.api.body import parse_request
from deltaserve.api.completion_body import build_echoed, check_prompt_logprob_work, full_completion
from deltaserve.api.errors import bad_request
from deltaserve.api.logprobs import CompletionLogprobs, TokenNamer, completion_top
from deltaserve.api.protocol import CompletionRequest
from deltaserve.api.sampling import (
    build_each,
    build_sampling_params,
    cache_salt_of,
    check_sampling_request,
    sample_logprobs,
    tokenize_bad_words,
)
from deltaserve.api.serving_common import (
    DONE_EVENT,
    check_model,
    check_token_ids,
    engine_request_id,
    engine_stream,
    merge_streams,
    prompt_details,
    request_ids,
    request_timing,
    respond,
    sse,
    stream_error_event,
    stream_usage_flags,
    usage,
    without_none,
)
from deltaserve.api.settings import ServerState
from deltaserve.api.structured import resolve_structured_outputs
from deltaserve.api.tokens import truncate_ids, truncation_length
from deltaserve.engine.request import CompletionOutput, Logprob, RequestOutput
from deltaserve.engine.stats import RequestMetrics
from deltaserve.sampling_params import SamplingParams, StructuredOutputsParams, resolve_num_logprobs


@dataclass
class Prompt:
    token_ids: list[int]
    text: str | None  # None for token-id prompts until echo needs it


@dataclass
class ChoiceState:
    """One output choice: what was sent so far, for echo, logprobs offsets and usage."""

    prompt_index: int
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    has_echoed: bool = False
    logprobs: CompletionLogprobs | None = None
    logprob_entries: list[dict[int, Logprob]] = field(default_factory=list)  # raw, one per token (full body)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] = field(default_factory=list)


async def resolve_prompts(state: ServerState, request: CompletionRequest) -> list[Prompt]:
    """str | list[str] | list[int] | list[list[int]] -> one Prompt per engine request (with echo, its text)."""
    prompt = request.prompt
    if not prompt:  # None, "" or []: vLLM's words (prompt_embeds, which it also names, is refused by name here)
        raise bad_request("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
    items: list[Any] = [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else list(prompt)
    max_model_len = state.engine.max_model_len
    keep = truncation_length(request.truncate_prompt_tokens, max_model_len)
    prompts = []
    for item in items:
        if isinstance(item, str):
            token_ids, count = await state.tokens.encode(
                item,
                add_special_tokens=request.add_special_tokens,
                max_input_tokens=max_model_len,
                truncate=keep,
                truncation_side=request.truncation_side,
            )
            prompts.append(Prompt(token_ids, item if count == len(token_ids) else None))
        else:
            check_token_ids(state, item, "prompt")
            token_ids = truncate_ids(list(item), keep, request.truncation_side)
            prompts.append(Prompt(token_ids, None))
    if request.echo:
        # The echoed prompt is the decoded tokens (token-id and truncated prompts have no text of their own).
        for prompt in prompts:
            if prompt.text is None:
                prompt.text = await state.tokens.decode(prompt.token_ids)
    return prompts


@dataclass
class CompletionJob:
    state: ServerState
    request: CompletionRequest
    response_id: str
    created: int
    prompts: list[Prompt]
    streams: list[AsyncGenerator[RequestOutput, None]]
    namer: TokenNamer
    choices: dict[int, ChoiceState] = field(default_factory=dict)
    num_cached_tokens: dict[int, int] = field(default_factory=dict)  # prompt index -> prefix-cache hits
    metrics: RequestMetrics | None = None  # the engine's timestamps of a one-prompt request, once it finished
    # prompt index -> its prompt logprobs: one list per prompt, however many choices report it
    prompt_logprobs: dict[int, list[dict[int, Logprob] | None]] = field(default_factory=dict)
    # prompt index -> (its echoed logprobs, the offset after them): built once, shared by the prompt's n choices
    echoed: dict[int, tuple[dict[str, Any], int]] = field(default_factory=dict)

    @property
    def is_echo_only(self) -> bool:
        return bool(self.request.echo) and self.request.max_tokens == 0

    def choice(self, prompt_index: int, seq: CompletionOutput) -> tuple[int, ChoiceState]:
        index = prompt_index * self.request.n + seq.index
        state = self.choices.get(index)
        if state is None:
            state = self.choices[index] = ChoiceState(prompt_index)
            if self.request.logprobs is not None:
                state.logprobs = CompletionLogprobs(self.namer, completion_top(self.request))
        return index, state

    def note_output(self, prompt_index: int, output: RequestOutput) -> None:
        if self.state.settings.enable_prompt_tokens_details:
            self.num_cached_tokens.setdefault(prompt_index, output.num_cached_tokens)
        if output.metrics is not None:
            self.metrics = output.metrics

    def advance(
        self, choice: ChoiceState, seq: CompletionOutput, output: RequestOutput
    ) -> tuple[str, dict[str, Any] | None]:
        """Records a sequence delta; returns its text (with the echoed prompt first) and its logprobs (with the
        prompt's first when echoed: vLLM reports None for the first prompt token)."""
        text = seq.text
        echoed = None
        if self.request.echo and not choice.has_echoed:
            prompt = self.prompts[choice.prompt_index]
            text = (prompt.text or "") + text
            if choice.logprobs is not None:
                if choice.prompt_index not in self.echoed:
                    self.echoed[choice.prompt_index] = build_echoed(
                        self.namer, choice.logprobs.num_top, prompt.token_ids, output.prompt_logprobs
                    )
                echoed, choice.logprobs.offset = self.echoed[choice.prompt_index]
        if self.is_echo_only:
            # echo with max_tokens 0 (scoring): the prompt alone; the one token the engine drew is not shown
            text = text[: len(text) - len(seq.text)]
        choice.has_echoed = True
        choice.text.append(text)
        if not self.is_echo_only:
            choice.num_tokens += len(seq.token_ids)
            choice.token_ids.extend(seq.token_ids)
        if seq.finish_reason is not None:
            choice.finish_reason, choice.stop_reason = seq.finish_reason, seq.stop_reason
        logprobs = choice.logprobs.build(seq.token_ids, seq.logprobs) if choice.logprobs is not None else None
        if self.is_echo_only:
            return text, echoed
        if echoed is not None:
            logprobs = _merge_logprobs([echoed, logprobs])
        return text, logprobs

    def usage(self) -> dict[str, Any]:
        num_prompt_tokens = sum(len(prompt.token_ids) for prompt in self.prompts)
        details = None
        if self.state.settings.enable_prompt_tokens_details:
            # vLLM's completions report the hits alone (created_cache_tokens and multimodal_tokens null); a batch's
            # are summed here where vLLM reports its last prompt's (docs/compatibility.md)
            details = prompt_details(sum(self.num_cached_tokens.values()))
        num_tokens = sum(choice.num_tokens for choice in self.choices.values())
        return usage(num_prompt_tokens, num_tokens, prompt_tokens_details=details)

    def timing(self) -> dict[str, float | None] | None:
        """The response's `metrics` under --enable-per-request-metrics: None unless one prompt and n = 1 made it
        (vLLM's rule: the timestamps of one stream)."""
        settings = self.state.settings
        if not settings.enable_per_request_metrics or len(self.prompts) != 1 or self.request.n != 1:
            return None
        return request_timing(self.metrics, sum(choice.num_tokens for choice in self.choices.values()))

    def envelope(self, choices: list[Any]) -> dict[str, Any]:
        return {"id": self.response_id, "object": "text_completion", "created": self.created,
                "model": self.state.settings.model_name, "choices": choices}  # fmt: skip

    def body(self, choices: list[Any]) -> dict[str, Any]:
        """The whole non-streamed body: vLLM's CompletionResponse serialised whole, in its field order (the transfer
        parameters of its KV / encoder-cache connectors null)."""
        return self.envelope(choices) | {
            "service_tier": None,
            "system_fingerprint": self.state.settings.system_fingerprint,
            "usage": self.usage(),
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": self.timing(),
        }


async def create_completion(
    state: ServerState, raw_request: Request, body: tuple[dict[str, Any], bool] | None = None
) -> Response:
    """One completion request, top to bottom: parse, validate, tokenise, SamplingParams, submit, respond."""
    arrival = time.perf_counter()
    request = await parse_request(state, raw_request, CompletionRequest, body)
    constraint = await validate(state, request)
    prompts = await resolve_prompts(state, request)
    params = await build_params(state, request, prompts, constraint)
    response_id = request_ids(raw_request, request.request_id, "cmpl")
    if request.use_beam_search:  # api/beam_search.py: one finished output per prompt, its beams as the choices
        token_ids = [prompt.token_ids for prompt in prompts]
        streams = beam_search_streams(state, token_ids, params, request.n, request.length_penalty, response_id)
    else:
        streams = [
            engine_stream(
                state,
                prompt.token_ids,
                params[i],
                engine_request_id(response_id, i),
                arrival,
                priority=request.priority,
                cache_salt=cache_salt_of(request),
            )
            for i, prompt in enumerate(prompts)
        ]  # each submitted on its first iteration; fmt: skip
    as_ids = bool(request.return_tokens_as_token_ids or state.settings.return_tokens_as_token_ids)
    namer = TokenNamer(state.engine.tokenizer, as_ids)
    job = CompletionJob(state, request, response_id, int(time.time()), prompts, streams, namer)
    return await respond(
        state, raw_request, bool(request.stream), lambda: stream_completion(job), lambda: full_completion(job)
    )


async def build_params(
    state: ServerState, request: CompletionRequest, prompts: list[Prompt], constraint: StructuredOutputsParams | None
) -> list[SamplingParams]:
    """Each prompt's SamplingParams (the completions route's and its render's): echo's prompt logprobs, the bound on
    prompt-logprob work, max_tokens per prompt, bad_words tokenised once for every prompt."""
    # vLLM: echo with logprobs reports the prompt's logprobs too (prompt_logprobs = logprobs unless set)
    prompt_logprobs = request.prompt_logprobs
    if prompt_logprobs is None and request.echo and request.logprobs is not None:
        prompt_logprobs = request.logprobs
    num_prompt_tokens = sum(len(prompt.token_ids) for prompt in prompts)
    num_prompt_logprobs = resolve_num_logprobs(prompt_logprobs, state.vocab_size)  # -1: the whole vocabulary
    check_prompt_logprob_work(
        request, num_prompt_tokens, num_prompt_logprobs, state.settings.max_prompt_logprob_entries
    )
    # vLLM's echo without generation: the engine draws one token, which is not reported
    requested = 1 if request.echo and request.max_tokens == 0 else request.max_tokens
    bad_words_ids = await tokenize_bad_words(state, request)  # once for every prompt of the request
    params = await build_each(
        prompts,
        lambda prompt: build_sampling_params(
            state,
            request,
            num_prompt_tokens=len(prompt.token_ids),
            max_tokens=requested,  # unset: the rest of that prompt's context
            prompt_param="prompt",
            logprobs=sample_logprobs(request),
            prompt_logprobs=prompt_logprobs,
            structured_outputs=constraint,
            bad_words_ids=bad_words_ids,
            is_beam_search=request.use_beam_search,
        ),
    )
    return params


async def validate(state: ServerState, request: CompletionRequest) -> StructuredOutputsParams | None:
    """Every check of the request's fields, before any work (each a 400 naming its field): the model, the
    sampling fields, suffix; then its constraint, parsed (returned)."""
    check_model(state, request.model)
    check_sampling_request(state, request)
    if request.suffix is not None:
        raise bad_request("suffix is not currently supported", "suffix")
    return await resolve_structured_outputs(request, (request.model_extra or {}).get("response_format"))


async def stream_completion(job: CompletionJob) -> AsyncIterator[str]:
    include_usage, is_continuous = stream_usage_flags(
        job.request.stream_options, job.state.settings.enable_force_include_usage
    )
    fingerprint = job.state.settings.system_fingerprint
    try:
        async with contextlib.aclosing(merge_streams(job.streams)) as merged:
            async for prompt_index, output in merged:
                job.note_output(prompt_index, output)
                for seq in output.outputs:
                    index, choice = job.choice(prompt_index, seq)
                    is_first = not choice.has_echoed
                    # echoed logprobs are large (prompt x logprobs): built once per prompt, off the event loop
                    is_large = is_first and job.request.echo and choice.logprobs is not None
                    if is_large and prompt_index not in job.echoed:
                        job.echoed[prompt_index] = await anyio.to_thread.run_sync(
                            build_echoed, job.namer, choice.logprobs.num_top, job.prompts[prompt_index].token_ids,
                            output.prompt_logprobs,
                        )  # fmt: skip
                    text, logprobs = job.advance(choice, seq, output)
                    item = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": seq.finish_reason,
                            "stop_reason": seq.stop_reason}  # fmt: skip
                    if job.request.return_token_ids:
                        if is_first:
                            item["prompt_token_ids"] = job.prompts[prompt_index].token_ids
                        item["token_ids"] = list(seq.token_ids)
                    chunk = job.envelope([item])
                    if fingerprint is not None and seq.finish_reason is not None and not include_usage:
                        chunk["system_fingerprint"] = fingerprint  # vLLM's: a choice's last chunk, no usage after
                    if is_continuous:  # vLLM counts the chunk's own choice and its prompt, not every choice
                        num_prompt = len(job.prompts[prompt_index].token_ids)
                        chunk["usage"] = without_none(usage(num_prompt, choice.num_tokens))
                    yield await anyio.to_thread.run_sync(sse, chunk) if is_large else sse(chunk)
        if include_usage:
            chunk = job.envelope([])
            chunk["usage"] = without_none(job.usage())
            timing = job.timing()
            chunk |= without_none({"system_fingerprint": fingerprint, "metrics": timing and without_none(timing)})
            yield sse(chunk)
    except Exception as exc:
        yield stream_error_event(exc)
    yield DONE_EVENT


def _merge_logprobs(parts: list[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for part in parts:
        for key, values in merged.items():
            values.extend(part[key])
    return merged
