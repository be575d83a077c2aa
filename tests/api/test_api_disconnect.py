"""A client that goes away aborts its request: the FakeEngine's KV blocks and state slots come back (via /metrics)."""

from __future__ import annotations

import time

import httpx
import pytest

from .fake_engine import FakeEngine
from .server_thread import metric_value


def wait_until_freed(http: httpx.Client, timeout: float = 10.0) -> str:
    """Polls /metrics until every KV block and state slot is free and nothing runs; returns the last scrape."""
    deadline = time.monotonic() + timeout
    while True:
        text = http.get("/metrics").text
        is_free = metric_value(text, "deltaserve:num_free_kv_blocks") == metric_value(
            text, "deltaserve:num_total_kv_blocks"
        ) and metric_value(text, "deltaserve:num_free_state_slots") == metric_value(
            text, "deltaserve:num_total_state_slots"
        )
        if is_free and metric_value(text, "vllm:num_requests_running") == 0:
            return text
        if time.monotonic() > deadline:
            raise AssertionError("resources were not freed:\n" + text)
        time.sleep(0.02)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "x", "max_tokens": 1500, "ignore_eos": True, "stream": True}),
        ("/v1/completions", {"prompt": ["a", "b"], "n": 2, "max_tokens": 1500, "ignore_eos": True, "stream": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True, "stream": True}),
    ],
    ids=["completion", "batched-completion", "chat"],
)
def test_stream_disconnect_frees_resources(
    http: httpx.Client, fake_engine: FakeEngine, path: str, body: dict[str, object]
) -> None:
    fake_engine.step_delay = 0.005
    num_aborted = fake_engine.num_aborted
    with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        # next() rather than a for/break: abandoning the iterator would already drop the connection.
        lines = response.iter_lines()
        num_chunks = 0
        while num_chunks < 3:
            num_chunks += next(lines).startswith("data: ")
        busy = metric_value(http.get("/metrics").text, "deltaserve:num_free_state_slots")
        assert busy < fake_engine.num_total_state_slots, "the request holds a state slot while streaming"
        # Leaving the block closes the connection mid-stream.
    text = wait_until_freed(http)
    assert fake_engine.num_aborted > num_aborted
    assert 'finished_reason="abort"' in text
    assert http.get("/load").json() == {"server_load": 0}


def sample(text: str, name: str, label: str = "") -> float:
    """The value of the sample `name` whose labels hold `label` (0 when it has none)."""
    for line in text.splitlines():
        if line.startswith(name + "{") and label in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_disconnect_is_not_counted_as_a_finished_request(http: httpx.Client, fake_engine: FakeEngine) -> None:
    """As vLLM: a request its client abandoned is dropped without being recorded as finished, so the abort series of
    vllm:request_success_total, the e2e latency and the per-request token histograms do not move."""
    fake_engine.step_delay = 0.005
    before = http.get("/metrics").text
    body = {"prompt": "x", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        while not next(lines).startswith("data: "):
            pass
    after = wait_until_freed(http)
    for name, label in (
        ("vllm:request_success_total", 'finished_reason="abort"'),
        ("vllm:e2e_request_latency_seconds_count", ""),
        ("vllm:request_prompt_tokens_count", ""),
        ("vllm:request_generation_tokens_count", ""),
    ):
        assert sample(after, name, label) == sample(before, name, label), name
    assert sample(after, "vllm:generation_tokens_total") > sample(before, "vllm:generation_tokens_total")


def test_non_streaming_disconnect_frees_resources(http: httpx.Client, fake_engine: FakeEngine) -> None:
    fake_engine.step_delay = 0.005
    num_aborted = fake_engine.num_aborted
    body = {"prompt": "x", "max_tokens": 1500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(str(http.base_url) + "/v1/completions", json=body, timeout=0.5)
    wait_until_freed(http)
    assert fake_engine.num_aborted == num_aborted + 1
    assert http.get("/load").json() == {"server_load": 0}


def test_batch_chat_disconnect_aborts_every_conversation(http: httpx.Client, fake_engine: FakeEngine) -> None:
    """/v1/chat/completions/batch runs its conversations concurrently: a client that goes away aborts all of them
    (each was submitted, so each is aborted and counted as one), and their blocks and slots come back."""
    fake_engine.step_delay = 0.005
    num_aborted = fake_engine.num_aborted
    conversations = [[{"role": "user", "content": word}] for word in ("a", "b", "c")]
    body = {"messages": conversations, "max_tokens": 1500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(str(http.base_url) + "/v1/chat/completions/batch", json=body, timeout=0.5)
    text = wait_until_freed(http)
    assert fake_engine.num_aborted == num_aborted + len(conversations)
    assert 'finished_reason="abort"' in text
    assert http.get("/load").json() == {"server_load": 0}
