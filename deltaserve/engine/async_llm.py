"""AsyncLLM: vLLM's asyncio engine API (vllm.AsyncLLMEngine, v1's AsyncLLM) over the server's AsyncEngine, for code
that serves through vLLM's engine object rather than its HTTP server (custom servers, Triton's and Ray's backends):

    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=...))
    async for output in engine.generate("Hello", SamplingParams(max_tokens=16), "request-0"):
        ...

Prompts are what the offline API takes (a string, token ids, a TextPrompt / TokensPrompt dict with its
multi_modal_data and cache_salt: engine/prompts.py). Each request's outputs come as its output_kind asks, as vLLM's:
the whole output so far (CUMULATIVE, the default), what is new (DELTA), or once, finished (FINAL_ONLY). The core runs
in a process of its own (DELTASERVE_ENABLE_MULTIPROCESSING=0: a thread), started by the first request; a consumer
that stops iterating aborts its request, which frees its blocks and slot. vLLM's keywords that would change tokens
and are not served (a LoRA request, tokenization_kwargs, a data-parallel rank, reasoning_ended /
reasoning_parser_kwargs) are refused by name; trace_headers are taken and unused, as vLLM's without tracing.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any

from deltaserve.engine.async_engine import AsyncEngine, EngineDeadError
from deltaserve.engine.prompts import PromptType, check_no_lora, check_no_overrides, multimodal, salt_of, to_token_ids
from deltaserve.engine.request import RequestOutput
from deltaserve.engine_config import EngineConfig
from deltaserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class AsyncLLM:
    def __init__(self, config: EngineConfig, log_stats: bool = True) -> None:
        self.engine = AsyncEngine.from_config(config)
        self.engine.by_output_kind = True
        self.config = config
        self.log_stats = log_stats
        self._is_stopped = False

    @classmethod
    def from_engine_args(
        cls,
        engine_args: Any,
        start_engine_loop: bool = True,
        usage_context: Any = None,
        stat_loggers: list[Any] | None = None,
    ) -> AsyncLLM:
        """vLLM's constructor from an (Async)EngineArgs: anything whose create_engine_config() returns an
        EngineConfig. usage_context is vLLM's telemetry tag, taken and unused; custom stat_loggers are refused by
        name; start_engine_loop is taken as vLLM's: the core starts with the first request either way."""
        if stat_loggers:
            raise ValueError("stat_loggers is not supported: deltaserve's AsyncLLM calls no custom stat loggers")
        log_stats = not getattr(engine_args, "disable_log_stats", False)
        return cls(engine_args.create_engine_config(usage_context), log_stats=log_stats)

    # -- requests -------------------------------------------------------------------------------------

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        prompt_text: str | None = None,
        lora_request: Any = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        trace_headers: Mapping[str, str] | None = None,
        priority: int = 0,
        data_parallel_rank: int | None = None,
        reasoning_ended: bool | None = None,
        reasoning_parser_kwargs: dict[str, Any] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """vLLM's AsyncLLM.generate: the request's RequestOutputs as its output_kind asks. Raises ValueError (its
        RequestError) for a prompt or limit the engine cannot serve, before anything runs."""
        check_no_lora(lora_request)
        check_no_overrides(tokenization_kwargs, None)
        if data_parallel_rank not in (None, 0):
            raise ValueError(f"data_parallel_rank={data_parallel_rank}: deltaserve runs one data-parallel rank")
        if reasoning_ended is not None or reasoning_parser_kwargs is not None:
            raise ValueError(
                "reasoning_ended / reasoning_parser_kwargs are not supported: the engine reads the reasoning section "
                "from --reasoning-parser and the prompt"
            )
        if self._is_stopped:
            raise EngineDeadError("the engine was shut down")
        await self.engine.start()
        text, token_ids = to_token_ids(self.engine, prompt)
        token_ids, mm_input = multimodal(self.engine, prompt, token_ids)
        outputs = self.engine.generate(
            token_ids, sampling_params, request_id, mm_input=mm_input, priority=priority, cache_salt=salt_of(prompt),
            prompt_text=prompt_text or text,
        )  # fmt: skip
        async for output in outputs:
            yield output

    async def abort(self, request_id: str | Iterable[str], internal: bool = False) -> None:
        """vLLM's: aborts one request or several; unknown or finished ids are skipped."""
        for each in [request_id] if isinstance(request_id, str) else list(request_id):
            await self.engine.abort(each)

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Drops the prefix cache's entries that no running request holds; False when some were held."""
        if reset_running_requests:
            logger.warning("reset_running_requests=True is not honoured: running requests keep what they hold")
        return await self.engine.reset_prefix_cache()

    async def reset_mm_cache(self) -> None:
        """Nothing to drop: each image and video is processed and encoded with its request."""

    async def reset_encoder_cache(self) -> None:
        """Nothing to drop: no encoder outputs are kept between requests."""

    # -- state ----------------------------------------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    async def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    async def is_tracing_enabled(self) -> bool:
        return False

    async def do_log_stats(self) -> None:
        """vLLM logs its periodic stats line here; the server's stat logger does that (api/stat_logger.py)."""

    async def check_health(self) -> None:
        """Raises the engine's error once the core died, as vLLM's."""
        if self.engine.is_dead:
            raise EngineDeadError("the engine core is not running")

    @property
    def is_running(self) -> bool:
        return not self._is_stopped and not self.engine.is_dead

    @property
    def is_stopped(self) -> bool:
        return self._is_stopped

    @property
    def errored(self) -> bool:
        return self.engine.is_dead

    @property
    def dead_error(self) -> BaseException:
        return EngineDeadError("the engine core is not running")

    def shutdown(self, timeout: float | None = None) -> None:
        """Stops the core (its process and threads); the engine takes no request afterwards."""
        if not self._is_stopped:
            self._is_stopped = True
            self.engine.client.shutdown()


# vLLM's older name, still exported by vLLM 0.26 (vllm.AsyncLLMEngine is its AsyncLLM)
AsyncLLMEngine = AsyncLLM
