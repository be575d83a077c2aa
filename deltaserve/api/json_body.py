"""Large JSON response bodies, rendered off the event loop in small GIL-holding steps and sent in pieces.

`json.dumps` of a whole body is one C call that holds the GIL from start to end: on a worker thread it still stops
the event loop for as long as it runs (seconds for a body of a few hundred MB). `render_json` produces the very same
bytes as Starlette's JSONResponse (compact separators, ensure_ascii off, NaN refused) but walks the value and hands
`json.dumps` only pieces of bounded size: long lists go SLICE_ITEMS elements at a time, dicts and lists holding big
containers are walked into. Between pieces the interpreter may switch threads, so /health keeps answering while a
worker thread renders. A `RawJSON` value is text already rendered (a prompt's logprobs, shared by its n choices) and
is emitted as is, without copying it per choice.

`JSONPiecesResponse` sends the rendered pieces one ASGI message each, with the total Content-Length, so a body is
never joined into one more copy.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

# Elements of a list rendered by one json.dumps call: scalars, and small containers (a token's logprob entry).
SLICE_SCALARS = 4096
SLICE_ITEMS = 256
# A container this long, or holding one, is walked into rather than rendered in one call.
FLAT_LEN = 64
# Rendered text is grouped into pieces of about this many characters before encoding.
PIECE_CHARS = 1 << 20

_dumps = functools.partial(json.dumps, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))


class RawJSON:
    """JSON already rendered (render_json's pieces), emitted verbatim and uncopied wherever the value appears."""

    __slots__ = ("chunks",)

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks


def _is_flat(value: Any) -> bool:
    """Small enough to render in one call: not a container, or a short one of scalars and short scalar-only ones."""
    if isinstance(value, RawJSON):
        return False
    if not isinstance(value, dict | list | tuple):
        return True
    if len(value) > FLAT_LEN:
        return False
    for item in value.values() if isinstance(value, dict) else value:
        if isinstance(item, RawJSON):
            return False
        if isinstance(item, dict | list | tuple):
            if len(item) > FLAT_LEN:
                return False
            inner = item.values() if isinstance(item, dict) else item
            if any(isinstance(x, dict | list | tuple | RawJSON) for x in inner):
                return False
    return True


def _pieces(value: Any) -> Iterator[str | RawJSON]:
    if isinstance(value, RawJSON):
        yield value
    elif _is_flat(value):
        yield _dumps(value)
    elif isinstance(value, dict):
        if not all(isinstance(key, str) for key in value):
            yield _dumps(value)  # json's key coercion (ints, floats, None) is not repeated here
            return
        yield "{"
        for position, (key, item) in enumerate(value.items()):
            yield ("," if position else "") + _dumps(key) + ":"
            yield from _pieces(item)
        yield "}"
    else:
        yield "["
        step = SLICE_SCALARS if not isinstance(value[0], dict | list | tuple | RawJSON) else SLICE_ITEMS
        for start in range(0, len(value), step):
            part = value[start : start + step]
            if start:
                yield ","
            if all(_is_flat(item) for item in part):
                yield _dumps(part)[1:-1]
            else:
                for position, item in enumerate(part):
                    if position:
                        yield ","
                    yield from _pieces(item)
        yield "]"


def render_json(value: Any) -> list[bytes]:
    """The UTF-8 JSON of value, byte for byte JSONResponse's, as a list of pieces (run it on a worker thread)."""
    chunks: list[bytes] = []
    pending: list[str] = []
    size = 0
    for piece in _pieces(value):
        if isinstance(piece, RawJSON):
            if pending:
                chunks.append("".join(pending).encode())
                pending, size = [], 0
            chunks.extend(piece.chunks)
            continue
        pending.append(piece)
        size += len(piece)
        if size >= PIECE_CHARS:
            chunks.append("".join(pending).encode())
            pending, size = [], 0
    if pending:
        chunks.append("".join(pending).encode())
    return chunks


class JSONPiecesResponse(Response):
    """An application/json response whose body is a list of byte pieces, sent one message each."""

    media_type = "application/json"

    def __init__(self, chunks: list[bytes], status_code: int = 200) -> None:
        self.chunks = chunks
        super().__init__(b"", status_code=status_code)
        self.headers["content-length"] = str(sum(len(chunk) for chunk in chunks))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        last = len(self.chunks) - 1
        for index, chunk in enumerate(self.chunks):
            await send({"type": "http.response.body", "body": chunk, "more_body": index < last})
        if not self.chunks:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        if self.background is not None:
            await self.background()
