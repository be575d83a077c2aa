"""Where a step's verify chunks sit, and how many sequences may speculate (docs/speculative-decoding.md).

`spec_layout` reads a plan's verify chunks (ScheduledSeq.num_draft_tokens = k > 0, placed after the plain decodes
and before the prefill chunks) into a SpecLayout: the host-side arrays every later stage indexes with, the chunks'
rows of the step, where their drafts go in the input ids, and which sampled positions belong to which sequence. It
refuses a plan whose verify chunks are out of place or ask for what a verify chunk cannot do. `scratch_rows` and
`speculating_seqs` size speculation from the cache budget: the verify chunks whose scratch a step may hold, and the
sequences that may run while each holds its pool slot and its chunk's scratch (docs/speculative-decoding.md#memory).
Plain data in, numpy out: nothing here touches the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from deltaserve.step import ScheduledSeq


@dataclass
class SpecLayout:
    """The host-side description of a step's verify chunks (plan order; they follow the plain decodes)."""

    seq_index: np.ndarray  # [S] indices into plan.seqs
    num_drafts: np.ndarray  # [S]
    state_slots: np.ndarray  # [S] int32 live slots
    token_index: np.ndarray  # [S, W] rows of the verify slice, -1 past 1 + k_s
    num_tokens: int  # rows of the verify slice
    draft_token_index: np.ndarray  # [D] step rows that hold a draft token
    draft_rows: np.ndarray  # [D] their table rows
    draft_cols: np.ndarray  # [D] their draft index (0 .. k_s - 1)
    sample_counts: np.ndarray  # [n sampling seqs] positions each sampling sequence samples (1 + k for a verify)
    sample_offsets: np.ndarray  # [n sampling seqs + 1] where each one's positions start among all of them
    position_offsets: np.ndarray  # [P] index of each sampled position within its sequence's run
    spec_sample_index: np.ndarray  # [S] index of each verify sequence among the sampling sequences


def spec_layout(
    seqs: tuple[ScheduledSeq, ...], query_start_loc: np.ndarray, sample_seqs: np.ndarray, num_decodes: int
) -> SpecLayout | None:
    """The verify chunks of a step, or None when it holds none. Refuses a plan whose verify chunks do not directly
    follow its plain decodes (the layers slice decode, verify and prefill rows as three runs)."""
    seq_index = np.fromiter((i for i, s in enumerate(seqs) if s.num_draft_tokens), dtype=np.int64)
    if not len(seq_index):
        return None
    if not np.array_equal(seq_index, np.arange(num_decodes, num_decodes + len(seq_index))):
        raise ValueError("verify chunks must follow the plain decodes and precede the prefill chunks in a plan")
    num_drafts = np.fromiter((seqs[i].num_draft_tokens for i in seq_index), dtype=np.int64)
    for i in seq_index:
        seq = seqs[i]
        if seq.num_new_tokens != 1 + seq.num_draft_tokens or not seq.needs_sample or seq.read_slot != seq.write_slot:
            raise ValueError(
                f"a verify chunk computes 1 + k tokens from its own slot and samples: got {seq.num_new_tokens} tokens "
                f"for k = {seq.num_draft_tokens}, needs_sample {seq.needs_sample}, slots {seq.read_slot} -> "
                f"{seq.write_slot}"
            )
        if seq.checkpoints:
            raise ValueError("ScheduledSeq.checkpoints on a verify chunk: not implemented")
    width = int(num_drafts.max()) + 1
    base = int(query_start_loc[num_decodes])
    starts = query_start_loc[seq_index] - base  # [S]
    columns = np.arange(width)
    token_index = np.where(columns[None, :] <= num_drafts[:, None], starts[:, None] + columns[None, :], -1)
    draft_cols = np.concatenate([np.arange(k) for k in num_drafts])
    draft_token_index = np.repeat(query_start_loc[seq_index] + 1, num_drafts) + draft_cols
    rows = np.fromiter((seqs[i].row for i in seq_index), dtype=np.int64)
    is_verify = np.zeros(len(seqs), dtype=np.int64)
    is_verify[seq_index] = num_drafts
    sample_counts = 1 + is_verify[sample_seqs]
    sample_offsets = np.zeros(len(sample_seqs) + 1, dtype=np.int64)
    np.cumsum(sample_counts, out=sample_offsets[1:])
    position_offsets = np.arange(int(sample_offsets[-1])) - np.repeat(sample_offsets[:-1], sample_counts)
    return SpecLayout(
        seq_index=seq_index,
        num_drafts=num_drafts,
        state_slots=np.fromiter((seqs[i].write_slot for i in seq_index), dtype=np.int32),
        token_index=token_index,
        num_tokens=int(num_drafts.sum()) + len(seq_index),
        draft_token_index=draft_token_index,
        draft_rows=np.repeat(rows, num_drafts),
        draft_cols=draft_cols,
        sample_counts=sample_counts,
        sample_offsets=sample_offsets,
        position_offsets=position_offsets,
        spec_sample_index=np.searchsorted(sample_seqs, seq_index),
    )


STATE_SHARE = 0.5  # of the cache budget, at most, for the state pool and the verify scratch (a sized count)
SCRATCH_SHARE = 0.25  # of the cache budget, at most, for the verify scratch under the k policy


def scratch_rows(budget_bytes: int, row_bytes: int, max_num_seqs: int) -> int:
    """The verify chunks under the deltaserve-only k policy, whose count is sized as without speculation: each
    chunk's scratch (row_bytes: runner/cache.py verify_row_bytes) in at most a quarter of the cache budget, at most
    max_num_seqs chunks; a step with more decodes than chunks drafts nothing (scheduler/spec_policy.py), so it
    replays a width-1 graph at the full count instead of running eager. At least one."""
    return max(1, min(max_num_seqs, int(budget_bytes * SCRATCH_SHARE) // max(row_bytes, 1)))


def speculating_seqs(budget_bytes: int, slot_bytes: int, row_bytes: int, upper: int, share: float = STATE_SHARE) -> int:
    """How many sequences may run while speculating: each holds its pool slot and its verify chunk's scratch
    (row_bytes: 1 + k conv windows and token rows, so one recurrent state with the slot, where vLLM's hybrid cache
    gives a speculating request 1 + k state blocks), so every step fits a captured verify graph (a step past the
    scratch would run eager). vLLM's default count (upper) is sized with the pool and the scratch in at most half of
    the cache budget, the rule without speculation; a count the user set is held to what the whole budget holds
    (share 1). At least one (docs/speculative-decoding.md#memory)."""
    per_seq = max(slot_bytes + row_bytes, 1)
    return max(1, min(upper, int(budget_bytes * share) // per_seq))
