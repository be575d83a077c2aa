"""`deltaserve serve` as systemd and load balancers see it: a frozen engine core fails /health within the heartbeat
bound (and passes again once it runs), and SIGTERM to the whole process group drains the open streams (they finish)
before the server exits, as SIGTERM to the main process does, while a client stuck mid-upload holds it no longer than
--timeout-graceful-shutdown. One server serves both, so the suite starts one."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx

from deltaserve.engine.core_client import SHUTDOWN_WAIT_S
from tests.support.serve_process import open_streams, start_serve, stuck_upload

HEARTBEAT_TIMEOUT_S = 0.5
# Long enough for the streams below to finish on a busy 2-core machine (6 s cut them once, with other test runs
# loading its cores: CI took 996 s where it takes ~600); the stuck upload is held this long.
GRACEFUL_S = 12.0


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
        tiny_dense, "--timeout-graceful-shutdown", str(GRACEFUL_S), "--timeout-request-body", "60", new_session=True,
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

        # 400 tokens: 3 x 100 took 0.3-0.6 s on a 2-core box, about what the upload and the signal take, so the
        # streams sometimes ended before the signal and the test raced (seen on both sides of the core's reader thread)
        events, threads = open_streams(base, 3, prompt="drain", max_tokens=400, min_events=2)
        upload = stuck_upload(base)
        time.sleep(0.2)  # the upload reaches the body read
        # systemd's default (KillMode=control-group) and `timeout` signal the whole group: the core included
        signalled_at = time.monotonic()
        os.killpg(server.process.pid, signal.SIGTERM)
        num_at_signal = [len(e) for e in events]
        for thread in threads:
            thread.join(60)
        for payloads, num_before in zip(events, num_at_signal, strict=True):
            received = [{"done": True} if p == "[DONE]" else json.loads(p) for p in payloads]
            assert all("error" not in event for event in received), received[-2:]
            assert received[-1] == {"done": True}
            assert received[-2]["choices"][0]["finish_reason"] == "length"
            assert len(received) > num_before  # it was still streaming when the signal came
        # the drain bound, the core's stop bound, and the process's teardown; uvicorn re-raises the signal it drained
        # for once it is done, so a clean exit is 0 or "terminated"
        bound = GRACEFUL_S + SHUTDOWN_WAIT_S + 5
        assert server.process.wait(bound) in (0, -signal.SIGTERM)
        assert time.monotonic() - signalled_at < bound
        upload.close()
        log = server.output()
        assert "Traceback" not in log and not [line for line in log.splitlines() if "ERROR" in line], log
        assert log.count("still open at the shutdown bound") == 1, log
    finally:
        server.close()


def _stream_until_cut(base_url: str, index: int, events: list[list[str]]) -> None:
    """One long streamed completion collecting its payloads; a connection the server cuts ends it quietly."""
    body = {"model": "tiny", "prompt": f"cut {index}", "max_tokens": 3000, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    try:
        with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events[index].append(line[6:])
    except httpx.HTTPError:
        pass


def test_shutdown_timeout_zero_closes_in_flight_requests_at_once(tiny_dense: Path) -> None:
    """vLLM's --shutdown-timeout 0 (its default): SIGTERM closes the in-flight streams at once instead of letting them
    finish, whatever --timeout-graceful-shutdown says, and the server exits within the core's stop bound. Without the
    flag honoured, the 60 s drain would let both 3000-token streams end on 'length'."""
    server = start_serve(tiny_dense, "--shutdown-timeout", "0", "--timeout-graceful-shutdown", "60")
    try:
        events: list[list[str]] = [[], []]
        threads = [threading.Thread(target=_stream_until_cut, args=(server.base_url, i, events)) for i in range(2)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 60
        while min(len(e) for e in events) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        signalled_at = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(SHUTDOWN_WAIT_S + 10) in (0, -signal.SIGTERM)
        assert time.monotonic() - signalled_at < SHUTDOWN_WAIT_S + 10
        for thread in threads:
            thread.join(10)
        for payloads in events:
            assert len(payloads) >= 2 and "[DONE]" not in payloads  # cut mid-stream, not finished
    finally:
        server.close()
