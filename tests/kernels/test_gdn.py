"""gdn_decode_triton and gdn_prefill_triton against the torch twins (recurrent decode, chunked prefill ref), and the
chunked prefill's blocked (I + A)^-1 (chunk_inverse_triton) against chunk_inverse_ref."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from deltaserve.kernels import gdn_triton
from deltaserve.kernels.gdn import chunk_inverse_ref, gdn_decode_ref, gdn_gates, gdn_prefill_ref, l2norm_fp32
from deltaserve.kernels.gdn_triton import CHUNK, chunk_inverse_triton, gdn_decode_triton, gdn_prefill_triton

from ._util import DEVICE, DTYPES, assert_close, poisoned_empty, randn, tolerance, varlen_starts


def _inputs(num_tokens: int, hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """q, k, v as strided head views of one conv-output row (as the layer splits it), plus a, b, A_log, dt_bias."""
    key_dim, value_dim = hk * dk, hv * dv
    mixed = randn(num_tokens, 2 * key_dim + value_dim, dtype=dtype)
    q = mixed[:, :key_dim].view(num_tokens, hk, dk)
    k = mixed[:, key_dim : 2 * key_dim].view(num_tokens, hk, dk)
    v = mixed[:, 2 * key_dim :].view(num_tokens, hv, dv)
    ba = randn(num_tokens, 2 * hv, dtype=dtype)
    b, a = ba[:, :hv], ba[:, hv:]
    A_log = torch.log(torch.empty(hv, device=DEVICE).uniform_(1, 16))
    dt_bias = randn(hv, scale=0.5)
    return q, k, v, a, b, A_log, dt_bias


def _against_ref(
    ref_op: Callable[..., torch.Tensor],
    kernel: Callable[..., torch.Tensor],
    inputs: tuple[torch.Tensor, ...],
    states: torch.Tensor,
    routing: tuple[torch.Tensor, ...],
    tol: float,
    states_tol: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin on a copy of the states, the kernel (outputs NaN-poisoned) on `states`, both called as
    (*inputs, states, *routing); asserts the outputs and the states agree. Returns (kernel output, twin's states)."""
    ref_states = states.clone()
    ref = ref_op(*inputs, ref_states, *routing)
    with poisoned_empty():
        out = kernel(*inputs, states, *routing)
    assert_close("o", ref, out, tol)
    assert_close("states", ref_states, states, tol if states_tol is None else states_tol)
    return out, ref_states


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("lengths", "has_init", "hk", "hv", "dk", "dv"),
    [
        ([1], [False], 2, 2, 32, 32),
        ([63], [True], 1, 3, 32, 64),
        ([100, 5, 0, 40], [True, False, False, True], 2, 4, 64, 32),
        ([70], [True], 1, 2, 128, 32),  # dk 128: the chunked scan's two dk halves
    ],
)
def test_gdn_prefill(
    lengths: list[int], has_init: list[bool], hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype
) -> None:
    num_slots = len(lengths) + 2
    q, k, v, a, b, A_log, dt_bias = _inputs(sum(lengths), hk, hv, dk, dv, dtype)
    states = randn(num_slots, hv, dk, dv, scale=0.1)
    slots = torch.randperm(num_slots, device=DEVICE)[: len(lengths)].int()
    qsl = varlen_starts(lengths)
    init = torch.tensor(has_init, device=DEVICE)
    _against_ref(
        gdn_prefill_ref,
        gdn_prefill_triton,
        (q, k, v, a, b, A_log, dt_bias),
        states,
        (qsl, slots, init),
        tolerance(dtype, fp32=2e-5, low=2e-2),
    )


@pytest.mark.parametrize(("block_v", "warps", "stages"), [(16, 2, 1), (64, 4, 3), (128, 8, 4)])
def test_gdn_prefill_scan_launch_configs(
    monkeypatch: pytest.MonkeyPatch, block_v: int, warps: int, stages: int
) -> None:
    """The scan launch configurations `gdn_prefill_kernels.py --scan-configs` sweeps (BV, warps, stages: it replaces
    scan_launch, looked up at each call) compute the same prefill: against the ref at fp32, dv 128 (BV 16 to 128)."""
    monkeypatch.setattr(gdn_triton, "scan_launch", lambda *args: (block_v, warps, stages))
    lengths, hk, hv, dk, dv = [70, 9], 1, 2, 64, 128
    q, k, v, a, b, A_log, dt_bias = _inputs(sum(lengths), hk, hv, dk, dv, torch.float32)
    states = randn(len(lengths), hv, dk, dv, scale=0.1)
    slots = torch.arange(len(lengths), device=DEVICE, dtype=torch.int32)
    init = torch.tensor([True, False], device=DEVICE)
    _against_ref(
        gdn_prefill_ref, gdn_triton.gdn_prefill_triton, (q, k, v, a, b, A_log, dt_bias), states,
        (varlen_starts(lengths), slots, init), 2e-5,
    )  # fmt: skip


