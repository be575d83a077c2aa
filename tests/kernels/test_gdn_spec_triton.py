"""gdn_verify_triton (kernels/gdn_spec_triton.py) against its twin gdn_verify_ref: outputs NaN-poisoned so an
unwritten row fails, each real token's [k | v | a | b] in the row scratch bit-equal to the twin's (a copy), the
live slots read only, nothing else written; under TRITON_INTERPRET=1 on the CPU (tiny shapes, fp32) and at the
served head shapes on the GPU."""

from __future__ import annotations

import pytest
import torch

from deltaserve.kernels.gdn_spec import gdn_verify_ref, verify_row_width
from deltaserve.kernels.gdn_spec_triton import gdn_verify_triton

from ._util import DEVICE, DTYPES, assert_close, poisoned_empty, randn, tolerance
from .test_gdn import _inputs


def _token_index(lengths: list[int]) -> torch.Tensor:
    width, rows, start = max(lengths), [], 0
    for n in lengths:
        rows.append([start + j if j < n else -1 for j in range(width)])
        start += n
    return torch.tensor(rows, dtype=torch.int64, device=DEVICE)


def _check(
    lengths: list[int],
    hk: int,
    hv: int,
    dk: int,
    dv: int,
    dtype: torch.dtype,
    ratio: float,
    padded: tuple[int, ...] = (),
) -> None:
    """padded: the sequences given slot -1 (CUDA-graph padding), whose output rows must be zeros and whose scratch
    entries and slots must stay as they were; the slot pool is a view one slot into a NaN-filled pool, so a read of
    slot -1 shows up as NaN."""
    num_slots = len(lengths) + 3
    q, k, v, a, b, A_log, dt_bias = _inputs(sum(lengths), hk, hv, dk, dv, dtype)
    pool = torch.full((num_slots + 1, hv, dk, dv), float("nan"), device=DEVICE)
    states = pool[1:]
    states.copy_(randn(num_slots, hv, dk, dv, scale=0.1))
    slots = torch.randperm(num_slots, device=DEVICE)[: len(lengths)].int()
    slots[list(padded)] = -1
    is_live = slots >= 0
    index = _token_index(lengths)
    width = max(lengths)
    before = states.clone()
    rows = verify_row_width(hk, dk, hv, dv)
    ref_scratch = torch.full((len(lengths) + 1, width + 1, rows), float("nan"), dtype=dtype, device=DEVICE)
    ref = gdn_verify_ref(q, k, v, a, b, A_log, dt_bias, states.clone(), slots, index, ref_scratch)
    scratch = torch.full_like(ref_scratch, float("nan"))
    with poisoned_empty():
        out = gdn_verify_triton(q, k, v, a, b, A_log, dt_bias, states, slots, index, scratch)
    assert_close("o", ref, out, ratio)
    assert torch.equal(scratch.isnan(), ref_scratch.isnan()), "rows written unlike the twin's"
    assert torch.equal(scratch.nan_to_num(), ref_scratch.nan_to_num()), "rows differ from the twin's (a copy)"
    real = (index >= 0) & is_live[:, None]  # [S, W]
    assert not scratch[: len(lengths), :width][real].isnan().any(), "a real token's row was not written"
    assert torch.equal(states, before), "the verify wrote a slot (the live slots are read only)"
    assert pool[0].isnan().all(), "wrote slot -1"
    padded_rows = index[~is_live]
    assert (out[padded_rows[padded_rows >= 0]] == 0).all(), "a sequence with slot -1 has zero output rows"
    assert scratch[: len(lengths)][~is_live].isnan().all(), "a sequence with slot -1 writes no scratch"
    assert scratch[len(lengths) :].isnan().all() and scratch[:, width:].isnan().all(), "wrote outside the step"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("lengths", "hk", "hv", "dk", "dv"),
    [([2, 5, 1], 2, 4, 16, 16), ([4, 4], 1, 3, 32, 48)],  # k = 1 / 4 / 0 padded; group 3 with a partial value block
)
def test_gdn_verify(lengths: list[int], hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype) -> None:
    _check(lengths, hk, hv, dk, dv, dtype, tolerance(dtype, fp32=3e-6, low=1e-2))


def test_gdn_verify_skips_a_sequence_with_slot_below_zero() -> None:
    """Padded sequences of a CUDA-graph bucket (slot -1), first and between live ones: nothing read or written."""
    _check([3, 2, 4, 1], 1, 2, 16, 16, torch.float32, 3e-6, padded=(0, 2))


@pytest.mark.gpu
@pytest.mark.parametrize(("hk", "hv"), [(16, 48), (16, 32)], ids=["27b", "35b-a3b"])
@pytest.mark.parametrize("num_seqs", [1, 64])
def test_gdn_verify_served_shapes(hk: int, hv: int, num_seqs: int) -> None:
    """bf16 activations, fp32 states, 128 x 128 heads, k = 3 with some sequences capped lower."""
    lengths = [4 if i % 5 else 2 for i in range(num_seqs)]
    _check(lengths, hk, hv, 128, 128, torch.bfloat16, 1e-2, padded=(num_seqs - 1,) if num_seqs > 1 else ())
