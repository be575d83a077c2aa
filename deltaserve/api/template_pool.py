"""Chat templates render in worker processes that the server kills when a render overruns its time bound.

Why processes: a render is untrusted code (a request may carry its own template under
--trust-request-chat-template, and any template loops over request data). On the event loop it would stall every
stream; in a thread it still could not be stopped, and pure-Python template code holds the GIL. A worker process
is stopped by SIGKILL after `timeout` seconds and replaced, its address space is capped with RLIMIT_AS (a render
that allocates too much fails with MemoryError inside the worker), and the sandbox in template.py caps the sizes
one operation may build. The parent waits on the worker from a thread, so the event loop never blocks.

Each worker renders one job at a time; the pool hands jobs to idle workers. A worker that died or was killed is
replaced in the background by the thread that noticed. Templates sent with requests (--trust-request-chat-template)
hold at most num_workers - 1 workers at once, so slow request templates queue behind each other while the server's
own template always finds a worker (a pool of one worker has none to spare and shares it).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from deltaserve.api.template import RenderJob, RenderLimits, TemplateCache, render

logger = logging.getLogger(__name__)

DEFAULT_NUM_WORKERS = 2
DEFAULT_TIMEOUT_S = 5.0
DEFAULT_MEMORY_BYTES = 2 * 2**30
SPAWN_TIMEOUT_S = 60.0
# Messages sent per pickled frame: pickling 100k messages at once would hold the GIL for a quarter second.
MESSAGES_PER_FRAME = 1024


class TemplateRenderError(Exception):
    """The template failed for a reason the request caused: a 400 with this message."""


class TemplatePoolError(RuntimeError):
    """The pool itself cannot render (no worker would start)."""


def _set_memory_limit(num_bytes: int) -> None:
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (num_bytes, num_bytes))
    except (ImportError, ValueError, OSError):
        # Not every platform allows it; the time bound and the sandbox's size caps still hold.
        pass


def _die_with_parent() -> None:
    """Linux: the kernel kills this worker if the server dies, so an orphan cannot go on rendering."""
    try:
        import ctypes
        import signal

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _worker_main(conn: multiprocessing.connection.Connection) -> None:
    """A worker's whole life: read its limits, then receive RenderJobs and reply ("ok", text) or ("error", why)."""
    _die_with_parent()
    # Ctrl-C and a group SIGTERM reach the workers too: renders of requests the server drains must still finish
    # (the pool stops the workers, and the kernel kills them with the server)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    limits, memory_bytes = conn.recv()
    _set_memory_limit(memory_bytes)
    cache = TemplateCache(limits)
    conn.send(("ready", ""))
    while True:
        try:
            job, num_messages = conn.recv()
            while len(job.messages) < num_messages:
                job.messages.extend(conn.recv())
        except (EOFError, OSError, KeyboardInterrupt):
            return
        try:
            reply: tuple[str, str] = ("ok", render(cache, job))
        except MemoryError:
            reply = ("error", f"rendering the chat template needed more than {memory_bytes // 2**20} MiB")
        except RecursionError:
            reply = ("error", "the chat template recursed too deeply")
        except Exception as exc:  # everything a template can raise is the request's doing
            reply = ("error", _describe(exc))
        try:
            conn.send(reply)
        except (OSError, ValueError, KeyboardInterrupt):
            return


def worker_entry(fd: int) -> None:
    """`python -c` entry of a worker process, talking over the socket it inherited as `fd`."""
    _worker_main(multiprocessing.connection.Connection(fd))


