"""`deltaserve serve` as systemd and load balancers see it: a frozen engine core fails /health within the heartbeat
bound (and passes again once it runs), and SIGTERM to the whole process group drains the open streams (they finish)
before the server exits, as SIGTERM to the main process does. One server serves both, so the suite starts one."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx

from tests.support.serve_process import start_serve

HEARTBEAT_TIMEOUT_S = 0.5


def _wait_for_health(base: str, status: int, within_s: float) -> float:
    """Seconds until /health answers `status`; fails past within_s."""
    started = time.monotonic()
    while time.monotonic() - started < within_s:
        if httpx.get(base + "/health", timeout=within_s).status_code == status:
            return time.monotonic() - started
        time.sleep(0.05)
    raise AssertionError(f"/health did not answer {status} within {within_s} s")


def test_a_frozen_core_fails_health_and_a_group_sigterm_drains_open_streams(tiny_dense: Path) -> None:
    server = start_serve(
        tiny_dense, "--timeout-graceful-shutdown", "60", new_session=True,
        env={"DELTASERVE_ENGINE_HEARTBEAT_TIMEOUT_S": str(HEARTBEAT_TIMEOUT_S)},
    )  # fmt: skip
    base = server.base_url
    try:
        core = server.core_pid()
        os.kill(core, signal.SIGSTOP)
        try:
            # the bound: the heartbeat timeout, plus one beat period and a poll's slack
            assert _wait_for_health(base, 503, HEARTBEAT_TIMEOUT_S + 2) < HEARTBEAT_TIMEOUT_S + 2
        finally:
            os.kill(core, signal.SIGCONT)
        _wait_for_health(base, 200, 5)

        events: list[list[dict]] = [[] for _ in range(3)]

        def stream(index: int) -> None:
            body = {"model": "tiny", "prompt": f"drain {index}", "max_tokens": 150, "temperature": 0,
                    "ignore_eos": True, "stream": True}  # fmt: skip
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        events[index].append(json.loads(line[6:]))
                    elif line == "data: [DONE]":
                        events[index].append({"done": True})

        threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(3)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 60
        while min(len(e) for e in events) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        # systemd's default (KillMode=control-group) and `timeout` signal the whole group: the core included
        os.killpg(server.process.pid, signal.SIGTERM)
        num_at_signal = [len(e) for e in events]
        for thread in threads:
            thread.join(60)
        for received, num_before in zip(events, num_at_signal, strict=True):
            assert all("error" not in event for event in received), received[-2:]
            assert received[-1] == {"done": True}
            assert received[-2]["choices"][0]["finish_reason"] == "length"
            assert len(received) > num_before  # it was still streaming when the signal came
        # uvicorn re-raises the signal it drained for once it is done: a clean exit is 0 or "terminated"
        assert server.process.wait(30) in (0, -signal.SIGTERM)
        assert "Traceback" not in server.output()
    finally:
        server.close()
