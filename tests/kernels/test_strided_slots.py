"""The state kernels on slot pools whose slot stride is wider than one slot: every GDN and conv kernel that reads or
writes slots takes the slot stride from its tensor (docs/ARCHITECTURE.md#admission, "One pool": slots as page runs
of a shared pool are strided views). Each kernel runs on a strided view of a NaN-padded pool and on a contiguous
copy of the same values: outputs and states bit-equal, the padding between slots untouched (fp32 under
TRITON_INTERPRET=1 on the CPU, and on the GPU). The slot stride is a multiple of 16 elements, as a page run's is:
on an H100 a stride that is not (2,072) made the GDN decode and verify kernels round otherwise. Our reading, not yet
checked on the GPU: Triton specializes an integer argument divisible by 16, so such a stride compiles other loads
and those kernels' sums run in another order, while a multiple of 16 compiles the contiguous pool's kernel.
And a fresh slot (has_initial_state False) holding NaN, as a run that served blocks may, is never read."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from deltaserve.kernels.conv_triton import causal_conv1d_prefill_triton, causal_conv1d_update_triton
from deltaserve.kernels.gdn_spec import verify_row_width
from deltaserve.kernels.gdn_spec_conv_triton import causal_conv1d_verify_triton
from deltaserve.kernels.gdn_spec_triton import gdn_verify_triton
from deltaserve.kernels.gdn_triton import gdn_decode_triton, gdn_prefill_triton

from ._util import DEVICE, randn, varlen_starts
from .test_gdn import _inputs

PAD = 16  # elements at least between one slot's end and the next slot's start, the stride rounded up to 16s


def strided_pool(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(pool [S, stride] NaN-padded, a view [S, *slot shape] of it holding `values`): the slot stride is the slot's
    n elements plus PAD, rounded up to a multiple of 16."""
    num_slots, size = values.shape[0], math.prod(values.shape[1:])
    stride = -(-(size + PAD) // 16) * 16
    pool = torch.full((num_slots, stride), float("nan"), dtype=values.dtype, device=DEVICE)
    view = pool[:, :size].view(values.shape)
    view.copy_(values)
    assert not view.is_contiguous() and view.stride(0) == stride
    return pool, view


def run_both(kernel: Callable[[torch.Tensor], torch.Tensor], values: torch.Tensor) -> None:
    """kernel(states) on a contiguous copy and on a strided view of `values`: equal outputs and states, padding
    unwritten."""
    dense = values.clone()
    pool, strided = strided_pool(values)
    want = kernel(dense)
    got = kernel(strided)
    assert torch.equal(want.nan_to_num(7.0), got.nan_to_num(7.0)), "outputs differ on a strided pool"
    assert torch.equal(dense, strided), "states differ on a strided pool"
    assert pool[:, math.prod(values.shape[1:]) :].isnan().all(), "wrote between slots"


def test_gdn_prefill_and_decode_on_a_strided_pool() -> None:
    hk, hv, dk, dv, num_slots = 1, 2, 32, 32, 5
    lengths = [70, 3, 0]
    q, k, v, a, b, A_log, dt_bias = _inputs(sum(lengths), hk, hv, dk, dv, torch.float32)
    slots = torch.tensor([3, 0, 4], dtype=torch.int32, device=DEVICE)
    init = torch.tensor([True, False, True], device=DEVICE)
    states = randn(num_slots, hv, dk, dv, scale=0.1)
    run_both(
        lambda s: gdn_prefill_triton(q, k, v, a, b, A_log, dt_bias, s, varlen_starts(lengths), slots, init), states
    )
    q, k, v, a, b, A_log, dt_bias = _inputs(4, hk, hv, dk, dv, torch.float32)
    rows = torch.tensor([2, -1, 0, 4], dtype=torch.int32, device=DEVICE)
    run_both(lambda s: gdn_decode_triton(q, k, v, a, b, A_log, dt_bias, s, rows), states)


def test_conv_prefill_and_update_on_a_strided_pool() -> None:
    channels, kernel_size, num_slots, lengths = 48, 4, 5, [9, 1, 0, 2]
    weight = randn(channels, kernel_size, scale=0.5)
    states = randn(num_slots, kernel_size - 1, channels)
    x = randn(sum(lengths), channels)
    slots = torch.tensor([1, 4, 0, 2], dtype=torch.int32, device=DEVICE)
    init = torch.tensor([True, True, False, False], device=DEVICE)
    run_both(lambda s: causal_conv1d_prefill_triton(x, weight, s, varlen_starts(lengths), slots, init), states)
    rows = torch.tensor([3, -1, 1], dtype=torch.int32, device=DEVICE)
    x = randn(3, channels)
    run_both(lambda s: causal_conv1d_update_triton(x, weight, s, rows), states)


def test_the_verify_kernels_read_a_strided_pool() -> None:
    """The verify kernels read the live slots (the commit writes them, each slot contiguous: its own test)."""
    hk, hv, dk, dv, lengths, num_slots = 1, 2, 16, 16, [3, 2], 4
    q, k, v, a, b, A_log, dt_bias = _inputs(sum(lengths), hk, hv, dk, dv, torch.float32)
    slots = torch.tensor([2, 0], dtype=torch.int32, device=DEVICE)
    index = torch.tensor([[0, 1, 2], [3, 4, -1]], dtype=torch.int64, device=DEVICE)
    width = verify_row_width(hk, dk, hv, dv)

    def verify(states: torch.Tensor) -> torch.Tensor:
        scratch = torch.zeros(len(lengths), 3, width, device=DEVICE)
        out = gdn_verify_triton(q, k, v, a, b, A_log, dt_bias, states, slots, index, scratch)
        return torch.cat([out.flatten(), scratch.flatten()])

    run_both(verify, randn(num_slots, hv, dk, dv, scale=0.1))
    channels, kernel_size = 40, 4
    weight = randn(channels, kernel_size, scale=0.5)
    x = randn(sum(lengths), channels)

    def conv_verify(states: torch.Tensor) -> torch.Tensor:
        scratch = torch.zeros(len(lengths), 3, kernel_size - 1, channels, device=DEVICE)
        out = causal_conv1d_verify_triton(x, weight, states, slots, index, scratch)
        return torch.cat([out.flatten(), scratch.flatten()])

    run_both(conv_verify, randn(num_slots, kernel_size - 1, channels))


def test_the_pool_helper_makes_a_strided_view() -> None:
    pool, view = strided_pool(torch.ones(3, 2, 4))
    assert view.stride(0) == 32 and pool[:, 8:].isnan().all() and (view == 1).all()


def test_a_fresh_slot_holding_nan_is_never_read() -> None:
    """In one pool a slot's run may hold a block's K/V bytes from before (NaN where read as fp32): a sequence with
    has_initial_state False reads nothing of its slot, so the GDN and conv prefills give the outputs of a zeroed slot,
    finite, and write the same final states."""
    hk, hv, dk, dv, num_slots = 1, 2, 32, 32, 3
    lengths = [70, 5]
    q, k, v, a, b, A_log, dt_bias = _inputs(sum(lengths), hk, hv, dk, dv, torch.float32)
    slots = torch.tensor([2, 0], dtype=torch.int32, device=DEVICE)
    fresh = torch.tensor([False, False], device=DEVICE)
    outputs = []
    for fill in (0.0, float("nan")):
        states = torch.full((num_slots, hv, dk, dv), fill, device=DEVICE)
        out = gdn_prefill_triton(q, k, v, a, b, A_log, dt_bias, states, varlen_starts(lengths), slots, fresh)
        outputs.append((out, states[slots.long()]))
    assert outputs[0][0].isfinite().all() and torch.equal(outputs[0][0], outputs[1][0])
    assert torch.equal(outputs[0][1], outputs[1][1])
    channels, kernel_size = 48, 4
    weight = randn(channels, kernel_size, scale=0.5)
    x = randn(sum(lengths), channels)
    conv_outputs = []
    for fill in (0.0, float("nan")):
        states = torch.full((num_slots, kernel_size - 1, channels), fill, device=DEVICE)
        out = causal_conv1d_prefill_triton(x, weight, states, varlen_starts(lengths), slots, fresh)
        conv_outputs.append((out, states[slots.long()]))
    assert conv_outputs[0][0].isfinite().all() and torch.equal(conv_outputs[0][0], conv_outputs[1][0])
    assert torch.equal(conv_outputs[0][1], conv_outputs[1][1])
