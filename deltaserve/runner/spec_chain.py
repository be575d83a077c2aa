"""Chained chunks of async verify (docs/speculative-decoding.md#async-verify): the device-side start of a chunk the
scheduler planned while a verify chunk of the same sequence was still in flight (ScheduledSeq.is_chained).

Such a chunk starts where that verify's accepted run ended, which only the device knows when the chunk is launched.
The plan's num_computed_tokens assumes every draft was accepted (the chunk's KV blocks cover that span, so the true
span lies inside them); `start_shift` gives, per chunk of the step, how far that planned start is past the row's
true next start, and `shift_inputs` moves the chained chunks' tokens back by it before the forward: their positions
(every axis: past its prompt, a row's MRoPE positions are its text position plus a constant), the KV slots they
write (looked up in the device block table at the true positions) and the context lengths attention reads. The
shift also reaches the verify graphs' static buffers (runner/spec_graphs.py) and the drafter's start
(runner/drafter.py target_step) through StepInputs.start_shift. Host-side bounds built from the planned starts (the
attention's max_seq_len, the graphs' block-table width) stay upper bounds.

With async verify on (SpecDecoder.tracks_next_start; ModelRunner refuses a chained chunk without it), the true next
start of every row (RequestTable.next_start) is written after each sampling step, on the device:
the chunk's true start plus its tokens, or for a verify chunk plus the tokens it emitted (its input token and the
accepted drafts). Every tensor-parallel rank writes it from the same accepted counts (runner/spec_ranks.py). No host
sync anywhere: the shift is only ever a device tensor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from deltaserve.runner.request_table import RequestTable
from deltaserve.sampler.transfer import to_device

if TYPE_CHECKING:  # runner/inputs.py imports this module
    from deltaserve.runner.inputs import StepLayout
    from deltaserve.runner.spec_handle import SpecHandle


def start_shift(layout: StepLayout, table: RequestTable, device: torch.device) -> torch.Tensor | None:
    """[B] int64: how far each chained chunk's planned start is past its row's true next start (0 for the other
    chunks); None when the step holds no chained chunk."""
    chained = np.nonzero(layout.chained)[0]
    if not len(chained):
        return None
    index = to_device(chained, torch.int64, device)
    rows = to_device(layout.rows[chained], torch.int64, device)
    planned = to_device(layout.starts[chained], torch.int64, device)
    shift = torch.zeros(len(layout.rows), dtype=torch.int64, device=device)
    shift.index_copy_(0, index, planned - table.next_start.index_select(0, rows))
    return shift


def chained_tokens(layout: StepLayout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(the step rows of the chained chunks' tokens [C], the plan index of each one's chunk [C], each one's planned
    token position [C])."""
    chained = np.nonzero(layout.chained)[0]
    counts = layout.num_new[chained]
    first = layout.query_start_loc[chained]
    within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    tokens = np.repeat(first, counts) + within
    return tokens, np.repeat(chained, counts), np.repeat(layout.starts[chained], counts) + within


def shift_inputs(
    layout: StepLayout, table: RequestTable, block_size: int, shift: torch.Tensor, positions: torch.Tensor,
    slot_mapping: torch.Tensor, seq_lens: torch.Tensor,
) -> None:  # fmt: skip
    """Moves the chained chunks back by shift [B], in place: positions [3, T], slot_mapping [T] (int64), seq_lens [B]
    (int32) of the step's eager inputs."""
    tokens, seqs, planned = chained_tokens(layout)
    device = shift.device
    tokens_dev = to_device(tokens, torch.int64, device)
    delta = shift.index_select(0, to_device(seqs, torch.int64, device))  # [C]
    true_positions = to_device(planned, torch.int64, device) - delta  # [C] token positions
    positions[:, tokens_dev] = positions[:, tokens_dev] - delta
    rows = to_device(layout.rows[seqs], torch.int64, device)
    blocks = table.block_table[rows, true_positions // block_size].long()  # [C]
    slot_mapping[tokens_dev] = blocks * block_size + true_positions % block_size
    seq_lens.sub_(shift.to(seq_lens.dtype))


def record_next_starts(table: RequestTable, spec: SpecHandle, rows_dev: torch.Tensor) -> None:
    """After a sampling step's accept (spec: its SpecHandle, the accepted counts set): each sampling row's true next
    start (rows_dev: their table rows, in sampling order), from the planned ends, the chained chunks' shift and the
    verify chunks' emitted counts."""
    layout = spec.step_layout
    seqs = layout.sample_seqs
    device = rows_dev.device
    ends = to_device(layout.starts[seqs] + layout.num_new[seqs], torch.int64, device)  # [S] planned ends
    shift = spec.inputs.start_shift if spec.inputs is not None else None
    if shift is not None:
        ends = ends - shift.index_select(0, to_device(seqs, torch.int64, device))
    if spec.layout is not None:  # a verify chunk ends after what it emitted, not after its 1 + k tokens
        verify = spec.layout
        index = to_device(verify.spec_sample_index, torch.int64, device)
        unused = to_device(verify.num_drafts + 1, torch.int64, device) - spec.num_emitted  # [V]
        ends = ends.index_add(0, index, -unused)
    table.next_start.index_copy_(0, rows_dev, ends)