def test_gdn_prefill_chunk_edges() -> None:
    """Chunked prefill at fp32 over the chunk-grid edges in one batch: lengths 1, 63, 64, 65, 130 (and an empty
    one), dk 128 (the scan's two halves), has_initial_state mixed, one slot < 0 (starts from zeros, writes no
    state); every kernel output NaN-poisoned."""
    lengths = [65, 1, 130, 0, 64, 63]
    has_init = [True, True, False, True, True, False]
    hk, hv, dk, dv = 1, 2, 128, 32
    num_slots = len(lengths) + 1
    q, k, v, a, b, A_log, dt_bias = _inputs(sum(lengths), hk, hv, dk, dv, torch.float32)
    states = randn(num_slots, hv, dk, dv, scale=0.1)
    # The last slot is nobody's: a slot −1 taken as a Python index would read and write it.
    slots = torch.randperm(num_slots - 1, device=DEVICE)[: len(lengths)].int()
    slots[4] = -1  # a full chunk on a padding slot, with has_initial_state set
    qsl = varlen_starts(lengths)
    init = torch.tensor(has_init, device=DEVICE)
    _, ref_states = _against_ref(
        gdn_prefill_ref, gdn_prefill_triton, (q, k, v, a, b, A_log, dt_bias), states, (qsl, slots, init), 2e-5
    )
    untouched = [s for s in range(num_slots) if s not in slots.tolist()]
    assert num_slots - 1 in untouched
    assert torch.equal(states[untouched], ref_states[untouched]), "slot −1 (or a free slot) was written"


