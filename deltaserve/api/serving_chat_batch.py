"""POST /v1/chat/completions/batch: vLLM's batched chat, N conversations in one request, one choice each.

The body is a chat request whose `messages` is a list of conversations (protocol.BatchChatCompletionRequest refuses
streaming, tools, beam search and n != 1 in vLLM's words). Each conversation becomes a chat request of its own
(chat_requests) and goes through the chat endpoint's own steps: the shared fields are checked once
(serving_chat.validate: model, sampling fields, template trust, constraint), then every conversation is rendered
and its SamplingParams built (max_tokens and the length rules per prompt) before any is submitted, so one bad
conversation (one too long for the context, a template error) is that conversation's 400 for the whole request and
nothing runs, as in vLLM. Then all N run concurrently in the engine; each counts as one request in the metrics.

The response is one chat.completion: choice i is conversation i's (index i, its message built as the chat
endpoint builds it: reasoning parsed, `echo` of an assistant turn that continue_final_message continues), usage
sums prompt and completion tokens over the conversations (no details, as vLLM's batch usage has none). A client
that disconnects, or a conversation that fails, cancels the rest: every unfinished engine request is aborted, which
frees its KV blocks and state slot (serving_common.engine_stream's cleanup). `prompt_logprobs` is accepted and not
computed: vLLM's batch response has no place for it and returns none.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import Response

from deltaserve.api import serving_chat
from deltaserve.api.body import parse_request
from deltaserve.api.chat_job import ChatJob, collect_choices
from deltaserve.api.errors import APIError
from deltaserve.api.json_body import JSONPiecesResponse, render_json
from deltaserve.api.protocol import BatchChatCompletionRequest
from deltaserve.api.sampling import build_each, tokenize_bad_words
from deltaserve.api.serving_common import request_ids, respond, usage
from deltaserve.api.settings import ServerState

logger = logging.getLogger(__name__)

T = TypeVar("T")

_has_warned_prompt_logprobs = False


async def create_batch_chat_completion(state: ServerState, raw_request: Request) -> Response:
    """One batch request, top to bottom: parse, one chat request per conversation, validate the shared fields once,
    render and build every conversation's SamplingParams, submit all, gather their choices into one response."""
    arrival = time.perf_counter()
    batch = await parse_request(state, raw_request, BatchChatCompletionRequest)
    requests = await state.tokens.run(batch.chat_requests)  # off the loop: a shared field may be large (a schema)
    constraint, _ = await serving_chat.validate(state, requests[0])  # only `messages` differs between them
    prompts = [await serving_chat.render_prompt(state, request) for request in requests]
    # the constraint is copied per conversation: sampling_params may start it after that prompt's </think>
    bad_words_ids = await tokenize_bad_words(state, requests[0])  # a shared field: once for every conversation
    params = await build_each(
        zip(requests, prompts, strict=True),
        lambda pair: serving_chat.sampling_params(state, pair[0], pair[1], copy.copy(constraint), bad_words_ids),
    )
    if requests[0].prompt_logprobs is not None:
        _warn_prompt_logprobs()
        for one in params:
            one.prompt_logprobs = None
    response_id = request_ids(raw_request, requests[0].request_id, "chatcmpl")
    jobs = []
    for index, (request, prompt, one) in enumerate(zip(requests, prompts, params, strict=True)):
        role = serving_chat.response_role(state, request)
        echo = serving_chat.echo_prefix(request, role)
        jobs.append(serving_chat.submit(state, request, prompt, one, None, response_id, arrival, role, echo, index))
    created = int(time.time())
    return await respond(state, raw_request, False, _no_stream, lambda: full_batch(state, jobs, response_id, created))


def _no_stream() -> Any:
    raise AssertionError("batch chat completions are never streamed (refused by BatchChatCompletionRequest)")


def _warn_prompt_logprobs() -> None:
    global _has_warned_prompt_logprobs
    if not _has_warned_prompt_logprobs:  # once: a client sending it on every request would flood the log
        _has_warned_prompt_logprobs = True
        logger.warning("prompt_logprobs is ignored by /v1/chat/completions/batch: its response has no place for it")


async def gather_all(works: list[Awaitable[T]]) -> list[T]:
    """Runs the awaitables concurrently and returns their results in order. When one fails, or the caller is
    cancelled (a client disconnect), the others are cancelled and awaited before this returns or raises, so that
    their cleanup (aborting their engine requests) has run."""
    tasks = [asyncio.ensure_future(work) for work in works]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()  # a finished task ignores it
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)


async def full_batch(state: ServerState, jobs: list[ChatJob], response_id: str, created: int) -> JSONPiecesResponse:
    """The batch's one response: conversation i's only choice as choice i, usage summed over the conversations."""
    results = await gather_all([collect_choices(job) for job in jobs])
    choices: list[dict[str, Any]] = []
    num_prompt_tokens = num_completion_tokens = 0
    for index, (job, result) in enumerate(zip(jobs, results, strict=True)):
        if not result.choices:  # vLLM's check: an engine stream that ended without an output
            raise APIError(
                f"No output received from the engine for prompt {index}.", status=500, err_type="InternalServerError"
            )
        choices.append({**result.choices[0], "index": index})
        num_prompt_tokens += job.num_prompt_tokens
        num_completion_tokens += sum(processor.num_tokens for processor in result.processors)
    # vLLM's ChatCompletionResponse serialised whole (its batch path sets the fingerprint and usage, no details)
    body = {"id": response_id, "object": "chat.completion", "created": created, "model": state.settings.model_name,
            "choices": choices, "service_tier": None, "system_fingerprint": state.settings.system_fingerprint,
            "usage": usage(num_prompt_tokens, num_completion_tokens), "prompt_logprobs": None,
            "prompt_token_ids": None, "prompt_text": None, "kv_transfer_params": None, "ec_transfer_params": None,
            "metrics": None}  # fmt: skip
    # N conversations' logprobs can make a body of many MB: rendered off the event loop, as the chat endpoint does
    return JSONPiecesResponse(await anyio.to_thread.run_sync(render_json, body))
