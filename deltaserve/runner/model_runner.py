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

Under tensor parallelism one ModelRunner runs per rank (runner/executor.py starts them) with the rank's shard of
the model and of the caches: every rank applies the same plan to its own request table and runs the same forward
(its collectives meet the other ranks'), rank 0 alone samples, and the sampled tokens are broadcast over the device
group so every rank's table keeps the same last_sampled (the next decode's input); with speculative decoding the
broadcast also carries the verify chunks' accepted tokens, so every rank commits the same GDN states and drafts the
same tokens (runner/spec_ranks.py). Only rank 0's StepHandle holds tokens.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from deltaserve import env
from deltaserve.config import ModelConfig
from deltaserve.engine_config import EngineConfig
from deltaserve.model.checkpoint_files import MTP_RULE, SKIP_RULES
from deltaserve.model.context import forward_context
from deltaserve.model.loader import init_dummy_weights, load_checkpoint
from deltaserve.model.parallel import TensorParallel
from deltaserve.model.qwen3_5 import Qwen35Model
from deltaserve.model.vision import gather_mm_embeds
from deltaserve.runner import prompt_logprobs as plp
from deltaserve.runner.cache import (
    CacheLayout,
    affordable_slots,
    allocate_and_bind,
    bytes_per_slot,
    checkpoint_slots,
    copy_kv_blocks,
    copy_state_slots,
    plan_cache,
    requested_bytes,
)
from deltaserve.runner.cuda_graph import DecodeGraphs
from deltaserve.runner.inputs import StepLayout, build_eager_inputs, layout_step
from deltaserve.runner.memory import GIB, cache_budget, default_max_num_seqs
from deltaserve.runner.mtp_drafter import MtpDrafter
from deltaserve.runner.mtp_resume import rewrite_resumed_rows, save_last_hidden
from deltaserve.runner.observer import StepObserver, StepTimings, timed_launch
from deltaserve.runner.request_table import RequestTable
from deltaserve.runner.spec_decode import Drafter, SpecDecoder, SpecHandle, collect_tokens, scratch_rows
from deltaserve.runner.spec_graphs import VerifyGraphs, max_verify_batch
from deltaserve.runner.spec_ranks import receive_accepted, send_accepted
from deltaserve.sampler import Sampler, SamplerOutput, SamplingBatch, logprobs_to_host
from deltaserve.sampler.sampler import SAMPLING_EPS
from deltaserve.sampler.transfer import to_device
from deltaserve.step import StepPlan, StepResult

logger = logging.getLogger(__name__)

DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


