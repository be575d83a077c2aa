"""Decode CUDA graphs: one captured forward per batch-size bucket, replayed with static input buffers.

Only all-decode batches (one token per sequence) are captured, as in nano-vllm and vLLM: their shapes are
fixed by the bucket, and every kernel on the decode path is graph-safe (no host syncs, grids from shapes).
A batch of B sequences replays the smallest bucket >= B; padded rows store no KV (slot -1), touch no state
slot (slot -1) and read one token of block 0, so they never disturb real sequences. Sampling stays outside.
"""

from __future__ import annotations

import logging

import torch

from deltaserve.model.context import ForwardContext, forward_context
from deltaserve.model.qwen3_5 import Qwen35Model

logger = logging.getLogger(__name__)


def bucket_sizes(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, 513, 32))
    return [s for s in sizes if s < max_batch] + [max_batch]


class DecodeGraphs:
    def __init__(
        self, model: Qwen35Model, max_batch: int, max_blocks_per_seq: int, block_size: int, device: torch.device
    ) -> None:
        self.model = model
        self.max_seq_len = max_blocks_per_seq * block_size
        self.device = device
        self.sizes = bucket_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        n = self.max_batch
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(3, n, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.state_indices = torch.full((n,), -1, dtype=torch.int32, device=device)
        self.has_initial_state = torch.ones(n, dtype=torch.bool, device=device)
        self.logits: dict[int, torch.Tensor] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None

    def _context(self, size: int, max_seq_len: int) -> ForwardContext:
        return ForwardContext(
            num_decode_tokens=size,
            num_prefill_tokens=0,
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            slot_mapping=self.slot_mapping[:size],
            max_query_len=1,
            max_seq_len=max_seq_len,
            state_indices=self.state_indices[:size],
            has_initial_state=self.has_initial_state[:size],
            prefill_query_start_loc=self.query_start_loc[:1],
        )

    @torch.inference_mode()
    def capture(self) -> None:
        for size in reversed(self.sizes):  # largest first, sharing one memory pool
            ctx = self._context(size, self.max_seq_len)
            with forward_context(ctx):  # warm-up run outside the graph (Triton compiles, allocator settles)
                self.model.compute_logits(self.model(self.input_ids[:size], self.positions[:, :size]))
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with forward_context(ctx), torch.cuda.graph(graph, pool=self.pool):
                hidden = self.model(self.input_ids[:size], self.positions[:, :size])
                self.logits[size] = self.model.compute_logits(hidden)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (batch sizes %s)", len(self.graphs), self.sizes)

    def can_run(self, num_seqs: int, max_blocks: int) -> bool:
        return num_seqs <= self.max_batch and max_blocks <= self.block_tables.shape[1]

    def replay(self, ids: torch.Tensor, pos: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Copies this step's decode inputs into the static buffers and replays; returns logits [B, V]."""
        num_seqs = ids.shape[0]
        size = next(s for s in self.sizes if s >= num_seqs)
        self.input_ids[:num_seqs].copy_(ids)
        self.positions[:, :num_seqs].copy_(pos)
        self.seq_lens[:num_seqs].copy_(ctx.seq_lens)
        self.seq_lens[num_seqs:size].fill_(1)
        num_blocks = ctx.block_tables.shape[1]
        self.block_tables[:num_seqs, :num_blocks].copy_(ctx.block_tables)
        self.block_tables[num_seqs:size].zero_()
        self.slot_mapping[:num_seqs].copy_(ctx.slot_mapping)
        self.slot_mapping[num_seqs:size].fill_(-1)
        self.state_indices[:num_seqs].copy_(ctx.state_indices)
        self.state_indices[num_seqs:size].fill_(-1)
        self.graphs[size].replay()
        return self.logits[size][:num_seqs]
