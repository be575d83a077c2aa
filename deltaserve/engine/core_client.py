"""Clients of an EngineCore: in a process of its own (the server's default) or on a thread of this process.

Both run the same loop (`serve_core`): take commands (add, abort, reset the prefix cache, shutdown), step the core,
emit EngineCoreOutputs (a reset's answer rides in their `replies`).
The process client talks through two one-way multiprocessing pipes (pickled plain dataclasses; a well-kept
standard-library transport, no protocol of our own), so the core has its own interpreter and its own GIL: HTTP,
JSON, SSE and detokenisation in the API process no longer delay the next step. The core process ignores Ctrl-C and
SIGTERM (a signal to the whole process group, as systemd and `timeout` send it, must not cut the streams the API
process is draining: the API process stops the core when it is done), exits when the API process goes away, and
sends its start-up failure back as the exception itself, so the caller reports it as if the model had loaded
in-process. Once ready, a thread of the core process sends a heartbeat every HEARTBEAT_INTERVAL_S whatever the loop
is doing, so the API process can tell a frozen core (SIGSTOP, a hung host) from a busy one (`seconds_since_heard`).
Another thread of the core process receives the commands (engine/command_reader.py), so a large one (an image's
patch rows, megabytes) crosses the pipe while the loop keeps stepping.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import pickle
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from deltaserve import env
from deltaserve.engine.command_reader import CommandReader
from deltaserve.engine.protocol import EngineCoreInfo, EngineCoreOutputs, EngineCoreRequest
from deltaserve.engine_config import EngineConfig
from deltaserve.runner.threads import apply_serving_threads

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # how long an idle core blocks on its command queue before looking again
# The core's heartbeat period: a thread sends it, so a long step does not delay it; a frozen process does.
HEARTBEAT_INTERVAL_S = 0.5
# How long shutdown() waits for the core to finish its in-flight steps and exit before it kills it (the core ignores
# SIGTERM, so there is no gentler second try).
SHUTDOWN_WAIT_S = 5.0
# ("add", [EngineCoreRequest]) | ("abort", [core ids]) | ("reset_prefix_cache", call id) | ("shutdown", None)
Command = tuple[str, Any]
OnOutputs = Callable[[EngineCoreOutputs], None]
OnDead = Callable[[BaseException], None]


class EngineDeadError(RuntimeError):
    """The engine core has stopped; no request can be served."""


def serve_core(core: Any, get_commands: Callable[[bool], list[Command]], emit: OnOutputs) -> None:
    """The core's loop until a shutdown command. A failing add fails only its own request; a dead executor (a
    tensor-parallel worker gone, even while idle) ends the loop with its error."""
    while True:
        core.check_health()
        commands = get_commands(not core.has_unfinished())
        errors: list[tuple[str, str]] = []
        replies: list[tuple[int, object]] = []
        for kind, payload in commands:
            if kind == "shutdown":
                return
            if kind == "add":
                for request in payload:
                    try:
                        core.add_request(request)
                    except Exception as exc:  # one bad request fails alone; the loop goes on
                        errors.append((request.request_id, str(exc)))
            elif kind == "abort":
                core.abort_requests(payload)
            elif kind == "reset_prefix_cache":
                # in command order: a request added after the reset was asked for is planned after it
                replies.append((payload, core.reset_prefix_cache()))
        outputs = core.step() if core.has_unfinished() else []
        errors.extend(core.take_errors())
        if outputs or commands or errors:
            emit(EngineCoreOutputs(tuple(outputs), core.stats(), tuple(errors), tuple(replies)))


# -- in a process of its own ------------------------------------------------------------------------------


def _picklable(exc: BaseException) -> BaseException:
    try:
        pickle.dumps(exc)
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _send_heartbeats(send: Callable[[Command], None], interval_s: float) -> None:
    """The core process's heartbeat thread: ("heartbeat", None) every interval until the pipe closes."""
    while True:
        time.sleep(interval_s)
        try:
            send(("heartbeat", None))
        except (OSError, ValueError):
            return


def engine_core_main(
    config: EngineConfig,
    commands: Connection,
    outputs: Connection,
    log_level: str,
    heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S,
) -> None:
    """The engine-core process: build the core, report ready (or the start-up error), serve until told to stop."""
    # Ctrl-C and a group SIGTERM reach us too: the API process drains its streams first, then stops us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s [core]: %(message)s")
    from deltaserve.engine.core import EngineCore

    try:
        core = EngineCore(config)
    except BaseException as exc:
        logger.debug("the engine core failed to start", exc_info=True)
        with contextlib.suppress(OSError):
            outputs.send(("error", _picklable(exc)))
        sys.exit(1)
    apply_serving_threads(core.runner.device.type)  # start-up is done: one torch CPU thread on a GPU (as vLLM)
    outputs.send(("ready", core.info()))
    code = 0
    send_lock = threading.Lock()  # the loop and the heartbeat thread share the pipe

    def send(message: Command) -> None:
        with send_lock:
            outputs.send(message)

    threading.Thread(
        target=_send_heartbeats, args=(send, heartbeat_interval_s), name="deltaserve-core-heartbeat", daemon=True
    ).start()

    # commands arrive on a thread of their own: an image's patch rows take many pipe turns to cross, and the loop
    # must not stand still meanwhile (engine/command_reader.py); a closed pipe reads as a shutdown
    reader = CommandReader(commands, IDLE_WAIT_S)
    try:
        with contextlib.suppress(BrokenPipeError, EOFError):  # the API process is gone
            serve_core(core, reader.get, lambda batch: send(("outputs", batch)))
        core.drain()
    except Exception as exc:
        # the API process sees the exit: an error on every open stream, and the server stops non-zero
        logger.error("the engine core stopped: %s", exc)
        logger.debug("", exc_info=True)
        code = 1
    finally:
        core.shutdown()
    sys.exit(code)


