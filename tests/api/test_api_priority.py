"""The request field `priority` and --scheduling-policy through the HTTP API.

Without `--scheduling-policy priority` a priority other than 0 is refused with vLLM's words (a 400 before any
work, streamed or not); the field is an int64 as vLLM's pydantic field. With the policy, the real engine (tiny
checkpoint, one running place) serves a queued request of a lower value before one that arrived earlier.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from deltaserve.engine_config import EngineConfig

from .server_thread import ServerThread, metric_value, serve

USER = [{"role": "user", "content": "hi"}]
REFUSAL = "Got priority {} but Priority scheduling is not enabled."


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "x", "max_tokens": 2, "priority": 5}),
        ("/v1/completions", {"prompt": "x", "max_tokens": 2, "priority": -1, "stream": True}),
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 2, "priority": 3}),
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 2, "priority": 3, "stream": True}),
    ],
)
def test_priority_without_the_policy_is_refused(http: httpx.Client, path: str, body: dict[str, Any]) -> None:
    response = http.post(path, json=body)
    assert response.status_code == 400 and response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert error == {"message": REFUSAL.format(body["priority"]), "type": "BadRequestError", "param": "priority",
                     "code": 400}  # fmt: skip


@pytest.mark.parametrize("value", ["high", 1.5, 2**63, -(2**63) - 1, [1], None])
def test_priority_must_be_an_int64(http: httpx.Client, value: Any) -> None:
    response = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "priority": value})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "BadRequestError" and error["message"].startswith("1 validation error")
    assert "priority" in error["message"]


def test_priority_zero_is_the_default_and_accepted(http: httpx.Client) -> None:
    for body in ({"prompt": "x", "max_tokens": 2, "priority": 0}, {"messages": USER, "max_tokens": 2, "priority": 0}):
        path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
        assert http.post(path, json=body).status_code == 200


@pytest.fixture(scope="module")
def priority_server(tiny_dense: Path) -> Iterator[ServerThread]:
    from deltaserve.engine.async_engine import AsyncEngine

    config = EngineConfig(model=str(tiny_dense), device="cpu", max_model_len=512, max_num_seqs=1,
                          scheduling_policy="priority")  # fmt: skip
    server = serve(AsyncEngine.from_config(config), scheduling_policy="priority")
    yield server
    server.stop()


def wait_for_waiting(http: httpx.Client, count: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while metric_value(http.get("/metrics").text, "vllm:num_requests_waiting") != count:
        assert time.monotonic() < deadline, f"never {count} requests waiting"
        time.sleep(0.005)


def test_a_lower_value_queued_later_is_served_first(priority_server: ServerThread) -> None:
    """One running place, held by a long stream; b (priority 5) queues, then c (priority -1). Once the stream is
    closed, c runs to its end before b starts: c's response is complete before b's first token."""
    finished: dict[str, float] = {}
    first_token: dict[str, float] = {}

    def send(name: str, priority: int) -> None:
        body = {"prompt": "hello", "max_tokens": 8, "ignore_eos": True, "priority": priority, "stream": True}
        with httpx.stream("POST", priority_server.base_url + "/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: {") and '"text":"' in line:
                    first_token.setdefault(name, time.monotonic())
        finished[name] = time.monotonic()

    with httpx.Client(base_url=priority_server.base_url, timeout=60) as http:
        body = {"prompt": "hold", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as holder:
            lines = holder.iter_lines()  # kept: closing the iterator would close the stream
            next(lines)  # the holder runs: it has the one place
            threads = []
            for count, (name, priority) in enumerate((("b", 5), ("c", -1)), start=1):
                threads.append(threading.Thread(target=send, args=(name, priority)))
                threads[-1].start()
                wait_for_waiting(http, count)
        # leaving the block closes the holder's stream: the engine aborts it and frees its place
        for thread in threads:
            thread.join(timeout=60)
    assert set(finished) == {"b", "c"}
    assert finished["c"] < first_token["b"]


def test_the_flag_reaches_the_engine_and_the_server(capsys: pytest.CaptureFixture[str]) -> None:
    from deltaserve.api import cli

    from .test_api_flags import parse

    args = parse("m", "--scheduling-policy", "priority")
    assert cli.build_engine_config(args, "m", "cpu").scheduling_policy == "priority"
    assert cli.build_settings(args, "m").scheduling_policy == "priority"
    assert cli.build_engine_config(parse("m"), "m", "cpu").scheduling_policy == "fcfs"
    with pytest.raises(SystemExit):
        parse("m", "--scheduling-policy", "lifo")
    assert "invalid choice: 'lifo'" in capsys.readouterr().err
