"""EngineCore: the scheduler and the runner, stepping plain-data requests into plain-data outputs.

step() plans a step, launches it on the runner, and reports what the oldest launched step produced. With async
scheduling (the default, as in vLLM 0.26) up to two steps are in flight: step N+1 is planned and launched before
step N's tokens are collected, so the host's scheduling and input building overlap the GPU's work, and the host
learns step N's tokens (stop rules included) one step later. `async_scheduling=False` runs plan, launch, collect,
update one step at a time. Greedy and seeded outputs are the same either way.

The core runs in the server's engine-core process, or in the caller's process for the offline LLM and tests. It
steps an executor (runner/executor.py): the ModelRunner itself at --tensor-parallel-size 1, else rank 0's runner
plus one worker process per other rank; check_health() raises once a worker is gone, shutdown() stops them.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from pathlib import Path

import torch

from deltaserve.config import ModelConfig
from deltaserve.engine.budget import step_budgets
from deltaserve.engine.grammar import StructuredOutputsConfig
from deltaserve.engine.output import slice_prompt_logprobs
from deltaserve.engine.protocol import EngineCoreInfo, EngineCoreOutput, EngineCoreRequest
from deltaserve.engine.stats import EngineStats, IterationTokens, RequestMetrics, SpecDecodeCounts
from deltaserve.engine.structured import StructuredOutputManager
from deltaserve.engine_config import EngineConfig
from deltaserve.fp8_format import check_requested_quantization
from deltaserve.model.hub import resolve_model_dir
from deltaserve.model.preflight import resolve_max_model_len
from deltaserve.runner.drafter import Drafter
from deltaserve.runner.executor import make_executor
from deltaserve.runner.sampling_step import StepHandle
from deltaserve.scheduler.block_manager import BlockManager, PageTable, StateSlotPool
from deltaserve.scheduler.scheduler import Scheduler
from deltaserve.scheduler.sequence import Sequence
from deltaserve.scheduler.spec import SpecSchedule
from deltaserve.scheduler.spec_policy import KPolicy
from deltaserve.step import StepPlan

logger = logging.getLogger(__name__)

MAX_STEPS_IN_FLIGHT = 2  # async scheduling: one step running on the GPU, the next one queued behind it


def lookahead(num_speculative_tokens: int) -> int:
    """The most positions of one sequence a step launched now may sample before the core saw the tokens they follow:
    each step in flight and the new one sample up to 1 + k (a verify chunk)."""
    return MAX_STEPS_IN_FLIGHT * (1 + num_speculative_tokens)


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        model_dir = resolve_model_dir(config.model)
        if str(model_dir) != config.model:
            config = dataclasses.replace(config, model=str(model_dir))
        self.config = config
        self.model_dir = model_dir
        model_config = ModelConfig.from_pretrained(model_dir)
        check_requested_quantization(config.quantization, model_config.fp8, model_config.config_file)
        tokenizer_dir = Path(config.tokenizer) if config.tokenizer and Path(config.tokenizer).is_dir() else model_dir
        # vLLM's rule: a --max-model-len above the model's is refused (unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1)
        max_model_len = resolve_max_model_len(model_config, config.max_model_len, tokenizer_dir)
        self.model_config = model_config.with_max_model_len(max_model_len)
        on_gpu = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
        # not given: from the weights a token reads (engine/budget.py: 2048 for the 27B shape, 8192 for 35B-A3B), and
        # a larger budget for a step that prefills one prompt alone, which the runner's memory plan is sized for
        self.max_num_batched_tokens, self.lone_prefill_tokens = step_budgets(
            self.model_config, on_gpu, config.max_num_batched_tokens, config.lone_prefill_tokens, max_model_len
        )
        self.runner = make_executor(self.model_config, config, max_model_len, self.lone_prefill_tokens)
        layout = self.runner.layout
        self.max_model_len = max_model_len  # plan_cache refuses a cache that cannot hold one such sequence
        # one pool (layout.pages_per_slot): blocks and slots drawn from one page table (docs/ARCHITECTURE.md)
        pages = PageTable(layout.num_blocks, layout.pages_per_slot) if layout.pages_per_slot else None
        self.scheduler = Scheduler(
            BlockManager(layout.num_blocks, layout.block_size, pages),
            StateSlotPool(layout.num_slots, pages),
            self.runner.max_num_seqs,
            self.max_num_batched_tokens,
            self.max_model_len,
            config.scheduling_policy,
            enable_prefix_caching=config.enable_prefix_caching,
            checkpoint_interval=config.prefix_cache_checkpoint_interval,
            chunk_size=layout.gdn_chunk_size,
            lone_prefill_tokens=self.lone_prefill_tokens,
        )
        if config.speculative_config is not None:  # the runner built the MTP drafter
            k = config.speculative_config.num_speculative_tokens
            policy = KPolicy.from_config(config.speculative_config)  # logs itself
            self.scheduler.spec = SpecSchedule(k, self.runner.spec.max_spec_seqs, policy, config.chains_verifies)
            if self.scheduler.prefix_cache is not None:  # a hit rewrites the MTP KV at P - 1 in a private block
                self.scheduler.prefix_cache.rewrites_last_row = True
        self.is_async = config.async_scheduling
        self.sequences: dict[str, Sequence] = {}
        self._inflight: deque[tuple[StepPlan, StepHandle, tuple[str | None, ...]]] = deque()
        # history constraints (grammars, multi-token bad words, thinking budgets): state beside the scheduler;
        # requests whose grammar is still compiling are parked here, not in the scheduler
        spec = config.speculative_config
        self.structured = StructuredOutputManager(
            model_dir, config.tokenizer, self.model_config.vocab_size,
            StructuredOutputsConfig.parse(config.structured_outputs_config),
            lookahead=lookahead(spec.num_speculative_tokens if spec is not None else 0),
        )  # fmt: skip
        self._parked: dict[str, Sequence] = {}
        self._errors: list[tuple[str, str]] = []  # (core request id, message): see take_errors
        self._num_prompt_logprobs: dict[str, int] = {}  # request -> prompt positions reported (resumes recompute)
        self._iteration_tokens = IterationTokens()
        self._spec_decode = SpecDecodeCounts(spec.num_speculative_tokens) if spec is not None else None
        if self.runner.load_report is not None:
            logger.info("%s", self.runner.load_report.summary())
        logger.info(
            "engine core ready: %s on %s (%s, tensor parallel %d), %d KV blocks x %d tokens, %d state slots, "
            "max_num_seqs %d, max_num_batched_tokens %d%s, max_model_len %d, async scheduling %s",
            model_dir, self.runner.device, self.runner.dtype, config.tensor_parallel_size, layout.num_blocks,
            layout.block_size, layout.num_slots, self.runner.max_num_seqs, self.max_num_batched_tokens,
            f" ({self.lone_prefill_tokens} for a step that prefills one prompt alone)"
            if self.lone_prefill_tokens > self.max_num_batched_tokens else "",
            self.max_model_len, "on" if self.is_async else "off",
        )  # fmt: skip
        if config.enable_prefix_caching:
            logger.info(
                "prefix caching on: %d of the %d state slots (%.1f MiB each) hold checkpoints beside the %d live ones, "
                "a checkpoint every %s prefill tokens and at each branch point, prompt end and generation end",
                layout.num_checkpoint_slots, layout.num_slots, layout.bytes_per_slot / 2**20, self.runner.max_num_seqs,
                config.prefix_cache_checkpoint_interval or "(no periodic)",
            )  # fmt: skip

    def enable_speculation(self, num_speculative_tokens: int, drafter: Drafter, policy: KPolicy | None = None) -> None:
        """Speculative decoding with up to num_speculative_tokens drafts a decode, proposed by `drafter`, k chosen
        per step by `policy` where one is given (docs/speculative-decoding.md)."""
        self.runner.enable_speculation(num_speculative_tokens, drafter)
        self.structured.lookahead = lookahead(num_speculative_tokens)
        self.scheduler.spec = SpecSchedule(num_speculative_tokens, self.runner.spec.max_spec_seqs, policy)

    def info(self) -> EngineCoreInfo:
        layout = self.runner.layout
        return EngineCoreInfo(
            max_model_len=self.max_model_len,
            max_num_seqs=self.runner.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            num_blocks=layout.num_blocks,
            block_size=layout.block_size,
            num_slots=layout.num_slots,
            device=str(self.runner.device),
            dtype=str(self.runner.dtype).removeprefix("torch."),
            is_async_scheduling=self.is_async,
            enable_prefix_caching=self.config.enable_prefix_caching,
            num_speculative_tokens=self._spec_decode.num_speculative_tokens if self._spec_decode else 0,
        )

    # -- requests -------------------------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        if request.request_id in self.sequences:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        seq = Sequence(
            request.request_id,
            list(request.prompt_token_ids),
            request.max_tokens,
            sampling=request.sampling,
            eos_token_ids=request.eos_token_ids,
            eos_token_id=request.eos_token_id,
            arrival_time=request.arrival_time,
            mm_input=request.mm_input,
            logits_chunks=request.logits_chunks,
            priority=request.priority,
            cache_salt=request.cache_salt,
        )
        self.sequences[seq.seq_id] = seq
        if request.sampling.prompt_logprobs is not None:
            self._num_prompt_logprobs[seq.seq_id] = 0
        if self.structured.add(seq.seq_id, request.sampling, request.eos_token_ids, request.thinking):
            self.scheduler.add(seq)
        else:
            self._parked[seq.seq_id] = seq  # until its grammar compiled (a worker thread)

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            seq = self.sequences.pop(request_id, None)
            self.structured.remove(request_id)
            self._num_prompt_logprobs.pop(request_id, None)
            if self._parked.pop(request_id, None) is None and seq is not None:
                self.scheduler.finish(seq)

    def has_unfinished(self) -> bool:
        return bool(self.sequences) or bool(self._inflight)

    def check_health(self) -> None:
        """Raises when the executor cannot step any more (a tensor-parallel worker died)."""
        self.runner.check_health()

    def shutdown(self) -> None:
        """Stops the executor's workers (nothing at --tensor-parallel-size 1)."""
        self.runner.shutdown()

    def _admit_compiled(self) -> None:
        """Moves requests whose grammar compiled into the scheduler; those that failed end with an error."""
        if not self._parked:
            return
        if len(self._parked) == len(self.sequences) and not self._inflight:
            self.structured.wait_any(timeout=0.05)  # only parked work: wait for a compile, do not spin
        ready, failed = self.structured.take_ready()
        for request_id in ready:
            seq = self._parked.pop(request_id, None)
            if seq is not None:
                self.scheduler.add(seq)
        for request_id, message in failed:
            if self._parked.pop(request_id, None) is not None:
                self.sequences.pop(request_id, None)
                self._errors.append((request_id, message))

    def take_errors(self) -> list[tuple[str, str]]:
        """(core request id, message) of requests the core ended with an error since the last call (a grammar
        that did not compile, a constraint no token can satisfy); the front end fails them, never finishes them."""
        errors, self._errors = self._errors, []
        return errors

    # -- stepping -------------------------------------------------------------------------------------

    def _launch(self) -> bool:
        """Plans a step and launches it; True when it holds work."""
        plan = self.scheduler.schedule()
        if plan.is_empty:
            if plan.removed:
                self.runner.execute(plan)  # only the table's diffs
            return False
        owners = self.structured.observe(plan)
        # a step holding a constrained row launches only its forward: its bitmask needs the previous step's tokens
        is_deferred = self.structured.needs_mask(plan, owners)
        self._inflight.append((plan, self.runner.execute(plan, defer_sampling=is_deferred), owners))
        return True

    def _sample_oldest(self) -> None:
        """Samples the oldest launched step if it was deferred: every step before it is collected, so each
        grammar has seen the tokens this step's bitmask depends on."""
        if self._inflight and self._inflight[0][1].pending is not None:
            plan, handle, owners = self._inflight[0]
            # verify chunks: each grammar walks its chunk's drafts to mask every position
            drafts = self.runner.step_drafts(handle) if any(s.num_draft_tokens for s in plan.seqs) else None
            bitmask, positions, forced = self.structured.fill(plan, owners, drafts)
            self.runner.sample(handle, None if bitmask is None else bitmask.numpy(), positions, forced)

    def step(self) -> list[EngineCoreOutput]:
        """Advances by one step; returns the outputs of the step it collected (none while only launching)."""
        self._admit_compiled()
        outputs: list[EngineCoreOutput] = []
        depth = MAX_STEPS_IN_FLIGHT if self.is_async else 1
        is_launched = False
        if len(self._inflight) < depth and len(self.sequences) > len(self._parked):
            is_launched = self._launch()
        self._sample_oldest()
        if not self._inflight or (is_launched and len(self._inflight) < depth and self.is_async):
            return outputs
        plan, handle, owners = self._inflight.popleft()
        result = self.runner.collect(handle)
        if self._spec_decode is not None:
            # as vLLM, nothing of a sequence finished since the step was planned (one that stopped inside an
            # accepted run with a chained verify in flight, or was aborted) is counted
            self._spec_decode.observe_step(plan, result, self.scheduler.unfinished(plan))
            self._spec_decode.maybe_log()
        prompt_logprobs = self._prompt_logprobs(result.prompt_logprobs, owners)
        failed: list[str] = []
        num_iteration_tokens = 0
        for seq, tokens, logprobs in self.scheduler.update(plan, result):
            is_finished = seq.is_finished
            # vLLM's count: a request's prompt once, with its first token, then every generated token
            is_first = len(seq.output_token_ids) == len(tokens) > 0
            num_iteration_tokens += len(tokens) + (seq.num_prompt_tokens if is_first else 0)
            error = self.structured.accept(seq.seq_id, tokens)
            if is_finished:  # the scheduler already freed it
                self.sequences.pop(seq.seq_id, None)
                self.structured.remove(seq.seq_id)
                self._num_prompt_logprobs.pop(seq.seq_id, None)
            if error is not None:
                # the token breaks the constraint: the request fails (its output would not follow it)
                self._errors.append((seq.seq_id, error))
                prompt_logprobs.pop(seq.seq_id, None)
                if not is_finished:
                    failed.append(seq.seq_id)
                continue
            outputs.append(
                EngineCoreOutput(
                    request_id=seq.seq_id,
                    new_token_ids=tuple(tokens),
                    new_logprobs=tuple(logprobs) if any(lp is not None for lp in logprobs) else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    metrics=self._metrics(seq) if is_finished else None,
                    prompt_logprobs=prompt_logprobs.pop(seq.seq_id, None),
                    logits=b"".join(seq.logits) if seq.is_prefill_only else None,
                    num_cached_tokens=seq.num_cached_tokens,
                    num_cache_creation_tokens=max(
                        0, min(seq.num_cache_depth, seq.num_prompt_tokens) - seq.num_cached_tokens
                    ),
                )
            )
        if num_iteration_tokens:
            self._iteration_tokens.observe(num_iteration_tokens)
        self.abort_requests(failed)
        # prompt logprobs of chunks that sampled nothing yet (a long prompt's early chunks)
        outputs.extend(EngineCoreOutput(rid, (), None, prompt_logprobs=lp) for rid, lp in prompt_logprobs.items())
        self._sample_oldest()
        return outputs

    def _prompt_logprobs(self, per_seq: tuple, owners: tuple[str | None, ...]) -> dict[str, tuple]:
        """request id -> this step's new prompt-logprob entries (a resumed prefill's repeats are dropped)."""
        found = {}
        for entry, owner in zip(per_seq, owners, strict=False):
            if entry is None or owner is None or owner not in self._num_prompt_logprobs:
                continue
            first, entries = entry
            new = slice_prompt_logprobs(first, entries, self._num_prompt_logprobs[owner])
            if new:
                self._num_prompt_logprobs[owner] += len(new)
                found[owner] = new
        return found

    def drain(self) -> None:
        """Collects every launched step and drops its results (shutdown)."""
        while self._inflight:
            self._sample_oldest()
            plan, handle, _ = self._inflight.popleft()
            self.scheduler.update(plan, self.runner.collect(handle))

    @staticmethod
    def _metrics(seq: Sequence) -> RequestMetrics:
        return RequestMetrics(
            arrival_time=seq.arrival_time,
            first_scheduled_time=seq.first_scheduled_time,
            first_token_time=seq.first_token_time,
            last_token_time=seq.last_token_time,
            num_preemptions=seq.num_preemptions,
        )

    def stats(self) -> EngineStats:
        blocks, slots, scheduler = self.scheduler.blocks, self.scheduler.slots, self.scheduler
        return EngineStats(
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            kv_cache_usage=blocks.usage,
            num_free_kv_blocks=blocks.num_available_blocks,  # checkpoints' blocks count free, as vLLM's cached ones
            num_total_kv_blocks=blocks.num_blocks,
            num_free_state_slots=scheduler.num_available_slots,
            num_total_state_slots=slots.num_slots,
            num_preemptions_total=scheduler.num_preemptions_total,
            num_waiting_for_capacity=scheduler.num_waiting_for_capacity,
            num_waiting_deferred=scheduler.num_waiting - scheduler.num_waiting_for_capacity,
            iteration_token_counts=self._iteration_tokens.cumulative_counts(),
            iteration_tokens_sum=self._iteration_tokens.sum,
            block_size=blocks.block_size,
            prefix_cache_queries=scheduler.prefix_cache_queries,
            prefix_cache_hits=scheduler.prefix_cache_hits,
            gpu_memory_utilization=self.config.gpu_memory_utilization,
            kv_cache_memory_bytes=self.config.kv_cache_memory_bytes,
            enable_prefix_caching=self.config.enable_prefix_caching,
            **(self._spec_decode.fields() if self._spec_decode is not None else {}),
        )

    def reset_prefix_cache(self) -> bool:
        """Drops every cached block and state checkpoint no running request holds (vLLM's reset_prefix_cache);
        False when some could not be dropped. The counters behind vllm:prefix_cache_* keep counting."""
        return self.scheduler.reset_prefix_cache()
