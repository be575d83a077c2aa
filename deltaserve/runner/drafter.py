"""The drafter's interface in speculative decoding (docs/speculative-decoding.md#drafters): the Drafter protocol,
what a drafter sees after every step (DraftInputs), and the target's forward of that step (TargetStep) for a
drafter that reads hidden states, as the MTP drafter does (runner/mtp_drafter.py).

`target_step` builds the TargetStep of an eager step from its SpecHandle: each step row's next token, which a
drafter pairs with the row's hidden state (a verify chunk's rows take its emitted tokens, a chunk that sampled
nothing the next prompt token), and the row and token index each sampling row's drafts continue from (a verify
chunk's last accepted token; a chained chunk's start moved back by StepInputs.start_shift, runner/spec_chain.py).
Everything stays on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from deltaserve.model.context import ForwardContext
from deltaserve.runner.request_table import RequestTable
from deltaserve.runner.spec_handle import SpecHandle
from deltaserve.sampler.transfer import to_device


@dataclass
class TargetStep:
    """The target's forward of a step, as a drafter that reads hidden states needs it (all on the device)."""

    ctx: ForwardContext  # the step's batch metadata (its attention fields index the step's KV slots)
    positions: torch.Tensor  # [3, T]
    hidden: torch.Tensor  # [T, H] final-normed
    next_ids: torch.Tensor  # [T] the token at each row's position + 1 where known (0 where not: a rejected draft's)
    draft_rows: torch.Tensor  # [R] per sampling row, the row of the step its drafts continue from (last accepted)
    draft_index: torch.Tensor  # [R] that row's token index in its sequence
    kv_limit: np.ndarray  # [R] tokens the sampling row's KV blocks cover (host)
    block_tables: torch.Tensor  # [R, max_blocks] int32
    block_size: int


@dataclass
class DraftInputs:
    """What a drafter sees after a step: per sampling row, the tokens the step emitted, and the target's forward."""

    rows: np.ndarray  # [R] table rows (host); empty for a step that sampled nothing
    rows_dev: torch.Tensor  # [R]
    tokens: torch.Tensor  # [R, W] int64: the tokens emitted this step, -1 past num_emitted
    num_emitted: torch.Tensor  # [R] int64: 1 for a plain sample, 1 .. 1 + k for a verify
    target: TargetStep | None = None
    # drafts a row's next verify may use (StepPlan.num_drafts_next, 0 .. k_max): a drafter may leave the columns past
    # it as they are; one with a KV cache of its own still fills that cache over the step's tokens at 0
    num_drafts: int | None = None  # None: k_max


class Drafter(Protocol):
    def propose(self, inputs: DraftInputs) -> torch.Tensor:
        """[R, k_max] int64 draft tokens for the next decode of each row (on the device; the first
        inputs.num_drafts columns are the ones read). Called after every step while speculating, also with R = 0 (a
        drafter with a KV cache of its own fills it then)."""
        ...


def target_step(
    spec: SpecHandle, table: RequestTable, block_size: int, rows: np.ndarray, rows_dev: torch.Tensor,
    seq_tokens: torch.Tensor,
) -> TargetStep:  # fmt: skip
    """Each step row's next token (what a drafter that reads hidden states pairs with it) and where each
    sampling row's drafts start."""
    inputs, layout = spec.inputs, spec.step_layout
    device = inputs.input_ids.device
    ids = inputs.input_ids
    next_ids = torch.zeros_like(ids)
    next_ids[:-1] = ids[1:]
    ends = layout.query_start_loc[1:] - 1  # [B] each chunk's last row
    # a chunk that sampled nothing: its next token is the next prompt token (0 past the prompt)
    is_sampling = np.zeros(len(layout.rows), dtype=np.bool_)
    is_sampling[layout.sample_seqs] = True
    quiet = np.nonzero(~is_sampling)[0]
    if len(quiet):
        following = layout.starts[quiet] + layout.num_new[quiet]
        values = [
            int(table.prompts[r][e]) if e < table.num_prompt[r] else 0
            for r, e in zip(layout.rows[quiet].tolist(), following.tolist(), strict=True)
        ]
        next_ids.index_copy_(0, to_device(ends[quiet], torch.int64, device), to_device(values, torch.int64, device))
    sample_ends = to_device(ends[layout.sample_seqs], torch.int64, device)
    if len(rows):
        next_ids.index_copy_(0, sample_ends, seq_tokens)
    draft_rows = sample_ends.clone()
    draft_index = to_device(layout.starts[layout.sample_seqs] + layout.num_new[layout.sample_seqs] - 1,
                            torch.int64, device)  # fmt: skip
    if spec.layout is not None:  # verify chunks: the emitted tokens follow their rows; drafts continue at a_s
        verify = spec.layout
        width = verify.token_index.shape[1]
        first = layout.query_start_loc[verify.seq_index]  # [S]
        columns = np.arange(width)
        is_real = columns[None, :] <= verify.num_drafts[:, None]
        # padding entries go to a spare row past the step's rows (no boolean mask: no host sync)
        flat = np.where(is_real, first[:, None] + columns[None, :], len(ids)).reshape(-1)
        spare = torch.cat([next_ids, next_ids.new_zeros(1)])
        spare.index_copy_(0, to_device(flat, torch.int64, device), spec.tokens.clamp(min=0).reshape(-1))
        next_ids = spare[:-1]
        index = to_device(verify.spec_sample_index, torch.int64, device)
        accepted = spec.num_emitted - 1
        draft_rows.index_copy_(0, index, to_device(first, torch.int64, device) + accepted)
        starts = to_device(layout.starts[verify.seq_index], torch.int64, device)
        draft_index.index_copy_(0, index, starts + accepted)
    if inputs.start_shift is not None:  # chained chunks: their planned starts moved back (runner/spec_chain.py)
        sample_seqs = to_device(layout.sample_seqs, torch.int64, device)
        draft_index = draft_index - inputs.start_shift.index_select(0, sample_seqs)
    return TargetStep(
        ctx=inputs.ctx,
        positions=inputs.positions,
        hidden=spec.hidden,
        next_ids=next_ids,
        draft_rows=draft_rows,
        draft_index=draft_index,
        kv_limit=table.num_blocks[rows] * block_size,
        block_tables=table.block_table.index_select(0, rows_dev),
        block_size=block_size,
    )
