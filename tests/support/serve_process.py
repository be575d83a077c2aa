"""`deltaserve serve` in a process of its own, for tests of how the server lives and dies (signals, a killed core).

start_serve() starts it on a free port, its output going to a temporary file (a pipe nobody reads would block it),
and returns once /health answers 200. open_streams() holds streamed completions open on it from threads (the
requests a death or a shutdown must end), stuck_upload() a request whose body never finishes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx

from tests.support.ports import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class ServeProcess:
    process: subprocess.Popen[bytes]
    base_url: str
    log: IO[bytes]

    def output(self) -> str:
        """Everything the server wrote so far (stdout and stderr)."""
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def core_pid(self) -> int:
        """The engine-core child of the server process (not multiprocessing's resource tracker)."""
        pid = self.process.pid
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        for child in children:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
            if b"spawn_main" in cmdline:
                return int(child)
        raise AssertionError(f"no engine-core child among {children}")

    def close(self) -> None:
        """Kills the server if it still runs (a failed test) and releases the log."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)
        self.log.close()


def start_serve(
    model: Path,
    *flags: str,
    new_session: bool = False,
    env: dict[str, str] | None = None,
    start_timeout_s: float = 120,
) -> ServeProcess:
    """The started server; new_session puts it at the head of a process group of its own."""
    port = free_port()
    log = tempfile.TemporaryFile()  # noqa: SIM115 (ServeProcess.close closes it)
    process = subprocess.Popen(
        [sys.executable, "-m", "deltaserve.cli", "serve", str(model), "--device", "cpu", "--port", str(port),
         "--max-model-len", "4096", "--served-model-name", "tiny", "--uvicorn-log-level", "warning", *flags],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})},
        start_new_session=new_session,
    )  # fmt: skip
    server = ServeProcess(process, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + start_timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            output = server.output()
            server.close()
            raise AssertionError(f"the server exited during start-up:\n{output}")
        try:
            if httpx.get(server.base_url + "/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            time.sleep(0.1)
    server.close()
    raise AssertionError("the server did not start")


def open_streams(
    base_url: str, num: int, prompt: str = "hello", max_tokens: int = 3000, min_events: int = 3
) -> tuple[list[list[str]], list[threading.Thread]]:
    """`num` streamed completions (ignore_eos, `prompt` plus the index), each on a thread collecting its data
    payloads ("[DONE]" included, in order); returns once every stream has `min_events` of them."""
    events: list[list[str]] = [[] for _ in range(num)]

    def stream(index: int) -> None:
        body = {"model": "tiny", "prompt": f"{prompt} {index}", "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}  # fmt: skip
        with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events[index].append(line[6:])

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(num)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while min(len(e) for e in events) < min_events and time.monotonic() < deadline:
        time.sleep(0.01)
    assert min(len(e) for e in events) >= min_events, "the streams did not start"
    return events, threads


def assert_streams_end_in_an_error(events: list[list[str]]) -> None:
    """Each stream of open_streams ended with one error event (a 5xx code) and then "[DONE]", and carried no error
    before it: what a client sees when the engine dies under it."""
    for received in events:
        assert received[-1] == "[DONE]"
        error = json.loads(received[-2])
        assert "error" in error and error["error"]["code"] >= 500
        assert all("error" not in json.loads(e) for e in received[:-2])  # only the last event is the error


def stuck_upload(base_url: str) -> socket.socket:
    """A connection that sends the head and the start of a completion's body, then nothing more."""
    host, port = base_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n{\"model\": ")  # fmt: skip
    return sock
