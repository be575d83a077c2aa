"""Plumbing shared by the generation endpoints: body parsing, request checks, engine streams, SSE and disconnects.

Bodies are read against --max-request-body-bytes (413) and must be `application/json` (vLLM's 400 otherwise). A
large body is parsed and validated on a worker thread, through Python hooks (so the thread yields the GIL between
elements) with the garbage collector paused. Two bounds keep the object graph of one request small, because
building (and later collecting) millions of Python objects stalls the event loop whatever thread does it: at most
MAX_JSON_ELEMENTS values (a 1,048,576-token prompt fits) and MAX_JSON_OBJECTS objects (16,384 chat messages; the
garbage collector walks every container, token ids are not containers). vLLM has neither bound.

Two rules hold everything together. Every engine stream is consumed through `engine_stream`, whose cleanup
(close the engine iterator, abort the request if unfinished) runs shielded from cancellation, so a client that
goes away always frees its KV blocks and state slot. And a response never holds an engine request open longer than
its client: streams are closed by `SSEResponse`, non-streaming handlers are raced against the disconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import threading
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, TypeVar

import anyio
import pydantic
from fastapi import Request
from starlette.requests import ClientDisconnect
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from deltaserve.api.errors import (
    APIError,
    ClientGone,
    bad_request,
    model_not_found,
    request_too_large,
    to_api_error,
    validation_error,
)
from deltaserve.api.settings import ServerState
from deltaserve.engine.request import RequestOutput
from deltaserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

ModelT = TypeVar("ModelT", bound=pydantic.BaseModel)
T = TypeVar("T")

DONE_EVENT = "data: [DONE]\n\n"


JSON_MEDIA_TYPE = "application/json"
# Bodies above this are parsed and validated on a worker thread.
OFF_LOOP_BYTES = 64 * 1024
# Commas, brackets and braces a body may hold (counted over the raw bytes, strings included): a 1,048,576-token
# prompt fits; ten million tiny JSON values do not.
MAX_JSON_ELEMENTS = 1 << 20
# JSON objects a body may hold: each chat message, tool and content part is one or more.
MAX_JSON_OBJECTS = 1 << 14
# Chat messages above this are validated one by one (a single pydantic call over 100k messages holds the GIL).
NUM_MESSAGES_VALIDATED_AT_ONCE = 256


_gc_lock = threading.Lock()
_num_gc_pauses = 0
_was_gc_enabled = True


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pauses the cyclic garbage collector while a worker thread builds a large request's objects: a collection
    pass triggered by those allocations walks the whole heap with the GIL held (hundreds of ms for 60k messages)."""
    global _num_gc_pauses, _was_gc_enabled
    with _gc_lock:
        if _num_gc_pauses == 0:
            _was_gc_enabled = gc.isenabled()
            gc.disable()
        _num_gc_pauses += 1
    try:
        yield
    finally:
        with _gc_lock:
            _num_gc_pauses -= 1
            if _num_gc_pauses == 0 and _was_gc_enabled:
                gc.enable()


