"""causal_conv1d_verify_triton (kernels/gdn_spec_conv_triton.py) against its twin causal_conv1d_verify_ref: the
output NaN-poisoned so an unwritten row fails, the window after every token in scratch (padded columns included),
padded sequences (slot -1) reading and writing nothing but zero output rows, the live slots untouched; under
TRITON_INTERPRET=1 on the CPU in fp32 (windows bit-equal; outputs bit-equal up to the SiLU, whose last bit torch's
vectorised F.silu does not pin), bf16 at the served conv widths on the GPU."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch

from deltaserve.bench.kernel_shapes import MODELS
from deltaserve.kernels import causal_conv1d_verify
from deltaserve.kernels._triton import is_interpreting
from deltaserve.kernels.gdn_spec import causal_conv1d_verify_ref
from deltaserve.kernels.gdn_spec_conv_triton import causal_conv1d_verify_triton

from ._util import DEVICE, assert_close, poisoned_empty, randn
from .test_gdn_spec_triton import _token_index

KERNEL_SIZE = 4


def _check(lengths: list[int], channels: int, dtype: torch.dtype, padded: tuple[int, ...] = ()) -> None:
    """padded: the sequences given slot -1. The slot pool is a view one slot into a NaN-filled pool, so a read of
    slot -1 shows up as NaN; x is a column slice of a wider projection, as the layer passes it."""
    num_seqs, width = len(lengths), max(lengths)
    num_slots = num_seqs + 3
    x = randn(sum(lengths), channels + 24, dtype=dtype)[:, :channels]
    weight = randn(channels, KERNEL_SIZE, scale=0.5).to(dtype)
    pool = torch.full((num_slots + 1, KERNEL_SIZE - 1, channels), float("nan"), dtype=dtype, device=DEVICE)
    states = pool[1:]
    states.copy_(randn(num_slots, KERNEL_SIZE - 1, channels, dtype=dtype))
    slots = torch.randperm(num_slots, device=DEVICE)[:num_seqs].int()  # slot s is rarely sequence s
    slots[list(padded)] = -1
    is_live = slots >= 0
    index = _token_index(lengths)
    scratch_shape = (num_seqs + 1, width + 1, KERNEL_SIZE - 1, channels)  # one spare sequence and column
    ref_scratch = torch.full(scratch_shape, float("nan"), dtype=dtype, device=DEVICE)
    ref = causal_conv1d_verify_ref(x, weight, states, slots, index, ref_scratch)
    before = pool.clone()
    scratch = torch.full_like(ref_scratch, float("nan"))
    with poisoned_empty():
        out = causal_conv1d_verify_triton(x, weight, states, slots, index, scratch)
    rows = index[index >= 0]
    live_scratch = scratch[:num_seqs, :width][is_live]
    if dtype == torch.float32:  # windows are copies: bit-equal
        assert torch.equal(live_scratch, ref_scratch[:num_seqs, :width][is_live]), "scratch differs from the twin"
        assert_close("y", ref[rows], out[rows], 2e-6)
        if is_interpreting():
            _assert_same_conv_sums(x, weight, states, slots, index, out)
    else:
        assert_close("y", ref[rows], out[rows], 1e-2)
        assert_close("scratch", ref_scratch[:num_seqs, :width][is_live], live_scratch, 1e-2)
    padded_rows = index[~is_live]
    assert (out[padded_rows[padded_rows >= 0]] == 0).all(), "a sequence with slot -1 has zero output rows"
    assert scratch[:num_seqs][~is_live].isnan().all(), "a sequence with slot -1 writes no scratch"
    assert scratch[num_seqs:].isnan().all() and scratch[:, width:].isnan().all(), "wrote outside the step"
    assert torch.equal(pool.isnan(), before.isnan()) and torch.equal(pool.nan_to_num(), before.nan_to_num()), (
        "the live slots are the commit's to write"
    )


def _assert_same_conv_sums(
    x: torch.Tensor,
    weight: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    index: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Bit-equality up to the SiLU: the twin's fp32 conv sums (its SiLU swapped for the identity), through the
    kernel's SiLU formula x / (1 + e^-x) in numpy (the interpreter's arithmetic), equal the kernel's output bit for
    bit. torch's vectorised F.silu itself differs by an ulp or two between shapes of the same values."""
    scratch = torch.empty(index.shape[0], index.shape[1], *states.shape[1:], dtype=states.dtype, device=DEVICE)
    with mock.patch.object(torch.nn.functional, "silu", lambda t: t):
        sums = causal_conv1d_verify_ref(x, weight, states, slots, index, scratch)
    rows = index[index >= 0]
    a = sums[rows].numpy()
    want = torch.from_numpy(a / (np.float32(1.0) + np.exp(-a)))
    assert torch.equal(out[rows], want), "the kernel's conv sums differ from the twin's"


@pytest.mark.parametrize(
    ("lengths", "channels", "padded"),
    [
        ([2, 4, 1], 48, ()),  # k = 1 / 3 / 0: padded columns; one channel block of 64, partly masked
        ([3, 1, 4], 300, (1,)),  # two channel blocks (256 + 44); a padded sequence between live ones
        ([1], 20, ()),  # W = 1: no draft at all
        ([2, 2, 3], 40, (0,)),  # the first sequence padded
    ],
)
def test_conv_verify(lengths: list[int], channels: int, padded: tuple[int, ...]) -> None:
    _check(lengths, channels, torch.float32, padded)


def test_conv_verify_history_only_window() -> None:
    """A live sequence whose every column is padded (width from another sequence): its windows are its slot's
    rows, as the twin's, and it writes no output row."""
    _check([0, 3], 24, torch.float32)


@pytest.mark.gpu
def test_conv_verify_dispatches_to_triton_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    called: list[bool] = []

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        called.append(True)
        return causal_conv1d_verify_triton(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr("deltaserve.kernels.gdn_spec_conv_triton.causal_conv1d_verify_triton", spy)
    x = randn(3, 16, dtype=torch.bfloat16)
    weight = randn(16, KERNEL_SIZE, dtype=torch.bfloat16)
    states = randn(2, KERNEL_SIZE - 1, 16, dtype=torch.bfloat16)
    scratch = torch.empty(1, 3, KERNEL_SIZE - 1, 16, dtype=torch.bfloat16, device=DEVICE)
    index = _token_index([3])
    causal_conv1d_verify(x, weight, states, torch.tensor([1], dtype=torch.int32, device=DEVICE), index, scratch)
    assert called, "causal_conv1d_verify did not take the Triton kernel on CUDA"


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["27b", "35b-a3b"])
@pytest.mark.parametrize("num_seqs", [1, 64])
def test_conv_verify_served_shapes(model: str, num_seqs: int) -> None:
    """bf16 at the served conv widths (conv_dim 10240 / 8192), k = 3 with some sequences capped lower and the last
    of a batch padded as a CUDA-graph bucket pads it."""
    lengths = [4 if i % 5 else 2 for i in range(num_seqs)]
    _check(lengths, MODELS[model].conv_dim, torch.bfloat16, padded=(num_seqs - 1,) if num_seqs > 1 else ())
