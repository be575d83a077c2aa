"""The runner's verify-chunk layout (runner/spec_layout.py: spec_layout) on hand-built plans, its refusals, and the
verify scratch's share of the cache budget (plain data in, numpy out: no model). Under tensor parallelism:
tests/runner/test_spec_decode_tensor_parallel.py."""

from __future__ import annotations

import numpy as np
import pytest

from deltaserve.runner.spec_layout import spec_layout, speculating_seqs
from deltaserve.step import ScheduledSeq


def decode(row: int, k: int = 0, **fields: object) -> ScheduledSeq:
    return ScheduledSeq(row, 10 + row, 1 + k, row, row, (), True, num_draft_tokens=k, **fields)


def layout_of(seqs: list[ScheduledSeq], num_decodes: int):  # noqa: ANN201
    qsl = np.concatenate([[0], np.cumsum([s.num_new_tokens for s in seqs])])
    sample = np.array([i for i, s in enumerate(seqs) if s.needs_sample])
    return spec_layout(tuple(seqs), qsl, sample, num_decodes)


def test_layout_of_decodes_verifies_and_a_prefill() -> None:
    prefill = ScheduledSeq(9, 0, 5, 9, None, (), True)
    layout = layout_of([decode(0), decode(1, k=2), decode(2, k=1), prefill], num_decodes=1)
    # step rows: decode 0 | verify 1-3 | verify 4-5 | prefill 6-10
    assert layout.seq_index.tolist() == [1, 2] and layout.num_tokens == 5
    assert layout.token_index.tolist() == [[0, 1, 2], [3, 4, -1]]  # offsets in the verify slice, -1 padding
    assert layout.draft_token_index.tolist() == [2, 3, 5]  # the drafts' step rows (after each chunk's first token)
    assert layout.draft_rows.tolist() == [1, 1, 2] and layout.draft_cols.tolist() == [0, 1, 0]
    assert layout.sample_counts.tolist() == [1, 3, 2, 1]  # positions each sampling sequence samples
    assert layout.sample_offsets.tolist() == [0, 1, 4, 6, 7]
    assert layout.position_offsets.tolist() == [0, 0, 1, 2, 0, 1, 0]  # each position's output index offset
    assert layout.spec_sample_index.tolist() == [1, 2]
    assert layout_of([decode(0), prefill], num_decodes=1) is None


@pytest.mark.parametrize(
    ("seqs", "message"),
    [
        ([ScheduledSeq(9, 0, 5, 9, None, (), True), decode(1, k=2)], "must follow the plain decodes"),
        ([decode(1, k=2, checkpoints=((13, 5),))], "checkpoints on a verify chunk"),
        ([ScheduledSeq(1, 11, 5, 1, 1, (), True, num_draft_tokens=2)], "1 \\+ k tokens .* got 5 tokens for k = 2"),
        ([ScheduledSeq(1, 11, 3, 1, 1, (), False, num_draft_tokens=2)], "needs_sample False"),
    ],
)
def test_refusals(seqs: list[ScheduledSeq], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        layout_of(seqs, num_decodes=0)


def test_speculating_seqs_hold_each_sequence_with_its_scratch() -> None:
    """A sequence holds its slot and its verify chunk's scratch: slots of 10 bytes, a scratch of 30 (k = 3 states),
    40 bytes a sequence."""
    assert speculating_seqs(1000, 10, 30, upper=100) == 12  # half of the budget, vLLM's default count sized
    assert speculating_seqs(1000, 10, 30, upper=100, share=1.0) == 25  # all of it, beside a count the user set
    assert speculating_seqs(1000, 10, 30, upper=4) == 4
    assert speculating_seqs(10, 10, 30, upper=4) == 1  # at least one: speculation never turns itself off here