def check_content_type(request: Request) -> None:
    """vLLM's validate_json_request: the media type must be application/json."""
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != JSON_MEDIA_TYPE:
        raise APIError(
            "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed", err_type="Bad Request"
        )


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The whole body, or 413 as soon as it passes max_bytes; a client that drops mid-upload is ClientGone."""
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise request_too_large(max_bytes)
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone() from None
    return b"".join(chunks)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _py_int(text: str) -> int:
    return int(text)


def _py_float(text: str) -> float:
    return float(text)


class _ObjectCounter:
    """object_pairs_hook that builds dicts and refuses the body past MAX_JSON_OBJECTS of them."""

    def __init__(self) -> None:
        self.num_objects = 0

    def __call__(self, pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        self.num_objects += 1
        if self.num_objects > MAX_JSON_OBJECTS:
            raise _TooManyObjects()
        return dict(pairs)


class _TooManyObjects(Exception):
    pass


def parse_json(raw: bytes, *, is_interruptible: bool = False) -> dict[str, Any]:
    """The body as a JSON object; with is_interruptible, Python hooks let other threads run between values.

    Braces in the raw bytes bound the number of objects from above (strings may hold braces too): only a body
    with more braces than MAX_JSON_OBJECTS has its objects counted, which needs the hooks."""
    num_elements = raw.count(b",") + raw.count(b"[") + raw.count(b"{")
    if num_elements > MAX_JSON_ELEMENTS:
        raise bad_request(f"The request body holds more than {MAX_JSON_ELEMENTS} JSON elements.")
    is_interruptible = is_interruptible or raw.count(b"{") > MAX_JSON_OBJECTS
    hooks: dict[str, Any] = {}
    if is_interruptible:
        hooks = {"parse_int": _py_int, "parse_float": _py_float, "object_pairs_hook": _ObjectCounter()}
    try:
        # A collection pass over millions of fresh containers would hold the GIL for seconds.
        with gc_paused() if is_interruptible else contextlib.nullcontext():
            data = json.loads(raw, parse_constant=_reject_constant, **hooks)
    except _TooManyObjects:
        raise bad_request(f"The request body holds more than {MAX_JSON_OBJECTS} JSON objects.") from None
    except UnicodeDecodeError as exc:
        raise bad_request(f"The request body is not valid UTF-8: {exc.reason}.") from None
    except json.JSONDecodeError as exc:
        raise bad_request(f"The request body is not valid JSON: {exc.msg} (char {exc.pos}).") from None
    except (ValueError, RecursionError) as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}.") from None
    if not isinstance(data, dict):
        raise bad_request("The request body must be a JSON object.")
    return data


def parse_body(model: type[ModelT], data: dict[str, Any]) -> ModelT:
    try:
        messages = data.get("messages")
        if isinstance(messages, list) and len(messages) > NUM_MESSAGES_VALIDATED_AT_ONCE:
            message_model = model.model_fields["messages"].annotation.__args__[0]  # list[ChatMessage]
            data = {**data, "messages": [message_model.model_validate(item) for item in messages]}
        return model.model_validate(data)
    except pydantic.ValidationError as exc:
        raise validation_error(exc) from None
    except RecursionError:
        raise bad_request("The request body is nested too deeply.") from None


async def read_json(state: ServerState, request: Request) -> tuple[dict[str, Any], bool]:
    """(the body as a JSON object, whether it is large); large bodies are parsed on a worker thread."""
    check_content_type(request)
    raw = await read_body(request, state.settings.max_request_body_bytes)
    if len(raw) <= OFF_LOOP_BYTES:
        return parse_json(raw), False
    return await state.tokens.run(parse_json, raw, is_interruptible=True), True


async def parse_request(
    state: ServerState, request: Request, model: type[ModelT], body: tuple[dict[str, Any], bool] | None = None
) -> ModelT:
    """The request model of a body (read here unless /invocations already read it); large ones off the loop."""
    data, is_large = body if body is not None else await read_json(state, request)
    if is_large:

        def parse() -> ModelT:
            with gc_paused():
                return parse_body(model, data)

        return await state.tokens.run(parse)
    return parse_body(model, data)


def check_model(state: ServerState, model: str | None) -> None:
    """vLLM accepts a missing or empty model and any served name; anything else is a 404."""
    if model and model not in state.settings.served_model_names:
        raise model_not_found(model)


def check_token_ids(state: ServerState, token_ids: list[int], param: str) -> None:
    vocab_size = state.vocab_size
    if token_ids and not (min(token_ids) >= 0 and max(token_ids) < vocab_size):
        outside = next(token_id for token_id in token_ids if not 0 <= token_id < vocab_size)
        raise bad_request(f"Token id {outside} is out of vocabulary (vocab size {vocab_size}).", param)


def check_context(state: ServerState, num_prompt_tokens: int, max_tokens: int | None, prompt_param: str) -> None:
    """vLLM's context checks: the prompt must leave room for one token, prompt + max_tokens must fit."""
    max_model_len = state.engine.max_model_len
    if num_prompt_tokens == 0:
        raise bad_request("The prompt cannot be empty.", prompt_param)
    if num_prompt_tokens >= max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{num_prompt_tokens} input tokens. Please reduce the length of the input.",
            prompt_param,
        )
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise bad_request(
            f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum context "
            f"length is {max_model_len} tokens and your request has {num_prompt_tokens} input tokens "
            f"({max_tokens} > {max_model_len} - {num_prompt_tokens}).",
            "max_tokens",
        )


def truncation_length(truncate_prompt_tokens: int | None, max_model_len: int) -> int | None:
    """vLLM's truncate_prompt_tokens: k tokens kept, -1 meaning max_model_len; None: no truncation."""
    if truncate_prompt_tokens is None:
        return None
    if truncate_prompt_tokens == -1:
        return max_model_len
    if truncate_prompt_tokens < 1 or truncate_prompt_tokens > max_model_len:
        raise bad_request(
            f"truncate_prompt_tokens must be -1 or in [1, {max_model_len}], got {truncate_prompt_tokens}.",
            "truncate_prompt_tokens",
        )
    return truncate_prompt_tokens


def truncate_ids(token_ids: list[int], keep: int | None, side: str | None) -> list[int]:
    """Token-id prompts are truncated as text prompts are: the last `keep` tokens, or the first with side right."""
    if keep is None or len(token_ids) <= keep:
        return token_ids
    return token_ids[:keep] if side == "right" else token_ids[-keep:]


def request_ids(request: Request, body_request_id: str | None, prefix: str) -> str:
    """The response id: prefix + X-Request-Id (or the body's request_id, or a fresh uuid), as vLLM builds it."""
    base = request.headers.get("x-request-id") or body_request_id or uuid.uuid4().hex
    return f"{prefix}-{base}"


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
    num_cached_tokens: int | None = None,
    num_reasoning_tokens: int | None = None,
) -> dict[str, Any]:
    """vLLM's UsageInfo. num_cached_tokens is given only under --enable-prompt-tokens-details; reasoning tokens
    only with a reasoning parser (vLLM reports completion_tokens_details then)."""
    body: dict[str, Any] = {
        "prompt_tokens": num_prompt_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
        "completion_tokens": num_completion_tokens,
        "prompt_tokens_details": None if num_cached_tokens is None else {"cached_tokens": num_cached_tokens},
    }
    if num_reasoning_tokens is not None:
        body["completion_tokens_details"] = {"reasoning_tokens": num_reasoning_tokens}
    return body


def without_none(body: dict[str, Any]) -> dict[str, Any]:
    """Streamed usage is serialised with None fields left out, as vLLM's final chunk is."""
    return {key: value for key, value in body.items() if value is not None}


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
    state: ServerState, prompt_token_ids: list[int], params: SamplingParams, request_id: str, arrival: float
) -> AsyncGenerator[RequestOutput, None]:
    """engine.generate with metrics, and a cleanup that always aborts an unfinished request."""
    max_tokens = params.max_tokens or state.engine.max_model_len - len(prompt_token_ids)
    tracker = state.metrics.track(len(prompt_token_ids), params.n, max_tokens, arrival)
    iterator = state.engine.generate(prompt_token_ids, params, request_id)
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
    if err.status >= 500:
        logger.error("stream failed: %r", exc, exc_info=exc)
    return sse(err.payload())
