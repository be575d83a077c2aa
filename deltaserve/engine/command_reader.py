"""The engine-core process's command reader: the API process's commands are received and unpickled on a thread of
their own, so the step loop never waits for a command to arrive whole.

Why a thread (docs/multimodal.md#speed-under-image-traffic): an add command carries each image's patch rows (a
512x512 image is 1024 x 1536 fp32 values, 6.3 MB pickled). A pipe holds 64 KB, so such a message crosses in about a
hundred write / read turns between the API process's sender thread and its reader; read on the step loop (poll,
then recv), the loop stood still for the whole crossing, and with it the decodes of every running request. vLLM's
engine core likewise receives and decodes its input on a thread beside its busy loop. Order is kept: one thread
reads the pipe in order and the loop takes what has arrived, oldest first.
"""

from __future__ import annotations

import queue
import threading
from multiprocessing.connection import Connection
from typing import Any

Command = tuple[str, Any]  # ("add", [EngineCoreRequest]) | ("abort", [ids]) | ("reset_prefix_cache", id) | ...
SHUTDOWN: Command = ("shutdown", None)


class CommandReader:
    """Receives commands from `conn` on a daemon thread into a queue; `get` hands the loop what has arrived.

    A closed or broken pipe (the API process is gone) reads as a shutdown command, as the loop expects."""

    def __init__(self, conn: Connection, idle_wait_s: float, name: str = "deltaserve-core-reader") -> None:
        self._conn = conn
        self._idle_wait_s = idle_wait_s
        self._queue: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._read, name=name, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while True:
            try:
                command = self._conn.recv()  # the read syscalls release the GIL: the loop keeps stepping
            except (EOFError, OSError):
                self._queue.put(SHUTDOWN)
                return
            self._queue.put(command)
            if command[0] == "shutdown":
                return

    def get(self, block: bool) -> list[Command]:
        """Every command that has arrived whole, in order; with block, waits up to idle_wait_s for the first."""
        commands: list[Command] = []
        try:
            commands.append(self._queue.get(timeout=self._idle_wait_s) if block else self._queue.get_nowait())
            while True:
                commands.append(self._queue.get_nowait())
        except queue.Empty:
            pass
        return commands