def test_chunk_inverse() -> None:
    """The blocked (I + A)^-1 equals the triangular solve on A of the prefill's form and scale: k̂ sharing a
    common direction (k̂_i·k̂_j ≈ 0.6, so A is dense and X far from I off the diagonal blocks), β ≈ 0.85, slow
    decay; the third chunk's second half is padding (k̂ = 0, β = 0), as at a sequence's end."""
    num_tiles, dk = 3, 64
    common = randn(1, dk)
    k_hat = l2norm_fp32(randn(num_tiles, CHUNK, dk, scale=0.8) + common)  # [N, C, dk]
    g, beta = gdn_gates(
        randn(num_tiles, CHUNK), randn(num_tiles, CHUNK) + 2.0, torch.zeros(1, device=DEVICE), randn(1) - 3.0
    )
    k_hat[2, CHUNK // 2 :] = 0.0
    beta[2, CHUNK // 2 :] = 0.0
    cum_g = g.cumsum(-1)  # [N, C]
    strict = (k_hat @ k_hat.transpose(-1, -2)) * beta[..., None] * (cum_g[..., :, None] - cum_g[..., None, :]).exp()
    strict = strict.tril(-1)  # [N, C, C]
    ref = chunk_inverse_ref(strict)
    assert ref[:, 16:32, :16].abs().max().item() > 0.1, "A too weak to exercise the off-diagonal blocks"
    out = chunk_inverse_triton(strict)
    assert_close("X", ref, out, 1e-5)
    # Each block below the diagonal on its own (the far ones are small: X decays with distance from it).
    for i in range(1, 4):
        for j in range(i):
            rows, cols = slice(16 * i, 16 * i + 16), slice(16 * j, 16 * j + 16)
            assert_close(f"X block ({i}, {j})", ref[:, rows, cols], out[:, rows, cols], 1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("lengths", "hk", "hv"), [([2048], 16, 48), ([1024] * 8, 16, 32)], ids=["27b-2048", "35b-a3b-8x1024"]
)
def test_gdn_prefill_served_shapes(lengths: list[int], hk: int, hv: int) -> None:
    """bf16 activations at the served head shapes (128 x 128) against the ref (fp32 inside), initial states set."""
    dk = dv = 128
    num_slots = len(lengths) + 4
    q, k, v, a, b, A_log, dt_bias = _inputs(sum(lengths), hk, hv, dk, dv, torch.bfloat16)
    states = randn(num_slots, hv, dk, dv, scale=0.05)
    slots = torch.randperm(num_slots, device=DEVICE)[: len(lengths)].int()
    qsl = varlen_starts(lengths)
    init = torch.ones(len(lengths), dtype=torch.bool, device=DEVICE)
    _against_ref(gdn_prefill_ref, gdn_prefill_triton, (q, k, v, a, b, A_log, dt_bias), states, (qsl, slots, init), 2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("hk", "hv", "dk", "dv"),
    [(2, 2, 32, 32), (2, 6, 64, 48), (1, 3, 128, 128)],
    ids=["small", "dv48", "head128-group3"],  # dv 48: a partial value block; 128 x 128: the served heads
)
def test_gdn_decode(hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype) -> None:
    batch, num_slots = 5, 8
    q, k, v, a, b, A_log, dt_bias = _inputs(batch, hk, hv, dk, dv, dtype)
    states = randn(num_slots, hv, dk, dv, scale=0.1)
    slots = torch.randperm(num_slots, device=DEVICE)[:batch].int()
    slots[1] = slots[4] = -1  # CUDA-graph padding rows, one of them the last
    out, ref_states = _against_ref(
        gdn_decode_ref,
        gdn_decode_triton,
        (q, k, v, a, b, A_log, dt_bias),
        states,
        (slots,),
        tolerance(dtype, fp32=3e-6, low=1e-2),
    )
    untouched = [s for s in range(num_slots) if s not in slots.tolist()]
    assert torch.equal(states[untouched], ref_states[untouched]), "padded rows must leave the other slots alone"
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.equal(out[4], torch.zeros_like(out[4]))


@pytest.mark.gpu
@pytest.mark.parametrize(("hk", "hv"), [(16, 48), (16, 32)], ids=["27b", "35b-a3b"])
@pytest.mark.parametrize("batch", [1, 64, 256])
def test_gdn_decode_served_shapes(hk: int, hv: int, batch: int) -> None:
    """bf16 activations, fp32 states at the served head shapes (128 x 128), scattered slots and padding rows."""
    dk = dv = 128
    num_slots = batch + 8
    q, k, v, a, b, A_log, dt_bias = _inputs(batch, hk, hv, dk, dv, torch.bfloat16)
    states = randn(num_slots, hv, dk, dv, scale=0.05)
    slots = torch.randperm(num_slots, device=DEVICE)[:batch].int()
    slots[::7] = -1
    out, _ = _against_ref(
        gdn_decode_ref, gdn_decode_triton, (q, k, v, a, b, A_log, dt_bias), states, (slots,), 1e-2, states_tol=1e-5
    )
    assert torch.equal(out[::7], torch.zeros_like(out[::7]))


def test_gdn_decode_continues_prefill() -> None:
    """A prefill then decodes on one slot equals one longer prefill (fp32): the two kernels share a state layout."""
    hk, hv, dk, dv, length = 1, 2, 32, 32, 9
    q, k, v, a, b, A_log, dt_bias = _inputs(length, hk, hv, dk, dv, torch.float32)
    states = torch.zeros(2, hv, dk, dv, device=DEVICE)
    slot = torch.tensor([1], dtype=torch.int32, device=DEVICE)
    init = torch.tensor([False], device=DEVICE)
    whole = gdn_prefill_triton(q, k, v, a, b, A_log, dt_bias, states.clone(), varlen_starts([length]), slot, init)
    split = length - 3
    parts = [
        gdn_prefill_triton(
            *(t[:split] for t in (q, k, v, a, b)), A_log, dt_bias, states, varlen_starts([split]), slot, init
        )
    ]
    for t in range(split, length):
        parts.append(gdn_decode_triton(*(x[t : t + 1] for x in (q, k, v, a, b)), A_log, dt_bias, states, slot))
    # Prefill rounds q̂/k̂ to the input dtype, decode does not: identical at fp32.
    assert_close("o", whole, torch.cat(parts), 1e-5)
    assert math.isfinite(states.abs().max().item())
