"""Request bodies: read against the size limit, checked for JSON's media type, parsed and validated.

Bodies are read against --max-request-body-bytes (413) and must be `application/json` (vLLM's 400 otherwise). A
large body is parsed and validated on a worker thread, through Python hooks (so the thread yields the GIL between
elements) with the garbage collector paused. Two bounds keep the object graph of one request small, because
building (and later collecting) millions of Python objects stalls the event loop whatever thread does it: at most
MAX_JSON_ELEMENTS values (a 1,048,576-token prompt fits) and MAX_JSON_OBJECTS objects (16,384 chat messages; the
garbage collector walks every container, token ids are not containers). vLLM has neither bound. A third,
MAX_JSON_DEPTH, refuses deep nesting (a tool schema 450 levels deep) with a 400 naming the field, before recursive
code downstream (pickling, schema compilation) fails on it.

An upload refused by its declared length (middleware.BodySizeMiddleware) is read to its end first (up to
MAX_DRAIN_BYTES, for at most DRAIN_TIMEOUT_S): a server that closes a connection with unread bytes makes the kernel
reset it, and the reset can throw the 413 away before the client, still uploading, reads it. (A chunked body refused
mid-read needs nothing: uvicorn reads and drops the rest after the answer.) vLLM reads every body whole. A client
that stops sending its body for --timeout-request-body seconds gets a 408 and the connection is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any, TypeVar

import pydantic
from fastapi import Request
from starlette.requests import ClientDisconnect

from deltaserve.api.errors import APIError, ClientGone, bad_request, request_too_large, validation_error
from deltaserve.api.settings import ServerState

ModelT = TypeVar("ModelT", bound=pydantic.BaseModel)

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
# Nesting levels a body may hold (the body itself is level 1). Deeper values reach recursive code downstream (pickling
# a tool schema to the template worker, compiling a JSON schema) and fail there with a RecursionError at ~300-400
# levels; a JSON schema spends two levels per level of its own, so 128 leaves a schema 60 levels deep.
MAX_JSON_DEPTH = 128
# How much of a refused upload is read and thrown away, and for how long, so that the client can read the 413.
MAX_DRAIN_BYTES = 64 * 2**20
DRAIN_TIMEOUT_S = 10.0


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


def body_timeout(timeout_s: float) -> APIError:
    return APIError(
        f"The request body was not received in time: nothing arrived for {timeout_s:g} s.",
        status=408,
        err_type="Request Timeout",
    )


async def read_body(request: Request, max_bytes: int, timeout_s: float | None = None) -> bytes:
    """The whole body, or 413 as soon as it passes max_bytes; 408 when no part of it arrives for timeout_s (None:
    no bound); a client that drops mid-upload is ClientGone."""
    chunks: list[bytes] = []
    size = 0
    stream = request.stream()
    try:
        while True:
            try:
                # the bound is between two reads, so a slow but steady upload of a large body still gets through
                async with asyncio.timeout(timeout_s):
                    chunk = await anext(stream)
            except StopAsyncIteration:
                break
            except TimeoutError:
                raise body_timeout(timeout_s or 0.0) from None
            size += len(chunk)
            if size > max_bytes:
                raise request_too_large(max_bytes)
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone() from None
    finally:
        await stream.aclose()
    return b"".join(chunks)


async def drain(chunks: AsyncIterator[bytes]) -> bool:
    """Reads and drops the rest of a refused body; True if it ended within the bounds (see the module docstring)."""
    size = 0
    try:
        async with asyncio.timeout(DRAIN_TIMEOUT_S):
            async for chunk in chunks:
                size += len(chunk)
                if size > MAX_DRAIN_BYTES:
                    return False
    except (TimeoutError, ClientDisconnect):
        return False
    return True


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
    check_depth(data)
    return data


def check_depth(data: dict[str, Any]) -> None:
    """A 400 naming the field (its first four steps) where the body nests deeper than MAX_JSON_DEPTH levels."""
    path = _first_too_deep(data)
    if path is not None:
        field = "".join(f"[{key}]" if isinstance(key, int) else f".{key}" for key in path[:4]).lstrip(".")
        raise bad_request(f"`{field}` is nested more than {MAX_JSON_DEPTH} levels deep.", field)


def _first_too_deep(data: dict[str, Any]) -> tuple[str | int, ...] | None:
    # Iterative: a recursive walk would itself hit the recursion limit on the bodies it is there to refuse.
    stack: list[tuple[dict[str, Any] | list[Any], tuple[str | int, ...]]] = [(data, ())]
    while stack:
        value, path = stack.pop()
        if len(path) >= MAX_JSON_DEPTH:
            return path
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(item, dict | list):
                stack.append((item, (*path, key)))
    return None


def _message_model(model: type[pydantic.BaseModel]) -> type[pydantic.BaseModel] | None:
    """The model of one chat message where `messages` is a list of them (list[ChatMessage]); None otherwise (no
    messages, or the batch endpoint's list of conversations, which is validated whole)."""
    field = model.model_fields.get("messages")
    args = getattr(field.annotation, "__args__", ()) if field is not None else ()
    item = args[0] if args else None
    return item if isinstance(item, type) and issubclass(item, pydantic.BaseModel) else None


def parse_body(model: type[ModelT], data: dict[str, Any]) -> ModelT:
    try:
        messages = data.get("messages")
        message_model = _message_model(model)
        if message_model is not None and isinstance(messages, list) and len(messages) > NUM_MESSAGES_VALIDATED_AT_ONCE:
            data = {**data, "messages": [message_model.model_validate(item) for item in messages]}
        return model.model_validate(data)
    except pydantic.ValidationError as exc:
        raise validation_error(exc) from None
    except RecursionError:
        raise bad_request("The request body is nested too deeply.") from None


async def read_json(state: ServerState, request: Request) -> tuple[dict[str, Any], bool]:
    """(the body as a JSON object, whether it is large); large bodies are parsed on a worker thread."""
    check_content_type(request)
    raw = await read_body(request, state.settings.max_request_body_bytes, state.settings.body_read_timeout_s)
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
