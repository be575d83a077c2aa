"""causal_conv1d_prefill_triton (varlen, fresh and continued sequences) and causal_conv1d_update_triton."""

from __future__ import annotations

import pytest
import torch

from deltaserve.kernels.conv import causal_conv1d_prefill_ref, causal_conv1d_update_ref
from deltaserve.kernels.conv_triton import causal_conv1d_prefill_triton, causal_conv1d_update_triton

from ._util import DEVICE, DTYPES, assert_close, poisoned_empty, randn, tolerance, varlen_starts

KERNEL_SIZE = 4


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("lengths", "has_init", "channels"),
    [
        ([1], [False], 64),
        ([63], [True], 96),
        ([100, 2, 0, 17, 1], [True, True, False, False, True], 80),  # short ones keep part of their history
    ],
)
def test_causal_conv1d_prefill(lengths: list[int], has_init: list[bool], channels: int, dtype: torch.dtype) -> None:
    num_slots = len(lengths) + 3
    x = randn(sum(lengths), channels + 8, dtype=dtype)[:, :channels]  # a strided view, as from a fused GEMM
    weight = randn(channels, KERNEL_SIZE, scale=0.5)
    states = randn(num_slots, KERNEL_SIZE - 1, channels, dtype=dtype)
    slots = torch.randperm(num_slots, device=DEVICE)[: len(lengths)].int()
    qsl = varlen_starts(lengths)
    init = torch.tensor(has_init, device=DEVICE)
    ref_states = states.clone()
    ref = causal_conv1d_prefill_ref(x, weight, ref_states, qsl, slots, init)
    with poisoned_empty():
        out = causal_conv1d_prefill_triton(x, weight, states, qsl, slots, init)
    assert_close("y", ref, out, tolerance(dtype, fp32=2e-6))
    assert torch.equal(ref_states, states), "conv states (incl. untouched slots) differ"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("channels", [64, 300])
def test_causal_conv1d_update(channels: int, dtype: torch.dtype) -> None:
    batch, num_slots = 6, 9
    x = randn(batch, channels + 24, dtype=dtype)[:, :channels]  # the layer passes its projection's column slice
    weight = randn(channels, KERNEL_SIZE, scale=0.5)
    states = randn(num_slots, KERNEL_SIZE - 1, channels, dtype=dtype)
    slots = torch.randperm(num_slots, device=DEVICE)[:batch].int()
    slots[2] = slots[5] = -1  # CUDA-graph padding rows
    ref_states = states.clone()
    ref = causal_conv1d_update_ref(x, weight, ref_states, slots)
    with poisoned_empty():
        out = causal_conv1d_update_triton(x, weight, states, slots)
    assert_close("y", ref, out, tolerance(dtype, fp32=2e-6))
    assert torch.equal(ref_states, states), "conv states differ (padded rows must leave every slot untouched)"
    assert torch.equal(out[2], torch.zeros_like(out[2]))
