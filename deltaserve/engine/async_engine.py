"""AsyncEngine: the server's engine. The front end (tokenizer, detokenisation, stop strings) in this process, the core
in a process of its own (or, with DELTASERVE_ENABLE_MULTIPROCESSING=0, on a thread here), bridged to asyncio.

The event loop never runs the model nor detokenises: generate() validates and registers the request, hands its core
requests to the client and awaits deltas on a per-request asyncio.Queue; the client's output thread turns core
outputs into RequestOutputs and feeds the queues with call_soon_threadsafe. If the consumer stops iterating (client
disconnect, task cancellation) the request is aborted in the core, which frees its KV blocks, state slot and row.
If the core dies, every stream gets EngineDeadError, is_dead turns True and `on_dead` is called (the server exits
non-zero). If the core process sends nothing, not even its heartbeat, for heartbeat_timeout_s, is_hung is True (the
server's /health fails) until it is heard again. reset_prefix_cache() is a call into the core: it is queued behind the
commands already sent (so a request sent after it is planned against the emptied cache) and awaits the core's answer.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from deltaserve import env
from deltaserve.engine.core_client import HEARTBEAT_INTERVAL_S, EngineDeadError, ProcessCoreClient, ThreadCoreClient
from deltaserve.engine.frontend import EngineFrontend, RequestError
from deltaserve.engine.protocol import EngineCoreOutputs
from deltaserve.engine.request import RequestOutput
from deltaserve.engine.stats import EngineStats
from deltaserve.engine_config import EngineConfig
from deltaserve.model.hub import resolve_model_dir
from deltaserve.multimodal.inputs import MultimodalInput
from deltaserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["AsyncEngine", "EngineDeadError"]


class AsyncEngine:
    def __init__(self, frontend: EngineFrontend, client: ProcessCoreClient | ThreadCoreClient) -> None:
        self.frontend = frontend
        self.client = client
        self.model_dir: Path = frontend.model_dir
        self.tokenizer = frontend.tokenizer
        self.max_model_len = frontend.max_model_len
        self.vocab_size = frontend.vocab_size  # token-id bounds of the api's checks
        self.default_sampling: dict[str, Any] = frontend.default_sampling
        self.mm_processor = frontend.mm_processor  # None: text only
        self.info = client.info
        self.heartbeat_timeout_s = env.engine_heartbeat_timeout_s()
        self.on_dead: Callable[[], None] | None = None
        # False: every stream gets deltas (the server's routes read them so); True: each request's outputs as its
        # output_kind asks (engine/async_llm.py, vLLM's AsyncLLM)
        self.by_output_kind = False
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._error: BaseException | None = None
        self._is_started = False
        info = client.info
        self._stats = EngineStats(0, 0, 0.0, info.num_blocks, info.num_blocks, info.num_slots, info.num_slots, 0,
                                  block_size=info.block_size,
                                  enable_prefix_caching=info.enable_prefix_caching,
                                  num_speculative_tokens=info.num_speculative_tokens)  # fmt: skip
        # utility calls awaiting the core's answer: call id -> (loop, future)
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._call_ids = itertools.count()
        self._calls_lock = threading.Lock()

    @classmethod
    def from_config(cls, config: EngineConfig, multiprocess: bool | None = None) -> AsyncEngine:
        is_multiprocess = env.enable_multiprocessing() if multiprocess is None else multiprocess
        if is_multiprocess:
            # a few beats per timeout, so one late beat is not a hung core
            interval = min(HEARTBEAT_INTERVAL_S, env.engine_heartbeat_timeout_s() / 4)
            client: ProcessCoreClient | ThreadCoreClient = ProcessCoreClient(config, heartbeat_interval_s=interval)
        else:
            client = ThreadCoreClient(config)
        try:
            frontend = EngineFrontend(config, resolve_model_dir(config.model), client.info.max_model_len)
        except BaseException:
            client.shutdown()
            raise
        return cls(frontend, client)

    @property
    def is_dead(self) -> bool:
        return self._error is not None

    @property
    def is_hung(self) -> bool:
        """The running core has sent nothing, not even a heartbeat, for heartbeat_timeout_s (frozen, or stopped)."""
        return self._is_started and self.client.seconds_since_heard() > self.heartbeat_timeout_s

    async def start(self) -> None:
        if not self._is_started:
            self._is_started = True
            self.client.start(self._on_outputs, self._on_dead)

    async def stop(self) -> None:
        await asyncio.to_thread(self.client.shutdown)

    def stats(self) -> EngineStats:
        return self._stats

    # -- the client's output thread ---------------------------------------------------------------------

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            loop.call_soon_threadsafe(stream.put_nowait, item)

    def _answer(self, call_id: int, result: object) -> None:
        with self._calls_lock:
            target = self._calls.pop(call_id, None)
        if target is not None:
            loop, future = target
            method = future.set_exception if isinstance(result, BaseException) else future.set_result
            loop.call_soon_threadsafe(lambda: None if future.done() else method(result))

    def _on_outputs(self, batch: EngineCoreOutputs) -> None:
        self._stats = batch.stats
        for call_id, result in batch.replies:
            self._answer(call_id, result)
        processor = self.frontend.processor
        results, to_abort = processor.process(list(batch.outputs), by_output_kind=self.by_output_kind)
        self.client.abort(to_abort)
        for output in results:
            self._deliver(output.request_id, output)
        for core_id, message in batch.errors:
            request_id = core_id.split("#", 1)[0]
            _, core_ids = processor.abort(request_id)
            self.client.abort(core_ids)
            self._deliver(request_id, RequestError(message))

    def _on_dead(self, error: BaseException) -> None:
        logger.error("%s", error)
        self._error = error
        for request_id in list(self._streams):
            self._deliver(request_id, EngineDeadError(str(error)))
        with self._calls_lock:
            call_ids = list(self._calls)
        for call_id in call_ids:
            self._answer(call_id, EngineDeadError(str(error)))
        if self.on_dead is not None:
            self.on_dead()

    # -- asyncio side ---------------------------------------------------------------------------------

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        mm_input: MultimodalInput | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        prompt_text: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs (deltas, or as its output_kind asks with by_output_kind); prompt_text: what the
        outputs report as RequestOutput.prompt."""
        if self.is_dead:
            raise EngineDeadError("the engine core is not running")
        # raises RequestError (a ValueError: 400) before anything is queued
        core_requests = self.frontend.new_request(
            request_id, list(prompt_token_ids), params, prompt_text, mm_input=mm_input, priority=priority,
            cache_salt=cache_salt,
        )  # fmt: skip
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        self.client.add(core_requests)
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
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        _, core_ids = self.frontend.processor.abort(request_id)
        self.client.abort(core_ids)

    async def reset_prefix_cache(self) -> bool:
        """Drops the prefix cache's blocks and checkpoints that no running request holds (vLLM's
        EngineClient.reset_prefix_cache); False when some were held. Raises EngineDeadError on a dead engine."""
        if self.is_dead:
            raise EngineDeadError("the engine core is not running")
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        with self._calls_lock:
            call_id = next(self._call_ids)
            self._calls[call_id] = (asyncio.get_running_loop(), future)
        if self.is_dead:  # died while the call was being registered: _on_dead may have missed it
            self._answer(call_id, EngineDeadError("the engine core is not running"))
        self.client.reset_prefix_cache(call_id)
        return bool(await future)
