"""Slow clients are bounded: a request head that does not arrive in time closes the connection (slowloris), and a
body that stalls gets a 408 and the connection closed; a prompt client is untouched."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from deltaserve.api.http_protocol import protocol_with_header_timeout
from tests.api.fake_engine import FakeEngine
from tests.api.server_thread import ServerThread, serve

TIMEOUT_S = 0.3


@pytest.fixture(scope="module")
def timed_server(fake_engine: FakeEngine) -> Iterator[ServerThread]:
    server = serve(
        fake_engine, options={"http": protocol_with_header_timeout(TIMEOUT_S)}, body_read_timeout_s=TIMEOUT_S
    )
    yield server
    server.stop()


def _connect(server: ServerThread) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.settimeout(TIMEOUT_S + 3)
    return sock


def _read_until_closed(sock: socket.socket) -> bytes:
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def test_a_slow_request_head_is_closed(timed_server: ServerThread) -> None:
    silent = _connect(timed_server)
    slow = _connect(timed_server)
    slow.sendall(b"GET /health HTTP/1.1\r\nHo")  # and then nothing: a slowloris connection
    started = time.monotonic()
    assert _read_until_closed(silent) == b"" and _read_until_closed(slow) == b""
    assert time.monotonic() - started < TIMEOUT_S + 2
    # a client that sends its request promptly, twice on one connection, is served
    with httpx.Client(base_url=timed_server.base_url) as client:
        for _ in range(2):
            assert client.get("/health").status_code == 200


def test_a_stalled_body_gets_a_408_and_the_connection_closes(timed_server: ServerThread) -> None:
    sock = _connect(timed_server)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b'Content-Length: 100\r\n\r\n{"model": ')  # fmt: skip
    started = time.monotonic()
    response = _read_until_closed(sock)
    assert time.monotonic() - started < TIMEOUT_S + 2
    assert response.startswith(b"HTTP/1.1 408 "), response
    assert b"not received in time" in response
