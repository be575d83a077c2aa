"""ModelRunner: ScheduledBatch -> device inputs -> model forward -> sampler -> StepOutput.

It owns the model, its weights, the KV cache and the state pool. Inputs are built on the host from the
batch (token ids, 3-D positions, slot mapping, block tables, state slots) and copied to the device once per
step; the model reads them through the ForwardContext.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deltaserve import env
from deltaserve.config import ModelConfig
from deltaserve.engine_config import EngineConfig
from deltaserve.model.context import ForwardContext, forward_context
from deltaserve.model.loader import init_dummy_weights, load_checkpoint
from deltaserve.model.qwen3_5 import Qwen35Model
from deltaserve.runner.cache import CacheLayout, allocate_and_bind, plan_cache
from deltaserve.runner.cuda_graph import DecodeGraphs
from deltaserve.scheduler.batch import ScheduledBatch, ScheduledSequence

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
class StepOutput:
    sampled: dict[str, int] = field(default_factory=dict)  # seq_id -> next token
    logprobs: dict[str, list[tuple[int, float, int]]] = field(default_factory=dict)  # sampled first, then top-N
    all_logits: torch.Tensor | None = None  # [T, V] fp32, only when asked for


def build_forward_context(
    batch: ScheduledBatch, block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, ForwardContext]:
    """Host lists -> (input_ids [T], positions [3, T], ForwardContext) on the device."""
    input_ids: list[int] = []
    positions: list[list[int]] = [[], [], []]
    query_start_loc = [0]
    seq_lens: list[int] = []
    slot_mapping: list[int] = []
    state_indices: list[int] = []
    has_initial_state: list[bool] = []
    max_blocks = max(len(s.block_ids) for s in batch.sequences)
    block_tables: list[list[int]] = []
    has_mrope = False
    for seq in batch.sequences:
        num_new = len(seq.token_ids)
        input_ids.extend(seq.token_ids)
        for axis in range(3):
            positions[axis].extend(seq.positions[axis])
        has_mrope = has_mrope or seq.positions[1] != seq.positions[0] or seq.positions[2] != seq.positions[0]
        query_start_loc.append(query_start_loc[-1] + num_new)
        seq_lens.append(seq.start + num_new)
        for pos in range(seq.start, seq.start + num_new):
            slot_mapping.append(seq.block_ids[pos // block_size] * block_size + pos % block_size)
        state_indices.append(seq.state_slot)
        has_initial_state.append(seq.has_initial_state)
        block_tables.append(seq.block_ids + [0] * (max_blocks - len(seq.block_ids)))
    num_decodes = batch.num_decodes
    qsl = torch.tensor(query_start_loc, dtype=torch.int32)
    ctx = ForwardContext(
        num_decode_tokens=num_decodes,
        num_prefill_tokens=len(input_ids) - num_decodes,
        query_start_loc=qsl.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(block_tables, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
        max_query_len=max(len(s.token_ids) for s in batch.sequences),
        max_seq_len=max(seq_lens),
        state_indices=torch.tensor(state_indices, dtype=torch.int32, device=device),
        has_initial_state=torch.tensor(has_initial_state, dtype=torch.bool, device=device),
        has_mrope_positions=has_mrope,
        prefill_query_start_loc=(qsl[num_decodes:] - num_decodes).to(device),
    )
    ids = torch.tensor(input_ids, dtype=torch.int64, device=device)
    pos = torch.tensor(positions, dtype=torch.int64, device=device)
    return ids, pos, ctx


def warmup_sequences(num_tokens: int, max_seq_len: int, block_size: int) -> list[ScheduledSequence]:
    """Fresh prefill sequences of at most max_seq_len tokens each, num_tokens in all, on disjoint blocks and
    state slots 0, 1, ... of a throw-away cache."""
    sequences = []
    next_block = 0
    for index, start in enumerate(range(0, num_tokens, max_seq_len)):
        length = min(max_seq_len, num_tokens - start)
        num_blocks = -(-length // block_size)
        blocks = list(range(next_block, next_block + num_blocks))
        next_block += num_blocks
        row = list(range(length))
        sequences.append(
            ScheduledSequence(f"warmup-{index}", [0] * length, [row, row, row], 0, blocks, index, needs_sample=False)
        )
    return sequences


class ModelRunner:
    def __init__(
        self, model_config: ModelConfig, engine_config: EngineConfig, max_model_len: int, max_num_batched_tokens: int
    ) -> None:
        self.model_config = model_config
        self.engine_config = engine_config
        self.device = resolve_device(engine_config.device)
        self.dtype = resolve_dtype(engine_config.dtype, self.device)
        self.block_size = engine_config.block_size
        torch.manual_seed(engine_config.seed)
        if self.device.type == "cpu":
            threads = env.cpu_threads() or (1 if model_config.hidden_size < 512 else None)
            if threads:
                torch.set_num_threads(threads)
        self.model = Qwen35Model(model_config, self.dtype, self.device)
        if engine_config.load_format == "dummy":
            init_dummy_weights(self.model, engine_config.seed)
            self.load_report = None
        else:
            self.load_report = load_checkpoint(self.model, model_config, Path(engine_config.model))
        self.model.eval()
        from deltaserve.sampler.sampler import Sampler

        self.sampler = Sampler()
        self.graphs: DecodeGraphs | None = None
        num_slots = engine_config.num_state_slots or engine_config.max_num_seqs
        budget = self._cache_budget(max_num_batched_tokens, max_model_len)
        self.layout: CacheLayout = plan_cache(
            model_config, self.dtype, self.block_size, budget, num_slots, max_model_len
        )
        allocate_and_bind(self.model, model_config, self.layout, self.dtype, self.device)
        if self.device.type == "cuda" and env.cuda_graphs() and not engine_config.enforce_eager:
            max_blocks = -(-max_model_len // self.block_size)
            self.graphs = DecodeGraphs(self.model, engine_config.max_num_seqs, max_blocks, self.block_size, self.device)
            self.graphs.capture()

    def _profile_peak_bytes(self, num_tokens: int, max_seq_len: int) -> int:
        """Warm-up prefills on a throw-away cache: num_tokens (the largest step, whose activation peak in bytes is
        returned) and every power of two below it, so Triton compiles and autotunes the prefill shapes (the MoE
        and attention kernels key their configs on power-of-two size buckets) before serving, not during it.
        A step may hold more tokens than one sequence (max_num_batched_tokens > max_model_len), so a size above
        max_seq_len runs as several sequences, as the scheduler would batch them."""
        max_seqs = -(-num_tokens // max_seq_len)
        layout = CacheLayout(-(-num_tokens // self.block_size) + max_seqs, self.block_size, max_seqs, 0, 0)
        allocate_and_bind(self.model, self.model_config, layout, self.dtype, self.device)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        sizes = sorted({num_tokens} | {2**i for i in range(num_tokens.bit_length()) if 2**i < num_tokens}, reverse=True)
        started = time.perf_counter()
        for size in sizes:
            self.execute(ScheduledBatch(warmup_sequences(size, max_seq_len, self.block_size)))
        torch.cuda.synchronize()
        logger.info("warm-up: %d prefill shapes up to %d tokens in %.1f s", len(sizes), num_tokens,
                    time.perf_counter() - started)  # fmt: skip
        peak = torch.cuda.max_memory_allocated(self.device) - before
        for layer in self.model.layers:  # drop the throw-away cache before the real one is allocated
            mixer = layer.mixer
            mixer.k_cache = mixer.v_cache = mixer.conv_states = mixer.ssm_states = None
        torch.cuda.empty_cache()
        return peak

    def _cache_budget(self, max_num_batched_tokens: int, max_model_len: int) -> int:
        if self.device.type != "cuda":
            return self.engine_config.cpu_kv_cache_bytes
        peak = self._profile_peak_bytes(max_num_batched_tokens, max_model_len)
        free, total = torch.cuda.mem_get_info(self.device)
        weights = torch.cuda.memory_allocated(self.device)
        used_by_others = total - free - torch.cuda.memory_reserved(self.device)
        graph_headroom = 512 * 2**20  # decode graphs' private pool and library workspaces
        utilization = self.engine_config.gpu_memory_utilization
        budget = int(total * utilization) - weights - peak - used_by_others - graph_headroom
        logger.info(
            "memory: %.1f GiB total, weights %.2f GiB, warm-up peak %.2f GiB, cache budget %.2f GiB",
            total / 2**30, weights / 2**30, peak / 2**30, budget / 2**30,
        )  # fmt: skip
        return budget

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, return_all_logits: bool = False) -> StepOutput:
        input_ids, positions, ctx = build_forward_context(batch, self.block_size, self.device)
        out = StepOutput()
        graph_logits = None
        is_all_decode = ctx.num_prefill_tokens == 0 and not return_all_logits
        num_blocks = ctx.block_tables.shape[1]
        if self.graphs is not None and is_all_decode and self.graphs.can_run(len(batch.sequences), num_blocks):
            graph_logits = self.graphs.replay(input_ids, positions, ctx)  # [B, V]: every decode row samples
        else:
            with forward_context(ctx):
                hidden = self.model(input_ids, positions)  # [T, H]
            if return_all_logits:
                out.all_logits = self.model.compute_logits(hidden)
        rows: list[int] = []
        sampled_seqs: list[ScheduledSequence] = []
        end = 0
        for seq in batch.sequences:
            end += len(seq.token_ids)
            if seq.needs_sample:
                rows.append(end - 1)
                sampled_seqs.append(seq)
        if not rows:
            return out
        if graph_logits is not None:
            logits = graph_logits
        elif out.all_logits is not None:
            logits = out.all_logits[rows]
        else:
            logits = self.model.compute_logits(hidden[rows])  # [B, V] fp32
        result = self.sampler(logits, [s.sampling for s in sampled_seqs])
        for i, seq in enumerate(sampled_seqs):
            out.sampled[seq.seq_id] = result.token_ids[i]
            if result.logprobs is not None and result.logprobs[i] is not None:
                out.logprobs[seq.seq_id] = result.logprobs[i]
        return out
