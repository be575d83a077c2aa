"""The engine-core process's command reader: a command still crossing the pipe never holds up the step loop, and
commands come out whole, in order, with a closed pipe read as a shutdown."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import struct
import threading

import numpy as np

from deltaserve.engine.command_reader import CommandReader


def _call_in_thread(fn, timeout_s: float = 10.0):  # noqa: ANN001, ANN202  (a test helper)
    """fn() on a thread; (returned, result): returned is False when fn is still blocked after timeout_s."""
    result: list[object] = []
    thread = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    thread.start()
    thread.join(timeout_s)
    return not thread.is_alive(), (result[0] if result else None)


def test_a_command_still_crossing_the_pipe_does_not_block_the_loop() -> None:
    recv_end, send_end = multiprocessing.Pipe(duplex=False)
    reader = CommandReader(recv_end, idle_wait_s=0.05)
    rows = np.arange(64 * 1536, dtype=np.float32).reshape(64, 1536)  # an image's patch rows, 384 KB
    payload = pickle.dumps(("add", [rows]), protocol=pickle.HIGHEST_PROTOCOL)
    # the Connection's wire format: a 4-byte big-endian length, then the pickle; only the start is written yet
    try:
        # the Connection's wire format: a 4-byte big-endian length, then the pickle; only the start is written yet
        os.write(send_end.fileno(), struct.pack("!i", len(payload)) + payload[:1000])
        returned, got = _call_in_thread(lambda: reader.get(False))
        assert returned, "get(False) blocked on a command that has not arrived whole"
        assert got == []
        returned, got = _call_in_thread(lambda: reader.get(True))  # waits idle_wait_s at most
        assert returned and got == []
        os.write(send_end.fileno(), payload[1000:])
        returned, got = _call_in_thread(lambda: _wait_for_commands(reader, 1))
        assert returned
        [(kind, [received])] = got
        assert kind == "add" and received.dtype == rows.dtype and np.array_equal(received, rows)
    finally:
        send_end.close()  # a reader still blocked in recv sees the end of the pipe


def _wait_for_commands(reader: CommandReader, count: int) -> list[tuple[str, object]]:
    commands: list[tuple[str, object]] = []
    while len(commands) < count:
        commands += reader.get(True)
    return commands


def test_commands_come_in_order_and_a_closed_pipe_is_a_shutdown() -> None:
    recv_end, send_end = multiprocessing.Pipe(duplex=False)
    reader = CommandReader(recv_end, idle_wait_s=0.05)
    sent = [("add", [1]), ("abort", ["a", "b"]), ("reset_prefix_cache", 7), ("add", [np.zeros((512, 1536))])]

    def send_all() -> None:  # from a thread: the last command is larger than the pipe holds
        for command in sent:
            send_end.send(command)
        send_end.close()

    threading.Thread(target=send_all, daemon=True).start()
    returned, got = _call_in_thread(lambda: _wait_for_commands(reader, len(sent) + 1))
    assert returned
    assert [kind for kind, _ in got] == ["add", "abort", "reset_prefix_cache", "add", "shutdown"]
    assert got[1][1] == ["a", "b"] and got[2][1] == 7 and got[3][1][0].shape == (512, 1536)
    assert got[4] == ("shutdown", None)
    assert reader.get(False) == []  # the reader stopped after the shutdown: nothing more comes
