"""ForwardContext: the per-step batch metadata the model's layers read, set by the runner around a forward.

The model's forward takes only (input_ids, positions); everything else a layer needs for this step (where
to store KV, which blocks to read, which state slots to update) is here. Token order within a step is:
all decode tokens first (one per decoding sequence), then the prefill chunks, so layers can run decode and
prefill kernels on two contiguous slices.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from deltaserve.kernels.attention_prefill import PreparedPrefill


@dataclass
class ForwardContext:
    num_decode_tokens: int  # == number of decoding sequences (the first rows of the batch)
    num_prefill_tokens: int
    # full attention (all sequences, decodes first)
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32: context length after this step
    block_tables: torch.Tensor  # [B, max_blocks] int32
    slot_mapping: torch.Tensor  # [T] int64, -1 for padding
    max_query_len: int
    max_seq_len: int
    # Gated DeltaNet (all sequences, decodes first)
    state_indices: torch.Tensor  # [B] int32, -1 for padding
    has_initial_state: torch.Tensor  # [B] bool or int32 (nonzero: start from the slot's state)
    # RoPE table for this step's tokens, built once from the 3-D positions and shared by all attention layers
    cos_sin: torch.Tensor | None = None  # [T, r]
    has_mrope_positions: bool = False  # some row of positions differs from the others (true MRoPE)
    prefill_query_start_loc: torch.Tensor | None = None  # [num_prefills+1] int32, offsets within the prefill slice
    # The prefill sequences' state_indices / has_initial_state in tensors of their own, 16-byte aligned; the runner
    # packs them so, and prefill_slots() copies them out of the full tensors when it did not.
    prefill_state_indices: torch.Tensor | None = None  # [num_prefills] int32
    prefill_has_initial_state: torch.Tensor | None = None  # [num_prefills]
    # Speculative verify chunks (docs/speculative-decoding.md): num_spec_tokens rows right after the decode rows,
    # before the prefill rows; sequence s's rows are spec_token_index[s] (offsets in that slice, -1 padding)
    num_spec_tokens: int = 0
    spec_state_indices: torch.Tensor | None = None  # [S] int32 live slots of the verify sequences
    spec_token_index: torch.Tensor | None = None  # [S, W] int64
    # In-step prefix-cache checkpoints (runner/step_checkpoints.py), None when the step saves none: per prefill
    # sequence the 64-token chunk at whose start its GDN state is saved (-1: none) and the slot it goes to; per save
    # the prefill-slice row of its position (the conv window is the conv_kernel - 1 rows before it) and its slot
    prefill_checkpoint_chunks: torch.Tensor | None = None  # [num_prefills] int32
    prefill_checkpoint_slots: torch.Tensor | None = None  # [num_prefills] int32
    checkpoint_rows: torch.Tensor | None = None  # [N] int64
    checkpoint_slots: torch.Tensor | None = None  # [N] int64
    # --attention-backend FLASH_ATTN / FLASHINFER: the step's prefill rows planned on the library, once per step by
    # the runner (runner/attention_plan.py); None: the step has no prefill rows, or the backend is deltaserve's own
    prefill_attention: PreparedPrefill | None = None

    @property
    def num_decodes(self) -> int:
        return self.num_decode_tokens

    @property
    def num_spec_seqs(self) -> int:
        """Verify sequences of the step (their rows follow the decodes'); a host shape, no sync."""
        return 0 if self.spec_state_indices is None else self.spec_state_indices.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.num_decode_tokens + self.num_spec_tokens + self.num_prefill_tokens

    def prefill_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(state_indices, has_initial_state) of the prefill sequences in tensors of their own: a slice at an offset
        of num_decodes elements moves the pointer off the 16-byte alignment Triton specializes on, and each new
        alignment compiled a kernel variant in the middle of serving."""
        if self.prefill_state_indices is None or self.prefill_has_initial_state is None:
            start = self.num_decode_tokens
            if self.spec_state_indices is not None:
                start += self.spec_state_indices.shape[0]  # one state per verify sequence, after the decodes
            self.prefill_state_indices = self.state_indices[start:].clone()
            self.prefill_has_initial_state = self.has_initial_state[start:].clone()
        return self.prefill_state_indices, self.prefill_has_initial_state


_current: ForwardContext | None = None


@contextlib.contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    """Makes ctx the current context for the duration of one forward; nesting is a bug."""
    global _current
    if _current is not None:
        raise RuntimeError("forward_context entered while another forward is in progress")
    _current = ctx
    try:
        yield ctx
    finally:
        _current = None


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("no forward context: the model's forward must run inside runner.forward_context()")
    return _current
