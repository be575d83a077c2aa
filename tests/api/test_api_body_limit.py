"""A refused upload still lets its client read the 413: the server reads the rest of the body (within a bound)
before it answers and closes, so the kernel does not reset the connection under a client that is still sending
(the chunked case: uvicorn reads the rest after the answer)."""

from __future__ import annotations

import http.client
import time
from collections.abc import Iterator

import pytest

from deltaserve.api.server import build_app

from .fake_engine import FakeEngine
from .hostile_server import BODY_LIMIT, hostile_settings
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