@dataclass(eq=False)
class _Worker:
    process: subprocess.Popen[bytes]
    conn: multiprocessing.connection.Connection

    def kill(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.close()
        with contextlib.suppress(Exception):
            self.process.kill()
            self.process.wait(5)


def _worker_command(fd: int) -> list[str]:
    return [sys.executable, "-c", f"from deltaserve.api.template_pool import worker_entry; worker_entry({fd})"]


def _worker_env() -> dict[str, str]:
    """The parent's environment, with this deltaserve first on the path (so a checkout's code is what runs)."""
    root = str(Path(__file__).resolve().parents[2])
    paths = [root, *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


class TemplatePool:
    def __init__(
        self,
        num_workers: int = DEFAULT_NUM_WORKERS,
        timeout: float = DEFAULT_TIMEOUT_S,
        limits: RenderLimits | None = None,
        memory_bytes: int = DEFAULT_MEMORY_BYTES,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {num_workers}")
        self.num_workers = num_workers
        self.timeout = timeout
        self.limits = limits or RenderLimits()
        self.memory_bytes = memory_bytes
        self._executor = ThreadPoolExecutor(num_workers, thread_name_prefix="deltaserve-template")
        # How many workers request templates may hold at once: one is kept for the server's own template.
        self.num_request_slots = max(1, num_workers - 1)
        self._request_slots: asyncio.Semaphore | None = None
        self._idle: asyncio.Queue[_Worker] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._workers: set[_Worker] = set()
        self._lock = threading.Lock()
        self._is_closed = False
        self.num_killed = 0

    def _spawn(self) -> _Worker:
        # A plain subprocess, not multiprocessing: spawn would re-import the parent's __main__ (any script that
        # builds the app without a __main__ guard would recurse), and fork is unsafe beside the engine's threads.
        parent_sock, child_sock = socket.socketpair()
        child_fd = child_sock.fileno()
        try:
            process = subprocess.Popen(
                _worker_command(child_fd), pass_fds=(child_fd,), env=_worker_env(), stdin=subprocess.DEVNULL
            )
        finally:
            child_sock.close()
        parent = multiprocessing.connection.Connection(parent_sock.detach())
        worker = _Worker(process, parent)
        parent.send((self.limits, self.memory_bytes))
        # Start-up (imports) is not part of any render's time bound: wait for the worker to say it is ready.
        if not parent.poll(SPAWN_TIMEOUT_S) or parent.recv() != ("ready", ""):
            worker.kill()
            raise TemplatePoolError("a chat-template worker did not start")
        with self._lock:
            self._workers.add(worker)
        return worker

    def _retire(self, worker: _Worker) -> None:
        with self._lock:
            self._workers.discard(worker)
        worker.kill()

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._idle = asyncio.Queue()
        self._request_slots = asyncio.Semaphore(self.num_request_slots)
        workers = await asyncio.gather(*(self._loop.run_in_executor(self._executor, self._spawn)
                                         for _ in range(self.num_workers)))  # fmt: skip
        for worker in workers:
            self._idle.put_nowait(worker)

    async def stop(self) -> None:
        self._is_closed = True
        with self._lock:
            workers = list(self._workers)
            self._workers.clear()
        for worker in workers:
            worker.kill()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _release(self, worker: _Worker) -> None:
        assert self._loop is not None and self._idle is not None
        # A closed loop means the server is shutting down: nobody needs the worker back.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._idle.put_nowait, worker)

    def _roundtrip(self, worker: _Worker, job: RenderJob) -> tuple[str, str]:
        """Runs in a pool thread: one job on one worker, which always goes back to the pool (or a replacement)."""
        reply: tuple[str, str]
        try:
            messages = job.messages
            worker.conn.send((dataclasses.replace(job, messages=[]), len(messages)))
            for start in range(0, len(messages), MESSAGES_PER_FRAME):
                worker.conn.send(messages[start : start + MESSAGES_PER_FRAME])
            if worker.conn.poll(self.timeout):
                reply = worker.conn.recv()
            else:
                self.num_killed += 1
                reply = ("error", f"rendering the chat template took longer than {self.timeout:g} s")
                self._retire(worker)
                worker = self._spawn()
        except (EOFError, OSError, ValueError):
            # The worker died mid-job: only an allocation the kernel refused outright gets here.
            reply = ("error", "the chat template worker died while rendering (out of memory?)")
            self._retire(worker)
            worker = self._spawn()
        finally:
            if not self._is_closed:
                self._release(worker)
        return reply

    async def render(self, job: RenderJob, is_request_template: bool = False) -> str:
        """The rendered prompt; TemplateRenderError for anything the template or its inputs caused.
        is_request_template: the template came with the request, so the job first takes a request slot."""
        if self._idle is None or self._loop is None or self._request_slots is None:
            raise TemplatePoolError("the chat-template workers are not running")
        slots = self._request_slots if is_request_template else None
        if slots is not None:
            await slots.acquire()
        try:
            worker = await self._idle.get()
        except BaseException:
            if slots is not None:
                slots.release()
            raise
        future = self._loop.run_in_executor(self._executor, self._roundtrip, worker, job)
        if slots is not None:
            # The slot is held until the job ends, not until the client leaves: a worker still rendering counts.
            future.add_done_callback(lambda _: slots.release())
        # Shielded: if the client goes away, the job still ends (or times out) and hands its worker back.
        status, text = await asyncio.shield(future)
        if status != "ok":
            raise TemplateRenderError(text)
        return text
