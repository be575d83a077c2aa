"""One server process of a grid arm: started in its own process group with its log in a file, polled until its
health URL answers, and stopped as a whole group, after which the port and the GPU are waited on to be free.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
from pathlib import Path

from deltaserve import env
from deltaserve.bench.grid_config import REPO_ROOT, Launch
from deltaserve.bench.nvml import sample_used_gib_once
from deltaserve.bench.provenance import NO_PROXY

GPU_IDLE_GIB = 2.0  # below this much used device memory, the previous server has let go of the GPU


def pidfile() -> Path:
    """Where the running server's process group id is kept, so a grid killed without cleanup (SIGKILL) leaves
    a note that the next run of the harness script uses to stop that server (DELTASERVE_GRID_PIDFILE)."""
    return env.grid_pidfile()


def _is_port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


class Server:
    """A server process in its own process group, so stopping it stops every child (engine cores, workers)."""

    def __init__(self, launch: Launch, log_path: Path) -> None:
        self.launch = launch
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None
        port = re.search(r":(\d+)$", launch.base_url)
        self.port = int(port.group(1)) if port else 80

    def start(self) -> None:
        if _is_port_open(self.port):
            raise RuntimeError(f"port {self.port} is already in use; refusing to start {self.launch.arm.name}")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("wb")
        env = {**os.environ, **self.launch.env_overrides}
        self.process = subprocess.Popen(
            self.launch.argv, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        pidfile().write_text(f"{self.process.pid}\n")

    def wait_healthy(self, timeout_s: float) -> float:
        """Seconds until the health URL answered 200; raises if the process died or time ran out."""
        assert self.process is not None
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.launch.arm.name} exited with {self.process.returncode} before healthy")
            try:
                with NO_PROXY.open(self.launch.health_url, timeout=2) as response:
                    if response.status == 200:
                        return time.monotonic() - t0
            except (urllib.error.URLError, OSError, ValueError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.launch.arm.name} not healthy after {timeout_s:.0f} s")

    def stop(self, timeout_s: float = 30.0) -> bool:
        """SIGTERM the process group, SIGKILL after `timeout_s`; wait for the port (and the GPU) to be free.

        Returns True when the port was freed.
        """
        if self.process is None:
            return True
        pgid = self.process.pid
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            try:
                self.process.wait(timeout=timeout_s)
                # The leader is gone; make sure no child of the group survives it.
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
            break
        self.process = None
        pidfile().unlink(missing_ok=True)
        t0 = time.monotonic()
        while _is_port_open(self.port) and time.monotonic() - t0 < timeout_s:
            time.sleep(0.25)
        is_port_free = not _is_port_open(self.port)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 60:
            used = sample_used_gib_once()
            if used is None or used < GPU_IDLE_GIB:
                break
            time.sleep(1.0)
        return is_port_free
