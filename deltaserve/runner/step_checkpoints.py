"""Which prefix-cache checkpoints a step saves, and how: after the forward (a chunk's end) or inside it (in-step).

`ScheduledSeq.checkpoints` holds (position, slot) pairs (docs/prefix-caching.md#the-step-contract). A position at
the chunk's end is saved after the forward by copying the sequence's write slot (runner/cache.py copy_state_slots).
A position strictly inside a prefill chunk on its GDN chunk grid, `start + 64 j` with j >= 1, is saved during the
forward, at most one per chunk: the chunked prefill stores its fp32 state at the start of that 64-token chunk
(kernels/gdn_triton.py), each GDN layer copies the conv window (the conv_kernel - 1 pre-conv rows before the
position, all inside the chunk since 64 > conv_kernel - 1) from the step's own rows (model/layers/gdn.py), and with
the MTP layer the runner copies the hidden row of position - 1 (runner/mtp_resume.py). Anything else is refused.

`inner_fields` turns a step's in-step saves into the ForwardContext's arrays: per prefill sequence the chunk index
(-1: none) and slot the kernel reads, and per save the prefill-slice row of the position and the slot the conv
window goes to.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from deltaserve.kernels.gdn import CHUNK_SIZE
from deltaserve.step import ScheduledSeq


@dataclass(frozen=True)
class InnerSave:
    """An in-step checkpoint of sequence `index` (plan order): the state at `position` into `slot`."""

    index: int
    position: int
    slot: int


def split_checkpoints(index: int, seq: ScheduledSeq) -> tuple[list[tuple[int, int]], InnerSave | None]:
    """(the (write slot, checkpoint slot) copies after the forward, the in-step save or None) of the sequence at
    plan position `index`; refuses a position this runner does not implement and a slot that is the sequence's
    own read or write slot."""
    start = seq.num_computed_tokens
    end = start + seq.num_new_tokens
    copies: list[tuple[int, int]] = []
    inner: InnerSave | None = None
    for position, slot in seq.checkpoints:
        if slot == seq.write_slot or slot == seq.read_slot:
            raise ValueError(f"ScheduledSeq.checkpoints: slot {slot} is the sequence's own read or write slot")
        if position == end:
            copies.append((seq.write_slot, slot))
            continue
        offset = position - start
        if not (0 < offset < seq.num_new_tokens and offset % CHUNK_SIZE == 0) or seq.num_draft_tokens or seq.is_chained:
            raise ValueError(
                f"ScheduledSeq.checkpoints: position {position} is neither this chunk's end ({end}) nor on its GDN "
                f"chunk grid strictly inside a prefill chunk ({start} + {CHUNK_SIZE} j, {start} < position < {end})"
            )
        if inner is not None:
            raise ValueError(
                f"ScheduledSeq.checkpoints: positions {inner.position} and {position} are both inside the chunk; at "
                "most one in-step checkpoint per sequence per step is implemented"
            )
        inner = InnerSave(index, position, slot)
    return copies, inner


def inner_fields(
    saves: list[InnerSave], starts: np.ndarray, query_start_loc: np.ndarray, first_prefill: int
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(int32 fields, int64 fields) of a step's in-step saves for the ForwardContext: prefill_checkpoint_chunks /
    prefill_checkpoint_slots [num_prefills] (the kernel's per-sequence request), checkpoint_rows [N] (the row of
    each position in the prefill slice: the conv window is the conv_kernel - 1 rows before it) and checkpoint_slots
    [N]; starts / query_start_loc are the step's, in plan order."""
    num_prefills = len(starts) - first_prefill
    chunks = np.full(num_prefills, -1, dtype=np.int32)
    slots = np.zeros(num_prefills, dtype=np.int32)
    rows = np.zeros(len(saves), dtype=np.int64)
    dest = np.zeros(len(saves), dtype=np.int64)
    base = int(query_start_loc[first_prefill])
    for n, save in enumerate(saves):
        offset = save.position - int(starts[save.index])
        chunks[save.index - first_prefill] = offset // CHUNK_SIZE
        slots[save.index - first_prefill] = save.slot
        rows[n] = int(query_start_loc[save.index]) - base + offset
        dest[n] = save.slot
    short = {"prefill_checkpoint_chunks": chunks, "prefill_checkpoint_slots": slots}
    return short, {"checkpoint_rows": rows, "checkpoint_slots": dest}


def hidden_rows(saves: list[InnerSave], starts: np.ndarray, query_start_loc: np.ndarray) -> np.ndarray:
    """[N] the step's row of position - 1 of each in-step save (the MTP layer's slot hidden row)."""
    return np.fromiter(
        (int(query_start_loc[s.index]) + s.position - int(starts[s.index]) - 1 for s in saves),
        dtype=np.int64,
        count=len(saves),
    )
