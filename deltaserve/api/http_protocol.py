"""uvicorn's h11 protocol with a request-header timeout: a connection must deliver a whole request head in time.

uvicorn bounds only the idle time between a response and the next request (`timeout_keep_alive`), and any byte
resets even that; a connection that sends its headers a byte at a time, or opens and sends nothing, is held for as
long as the client likes (slowloris). With this protocol a connection that has not sent a complete request head
within `header_timeout_s` of connecting, or of its previous response, is closed. The body has its own bound, checked
as it is read (api/body.py), and a stalled response is the graceful-shutdown timeout's to end.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class HeaderTimeoutH11Protocol(H11Protocol):
    """H11Protocol whose connections close when a request head takes longer than `header_timeout_s`."""

    header_timeout_s: float = 20.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

    def _watch_header(self) -> None:
        """Arms the timer while a request head is awaited (h11's IDLE state of the client), else disarms it."""
        is_waiting = self.conn.their_state is h11.IDLE and not self.transport.is_closing()
        if is_waiting and self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._on_header_timeout)
        elif not is_waiting and self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.logger.info("closing a connection that sent no complete request head in %g s", self.header_timeout_s)
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._watch_header()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_header()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch_header()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().connection_lost(exc)


def protocol_with_header_timeout(header_timeout_s: float) -> type[HeaderTimeoutH11Protocol]:
    """The protocol class to give uvicorn.Config(http=...) for this bound."""
    if not header_timeout_s > 0:
        raise ValueError(f"the request-header timeout must be positive, got {header_timeout_s}")
    return type("HeaderTimeoutH11Protocol", (HeaderTimeoutH11Protocol,), {"header_timeout_s": header_timeout_s})
