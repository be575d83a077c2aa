"""ModelRunner: StepPlan -> device inputs -> model forward -> sampler -> StepResult, without waiting on the GPU.

It owns the model, its weights, the KV cache, the state pool, the request table and the CUDA graphs (decode graphs,
or while speculating the verify graphs of runner/spec_graphs.py; runner/memory.py sizes the caches). execute()
applies the plan's diffs to the request table, builds the inputs, launches the forward and the sampler, and starts
copying the sampled tokens to pinned host memory; it returns a StepHandle at once. collect() waits for that copy
and returns the StepResult. Under async scheduling the engine plans and launches step N+1 before collecting step N,
so the host work of a step overlaps the GPU work of the one before. A step whose rows need a token bitmask that
depends on the previous step's tokens (grammars) is launched with defer_sampling=True: only the forward runs, and
the engine calls sample(handle, bitmask) once it has filled the mask. Prompt logprobs are computed here too, for the
prefill chunks of rows that asked (runner/prompt_logprobs.py).

This file is the orchestration; the jobs live beside it, taking the state the runner owns as arguments:
runner/device_setup.py (device, dtype, threads, the GDN prefill kernel, this engine's share of the GPU),
runner/warmup.py (the warm-up, with runner/verify_warmup.py's verify step while speculating, and the cache budget),
runner/memory.py (the cache sizing), runner/sampling_step.py (StepHandle, the sampler call, the host copies,
collect), runner/spec_step.py (the speculative glue: verify graphs, the verify batch, accept and draft),
runner/mm_embeds.py (the vision encoder's embeddings of a step).

Under tensor parallelism one ModelRunner runs per rank (runner/executor.py starts them) with the rank's shard of
the model and of the caches: every rank applies the same plan to its own request table and runs the same forward
(its collectives meet the other ranks'), rank 0 alone samples, and the sampled tokens are broadcast over the device
group so every rank's table keeps the same last_sampled (the next decode's input); with speculative decoding the
broadcast also carries the verify chunks' accepted tokens, so every rank commits the same GDN states and drafts the
same tokens (runner/spec_ranks.py). Only rank 0's StepHandle holds tokens.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from deltaserve.config import ModelConfig
from deltaserve.engine_config import EngineConfig
from deltaserve.model.checkpoint_files import MTP_RULE, SKIP_RULES
from deltaserve.model.context import forward_context
from deltaserve.model.loader import init_dummy_weights, load_checkpoint
from deltaserve.model.parallel import TensorParallel
from deltaserve.model.qwen3_5 import Qwen35Model
from deltaserve.runner import attention_plan, device_setup, jit_monitor
from deltaserve.runner import prompt_logprobs as plp
from deltaserve.runner.cache import allocate_and_bind, copy_kv_blocks, copy_state_slots
from deltaserve.runner.cuda_graph import DecodeGraphs
from deltaserve.runner.device_setup import engine_share, is_cuda, rank_device, resolve_dtype, set_cpu_threads
from deltaserve.runner.drafter import Drafter
from deltaserve.runner.inputs import build_eager_inputs, layout_step
from deltaserve.runner.memory import size_caches
from deltaserve.runner.mm_embeds import step_mm_embeds
from deltaserve.runner.mtp_drafter import MtpDrafter
from deltaserve.runner.mtp_resume import rewrite_resumed_rows, save_inner_hidden, save_last_hidden
from deltaserve.runner.observer import StepObserver, timed_launch
from deltaserve.runner.request_table import RequestTable
from deltaserve.runner.sampling_step import StepHandle, collect_step, follow_first, sample_step
from deltaserve.runner.spec_decode import SpecDecoder
from deltaserve.runner.spec_graphs import VerifyGraphs
from deltaserve.runner.spec_handle import drafts_of, drafts_to_host
from deltaserve.runner.spec_step import (
    build_verify_graphs,
    draft_without_sampling,
    spec_draft_counts,
    step_spec_handle,
    verify_sampling_batch,
)
from deltaserve.sampler import Sampler, SamplingBatch
from deltaserve.sampler.transfer import to_device
from deltaserve.step import StepPlan, StepResult

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        engine_config: EngineConfig,
        max_model_len: int,
        max_num_batched_tokens: int,
        tp: TensorParallel | None = None,
    ) -> None:
        with jit_monitor.starting_up():  # what the start-up compiles is its own work
            self._start(model_config, engine_config, max_model_len, max_num_batched_tokens, tp)
        # from here a kernel compiled is one the warm-up missed (vLLM's --jit-monitor-mode)
        jit_monitor.activate(engine_config.jit_monitor_mode, engine_config.jit_monitor_verbose)

    def _start(
        self,
        model_config: ModelConfig,
        engine_config: EngineConfig,
        max_model_len: int,
        max_num_batched_tokens: int,
        tp: TensorParallel | None,
    ) -> None:
        """Weights, the warm-up, the caches and the CUDA graphs."""
        self.model_config = model_config
        self.engine_config = engine_config
        self.tp = tp or TensorParallel.single()
        self.device = rank_device(engine_config.device, self.tp)
        self.dtype = resolve_dtype(engine_config.dtype, self.device)
        self.block_size = engine_config.block_size
        self.max_model_len = max_model_len
        self.vocab_size = model_config.vocab_size
        torch.manual_seed(engine_config.seed)
        set_cpu_threads(self.device, model_config.hidden_size, self.tp)
        # the vision tower is built for a multimodal checkpoint unless --language-model-only (as vLLM's flag)
        self.has_vision = model_config.vision is not None and not engine_config.language_model_only
        # the GDN prefill kernel: an explicit FlashInfer request that cannot run is refused before anything is built
        self.gdn_prefill_backend = device_setup.gdn_prefill_backend(engine_config, self.device, self.dtype,
                                                                    model_config)  # fmt: skip
        # the kernel of the attention's prefill rows (--attention-backend), refused likewise before anything is built
        self.attention_backend = device_setup.attention_backend(engine_config, self.device, self.dtype, model_config,
                                                                self.block_size)  # fmt: skip
        # one line a grid reads back from the server's log (bench/server_logs.py): which kernels served the prefills
        logger.info("prefill kernels: attention=%s gdn=%s", self.attention_backend, self.gdn_prefill_backend)
        # this engine's share of the GPU (vLLM 0.26's per-instance accounting), before anything is built
        self._requested_bytes, self._allocated_before = engine_share(self.device, engine_config.gpu_memory_utilization)
        # the MTP layer (model/mtp.py) is built only for speculative decoding; its KV joins the cache plan
        self.model = Qwen35Model(
            model_config, self.dtype, self.device, build_vision=self.has_vision, tp=self.tp,
            build_mtp=engine_config.speculative_config is not None, gdn_prefill_backend=self.gdn_prefill_backend,
            attention_backend=self.attention_backend,
        )  # fmt: skip
        # the library for the prefill rows (None: ours); FlashInfer's workspace is allocated here, inside this
        # engine's share and before the warm-up, so the cache plan measures it with the weights
        self.prefill_attention = attention_plan.build_backend(self.attention_backend, model_config, self.tp,
                                                              self.block_size, self.dtype, self.device)  # fmt: skip
        if engine_config.load_format == "dummy":
            init_dummy_weights(self.model)  # vLLM's per-tensor seed, not --seed (as vLLM)
            self.load_report = None
        else:
            # a built vision tower consumes model.visual.* itself: only the MTP head stays a skipped prefix
            rules = (MTP_RULE,) if self.has_vision else SKIP_RULES
            self.load_report = load_checkpoint(
                self.model, model_config, Path(engine_config.model),
                ignore_unexpected=engine_config.ignore_unexpected_tensors, skip_rules=rules,
            )  # fmt: skip
        self.model.fuse_projections()
        self.model.eval()
        self.sampler = Sampler(engine_config.seed)
        self._step_observer: StepObserver | None = None  # set_step_observer
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        # speculating, the drafter reads each step's hidden states, which the decode graphs do not keep: the verify
        # graphs (and, under a k policy, their width-1 twin for all-decode steps) replace them
        self.is_graphed = (
            is_cuda(self.device) and not engine_config.enforce_eager and engine_config.speculative_config is None
        )
        self.graphs: DecodeGraphs | None = None  # captured after the cache exists; the warm-up runs eager
        # while speculating, verify steps replay verify graphs instead (runner/spec_graphs.py), on every rank alike
        self.is_spec_graphed = (
            is_cuda(self.device) and not engine_config.enforce_eager and engine_config.speculative_config is not None
        )
        self.spec_graphs: VerifyGraphs | None = None
        self.spec_decode_graphs: VerifyGraphs | None = None  # width 1: all-decode steps without verify chunks
        self.spec_draft_counts = spec_draft_counts(engine_config.speculative_config)  # StepPlan.num_drafts_next's
        self.spec: SpecDecoder | None = None  # enable_speculation; the warm-up sets its own for its steps
        # the warm-up (runner/warmup.py) measures the activation peak; what is left sizes the caches
        self.max_num_seqs, spec_rows, self.layout = size_caches(self, max_num_batched_tokens, max_model_len)
        allocate_and_bind(self.model, model_config, self.layout, self.dtype, self.device)
        self.table = RequestTable(self.max_num_seqs, self.max_blocks_per_seq, self.vocab_size, self.device)
        speculative = engine_config.speculative_config
        if speculative is not None:
            k = speculative.num_speculative_tokens
            self.enable_speculation(k, MtpDrafter(self.model, k), speculative.synthetic_acceptance_rates, spec_rows)
            if self.is_spec_graphed:
                self._use_spec_graphs(capture=True)
        if self.is_graphed:
            self.graphs = DecodeGraphs(
                self.model, self.max_num_seqs, self.max_blocks_per_seq, max_model_len, self.vocab_size, self.device
            )
            self.graphs.capture()

    # -- steps ----------------------------------------------------------------------------------------

    @timed_launch
    @torch.inference_mode()
    def execute(self, plan: StepPlan, defer_sampling: bool = False) -> StepHandle:
        """Applies the plan and launches its forward and sampling (only the forward with defer_sampling: call
        sample() next); does not wait for the GPU."""
        self.table.apply(plan)
        if plan.is_empty:
            return StepHandle(plan, np.zeros(0, dtype=np.int64), None, None, None)
        layout = layout_step(plan, self.table, self.block_size)
        if layout.chained.any() and not self._require_spec().tracks_next_start:
            raise ValueError(
                "a plan holds chunks planned behind a verify in flight (is_chained) but this runner does not track "
                "where verifies end: speculative_config async_verify is off or async scheduling is"
            )
        copy_state_slots(self.model, layout.state_copies)
        copy_kv_blocks(self.model, plan.block_copies)  # outside any graph, before the forward reads them
        num_seqs = len(plan.seqs)
        width = int(-(-(layout.starts + layout.num_new).max() // self.block_size))
        returns_logits = any(seq.return_logits for seq in plan.seqs)
        is_graph_step = (
            self.graphs is not None
            and not returns_logits
            and not layout.state_saves
            and self.spec is None  # the drafter reads the step's hidden states
            and layout.num_tokens == num_seqs == len(layout.device_token_index) == len(layout.sample_seqs)
            and self.graphs.can_run(num_seqs, width)
        )
        all_logits = None
        prompt_lp = None
        is_verify_graphed = False  # the target forward ran as a verify graph (runner/spec_graphs.py)
        if is_graph_step:
            logits = self.graphs.run(layout, self.table, self.block_size)  # [B, V]: every decode row samples
            sample_rows_dev = self.graphs.rows[:num_seqs]
        else:
            inputs = build_eager_inputs(plan, layout, self.table, self.block_size, self.device)
            if layout.spec is not None:
                self._require_spec().fill_draft_inputs(inputs.input_ids, layout.spec)
            mm_embeds = None
            if any(s.mm_spans for s in plan.seqs):
                mm_embeds = step_mm_embeds(self.model, self.table, plan, layout, self.device)
            if self.model.mtp is not None:  # the MTP KV at P - 1 of sequences resumed at P (after the block copies)
                rewrite_resumed_rows(self.model, plan, layout.query_start_loc, inputs.input_ids, self.table,
                                     self.block_size)  # fmt: skip
            verify_logits = None  # [P, V] when a verify graph ran the forward
            # a step with verify chunks: the verify graphs; plain decodes alone: the width-1 graphs (k policy)
            graphs = self.spec_graphs if layout.spec is not None else self.spec_decode_graphs
            is_verify_graphed = graphs is not None and graphs.can_run(plan, layout, self.block_size, defer_sampling)
            if is_verify_graphed:
                hidden, verify_logits = graphs.run(layout, inputs, self.table, self.block_size)
            else:
                attention_plan.plan_step(self.prefill_attention, inputs.ctx, layout)  # once a step, all layers
                with forward_context(inputs.ctx):
                    hidden = self.model(inputs.input_ids, inputs.positions, mm_embeds)  # [T, H]
            if self.model.mtp is not None:  # each slot's hidden row, before the checkpoints copy their slots
                save_last_hidden(self.model, hidden, layout.query_start_loc, layout.state_slots)
                save_inner_hidden(self.model, hidden, layout.inner_saves, layout.starts, layout.query_start_loc)
            # prefix-cache checkpoints: the state each chunk left in its write slot, saved (stream order: after the
            # forward wrote it, before any later step overwrites it)
            copy_state_slots(self.model, layout.state_saves)
            if returns_logits:
                all_logits = self.model.compute_logits(hidden)  # [T, V] fp32 (None off rank 0, like every logits)
            work = plp.plan_prompt_logprobs(self.table, layout.rows, layout.starts, layout.num_new,
                                            layout.query_start_loc)  # fmt: skip
            if work is not None:
                # every rank runs the slices (compute_logits gathers across ranks); rank 0 alone gets logprobs
                prompt_lp = plp.compute_prompt_logprobs(work, hidden, self.model.compute_logits, self.vocab_size)
                prompt_lp = None if prompt_lp is None else plp.to_host(prompt_lp)
            sample_rows_dev = inputs.sample_rows_dev
            logits = verify_logits
            if logits is None and len(layout.sample_seqs):
                index = inputs.sample_token_index
                rows = hidden if index is None else hidden.index_select(0, index)
                logits = self.model.compute_logits(rows)  # [S, V] fp32
        prompt_event = None
        if prompt_lp is not None and is_cuda(self.device):
            prompt_event = torch.cuda.Event()
            prompt_event.record()
        spec = None
        if self.spec is not None:  # (a decode-graph step never speculates: inputs and hidden exist)
            spec = step_spec_handle(layout, self.table, inputs, hidden, graphs, is_verify_graphed, defer_sampling,
                                    plan.num_drafts_next)  # fmt: skip
        if not len(layout.sample_seqs):
            if spec is not None:  # the drafter sees every forward (its own KV follows the target's)
                draft_without_sampling(self.spec, spec, self.table, self.block_size, layout, inputs)
            return StepHandle(plan, layout.sample_seqs, None, None, None, all_logits, None, prompt_lp, prompt_event)
        rows = layout.rows[layout.sample_seqs]
        if not self.tp.is_first:
            follow_first(spec, rows, sample_rows_dev, self.table, self.tp, self.spec, self.block_size,
                         self.device)  # fmt: skip
            return StepHandle(plan, layout.sample_seqs, None, None, None)
        if layout.spec is None:
            batch = self.table.sampling_batch(rows, sample_rows_dev)
        else:  # every position of a verify chunk samples as its row's next outputs
            batch = verify_sampling_batch(self.spec, spec, self.table, layout, inputs, rows)
        handle = StepHandle(plan, layout.sample_seqs, None, batch.num_logprobs, None, all_logits, None, prompt_lp,
                            prompt_event)  # fmt: skip
        handle.spec = spec
        if defer_sampling:
            handle.pending = (logits, rows, sample_rows_dev, batch)
            if spec is not None and spec.layout is not None:  # the grammars' masks walk the drafts (step_drafts)
                spec.drafts = drafts_to_host(self.spec.draft_tokens, spec.layout)
        else:
            self._sample(handle, logits, rows, sample_rows_dev, batch)
        return handle

    @torch.inference_mode()
    def sample(
        self, handle: StepHandle, bitmask: np.ndarray | None, bitmask_rows: np.ndarray | None,
        forced: np.ndarray | None = None,
    ) -> None:  # fmt: skip
        """Samples a step launched with defer_sampling. bitmask: int32 [C, ceil(V / 32)] for the positions
        bitmask_rows [C] of the step's sampling order (None: no row is masked); forced: int64 [F, 2] (position,
        token) rows, a token each of those positions must take (a spent thinking budget's reasoning end)."""
        if handle.pending is None:
            raise RuntimeError(f"step {handle.plan.step_id} has no deferred sampling")
        logits, rows, rows_dev, batch = handle.pending
        handle.pending = None
        if bitmask is not None and len(bitmask_rows):
            batch.token_bitmask = to_device(bitmask, torch.int32, self.device)
            batch.bitmask_rows = to_device(bitmask_rows, torch.int64, self.device)
        if forced is not None and len(forced):
            batch.forced = to_device(np.ascontiguousarray(forced.T), torch.int64, self.device)
        self._sample(handle, logits, rows, rows_dev, batch)

    def _sample(
        self, handle: StepHandle, logits: torch.Tensor, rows: np.ndarray, rows_dev: torch.Tensor, batch: SamplingBatch
    ) -> None:
        sample_step(handle, logits, rows, rows_dev, batch, self.sampler, self.table, self.tp, self.spec,
                    self.block_size, self.device)  # fmt: skip

    def step_drafts(self, handle: StepHandle) -> dict[int, list[int]]:
        """A deferred step's drafts, plan index -> the verify chunk's k drafts (the grammars fill their masks along
        them); empty without verify chunks."""
        spec = handle.spec
        if spec is None or spec.drafts is None:
            return {}
        return drafts_of(spec)

    def enable_speculation(
        self, num_speculative_tokens: int, drafter: Drafter, synthetic_rates: tuple[float, ...] | None = None,
        max_spec_seqs: int | None = None,
    ) -> None:  # fmt: skip
        """Turns on verify chunks of up to num_speculative_tokens drafts, which `drafter` proposes after every
        step (runner/spec_decode.py); synthetic_rates pins the accept decision (vLLM's synthetic mode);
        max_spec_seqs: verify chunks a step may hold (their scratch; default max_num_seqs)."""
        self.spec = SpecDecoder(self.model, self.max_num_seqs, num_speculative_tokens, drafter, self.device,
                                synthetic_rates, max_spec_seqs or self.max_num_seqs)  # fmt: skip
        self.spec.tracks_next_start = self.engine_config.chains_verifies  # the scheduler plans chained chunks then
        if self.spec_graphs is not None:  # the graphs name the old scratch: build them anew
            self._use_spec_graphs(self.spec_graphs.is_captured)

    def _use_spec_graphs(self, capture: bool) -> None:
        """Builds the verify graphs (runner/spec_graphs.py) and captures them; capture=False (tests, the CPU) runs
        their static-buffer code uncaptured, so the CPU proves the graph path's arithmetic. A drafter other than the
        MTP layer keeps its drafting (and the commit) eager. With a k policy, the all-decode steps it turns drafting
        off for get graphs of width 1 as well, in the same memory pool."""
        spec = self._require_spec()
        args = (self.model, spec, self.max_num_seqs, self.max_blocks_per_seq, self.max_model_len, self.vocab_size,
                self.device, self.block_size, capture, self.spec_draft_counts)  # fmt: skip
        self.spec_graphs = build_verify_graphs(*args)
        self.spec_decode_graphs = None
        if self.spec_draft_counts is not None and isinstance(spec.drafter, MtpDrafter):
            self.spec_decode_graphs = build_verify_graphs(*args, width=1, pool=self.spec_graphs.pool)

    def _require_spec(self) -> SpecDecoder:
        if self.spec is None:
            raise ValueError("a plan holds verify chunks (num_draft_tokens > 0) but speculative decoding is off")
        return self.spec

    def collect(self, handle: StepHandle) -> StepResult:
        """Waits for a launched step's tokens and returns them in the plan's sequence order."""
        return collect_step(handle, self.table, self.vocab_size, self._step_observer)

    def run(self, plan: StepPlan) -> StepResult:
        """execute + collect: one synchronous step."""
        return self.collect(self.execute(plan))

    # -- the executor interface (runner/executor.py): one process, one rank, nothing to coordinate ----------------

    def check_health(self) -> None:
        """Raises when the runner cannot step any more (never, in-process)."""

    def set_step_observer(self, observer: StepObserver | None) -> None:
        """Registers the callable collect() calls with each step's plan, result and host timings (runner/observer.py);
        None removes it."""
        self._step_observer = observer

    def shutdown(self) -> None:
        """Releases nothing: the runner's memory goes with it."""

    def run_on_all_ranks(self, method: str, *args: object) -> object:
        """Calls one of this runner's methods on every rank (here, the one) and returns rank 0's result."""
        return getattr(self, method)(*args)

    # -- the token gate's noise floor -----------------------------------------------------------------------------

    @torch.no_grad()
    def perturb_embedding(self, relative: float, seed: int) -> None:
        """Scales every embedding row by (1 + relative·noise), noise ~ N(0, 1) drawn for the whole [V, H] table
        from `seed` (each rank applies its rows' share), until restore_embedding()."""
        embed = self.model.embed_tokens
        self._saved_embedding = embed.data.clone()
        generator = torch.Generator(device=embed.device).manual_seed(seed)
        shape = (self.model_config.vocab_size, embed.shape[1])
        noise = torch.randn(shape, generator=generator, device=embed.device, dtype=torch.float32)
        vocab = self.model.shapes.vocab
        rows = noise[vocab.start : vocab.stop]  # [<= vocab.size, H]; the last rank's padding rows stay zero
        scale = torch.ones(embed.shape, dtype=torch.float32, device=embed.device)
        scale[: rows.shape[0]] += relative * rows
        embed.data.copy_((self._saved_embedding.float() * scale).to(embed.dtype))

    @torch.no_grad()
    def restore_embedding(self) -> None:
        self.model.embed_tokens.data.copy_(self._saved_embedding)
        del self._saved_embedding
