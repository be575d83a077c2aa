"""Decode CUDA graphs: one captured forward per batch-size bucket, replayed over static input buffers.

Only all-decode steps whose input tokens are the rows' last samples are captured, as in nano-vllm and vLLM: their
shapes are fixed by the bucket and every kernel on the decode path is graph-safe (no host syncs, grids from shapes).
The buckets are vLLM 0.26's default capture sizes (1, 2, 4, then every 8 up to 256, every 16 up to 512), capped at
the engine's max_num_seqs. A step of B sequences replays the smallest bucket >= B; padded rows store no KV (slot
-1), touch no state slot (slot -1), read the request table's empty dummy row and one token of block 0, so they never
disturb real sequences. Every bucket writes its logits into ONE shared fp32 buffer [max_batch, V] (a buffer per
bucket cost 2.09 GiB at 256 sequences with the 248,320-token vocabulary); sampling stays outside the graph.

Per step the host fills two pinned buffers laid out like the static device buffers (positions, slots, table rows;
context lengths, state slots) and copies each in one non-blocking transfer; the input tokens and block tables are
gathered on the device from the request table.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from deltaserve.model.context import ForwardContext, forward_context
from deltaserve.model.qwen3_5 import Qwen35Model
from deltaserve.runner.inputs import StepLayout
from deltaserve.runner.request_table import RequestTable

logger = logging.getLogger(__name__)


MAX_CAPTURE_SIZE = 512  # vLLM 0.26's default max_cudagraph_capture_size: a larger step runs eager there too


def capture_sizes(max_batch: int) -> list[int]:
    """vLLM 0.26's cudagraph_capture_sizes (as its server log lists them on an H200), up to max_batch and never past
    MAX_CAPTURE_SIZE: with a larger count, a step of more than 512 sequences runs eager (as in vLLM), and the static
    buffers stay at 512 rows (docs/ARCHITECTURE.md#the-samplers-share-of-the-warm-up-peak)."""
    top = min(max_batch, MAX_CAPTURE_SIZE)
    sizes = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, MAX_CAPTURE_SIZE + 1, 16))
    return [s for s in sizes if s < top] + [top]


def buckets(max_batch: int) -> tuple[list[int], int, int]:
    """(capture sizes, the largest, the static buffers' rows: the largest rounded up to 8 so that each field's
    region of a packed buffer stays 16-byte aligned)."""
    sizes = capture_sizes(max_batch)
    return sizes, sizes[-1], -(-sizes[-1] // 8) * 8


def static_bytes(max_batch: int, vocab_size: int) -> int:
    """Device memory of the static buffers the graphs keep beyond the cache: the shared fp32 logits buffer and the
    bf16 lm_head output of the largest bucket, which the graph pool holds."""
    return max_batch * vocab_size * (4 + 2)


class DecodeGraphs:
    def __init__(
        self,
        model: Qwen35Model,
        max_batch: int,
        max_blocks_per_seq: int,
        max_seq_len: int,
        vocab_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.max_seq_len = max_seq_len
        self.device = device
        self.sizes, self.max_batch, self.capacity = buckets(max_batch)
        cap = self.capacity
        # int64 regions: positions [3, cap] | slot_mapping [cap] | table rows [cap]; int32: seq_lens | state slots
        self.long = torch.zeros(5 * cap, dtype=torch.int64, device=device)
        self.short = torch.zeros(2 * cap, dtype=torch.int32, device=device)
        self.positions = self.long[: 3 * cap].view(3, cap)
        self.slot_mapping = self.long[3 * cap : 4 * cap]
        self.rows = self.long[4 * cap :]
        self.seq_lens = self.short[:cap]
        self.state_indices = self.short[cap:]
        self.slot_mapping.fill_(-1)
        self.seq_lens.fill_(1)
        self.state_indices.fill_(-1)
        self.input_ids = torch.zeros(cap, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(cap, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(cap + 1, dtype=torch.int32, device=device)
        self.has_initial_state = torch.ones(cap, dtype=torch.int32, device=device)
        self.logits = torch.empty(cap, vocab_size, dtype=torch.float32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None

    def _context(self, size: int) -> ForwardContext:
        return ForwardContext(
            num_decode_tokens=size,
            num_prefill_tokens=0,
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            slot_mapping=self.slot_mapping[:size],
            max_query_len=1,
            max_seq_len=self.max_seq_len,
            state_indices=self.state_indices[:size],
            has_initial_state=self.has_initial_state[:size],
            prefill_query_start_loc=self.query_start_loc[:1],
        )

    def _forward(self, size: int) -> None:
        with forward_context(self._context(size)):
            hidden = self.model(self.input_ids[:size], self.positions[:, :size])
        self.model.compute_logits(hidden, out=self.logits[:size])

    @torch.inference_mode()
    def capture(self) -> None:
        for size in reversed(self.sizes):  # largest first, sharing one memory pool
            self._forward(size)  # warm-up outside the graph (Triton compiles, allocator settles)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self._forward(size)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (batch sizes %s)", len(self.graphs), self.sizes)

    def can_run(self, num_seqs: int, num_blocks: int) -> bool:
        return num_seqs <= self.max_batch and num_blocks <= self.block_tables.shape[1]

    def run(self, layout: StepLayout, table: RequestTable, block_size: int) -> torch.Tensor:
        """Fills the static buffers for this all-decode step and replays its bucket; returns logits [B, V]."""
        num_seqs = len(layout.rows)
        size = next(s for s in self.sizes if s >= num_seqs)
        cap = self.capacity
        long = np.zeros(5 * cap, dtype=np.int64)
        long[: 3 * cap].reshape(3, cap)[:, :num_seqs] = layout.positions
        long[3 * cap : 3 * cap + num_seqs] = layout.slot_mapping
        long[3 * cap + num_seqs : 4 * cap] = -1
        long[4 * cap : 4 * cap + num_seqs] = layout.rows
        long[4 * cap + num_seqs :] = table.dummy_row
        seq_lens = layout.starts + 1
        short = np.empty(2 * cap, dtype=np.int32)
        short[:num_seqs] = seq_lens
        short[num_seqs:cap] = 1
        short[cap : cap + num_seqs] = layout.state_slots
        short[cap + num_seqs :] = -1
        self.long.copy_(torch.from_numpy(long).pin_memory(), non_blocking=True)
        self.short.copy_(torch.from_numpy(short).pin_memory(), non_blocking=True)
        rows = self.rows[:size]
        torch.index_select(table.last_sampled, 0, rows, out=self.input_ids[:size])
        width = int(-(-seq_lens.max() // block_size))
        self.block_tables[:size, :width] = table.block_table[:, :width].index_select(0, rows)
        self.graphs[size].replay()
        return self.logits[:num_seqs]
