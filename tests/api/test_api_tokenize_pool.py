"""The tokenizer pool is fair under hostile load (issue 39): large inputs run on a pool of their own, so /tokenize
requests with huge texts cannot hold the threads an ordinary completion is tokenised on.

The encodes of large texts are held inside the tokenizer (a wrapper waits on an event) until the test lets them go,
so "in flight" is exact rather than a matter of timing; the large-input threshold is lowered to fit the FakeEngine's
2,048-token context. On the shared pool of before, the held encodes took all four threads and the completion timed
out waiting for one.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from transformers import PreTrainedTokenizerFast

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


def test_inputs_go_to_the_pool_their_size_calls_for(tokenizer: PreTrainedTokenizerFast) -> None:
    """Encodes by characters, decodes and token strings by tokens: at the threshold and above, the large pool."""
    tokens = Tokens(tokenizer)
    tokens.large_chars, tokens.large_tokens = 100, 50
    used: list[str] = []  # the pool (thread-name prefix) each call ran on

    def recording(run_on: Any) -> Any:
        async def wrapped(fn: Any, *args: Any) -> Any:
            def call() -> Any:
                used.append(threading.current_thread().name.rsplit("_", 1)[0])
                return fn(*args)

            return await run_on(call)

        return wrapped

    tokens.run, tokens.run_large = recording(tokens.run), recording(tokens.run_large)  # type: ignore[method-assign]

    async def calls() -> None:
        for text in ("x" * 99, "x" * 100):
            assert (await tokens.encode(text, add_special_tokens=False))[0] == tokenizer.encode(text)
        for count in (49, 50):
            assert await tokens.decode([5] * count) == tokenizer.decode([5] * count)
            assert await tokens.token_strings([5] * count) == tokenizer.convert_ids_to_tokens([5] * count)

    try:
        asyncio.run(calls())
    finally:
        tokens.close()
    small_pool, large_pool = "deltaserve-tokenize", "deltaserve-tokenize-large"
    assert used == [small_pool, large_pool, small_pool, small_pool, large_pool, large_pool]
