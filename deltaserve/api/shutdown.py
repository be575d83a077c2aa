"""How `deltaserve serve` stops, in bounded time and in one log line per cause.

SIGTERM or Ctrl-C (to the main process or to its whole group: the engine-core process ignores both) starts uvicorn's
graceful shutdown: the socket stops accepting, idle connections close, open requests and streams may finish for
--timeout-graceful-shutdown seconds, then uvicorn cancels what is left and the lifespan stops the engine. When the
engine core dies, nothing can finish any more and every stream has its error event within milliseconds, so the
drain is cut to DEAD_ENGINE_DRAIN_S: a connection still open then is a client that neither reads nor sends (a
stuck upload), and it must not keep the server alive.

uvicorn logs the end of that bound as an ERROR ("Cancel N running task(s)") and every request it cancels as an
"Exception in ASGI application" traceback; ShutdownLogFilter turns both into WARNING lines without a traceback, so
the cause (the signal, or the engine's one ERROR line) is what the log shows as an error. The bounds are listed in
docs/ARCHITECTURE.md#lifecycle-timeouts-shutdown-and-health.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

# After the engine core dies, how long open connections get before they are closed and the server exits.
DEAD_ENGINE_DRAIN_S = 2.0


def stop_on_engine_death(server: Any, graceful_shutdown_s: float) -> None:
    """The engine's on_dead callback (its output thread calls it): uvicorn's main loop polls should_exit."""
    server.config.timeout_graceful_shutdown = min(graceful_shutdown_s, DEAD_ENGINE_DRAIN_S)
    server.should_exit = True


class ShutdownLogFilter(logging.Filter):
    """On uvicorn's error logger: the requests a bounded shutdown cancels are WARNING lines, not ERROR tracebacks."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, asyncio.CancelledError):
            record.msg, record.args = "a request was still open at the shutdown bound: closed", ()
            record.exc_info, record.exc_text = None, None
            _as_warning(record)
        elif isinstance(record.msg, str) and record.msg.startswith("Cancel %s running task(s)"):
            _as_warning(record)
        return True


def _as_warning(record: logging.LogRecord) -> None:
    record.levelno, record.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)


def install_shutdown_log_filter() -> None:
    """Call after uvicorn.Config is built (its logging setup comes first)."""
    logging.getLogger("uvicorn.error").addFilter(ShutdownLogFilter())
