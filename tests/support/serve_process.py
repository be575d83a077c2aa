"""`deltaserve serve` in a process of its own, for tests of how the server lives and dies (signals, a killed core).

start_serve() starts it on a free port, its output going to a temporary file (a pipe nobody reads would block it),
and returns once /health answers 200.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
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


def start_serve(model: Path, *flags: str, new_session: bool = False, env: dict[str, str] | None = None) -> ServeProcess:
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
    deadline = time.monotonic() + 120
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
