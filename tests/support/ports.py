"""A free TCP port on 127.0.0.1, for tests that start a server or a process group in another process.

The port is released before it is returned, so another process can bind it; a server in this process binds its
socket itself (tests/api/server_thread.py) and needs none of this.
"""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