class _QueuedCommands:
    """The commands both clients take from the engine side, queued in order for the loop that serves the core (the
    sender thread of ProcessCoreClient, the engine thread of ThreadCoreClient)."""

    _commands: queue.Queue[Any]

    def add(self, requests: list[EngineCoreRequest]) -> None:
        self._commands.put(("add", requests))

    def abort(self, core_ids: list[str]) -> None:
        if core_ids:
            self._commands.put(("abort", core_ids))

    def reset_prefix_cache(self, call_id: int) -> None:
        """The answer comes back as (call_id, bool) in the `replies` of an EngineCoreOutputs."""
        self._commands.put(("reset_prefix_cache", call_id))


class ProcessCoreClient(_QueuedCommands):
    """Starts the engine-core process and relays commands to it and outputs from it, on two threads."""

    def __init__(self, config: EngineConfig, heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S) -> None:
        context = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
        command_recv, self._command_send = context.Pipe(duplex=False)
        self._output_recv, output_send = context.Pipe(duplex=False)
        self.process = context.Process(
            target=engine_core_main,
            args=(config, command_recv, output_send, env.log_level(), heartbeat_interval_s),
            name="deltaserve-engine-core",
            # a daemonic process may not start processes: a tensor-parallel core starts its workers (it still exits
            # when the API process goes away, as its command pipe closes)
            daemon=config.tensor_parallel_size == 1,
        )
        self.process.start()
        command_recv.close()
        output_send.close()
        try:
            kind, payload = self._output_recv.recv()
        except EOFError:
            self.process.join(10)
            raise EngineDeadError(
                f"the engine core process exited during start-up (exit code {self.process.exitcode})"
            ) from None
        if kind == "error":
            self.process.join(10)
            raise payload
        self.info: EngineCoreInfo = payload
        self._commands: queue.Queue[Command | None] = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._is_stopping = False
        self._last_heard = time.monotonic()

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def seconds_since_heard(self) -> float:
        """Seconds since the core process last sent anything (outputs or a heartbeat)."""
        return time.monotonic() - self._last_heard

    def start(self, on_outputs: OnOutputs, on_dead: OnDead) -> None:
        self._last_heard = time.monotonic()  # beats sent before now wait in the pipe: heard as soon as read

        def receive() -> None:
            while True:
                try:
                    kind, payload = self._output_recv.recv()
                except (EOFError, OSError):
                    self.process.join(5)
                    if not self._is_stopping:
                        code = self.process.exitcode
                        on_dead(EngineDeadError(f"the engine core process exited (exit code {code})"))
                    return
                self._last_heard = time.monotonic()
                if kind == "outputs":
                    on_outputs(payload)

        def send() -> None:
            while (command := self._commands.get()) is not None:
                try:
                    self._command_send.send(command)
                except (BrokenPipeError, OSError):
                    return

        for target, name in ((receive, "deltaserve-core-outputs"), (send, "deltaserve-core-commands")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def shutdown(self) -> None:
        self._is_stopping = True
        self._commands.put(("shutdown", None))
        self._commands.put(None)
        self.process.join(SHUTDOWN_WAIT_S)
        if self.process.is_alive():
            logger.warning("the engine core did not stop within %g s: killing it", SHUTDOWN_WAIT_S)
            self.process.kill()
            self.process.join(5)


# -- on a thread of this process ----------------------------------------------------------------------------


class ThreadCoreClient(_QueuedCommands):
    """The core built here (start-up errors raise directly) and stepped on one thread of this process."""

    def __init__(self, config: EngineConfig) -> None:
        from deltaserve.engine.core import EngineCore

        self.core = EngineCore(config)
        self.info: EngineCoreInfo = self.core.info()
        self._commands: queue.Queue[Command] = queue.Queue()
        self._thread: threading.Thread | None = None

    pid = None

    def seconds_since_heard(self) -> float:
        """0: the core runs on a thread of this process, which cannot be frozen apart from it."""
        return 0.0

    def _get_commands(self, block: bool) -> list[Command]:
        items: list[Command] = []
        try:
            items.append(self._commands.get(timeout=IDLE_WAIT_S) if block else self._commands.get_nowait())
            while True:
                items.append(self._commands.get_nowait())
        except queue.Empty:
            pass
        return items

    def start(self, on_outputs: OnOutputs, on_dead: OnDead) -> None:
        def run() -> None:
            try:
                serve_core(self.core, self._get_commands, on_outputs)
            except BaseException as exc:
                logger.debug("the engine loop died", exc_info=True)  # on_dead logs the one ERROR line
                on_dead(EngineDeadError(f"the engine loop died: {exc!r}"))

        self._thread = threading.Thread(target=run, name="deltaserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._commands.put(("shutdown", None))
        if self._thread is not None:
            self._thread.join(10)
        self.core.shutdown()
