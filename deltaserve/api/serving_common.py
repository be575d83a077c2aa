"""Plumbing shared by the generation endpoints: the model check, submitting to the engine, responding (streamed or
not), usage, SSE and disconnects (request bodies are read and parsed by body.py).

Two rules hold everything together. Every engine stream is consumed through `engine_stream`, whose cleanup
(close the engine iterator, abort the request if unfinished) runs shielded from cancellation, so a client that
goes away always frees its KV blocks and state slot. And a response never holds an engine request open longer than
its client: streams are closed by `SSEResponse`, non-streaming handlers are raced against the disconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
import pydantic
from fastapi import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from deltaserve.api.errors import bad_request, model_not_found, to_api_error
from deltaserve.api.settings import ServerState
from deltaserve.engine.core_client import EngineDeadError
from deltaserve.engine.frontend import is_utf8_encodable
from deltaserve.engine.request import RequestOutput
from deltaserve.engine.stats import RequestMetrics
from deltaserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
request_logger = logging.getLogger("deltaserve.requests")  # --enable-log-requests

ModelT = TypeVar("ModelT", bound=pydantic.BaseModel)
T = TypeVar("T")

DONE_EVENT = "data: [DONE]\n\n"


def check_model(state: ServerState, model: str | None) -> None:
    """vLLM accepts a missing or empty model and any served name; anything else is a 404."""
    if model and model not in state.settings.served_model_names:
        raise model_not_found(model)


def check_token_ids(state: ServerState, token_ids: list[int], param: str) -> None:
    vocab_size = state.vocab_size
    if token_ids and not (min(token_ids) >= 0 and max(token_ids) < vocab_size):
        outside = next(token_id for token_id in token_ids if not 0 <= token_id < vocab_size)
        raise bad_request(f"Token id {outside} is out of vocabulary (vocab size {vocab_size}).", param)


def request_ids(request: Request, body_request_id: str | None, prefix: str) -> str:
    """The response id: prefix + X-Request-Id (or the body's request_id, or a fresh uuid), as vLLM builds it."""
    base = request.headers.get("x-request-id") or body_request_id or uuid.uuid4().hex
    return f"{prefix}-{checked_request_id(base)}"


def checked_request_id(request_id: str) -> str:
    """A request id every response can carry, or a 400 before any work: JSON's escapes can spell a lone surrogate,
    which no UTF-8 body encodes (a stream broke off after its first events, with no error event and no [DONE])."""
    if not is_utf8_encodable(request_id):
        raise bad_request("request_id must be valid Unicode text: it holds a lone surrogate.", "request_id")
    return request_id


def engine_request_id(response_id: str, prompt_index: int) -> str:
    # Unique even when clients reuse an X-Request-Id: the engine rejects duplicate ids.
    return f"{response_id}-{prompt_index}-{uuid.uuid4().hex[:8]}"


def sse(payload: dict[str, Any]) -> str:
    # Compact, as vLLM serialises its chunks: streams of thousands of events per second add up.
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def usage(
    num_prompt_tokens: int,
    num_completion_tokens: int,
    *,
    prompt_tokens_details: dict[str, Any] | None = None,
    num_reasoning_tokens: int | None = None,
) -> dict[str, Any]:
    """vLLM's UsageInfo. prompt_tokens_details (prompt_details's) is given only under --enable-prompt-tokens-details;
    reasoning tokens only with a reasoning parser (vLLM reports completion_tokens_details then)."""
    body: dict[str, Any] = {
        "prompt_tokens": num_prompt_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
        "completion_tokens": num_completion_tokens,
        "prompt_tokens_details": prompt_tokens_details,
    }
    if num_reasoning_tokens is not None:
        body["completion_tokens_details"] = {"reasoning_tokens": num_reasoning_tokens}
    return body


def prompt_details(
    num_cached_tokens: int,
    num_cache_creation_tokens: int | None = None,
    multimodal_tokens: dict[str, int] | None = None,
) -> dict[str, Any]:
    """vLLM's PromptTokenUsageInfo, every field present: the prefix-cache hits (reported even when 0, as vLLM since PR
    #44383, so a client can tell "nothing cached" from "no details"), the prompt tokens the request's prefill added to
    the cache (chat only: vLLM's completions leave it null) and the placeholder tokens of each modality (null for
    text)."""
    return {
        "cached_tokens": num_cached_tokens,
        "created_cache_tokens": num_cache_creation_tokens,
        "multimodal_tokens": multimodal_tokens or None,
    }


def multimodal_tokens(mm_input: Any) -> dict[str, int] | None:
    """The prompt's placeholder tokens per modality ({"image": n, "video": m}) of a deltaserve.multimodal
    MultimodalInput, as vLLM sums its placeholder ranges; None for a text prompt."""
    if mm_input is None:
        return None
    counts: dict[str, int] = {}
    for item in mm_input.items:
        counts[item.modality] = counts.get(item.modality, 0) + item.length
    return counts or None


def request_timing(metrics: RequestMetrics | None, num_generated_tokens: int) -> dict[str, float | None]:
    """vLLM's PerRequestTimingMetrics (--enable-per-request-metrics) from the engine's timestamps: TTFT from the first
    scheduling, generation time and mean ITL over the decode, queue time, and output tokens a second over the whole
    inference (prefill included). A field whose timestamps are missing is None; no metrics at all: every field None."""
    ttft = generation = queue = itl = rate = None
    if metrics is not None:
        scheduled, first, last = metrics.first_scheduled_time, metrics.first_token_time, metrics.last_token_time
        if scheduled is not None and first is not None:
            ttft = (first - scheduled) * 1000
        if first is not None and last is not None:
            generation = (last - first) * 1000
            if num_generated_tokens > 1:
                itl = generation / (num_generated_tokens - 1)
        if scheduled is not None:
            queue = (scheduled - metrics.arrival_time) * 1000
            if last is not None and last > scheduled:
                rate = num_generated_tokens / (last - scheduled)
    return {"time_to_first_token_ms": ttft, "generation_time_ms": generation, "queue_time_ms": queue,
            "mean_itl_ms": itl, "tokens_per_second": rate}  # fmt: skip


def without_none(body: dict[str, Any]) -> dict[str, Any]:
    """Streamed usage is serialised with None fields left out, at every depth, as vLLM's final chunk is."""
    return {key: without_none(value) if isinstance(value, dict) else value for key, value in body.items()
            if value is not None}  # fmt: skip


def stream_usage_flags(stream_options: Any, is_forced: bool = False) -> tuple[bool, bool]:
    """vLLM's should_include_usage: (include_usage, continuous usage on every chunk).

    Only a given stream_options turns usage on; continuous stats need include_usage too;
    --enable-force-include-usage turns both on."""
    if is_forced:
        return True, True
    if stream_options is None:
        return False, False
    include = bool(stream_options.include_usage)
    return include, include and bool(stream_options.continuous_usage_stats)


async def engine_stream(
    state: ServerState,
    prompt_token_ids: list[int],
    params: SamplingParams,
    request_id: str,
    arrival: float,
    mm_input: Any = None,
    priority: int = 0,
    cache_salt: str | None = None,
    is_logged: bool = True,
) -> AsyncGenerator[RequestOutput, None]:
    """engine.generate with metrics, and a cleanup that always aborts an unfinished request. params.max_tokens is
    bound (build_sampling_params resolved it). mm_input: the prompt's processed images and videos (a
    deltaserve.multimodal MultimodalInput), None for text. priority: checked against the policy already
    (check_sampling_request); like mm_input, passed only when set, so an engine without either need not take it.
    cache_salt: vLLM's per-request prefix-cache salt (checked already), passed only when set, as priority.
    is_logged: --enable-log-requests logs it (beam search's one-token steps are not, as vLLM's are not)."""
    if is_logged and state.settings.enable_log_requests:
        log_request(request_id, prompt_token_ids, params, state.settings.max_log_len)
    tracker = state.metrics.track(len(prompt_token_ids), params.n, params.max_tokens, arrival)
    extra: dict[str, Any] = {}
    if mm_input is not None:
        extra["mm_input"] = mm_input
    if priority:
        extra["priority"] = priority
    if cache_salt is not None:
        extra["cache_salt"] = cache_salt
    iterator = state.engine.generate(prompt_token_ids, params, request_id, **extra)
    is_finished = False
    try:
        async for output in iterator:
            tracker.on_output(output)
            is_finished = output.finished
            yield output
            if is_finished:
                break
    finally:
        # Shielded: under a cancelled anyio scope every unshielded await would be cancelled again.
        with anyio.CancelScope(shield=True):
            if not is_finished:
                tracker.on_abort()
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
            if not is_finished:
                with contextlib.suppress(Exception):
                    await state.engine.abort(request_id)


def log_request(request_id: str, prompt_token_ids: list[int], params: SamplingParams, max_log_len: int | None) -> None:
    """vLLM's RequestLogger.log_inputs: the id and SamplingParams at INFO; the prompt's token ids (cut at
    --max-log-len) at DEBUG. The prompt's text is not logged: the engine receives token ids."""
    if request_logger.isEnabledFor(logging.DEBUG):
        shown = prompt_token_ids if max_log_len is None else prompt_token_ids[:max_log_len]
        request_logger.debug("Request %s details: prompt_token_ids: %s, prompt_embeds shape: None.", request_id, shown)
    request_logger.info("Received request %s: params: %s, lora_request: None.", request_id, params)


async def merge_streams(streams: list[AsyncGenerator[T, None]]) -> AsyncIterator[tuple[int, T]]:
    """Interleaves several engine streams (a batched completion prompt) as (stream index, item).

    Consume it under contextlib.aclosing: a generator abandoned mid-iteration is otherwise closed only by the
    garbage collector, and its engine requests would run on until then."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as stream:
            async for item in stream:
                yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()
    end = object()

    async def pump(index: int, stream: AsyncGenerator[T, None]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((index, item, None))
        except Exception as exc:
            queue.put_nowait((index, None, exc))
        finally:
            with anyio.CancelScope(shield=True):
                await stream.aclose()
            queue.put_nowait((index, end, None))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        num_open = len(tasks)
        while num_open:
            index, item, error = await queue.get()
            if error is not None:
                raise error
            if item is end:
                num_open -= 1
                continue
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)


class SSEResponse(StreamingResponse):
    """A text/event-stream response that always closes its body generator and then runs `on_close`.

    Starlette cancels the body when the client disconnects; closing the generator here as well makes the engine
    cleanup deterministic instead of waiting for garbage collection.
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type=self.media_type, headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    with contextlib.suppress(Exception):
                        await aclose()
            self.on_close()


async def respond(
    state: ServerState,
    raw_request: Request,
    is_stream: bool,
    stream: Callable[[], AsyncIterator[str]],
    full: Callable[[], Awaitable[Response]],
) -> Response:
    """The response of a submitted request: its SSE stream, or its one body raced against the client's disconnect;
    the request counts as in flight (state.num_inflight) until its response is done."""
    state.num_inflight += 1

    def release() -> None:
        state.num_inflight -= 1

    if is_stream:
        return SSEResponse(stream(), on_close=release)
    try:
        return await run_until_disconnect(raw_request, full())
    finally:
        release()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(request: Request, work: Awaitable[T]) -> T | Response:
    """Runs a non-streaming handler; if the client disconnects first, cancels it (which aborts its requests)."""
    handler = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({handler, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not handler.done():
            handler.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(handler, return_exceptions=True)
    if handler.cancelled():
        logger.info("client disconnected; request cancelled")
        return Response(status_code=499)
    return handler.result()


def stream_error_event(exc: BaseException) -> str:
    """A mid-stream failure as a data event carrying vLLM's error envelope."""
    err = to_api_error(exc)
    if isinstance(exc, EngineDeadError):
        # the death itself is one ERROR line where it is detected; each stream it ends is one line more
        logger.warning("stream failed: the engine is dead")
    elif err.status >= 500:
        logger.error("stream failed: %r", exc, exc_info=exc)
    return sse(err.payload())
