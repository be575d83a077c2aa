"""Bounds on a request body. A refused upload still lets its client read the 413: the server reads the rest of the
body (within a bound) before it answers and closes, so the kernel does not reset the connection under a client that
is still sending (the chunked case: uvicorn reads the rest after the answer). Nesting past MAX_JSON_DEPTH is a 400
naming the field, before recursive code (pickling to the template worker) fails on it."""

from __future__ import annotations

import http.client
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from deltaserve.api.body import MAX_JSON_DEPTH
from deltaserve.api.server import build_app

from .fake_engine import FakeEngine
from .hostile_server import BODY_LIMIT, MODEL_NAME, hostile_settings
from .server_thread import ServerThread

OVER = BODY_LIMIT + 2 * 2**20
CHUNK = 64 * 2**10


@pytest.fixture(scope="module")
def server(fake_engine: FakeEngine) -> Iterator[ServerThread]:
    server = ServerThread(build_app(fake_engine, hostile_settings())).start()
    yield server
    server.stop()


def upload(server: ServerThread, headers: dict[str, str], body: Iterator[bytes]) -> http.client.HTTPResponse:
    """Sends the headers, waits until the server has answered them, then the whole body; only then reads."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    connection.putrequest("POST", "/v1/completions")
    for name, value in {"Content-Type": "application/json", **headers}.items():
        connection.putheader(name, value)
    connection.endheaders()
    time.sleep(0.2)  # a server that answers at the headers and closes has done so by now
    for chunk in body:
        connection.send(chunk)
    return connection.getresponse()


def test_413_on_a_declared_length_is_readable_after_the_upload(server: ServerThread) -> None:
    response = upload(server, {"Content-Length": str(OVER)}, (b" " * CHUNK for _ in range(OVER // CHUNK)))
    assert response.status == 413
    assert "--max-request-body-bytes" in response.read().decode()


def test_413_on_a_chunked_body_is_readable_after_the_upload(server: ServerThread) -> None:
    framed = (b"%x\r\n%s\r\n" % (CHUNK, b" " * CHUNK) for _ in range(OVER // CHUNK))
    response = upload(server, {"Transfer-Encoding": "chunked"}, iter([*framed, b"0\r\n\r\n"]))
    assert response.status == 413
    assert "--max-request-body-bytes" in response.read().decode()


def test_expect_100_continue_gets_the_413_without_uploading(server: ServerThread) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    connection.putrequest("POST", "/v1/completions")
    for name, value in {
        "Content-Type": "application/json",
        "Content-Length": str(OVER),
        "Expect": "100-continue",
    }.items():
        connection.putheader(name, value)
    connection.endheaders()
    started = time.monotonic()
    response = connection.getresponse()  # nothing of the body was sent: the answer comes at once
    assert response.status == 413 and time.monotonic() - started < 5


def nested_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def tools_nested(depth: int) -> dict[str, Any]:
    tool = {"type": "function", "function": {"name": "f", "parameters": nested_schema(depth)}}
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": [tool]}


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/chat/completions", tools_nested(450), "tools[0].function.parameters"),
        ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "response_format": {"type": "json_schema",
         "json_schema": {"name": "x", "schema": nested_schema(450)}}}, "response_format.json_schema.schema.properties"),
    ],
)  # fmt: skip
def test_over_deep_nesting_is_a_400_naming_the_field(
    server: ServerThread, path: str, body: dict[str, Any], field: str
) -> None:
    response = httpx.post(server.base_url + path, json=body, timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error == {
        "message": f"`{field}` is nested more than {MAX_JSON_DEPTH} levels deep.",
        "type": "BadRequestError",
        "param": field,
        "code": 400,
    }


def test_a_schema_well_within_the_depth_bound_is_served(server: ServerThread) -> None:
    response = httpx.post(server.base_url + "/v1/chat/completions", json=tools_nested(20), timeout=30)
    assert response.status_code == 200, response.text
