"""LLMEngine: the engine in one process (offline LLM, tests, gates): an EngineCore beside its front end.

step() = core.step() (plan, launch, collect one step, token stop rules) -> front end (detokenisation, stop strings,
delta RequestOutputs); sequences a stop string ended are aborted in the core at once. The server uses the same
two halves with the core in a process of its own (engine/core_client.py). prefill_logits() runs one prefill-only
request through the same core and returns the logits of every position (the token gates' logit checks).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from deltaserve.config import ModelConfig
from deltaserve.engine.core import EngineCore
from deltaserve.engine.frontend import EngineFrontend, RequestError
from deltaserve.engine.output import RequestState
from deltaserve.engine.prompts import PromptType, check_no_lora, check_no_overrides, multimodal, salt_of, to_token_ids
from deltaserve.engine.request import RequestOutput
from deltaserve.engine.stats import EngineStats
from deltaserve.engine_config import EngineConfig
from deltaserve.multimodal.inputs import MultimodalInput
from deltaserve.runner.executor import MultiprocExecutor
from deltaserve.runner.model_runner import ModelRunner
from deltaserve.sampling_params import SamplingParams
from deltaserve.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.core = EngineCore(config)
        self.config = self.core.config
        self.model_dir: Path = self.core.model_dir
        self.frontend = EngineFrontend(self.config, self.model_dir, self.core.max_model_len)

    @classmethod
    def from_engine_args(
        cls,
        engine_args: Any,
        usage_context: Any = None,
        stat_loggers: list[Any] | None = None,
        enable_multiprocessing: bool = False,
    ) -> LLMEngine:
        """vLLM's constructor from an EngineArgs (deltaserve.EngineArgs: anything whose create_engine_config()
        returns an EngineConfig). usage_context is vLLM's telemetry tag, taken and unused; custom stat_loggers are
        refused by name (the engine calls no logger factories); enable_multiprocessing is logged: this engine runs
        its core in the caller's process (the server runs it in one of its own)."""
        if stat_loggers:
            raise ValueError("stat_loggers is not supported: deltaserve's LLMEngine calls no custom stat loggers")
        if enable_multiprocessing:
            logger.info("enable_multiprocessing=True: accepted and logged; this LLMEngine runs its core in process")
        return cls(engine_args.create_engine_config(usage_context))

    # what the offline API, the gates and the tests read
    @property
    def model_config(self) -> ModelConfig:
        return self.core.model_config

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.frontend.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def default_sampling(self) -> dict:
        return self.frontend.default_sampling

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.frontend.eos_token_ids

    @property
    def runner(self) -> ModelRunner | MultiprocExecutor:
        return self.core.runner

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def requests(self) -> dict[str, RequestState]:
        return self.frontend.processor.requests

    # -- requests -------------------------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.frontend.validate(prompt_token_ids, params)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType | tuple[int, ...],
        params: SamplingParams,
        arrival_time: float | None = None,
        lora_request: Any = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        trace_headers: Mapping[str, str] | None = None,
        priority: int = 0,
        prompt_text: str | None = None,
        *,
        mm_input: MultimodalInput | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """vLLM's LLMEngine.add_request: `prompt` is a string (encoded with special tokens), token ids, or a
        TextPrompt / TokensPrompt dict (its multi_modal_data processed, its cache_salt read); returns request_id.
        trace_headers are taken and unused, as vLLM's without a tracing endpoint; lora_request and
        tokenization_kwargs are refused by name. mm_input / cache_salt: processed media and a salt given directly
        (token-id prompts, the offline LLM's path)."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {type(request_id)}")  # vLLM's words
        check_no_lora(lora_request)
        check_no_overrides(tokenization_kwargs, None)
        if isinstance(prompt, list | tuple) and all(isinstance(t, int) for t in prompt):
            token_ids = list(prompt)
        else:
            text, token_ids = to_token_ids(self, prompt)
            token_ids, media = multimodal(self, prompt, token_ids)
            prompt_text, mm_input = prompt_text or text, mm_input or media
            cache_salt = cache_salt or salt_of(prompt)
        requests = self.frontend.new_request(
            request_id, token_ids, params, prompt_text, mm_input, priority, cache_salt, arrival_time
        )
        for request in requests:
            self.core.add_request(request)
        return request_id

    def abort_request(self, request_ids: str | Iterable[str], internal: bool = False) -> None:
        """vLLM's: aborts these requests (vLLM 0.26 takes a list; one id as a string, as vLLM's earlier engine took
        it); an unknown or finished id is skipped. internal is vLLM's flag for its own ids, taken and unused."""
        for request_id in [request_ids] if isinstance(request_ids, str) else list(request_ids):
            _, core_ids = self.frontend.processor.abort(request_id)
            self.core.abort_requests(core_ids)

    def has_unfinished(self) -> bool:
        return bool(self.requests) or self.core.has_unfinished()

    # vLLM's LLMEngine names, as scripts reach them through LLM.llm_engine
    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self.tokenizer

    def has_unfinished_requests(self) -> bool:
        return self.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        """vLLM's count: each unfinished sequence (the n of a request are n requests in vLLM's engine)."""
        return sum(not seq.is_finished for state in self.requests.values() for seq in state.sequences)

    def step(self, by_output_kind: bool = True) -> list[RequestOutput]:
        """One core step's outputs, each as its request's output_kind asks (vLLM's: cumulative by default), or
        deltas whatever it asks (by_output_kind False: the offline LLM's loop and the step timings, which read only
        what is new and so pay no per-step copy of whole outputs); raises RequestError naming the request when the
        core failed one (after aborting all of that request's sequences)."""
        outputs, to_abort = self.frontend.processor.process(self.core.step(), by_output_kind=by_output_kind)
        self.core.abort_requests(to_abort)
        errors = self.core.take_errors()
        if errors:
            core_id, message = errors[0]
            for failed_id, _ in errors:
                _, core_ids = self.frontend.processor.abort(failed_id.split("#", 1)[0])
                self.core.abort_requests(core_ids)
            raise RequestError(f"request {core_id.split('#', 1)[0]}: {message}")
        return outputs

    def stats(self) -> EngineStats:
        return self.core.stats()

    def reset_prefix_cache(self) -> bool:
        """Drops the prefix cache's blocks and checkpoints that no request holds; False when some were held."""
        return self.core.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stops the tensor-parallel workers, if any; the engine cannot step afterwards."""
        self.core.shutdown()

    def prefill_logits(
        self, token_ids: list[int], prefill_chunks: list[int] | None = None, mm_input: MultimodalInput | None = None
    ) -> torch.Tensor:
        """Logits [L, V] (fp32, on the CPU) of every position of token_ids, from one prefill-only request that the
        scheduler plans (its blocks, slot and row) and the runner computes: prefill chunks of the given sizes
        (default: one chunk of everything), then the remaining tokens one at a time (decode-shaped steps).
        `mm_input`: the processor's images and videos for the prompt at the head of token_ids. Needs an idle
        engine: the steps it runs would take other requests' outputs."""
        if self.requests:
            raise RuntimeError("prefill_logits() needs an idle engine")
        request = self.frontend.prefill_request(f"prefill-{uuid.uuid4().hex}", token_ids, prefill_chunks, mm_input)
        self.core.add_request(request)
        logits = None
        try:
            while self.core.has_unfinished():
                for output in self.core.step():
                    if output.request_id == request.request_id and output.logits is not None:
                        logits = output.logits
        except BaseException:
            # a step that raised (the model refusing the input) leaves the request scheduled: free it
            self.core.abort_requests([request.request_id])
            raise
        if logits is None:
            raise RuntimeError(f"prefill-only request {request.request_id} finished without its logits")
        return torch.frombuffer(bytearray(logits), dtype=torch.float32).view(len(token_ids), -1)
