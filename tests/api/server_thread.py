"""A real uvicorn server for tests, on a random free port of 127.0.0.1, in a background thread, and serve(), which
puts an engine (the FakeEngine or a real AsyncEngine) behind deltaserve's app in one.

The socket is bound before uvicorn starts, so there is no race for the port; start() returns once the server
answers /health.
"""

from __future__ import annotations

import socket
import ssl
import threading
import time
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI

from deltaserve.api.server import build_app
from deltaserve.api.settings import EngineClient, ServerSettings

MODEL_NAME = "fake-qwen"  # the name the API tests serve the FakeEngine under


class ServerThread:
    def __init__(self, app: FastAPI, client_context: ssl.SSLContext | None = None, **options: Any) -> None:
        """options: more uvicorn.Config arguments (ssl_certfile, ...); with TLS the base URL is https and the
        health probe uses client_context (the server's certificate trusted, a client certificate if required)."""
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.base_url = f"{'https' if options.get('ssl_certfile') else 'http'}://127.0.0.1:{self.port}"
        self.verify: Any = client_context or True
        config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2, **options)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self, timeout: float = 60.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.server.started:
                try:
                    health = httpx.get(self.base_url + "/health", timeout=2, verify=self.verify)
                    if health.status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
            if not self.thread.is_alive():
                raise RuntimeError("the test server exited during startup")
            time.sleep(0.02)
        raise TimeoutError("the test server did not start")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


def serve(
    engine: EngineClient,
    client_context: ssl.SSLContext | None = None,
    options: dict[str, Any] | None = None,
    model_root: str = "m",
    served_model_names: list[str] | None = None,
    **fields: Any,
) -> ServerThread:
    """`engine` behind deltaserve's app in a started ServerThread, served as MODEL_NAME unless told otherwise; fields:
    more ServerSettings fields; client_context and options: as ServerThread takes them."""
    settings = ServerSettings(model_root=model_root, served_model_names=served_model_names or [MODEL_NAME], **fields)
    return ServerThread(build_app(engine, settings), client_context=client_context, **(options or {})).start()


def metric_value(text: str, name: str) -> float:
    """The value of the first sample named `name` (labels ignored) in Prometheus text."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)
