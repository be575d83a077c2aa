"""AsyncEngine: the engine loop on its own thread, bridged to asyncio for the HTTP server.

The event loop never runs the model: generate() posts the request to the engine thread through a command
queue and awaits deltas on a per-request asyncio.Queue that the thread feeds with call_soon_threadsafe.
If the consumer stops iterating (client disconnect, task cancellation) the request is aborted, which frees
its KV blocks and state slot. If the loop dies, every stream gets the error and is_dead turns True.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from deltaserve.engine.engine import LLMEngine
from deltaserve.engine.request import RequestOutput
from deltaserve.engine.stats import EngineStats
from deltaserve.engine_config import EngineConfig
from deltaserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.config = engine.config
        self.model_dir: Path = engine.model_dir
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.default_sampling: dict[str, Any] = engine.default_sampling
        self._commands: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._error: BaseException | None = None
        self._stats = engine.stats()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        return cls(LLMEngine(config))

    @property
    def is_dead(self) -> bool:
        return self._error is not None or (self._thread is not None and not self._thread.is_alive())

    async def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="deltaserve-engine", daemon=True)
            self._thread.start()

    async def stop(self) -> None:
        self._stopping.set()
        self._commands.put(("wake", None))
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10)

    def stats(self) -> EngineStats:
        return self._stats

    # -- engine thread --------------------------------------------------------------------------------

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            loop.call_soon_threadsafe(stream.put_nowait, item)

    def _handle(self, command: str, payload: Any) -> None:
        if command == "add":
            request_id, token_ids, params = payload
            try:
                self.engine.add_request(request_id, token_ids, params)
            except Exception as exc:  # a bad request fails alone, the loop goes on
                self._deliver(request_id, exc)
        elif command == "abort":
            output = self.engine.abort_request(payload)
            if output is not None:
                self._deliver(payload, output)

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                block = not self.engine.has_unfinished()
                try:
                    command, payload = self._commands.get(block=block, timeout=0.5 if block else None)
                    self._handle(command, payload)
                    while True:
                        command, payload = self._commands.get_nowait()
                        self._handle(command, payload)
                except queue.Empty:
                    pass
                if self.engine.has_unfinished():
                    for output in self.engine.step():
                        self._deliver(output.request_id, output)
                self._stats = self.engine.stats()
        except BaseException as exc:
            logger.exception("the engine loop died")
            self._error = exc
            for request_id in list(self._streams):
                self._deliver(request_id, EngineDeadError(f"the engine loop died: {exc!r}"))

    # -- asyncio side ---------------------------------------------------------------------------------

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        if self.is_dead:
            raise EngineDeadError("the engine loop is not running")
        self.engine.validate(prompt_token_ids, params)  # raises ValueError before anything is queued
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        self._commands.put(("add", (request_id, list(prompt_token_ids), params)))
        is_finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                is_finished = item.finished
                yield item
                if is_finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not is_finished:
                self._commands.put(("abort", request_id))

    async def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
