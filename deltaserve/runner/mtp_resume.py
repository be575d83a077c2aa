"""The MTP layer's KV across prefix-cache hits (docs/prefix-caching.md#with-mtp).

The MTP layer's KV entry at position t is computed from the target's final-normed hidden state at t and the token at
t + 1 (runner/mtp_drafter.py). A sequence that resumes from a checkpoint at P finds the entries [0, P - 1) right (they
only read its own tokens), but the entry at P - 1 was paired with the token the checkpoint's writer had at P (or with
its sampled token), and the drafter's catch-up pass of the resumed sequence starts at P. So:

- every state slot keeps a hidden row beside its GDN state (`MtpLayer.slot_hidden` [num_slots, H], bound by
  runner/cache.py and copied with the slot wherever copy_state_slots copies one): after each step, the hidden state
  of each sequence's last computed row (for a verify chunk, its last accepted row) is written into its write slot,
  so a checkpoint saved, restored or handed over at P holds the hidden at P - 1 (an in-step checkpoint at P gets
  the row of P - 1 from the step's hidden states: save_inner_hidden);
- the first step after a hit (its read slot differs from its write slot) rewrites the entry at P - 1 before the
  forward, from that row and the new sequence's own token at P, into the block the scheduler copied for it (the
  block holding P - 1 is never shared when the model has an MTP layer: scheduler/prefix_cache.py).
"""

from __future__ import annotations

import numpy as np
import torch

from deltaserve.model.context import ForwardContext, forward_context
from deltaserve.model.qwen3_5 import Qwen35Model
from deltaserve.runner.request_table import RequestTable
from deltaserve.runner.step_checkpoints import InnerSave, hidden_rows
from deltaserve.sampler.transfer import to_device
from deltaserve.step import StepPlan


def save_last_hidden(model: Qwen35Model, hidden: torch.Tensor, query_start_loc: np.ndarray, slots: np.ndarray) -> None:
    """hidden [T, H]: each sequence's last row of the step goes into its write slot's row (slots [B])."""
    buffer = model.mtp.slot_hidden  # [num_slots, H]
    device = hidden.device
    last = to_device(query_start_loc[1:] - 1, torch.int64, device)  # [B]
    buffer.index_copy_(0, to_device(slots, torch.int64, device), hidden.index_select(0, last).to(buffer.dtype))


def save_inner_hidden(model: Qwen35Model, hidden: torch.Tensor, saves: list[InnerSave], layout_starts: np.ndarray,
                      query_start_loc: np.ndarray) -> None:  # fmt: skip
    """hidden [T, H]: an in-step checkpoint at position P (runner/step_checkpoints.py) keeps the hidden of P - 1 in its
    slot's row, as a checkpoint saved at a chunk's end does."""
    if not saves:
        return
    buffer = model.mtp.slot_hidden
    device = hidden.device
    rows = to_device(hidden_rows(saves, layout_starts, query_start_loc), torch.int64, device)  # [N]
    slots = to_device(np.fromiter((s.slot for s in saves), np.int64, len(saves)), torch.int64, device)
    buffer.index_copy_(0, slots, hidden.index_select(0, rows).to(buffer.dtype))


def save_accepted_hidden(
    model: Qwen35Model, hidden: torch.Tensor, first_rows: np.ndarray, num_emitted: torch.Tensor, slots: np.ndarray
) -> None:
    """A verify chunk's live slot keeps the hidden of its last accepted row (first_rows [S] host, num_emitted [S] on
    the device: 1 + accepted drafts), not of its last row: the state was rolled back to that token."""
    buffer = model.mtp.slot_hidden
    device = hidden.device
    rows = to_device(first_rows, torch.int64, device) + num_emitted - 1  # [S]
    buffer.index_copy_(0, to_device(slots, torch.int64, device), hidden.index_select(0, rows).to(buffer.dtype))


def _position(table: RequestTable, row: int, index: int) -> int | tuple[int, int, int]:
    """The target's position of token `index` of the row's sequence (its MRoPE triple inside a multimodal prompt)."""
    mrope = table.mrope[row]
    if mrope is None:
        return index
    if index < mrope.shape[1]:
        return tuple(int(v) for v in mrope[:, index])
    return index + int(table.mrope_delta[row])


def rewrite_resumed_rows(
    model: Qwen35Model, plan: StepPlan, query_start_loc: np.ndarray, input_ids: torch.Tensor, table: RequestTable,
    block_size: int,
) -> None:  # fmt: skip
    """Before the forward of a step holding sequences resumed from a checkpoint at P (read slot != write slot): one
    MTP pass over one row each, at position P - 1, from the restored slot's hidden row (the state copy already ran)
    and the sequence's token at P (its chunk's first input), writing the MTP KV entry at P - 1 into the sequence's
    own copy of that block. The pass's output is not used: only the K/V it writes matter, and they depend on the
    row's inputs alone. Runs after the plan's block copies (they bring the block in)."""
    resumed = [
        i
        for i, s in enumerate(plan.seqs)
        if s.read_slot is not None and s.read_slot != s.write_slot and s.num_computed_tokens > 0
    ]
    if not resumed:
        return
    mtp = model.mtp
    device = input_ids.device
    seqs = [plan.seqs[i] for i in resumed]
    index = np.array([s.num_computed_tokens - 1 for s in seqs], dtype=np.int64)  # [E] the token P - 1
    rows = np.array([s.row for s in seqs], dtype=np.int64)
    blocks = table.block_table_host[rows, index // block_size].astype(np.int64)
    slot_mapping = blocks * block_size + index % block_size
    positions = np.empty((3, len(seqs)), dtype=np.int64)
    for e, (row, t) in enumerate(zip(rows.tolist(), index.tolist(), strict=True)):
        positions[:, e] = _position(table, row, t)
    width = int(index.max()) // block_size + 1
    count = torch.arange(len(seqs) + 1, dtype=torch.int32, device=device)
    ctx = ForwardContext(
        num_decode_tokens=len(seqs),
        num_prefill_tokens=0,
        query_start_loc=count,
        seq_lens=to_device(index + 1, torch.int32, device),
        block_tables=table.block_table[:, :width].index_select(0, to_device(rows, torch.int64, device)),
        slot_mapping=to_device(slot_mapping, torch.int64, device),
        max_query_len=1,
        max_seq_len=int(index.max()) + 1,
        state_indices=count[:-1],  # unused: the MTP layer has no GDN state
        has_initial_state=count[:-1],
        has_mrope_positions=bool((positions != positions[:1]).any()),
    )
    tokens = input_ids.index_select(0, to_device(query_start_loc[resumed], torch.int64, device))  # [E] token P
    slots = to_device(np.array([s.write_slot for s in seqs], dtype=np.int64), torch.int64, device)
    hidden = mtp.slot_hidden.index_select(0, slots)  # [E, H] the target's hidden at P - 1
    with forward_context(ctx):
        mtp(tokens, to_device(positions, torch.int64, device), hidden)
