"""LLMEngine: the synchronous engine core. add_request / abort_request / step, one process, one loop.

step() = scheduler.schedule() -> runner.execute() -> scheduler.advance() -> per-request stop rules and
detokenisation -> delta RequestOutputs. A request with n > 1 becomes n sequences (child seeds seed + i, as
vLLM does) that are scheduled independently and reported under the one request id.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from deltaserve.config import ModelConfig
from deltaserve.engine.detokenizer import IncrementalDetokenizer
from deltaserve.engine.generation_config import load_eos_token_ids, load_generation_defaults
from deltaserve.engine.output import RequestState, SequenceProgress
from deltaserve.engine.request import RequestOutput
from deltaserve.engine.stats import EngineStats
from deltaserve.engine_config import EngineConfig
from deltaserve.model.hub import resolve_model_dir
from deltaserve.runner.model_runner import ModelRunner
from deltaserve.sampler.sampler import SequenceSamplingState, make_generator
from deltaserve.sampling_params import SamplingParams
from deltaserve.scheduler.batch import ScheduledBatch, ScheduledSequence
from deltaserve.scheduler.block_manager import BlockManager, StateSlotPool
from deltaserve.scheduler.scheduler import Scheduler
from deltaserve.scheduler.sequence import Sequence

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_dir = resolve_model_dir(config.model)
        if str(self.model_dir) != config.model:
            config = dataclasses.replace(config, model=str(self.model_dir))
            self.config = config
        self.model_config = ModelConfig.from_pretrained(self.model_dir)
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(config.tokenizer or self.model_dir)
        self.max_model_len = min(config.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings)  # fmt: skip
        if config.generation_config == "vllm":
            self.default_sampling: dict = {}
        else:
            source = self.model_dir if config.generation_config == "auto" else Path(config.generation_config)
            self.default_sampling = load_generation_defaults(source)
        eos = set(load_eos_token_ids(self.model_dir)) | set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        on_gpu = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
        max_batched = config.max_num_batched_tokens or (8192 if on_gpu else 2048)
        self.runner = ModelRunner(self.model_config, config, self.max_model_len, max_batched)
        layout = self.runner.layout
        self.max_model_len = min(self.max_model_len, layout.num_blocks * layout.block_size)
        self.scheduler = Scheduler(
            BlockManager(layout.num_blocks, layout.block_size),
            StateSlotPool(layout.num_slots),
            config.max_num_seqs,
            max_batched,
        )
        self.requests: dict[str, RequestState] = {}
        self.sequences: dict[str, tuple[RequestState, int]] = {}
        logger.info(
            "engine ready: %s on %s (%s), %d KV blocks x %d tokens, %d state slots, max_model_len %d",
            self.model_dir, self.runner.device, self.runner.dtype, layout.num_blocks, layout.block_size,
            layout.num_slots, self.max_model_len,
        )  # fmt: skip

    # -- requests -------------------------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raises ValueError (a 400 in the API) for prompts and limits the engine cannot serve."""
        if not prompt_token_ids:
            raise ValueError("The prompt cannot be empty.")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"Token id {bad[0]} is out of vocabulary (vocab size {vocab}).")
        num_prompt = len(prompt_token_ids)
        if num_prompt >= self.max_model_len:
            raise ValueError(
                f"The prompt (length {num_prompt}) is longer than the maximum model length of {self.max_model_len}."
            )
        if params.max_tokens is not None and num_prompt + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{params.max_tokens} output tokens and your prompt contains {num_prompt} input tokens, for a total "
                f"of {num_prompt + params.max_tokens} tokens."
            )
        params.validate()

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None
    ) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.validate(prompt_token_ids, params)
        max_tokens = params.max_tokens or self.max_model_len - len(prompt_token_ids)
        state = RequestState(
            request_id, prompt, list(prompt_token_ids), params, self.eos_token_ids, self.max_model_len, []
        )
        for index in range(params.n):
            seq_id = request_id if params.n == 1 else f"{request_id}#{index}"
            seq = Sequence(seq_id, list(prompt_token_ids), max_tokens)
            seed = None if params.seed is None else params.seed + index
            seq.sampling = SequenceSamplingState(
                params=params,
                prompt_token_ids=seq.prompt_token_ids,
                output_token_ids=seq.output_token_ids,  # shared list: the sampler sees every appended token
                eos_token_ids=self.eos_token_ids,  # masked during min_tokens even with ignore_eos (vLLM)
                generator=None if seed is None else make_generator(seed, self.runner.device),
            )
            detokenizer = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, params)
            state.sequences.append(SequenceProgress(seq, detokenizer))
            self.sequences[seq_id] = (state, index)
            self.scheduler.add(seq)
        self.requests[request_id] = state

    def abort_request(self, request_id: str) -> RequestOutput | None:
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        state.abort()
        self._release(state)
        return state.delta_output()

    def _release(self, state: RequestState) -> None:
        for progress in state.sequences:
            self.scheduler.finish(progress.seq)
            self.sequences.pop(progress.seq.seq_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- stepping -------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        result = self.runner.execute(batch)
        self.scheduler.advance(batch)
        touched: dict[str, RequestState] = {}
        for scheduled in batch.sequences:
            token = result.sampled.get(scheduled.seq_id)
            if token is None:
                continue
            state, index = self.sequences[scheduled.seq_id]
            state.append_token(index, token, result.logprobs.get(scheduled.seq_id))
            if state.sequences[index].is_finished:
                self.scheduler.finish(state.sequences[index].seq)
            touched[state.request_id] = state
        outputs = []
        for state in touched.values():
            outputs.append(state.delta_output())
            if state.is_finished:
                self._release(state)
                self.requests.pop(state.request_id, None)
        return outputs

    def stats(self) -> EngineStats:
        blocks, slots = self.scheduler.blocks, self.scheduler.slots
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=blocks.usage,
            num_free_kv_blocks=blocks.num_free_blocks,
            num_total_kv_blocks=blocks.num_blocks,
            num_free_state_slots=slots.num_free_slots,
            num_total_state_slots=slots.num_slots,
            num_preemptions_total=self.scheduler.num_preemptions_total,
        )

    # -- scoring (gates) ------------------------------------------------------------------------------

    @torch.inference_mode()
    def score(self, token_ids: list[int], prefill_chunks: list[int] | None = None) -> torch.Tensor:
        """Logits [L, V] of every position of token_ids: prefill chunks of the given sizes (default: one chunk
        of everything), then the remaining tokens as one-token decode steps. Needs an idle engine."""
        if self.has_unfinished():
            raise RuntimeError("score() needs an idle engine")
        chunks = list(prefill_chunks or [len(token_ids)])
        if sum(chunks) > len(token_ids) or min(chunks) < 1:
            raise ValueError(f"prefill chunks {chunks} do not fit {len(token_ids)} tokens")
        chunks += [1] * (len(token_ids) - sum(chunks))
        blocks, slots = self.scheduler.blocks, self.scheduler.slots
        block_ids = blocks.allocate(blocks.blocks_needed(len(token_ids), 0))
        slot = slots.allocate()
        try:
            pieces = []
            start = 0
            for size in chunks:
                end = start + size
                row = list(range(start, end))
                scheduled = ScheduledSequence(
                    "score", token_ids[start:end], [row, row, row], start, block_ids, slot, needs_sample=False
                )
                pieces.append(self.runner.execute(ScheduledBatch([scheduled]), return_all_logits=True).all_logits)
                start = end
            return torch.cat(pieces)
        finally:
            blocks.free(block_ids)
            slots.free(slot)
