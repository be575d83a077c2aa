"""The tokenizer pool is fair under hostile load (issue 39): large inputs run on a pool of their own, so /tokenize
requests with huge texts cannot hold the threads an ordinary completion is tokenised on.

The encodes of large texts are held inside the tokenizer (a wrapper waits on an event) until the test lets them go,
so "in flight" is exact rather than a matter of timing; the large-input threshold is lowered to fit the FakeEngine's
2,048-token context. On the shared pool of before, the held encodes took all four threads and the completion timed
out waiting for one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from deltaserve.api.tokens import NUM_LARGE_THREADS, NUM_THREADS, Tokens

from .fake_engine import FakeEngine
from .server_thread import MODEL_NAME, ServerThread, serve

LARGE_CHARS = 1000
NUM_LARGE_REQUESTS = NUM_THREADS + NUM_LARGE_THREADS  # more than every thread of both pools
WAIT_S = 5.0


class HeldEncodes:
    """Wraps Tokens._encode_sync: texts of at least LARGE_CHARS wait for `release` (counted while they wait)."""

    def __init__(self, tokens: Tokens) -> None:
        self.release = threading.Event()
        self.num_waiting = 0
        self.lock = threading.Lock()
        encode = tokens._encode_sync

        def held(text: str, *args: Any) -> Any:
            if len(text) >= LARGE_CHARS:
                with self.lock:
                    self.num_waiting += 1
                self.release.wait(WAIT_S * 4)
            return encode(text, *args)

        tokens._encode_sync = held  # type: ignore[method-assign]


@pytest.fixture(scope="module")
def server(fake_engine: FakeEngine) -> Iterator[ServerThread]:
    server = serve(fake_engine)
    yield server
    server.stop()


def test_large_tokenize_requests_leave_the_small_pool_free(server: ServerThread) -> None:
    tokens: Tokens = server.server.config.app.state.deltaserve.tokens
    tokens.large_chars = LARGE_CHARS
    held = HeldEncodes(tokens)
    large = {"model": MODEL_NAME, "prompt": "hello world " * (LARGE_CHARS // 10)}  # under the context's char bound
    with ThreadPoolExecutor(NUM_LARGE_REQUESTS) as pool, httpx.Client(base_url=server.base_url) as client:
        try:
            futures = [pool.submit(client.post, "/tokenize", json=large, timeout=WAIT_S * 4)
                       for _ in range(NUM_LARGE_REQUESTS)]  # fmt: skip
            deadline = time.monotonic() + WAIT_S
            while held.num_waiting < min(NUM_LARGE_THREADS, NUM_THREADS):
                assert time.monotonic() < deadline, "the large encodes did not start"
                time.sleep(0.01)
            start = time.perf_counter()
            body = {"model": MODEL_NAME, "prompt": "Hello there", "max_tokens": 2}
            response = client.post("/v1/completions", json=body, timeout=WAIT_S)
            waited = time.perf_counter() - start
            assert response.status_code == 200, response.text
            assert not any(future.done() for future in futures)  # the large encodes are all still held
            assert waited < WAIT_S / 2
            # the large ones wait for the large pool's threads, not the shared ones
            assert held.num_waiting == NUM_LARGE_THREADS
        finally:
            held.release.set()
        assert all(future.result().status_code == 200 for future in futures)