@dataclass
class StepHandle:
    """A launched step: what collect() needs to turn it into a StepResult."""

    plan: StepPlan
    sample_seqs: np.ndarray  # [S] indices into plan.seqs
    sampled: SamplerOutput | None  # host copies (pinned) of the sampler's outputs, once the event completes
    num_logprobs: tuple[int, ...] | None
    event: torch.cuda.Event | None
    all_logits: torch.Tensor | None = None  # [T, V] fp32, only when a chunk has return_logits
    # defer_sampling: (logits [S, V], table rows [S], their device copy, the batch) until sample() is called
    pending: tuple[torch.Tensor, np.ndarray, torch.Tensor, SamplingBatch] | None = None
    prompt_logprobs: plp.PromptLogprobsOutput | None = None  # host copies once prompt_event completes
    prompt_event: torch.cuda.Event | None = None
    # host perf_counter() stamps of execute(), taken only while a step observer is registered
    launch_started: float = 0.0
    launched_at: float = 0.0
    spec: SpecHandle | None = None  # the step's verify chunks (speculative decoding)


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        engine_config: EngineConfig,
        max_model_len: int,
        max_num_batched_tokens: int,
        tp: TensorParallel | None = None,
    ) -> None:
        self.model_config = model_config
        self.engine_config = engine_config
        self.tp = tp or TensorParallel.single()
        self.device = resolve_device(engine_config.device)
        if self.device.type == "cuda" and self.tp.is_parallel:
            self.device = torch.device("cuda", self.tp.local_rank)  # one GPU per rank of this host
            torch.cuda.set_device(self.device)
        self.dtype = resolve_dtype(engine_config.dtype, self.device)
        self.block_size = engine_config.block_size
        self.max_model_len = max_model_len
        self.vocab_size = model_config.vocab_size
        torch.manual_seed(engine_config.seed)
        if self.device.type == "cpu":
            threads = env.cpu_threads_for(model_config.hidden_size)
            if threads is None and self.tp.is_parallel:
                threads = max(1, (os.cpu_count() or 1) // self.tp.size)  # the ranks share the host's cores
            if threads:
                torch.set_num_threads(threads)
        # the vision tower is built for a multimodal checkpoint unless --language-model-only (as vLLM's flag)
        self.has_vision = model_config.vision is not None and not engine_config.language_model_only
        # vLLM 0.26's per-instance share: utilization x total is this engine's, and must be free at start-up (what
        # other processes hold is not subtracted from it, so two engines at 0.45 share one GPU as under vLLM)
        self._requested_bytes = 0
        self._allocated_before = 0
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()  # this process's cached but unused blocks are free for this engine
            free, total = torch.cuda.mem_get_info(self.device)
            self._requested_bytes = requested_bytes(total, free, engine_config.gpu_memory_utilization)
            self._allocated_before = torch.cuda.memory_allocated(self.device)
        # the MTP layer (model/mtp.py) is built only for speculative decoding; its KV joins the cache plan
        self.model = Qwen35Model(
            model_config, self.dtype, self.device, build_vision=self.has_vision, tp=self.tp,
            build_mtp=engine_config.speculative_config is not None,
        )  # fmt: skip
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
        # speculative decoding runs every step eager (its drafter reads each step's hidden states): no decode graphs
        self.is_graphed = (
            self.device.type == "cuda" and not engine_config.enforce_eager and engine_config.speculative_config is None
        )
        self.graphs: DecodeGraphs | None = None  # captured after the cache exists; the warm-up runs eager
        # while speculating, verify steps replay verify graphs instead (runner/spec_graphs.py), on every rank alike
        self.is_spec_graphed = (
            self.device.type == "cuda"
            and not engine_config.enforce_eager
            and engine_config.speculative_config is not None
        )
        self.spec_graphs: VerifyGraphs | None = None
        upper = engine_config.max_num_seqs or default_max_num_seqs(self.device)
        # every rank sizes its cache alike (the plan names the same blocks and slots on all of them): the smallest
        # rank's budget wins
        budget = self.tp.min_over_ranks(cache_budget(self, max_num_batched_tokens, max_model_len, upper))
        slot_bytes = bytes_per_slot(model_config, self.dtype, self.model.shapes)
        self.max_num_seqs = upper
        if engine_config.max_num_seqs is None:
            # vLLM's default count, sized to memory: the state pool takes at most half of the cache budget
            self.max_num_seqs = min(upper, affordable_slots(budget, slot_bytes))
            if self.max_num_seqs < upper:
                logger.info(
                    "max_num_seqs %d (vLLM's default %d capped: %d GDN state slots of %.1f MiB would take %.1f GiB "
                    "of the %.1f GiB cache budget)", self.max_num_seqs, upper, upper, slot_bytes / 2**20,
                    upper * slot_bytes / GIB, budget / GIB,
                )  # fmt: skip
        num_slots = engine_config.num_state_slots or self.max_num_seqs
        speculative = engine_config.speculative_config
        spec_rows = 0
        if speculative is not None:  # the verify scratch comes out of the cache budget (runner/spec_decode.py)
            spec_rows = scratch_rows(budget, slot_bytes, speculative.num_speculative_tokens, self.max_num_seqs)
            budget -= spec_rows * (speculative.num_speculative_tokens + 1) * slot_bytes
        num_checkpoints = 0
        if engine_config.enable_prefix_caching:
            num_checkpoints = engine_config.num_checkpoint_slots
            if num_checkpoints is None:
                num_checkpoints = checkpoint_slots(budget, slot_bytes, self.max_num_seqs)
        self.layout: CacheLayout = plan_cache(
            model_config, self.dtype, self.block_size, budget, num_slots, max_model_len, self.model.shapes,
            num_checkpoints, has_mtp=self.model.mtp is not None,
        )  # fmt: skip
        allocate_and_bind(self.model, model_config, self.layout, self.dtype, self.device)
        self.table = RequestTable(self.max_num_seqs, self.max_blocks_per_seq, self.vocab_size, self.device)
        self.spec: SpecDecoder | None = None  # enable_speculation
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
            mm_embeds = self._mm_embeds(plan, layout) if any(s.mm_spans for s in plan.seqs) else None
            if self.model.mtp is not None:  # the MTP KV at P - 1 of sequences resumed at P (after the block copies)
                rewrite_resumed_rows(self.model, plan, layout.query_start_loc, inputs.input_ids, self.table,
                                     self.block_size)  # fmt: skip
            verify_logits = None  # [P, V] when a verify graph ran the forward
            graphs = self.spec_graphs
            is_verify_graphed = graphs is not None and graphs.can_run(plan, layout, self.block_size, defer_sampling)
            if is_verify_graphed:
                hidden, verify_logits = self.spec_graphs.run(layout, inputs, self.table, self.block_size)
            else:
                with forward_context(inputs.ctx):
                    hidden = self.model(inputs.input_ids, inputs.positions, mm_embeds)  # [T, H]
            if self.model.mtp is not None:  # each slot's hidden row, before the checkpoints copy their slots
                save_last_hidden(self.model, hidden, layout.query_start_loc, layout.state_slots)
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
        if prompt_lp is not None and self.device.type == "cuda":
            prompt_event = torch.cuda.Event()
            prompt_event.record()
        spec = None
        if self.spec is not None:
            keys = is_random = None
            if layout.spec is not None:
                verify_rows = layout.rows[layout.sample_seqs][layout.spec.spec_sample_index]
                keys = self.table.keys[verify_rows]
                is_random = self.table.params_host[verify_rows, 0] >= SAMPLING_EPS
            spec = SpecHandle(layout.spec, keys, is_random, inputs, layout, hidden)
            # the post-sampling replay reads the static buffers: not when another step may replay before sample()
            spec.is_graphed = is_verify_graphed and self.spec_graphs.has_drafter and not defer_sampling
        if not len(layout.sample_seqs):
            if spec is not None:  # the drafter sees every forward (its own KV follows the target's)
                empty = layout.rows[:0]
                self.spec.propose(spec, self.table, self.block_size, empty, inputs.sample_rows_dev[:0],
                                  inputs.input_ids[:0])  # fmt: skip
                SpecDecoder.to_host(spec)
            return StepHandle(plan, layout.sample_seqs, None, None, None, all_logits, None, prompt_lp, prompt_event)
        rows = layout.rows[layout.sample_seqs]
        if not self.tp.is_first:
            self._follow_first(spec, rows, sample_rows_dev)
            return StepHandle(plan, layout.sample_seqs, None, None, None)
        if layout.spec is None:
            batch = self.table.sampling_batch(rows, sample_rows_dev)
        else:  # every position of a verify chunk samples as its row's next outputs
            counts = layout.spec.sample_counts
            batch = self.table.sampling_batch(np.repeat(rows, counts), inputs.position_rows_dev,
                                              layout.spec.position_offsets)  # fmt: skip
            # the random rule reads the target's distributions; it and the synthetic one emit drafts whose logprobs
            # come from the raw logprobs
            batch.keep_probs = bool(spec.is_random.any()) or self.spec.synthetic_rates is not None
            self.spec.add_draft_counts(batch, layout.spec, self.table, rows)
        handle = StepHandle(plan, layout.sample_seqs, None, batch.num_logprobs, None, all_logits, None, prompt_lp,
                            prompt_event)  # fmt: skip
        handle.spec = spec
        if defer_sampling:
            handle.pending = (logits, rows, sample_rows_dev, batch)
            if spec is not None and spec.layout is not None:  # the grammars' masks walk the drafts (step_drafts)
                spec.drafts = SpecDecoder.drafts_to_host(self.spec.draft_tokens, spec.layout)
        else:
            self._sample(handle, logits, rows, sample_rows_dev, batch)
        return handle

    @torch.inference_mode()
    def sample(self, handle: StepHandle, bitmask: np.ndarray | None, bitmask_rows: np.ndarray | None) -> None:
        """Samples a step launched with defer_sampling. bitmask: int32 [C, ceil(V / 32)] for the positions
        bitmask_rows [C] of the step's sampling order (None: no row is masked)."""
        if handle.pending is None:
            raise RuntimeError(f"step {handle.plan.step_id} has no deferred sampling")
        logits, rows, rows_dev, batch = handle.pending
        handle.pending = None
        if bitmask is not None and len(bitmask_rows):
            batch.token_bitmask = to_device(bitmask, torch.int32, self.device)
            batch.bitmask_rows = to_device(bitmask_rows, torch.int64, self.device)
        self._sample(handle, logits, rows, rows_dev, batch)

    def _sample(
        self, handle: StepHandle, logits: torch.Tensor, rows: np.ndarray, rows_dev: torch.Tensor, batch: SamplingBatch
    ) -> None:
        out = self.sampler(logits, batch)
        tokens = out.token_ids  # [S]: each sampling sequence's next input
        if handle.spec is not None and handle.spec.layout is not None:
            last = self.spec.last_positions(handle.spec, tokens.device)
            shared = self.sampler._shared_generator(tokens.device)
            tokens = self.spec.accept(handle.spec, out, batch, shared, out.token_ids.index_select(0, last))
            self.spec.count_accepted(self.table, handle.spec.layout, rows, handle.spec)
        send_accepted(self.tp, tokens, handle.spec)  # the other ranks' _follow_first
        self.table.record_sampled(rows, rows_dev, tokens)
        if handle.spec is not None and handle.spec.is_graphed:  # commit, hidden rows and drafts: one replay
            self.spec_graphs.draft(tokens, handle.spec.tokens, handle.spec.num_emitted, handle.plan.num_decodes)
        elif handle.spec is not None:
            self.spec.propose(handle.spec, self.table, self.block_size, rows, rows_dev, tokens)
        handle.sampled, handle.event = self._to_host(out)
        if handle.spec is not None:
            SpecDecoder.to_host(handle.spec)

    def _follow_first(self, spec: SpecHandle | None, rows: np.ndarray, rows_dev: torch.Tensor) -> None:
        """A rank other than 0 after a sampling step: rank 0 samples (it alone has the gathered logits) and decides
        the verify chunks' acceptance; this rank receives the tokens (its next inputs) and the accepted counts,
        commits the same GDN states and runs its drafter on the same inputs (runner/spec_ranks.py)."""
        tokens = receive_accepted(self.tp, len(rows), spec, self.device)
        if spec is not None and spec.is_graphed:  # rank 0 replays its post-sampling graph: so does this rank
            self.table.record_sampled(rows, rows_dev, tokens)
            num_decodes = int(spec.layout.seq_index[0])  # the verify chunks follow the plain decodes
            self.spec_graphs.draft(tokens, spec.tokens, spec.num_emitted, num_decodes)
            return
        if spec is not None and spec.layout is not None:
            self.spec.commit(spec)
        self.table.record_sampled(rows, rows_dev, tokens)
        if spec is not None:  # its collectives meet rank 0's drafter's
            self.spec.propose(spec, self.table, self.block_size, rows, rows_dev, tokens)

    def step_drafts(self, handle: StepHandle) -> dict[int, list[int]]:
        """A deferred step's drafts, plan index -> the verify chunk's k drafts (the grammars fill their masks along
        them); empty without verify chunks."""
        spec = handle.spec
        if spec is None or spec.drafts is None:
            return {}
        return SpecDecoder.drafts_of(spec)

    def enable_speculation(
        self, num_speculative_tokens: int, drafter: Drafter, synthetic_rates: tuple[float, ...] | None = None,
        max_spec_seqs: int | None = None,
    ) -> None:  # fmt: skip
        """Turns on verify chunks of up to num_speculative_tokens drafts, which `drafter` proposes after every
        step (runner/spec_decode.py); synthetic_rates pins the accept decision (vLLM's synthetic mode);
        max_spec_seqs: verify chunks a step may hold (their scratch; default max_num_seqs)."""
        self.spec = SpecDecoder(self.model, self.max_num_seqs, num_speculative_tokens, drafter, self.device,
                                synthetic_rates, max_spec_seqs or self.max_num_seqs)  # fmt: skip
        if self.spec_graphs is not None:  # the graphs name the old scratch: build them anew
            self._use_spec_graphs(self.spec_graphs.is_captured)

    def _use_spec_graphs(self, capture: bool) -> None:
        """Builds the verify graphs (runner/spec_graphs.py) and captures them; capture=False (tests, the CPU) runs
        their static-buffer code uncaptured, so the CPU proves the graph path's arithmetic. A drafter other than the
        MTP layer keeps its drafting (and the commit) eager."""
        spec = self._require_spec()
        k = spec.num_speculative_tokens
        max_batch = max_verify_batch(k, self.max_num_seqs, spec.max_spec_seqs)
        drafts = spec.draft_tokens if isinstance(spec.drafter, MtpDrafter) else None  # else drafting stays eager
        self.spec_graphs = VerifyGraphs(self.model, max_batch, k, self.max_blocks_per_seq, self.max_model_len,
                                        self.vocab_size, self.device, self.block_size, drafts, capture)  # fmt: skip
        self.spec_graphs.capture()

    def _require_spec(self) -> SpecDecoder:
        if self.spec is None:
            raise ValueError("a plan holds verify chunks (num_draft_tokens > 0) but speculative decoding is off")
        return self.spec

    def _mm_embeds(self, plan: StepPlan, layout: StepLayout) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step's encoder embeddings: items a chunk's window needs are encoded whole (the ViT is bidirectional),
        all of a step's missing items in one tower call, and kept per row until their last placeholder is
        computed, so an image that straddles a chunk boundary is encoded once."""
        if self.model.visual is None:
            raise ValueError("a request carries images or videos, but the vision tower is not built "
                             "(--language-model-only, or a text-only checkpoint)")  # fmt: skip
        table = self.table
        missing: list[tuple[int, int]] = []
        for seq in plan.seqs:
            outputs = table.encoder_outputs[seq.row]
            missing += [(seq.row, span.item) for span in seq.mm_spans if span.item not in outputs]
        if missing:
            items = [table.mm[row].items[index] for row, index in missing]
            encoded = self.model.visual.encode([(torch.from_numpy(it.pixel_values), it.grid_thw) for it in items])
            for (row, index), rows in zip(missing, encoded, strict=True):
                table.encoder_outputs[row][index] = rows
        pieces: list[tuple[int, torch.Tensor]] = []
        for i, seq in enumerate(plan.seqs):
            if not seq.mm_spans:
                continue
            mm, outputs = table.mm[seq.row], table.encoder_outputs[seq.row]
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + seq.num_new_tokens
            base = int(layout.query_start_loc[i])
            for piece in mm.embed_slices(start, end):
                pieces.append((base + piece.dst_start, outputs[piece.item_index][piece.src_start : piece.src_end]))
            for index in list(outputs):
                last_run = mm.items[index].embed_runs[-1]
                if last_run[0] + last_run[1] <= end:
                    del outputs[index]  # every placeholder of the item is computed
        return gather_mm_embeds(pieces, self.device)

    def _to_host(self, out: SamplerOutput) -> tuple[SamplerOutput, torch.cuda.Event | None]:
        """Starts non-blocking copies of the sampler's outputs into pinned memory; the event marks their end."""
        if self.device.type != "cuda":
            return out, None

        def copy(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return host.copy_(t, non_blocking=True)

        host = SamplerOutput(
            token_ids=copy(out.token_ids), logprob_rows=out.logprob_rows, sampled_logprobs=copy(out.sampled_logprobs),
            sampled_ranks=copy(out.sampled_ranks), top_ids=copy(out.top_ids), top_logprobs=copy(out.top_logprobs),
        )  # fmt: skip
        event = torch.cuda.Event()
        event.record()
        return host, event

    def collect(self, handle: StepHandle) -> StepResult:
        """Waits for a launched step's tokens and returns them in the plan's sequence order."""
        observer = self._step_observer
        if observer is None:
            return self._collect(handle)
        started = time.perf_counter()
        if handle.pending is None:  # (a deferred step's error is _collect's to raise)
            for event in (handle.prompt_event, handle.event):
                if event is not None:
                    event.synchronize()
        waited = time.perf_counter()
        result = self._collect(handle)  # its events are complete: it does not wait again
        done = time.perf_counter()
        if not handle.plan.is_empty and handle.launched_at:
            timings = StepTimings(
                launch_s=handle.launched_at - handle.launch_started, wait_s=waited - started,
                collect_s=done - started, launched_at=handle.launched_at, collected_at=done,
            )  # fmt: skip
            observer(handle.plan, result, timings)
        return result

    def _collect(self, handle: StepHandle) -> StepResult:
        plan = handle.plan
        token_ids: list[tuple[int, ...]] = [()] * len(plan.seqs)
        logprobs: list = [None] * len(plan.seqs)
        if handle.pending is not None:
            raise RuntimeError(f"step {plan.step_id} was collected before its deferred sampling ran")
        prompt_logprobs: tuple = ()
        if handle.prompt_logprobs is not None:
            if handle.prompt_event is not None:
                handle.prompt_event.synchronize()
            prompt_logprobs = tuple(plp.to_plain(handle.prompt_logprobs, len(plan.seqs)))
        if handle.sampled is not None and handle.spec is not None:
            if handle.event is not None:
                handle.event.synchronize()
            collect_tokens(handle, self.table, self.vocab_size, token_ids, logprobs)
        elif handle.sampled is not None:
            if handle.event is not None:
                handle.event.synchronize()
            sampled = handle.sampled.token_ids.tolist()
            per_row = None
            if handle.num_logprobs is not None:
                per_row = logprobs_to_host(handle.sampled, sampled, handle.num_logprobs, self.vocab_size)
            for i, seq_index in enumerate(handle.sample_seqs.tolist()):
                token_ids[seq_index] = (sampled[i],)
                if per_row is not None and per_row[i] is not None:
                    logprobs[seq_index] = (per_row[i],)
        has_logprobs = any(entry is not None for entry in logprobs)
        return StepResult(
            plan.step_id,
            tuple(token_ids),
            tuple(logprobs) if has_logprobs else (),
            prompt_logprobs=prompt_logprobs,
            logits=self._logits_to_host(plan, handle.all_logits),
        )

    @staticmethod
    def _logits_to_host(plan: StepPlan, all_logits: torch.Tensor | None) -> tuple[bytes | None, ...]:
        """The logits of each chunk with return_logits, as StepResult carries them (raw fp32 bytes)."""
        if all_logits is None:
            return ()
        host = all_logits.float().cpu().numpy()  # [T, V]
        chunks: list[bytes | None] = []
        start = 0
        for seq in plan.seqs:
            end = start + seq.num_new_tokens
            chunks.append(host[start:end].tobytes() if seq.return_logits else None)
            start = end
        return tuple(chunks)

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
