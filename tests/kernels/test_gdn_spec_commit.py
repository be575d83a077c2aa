"""spec_state_commit_layers_triton (kernels/gdn_spec_commit_triton.py, the verify step's commit over every GDN layer
in one launch: the conv window copied, the accepted tokens replayed on the live recurrent state) against its twin
spec_state_commit_layers_ref, which is the per-layer spec_state_commit: the conv windows bit-equal (a copy), the
recurrent states within fp32 rounding (the twin's einsum and the kernel's tile sums add in different orders), every
slot the commit must not touch keeping its NaN poison or its old value; padded sequences (slot -1), every accepted
count 0 .. W - 1, a step narrower than the scratch, a one-column step, states longer than one block, and the
stacking of per-layer views (runner/spec_commit.py) that lets the runner call it. Under TRITON_INTERPRET=1 on the
CPU in fp32, and on the GPU at the 27B's per-layer shapes in bf16 / fp32."""

from __future__ import annotations

import pytest
import torch

from deltaserve.kernels import spec_state_commit_layers
from deltaserve.kernels.gdn_spec import spec_state_commit_layers_ref, verify_row_width
from deltaserve.kernels.gdn_spec_commit_triton import spec_state_commit_layers_triton
from deltaserve.runner.spec_commit import stack_views

from ._util import DEVICE, randn


def _tensors(layers: int, slots: int, seqs: int, width: int, conv: tuple[int, int], ssm: tuple[int, int, int],
             dtype: torch.dtype, hk: int) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """States [L, slots, ...] with slot 0 NaN (a slot no live sequence commits to: any write there shows), scratch
    [L, seqs + 1, width, ...] random (one spare sequence), the token rows [k | v | a | b] of hk key heads, the gate
    parameters [L, HV]."""
    hv, dk, dv = ssm
    conv_states = randn(layers, slots, *conv, dtype=dtype)
    ssm_states = randn(layers, slots, *ssm, dtype=torch.float32)
    conv_states[:, 0] = float("nan")
    ssm_states[:, 0] = float("nan")
    scratch_conv = randn(layers, seqs + 1, width, *conv, dtype=dtype)
    scratch_rows = randn(layers, seqs + 1, width, verify_row_width(hk, dk, hv, dv), dtype=dtype)
    A_log = randn(layers, hv, dtype=torch.float32)
    dt_bias = randn(layers, hv, dtype=dtype)
    return conv_states, ssm_states, scratch_conv, scratch_rows, A_log, dt_bias


def _check(
    accepted: list[int],
    slots: list[int],
    width: int,
    scratch_width: int,
    dtype: torch.dtype,
    conv: tuple[int, int] = (3, 40),
    ssm: tuple[int, int, int] = (2, 8, 8),
    layers: int = 3,
    hk: int = 1,
) -> None:
    num_slots = max(slots) + 2
    tensors = _tensors(layers, num_slots, len(slots), scratch_width, conv, ssm, dtype, hk)
    index = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    num_accepted = torch.tensor(accepted, dtype=torch.int64, device=DEVICE)
    ref = [t.clone() for t in tensors]
    spec_state_commit_layers_ref(*ref, index, num_accepted, width)
    out = [t.clone() for t in tensors]
    spec_state_commit_layers_triton(*out, index, num_accepted, width)
    assert torch.equal(ref[0].isnan(), out[0].isnan()), "conv_states: a slot written or left unlike the twin"
    assert torch.equal(ref[0].nan_to_num(), out[0].nan_to_num()), "conv_states: differs from the twin"
    assert torch.equal(ref[1].isnan(), out[1].isnan()), "ssm_states: a slot written or left unlike the twin"
    torch.testing.assert_close(out[1].nan_to_num(), ref[1].nan_to_num(), rtol=2e-5, atol=2e-5)
    for r, o in zip(ref[2:], out[2:], strict=True):
        assert torch.equal(r, o), "the scratch and the gates are read only"
    # the twin itself: the conv window of the accepted count, a state moved from the live one, nothing else touched
    conv_states, ssm_states, scratch_conv = tensors[:3]
    for s, (a, slot) in enumerate(zip(accepted, slots, strict=True)):
        if slot < 0:
            continue
        assert torch.equal(ref[0][:, slot], scratch_conv[:, s, min(a, scratch_width - 1)])
        if slot != 0:  # slot 0 is NaN: it stays NaN whatever is replayed on it
            assert not torch.equal(ref[1][:, slot], ssm_states[:, slot]), "the replay moved the state"
    untouched = [i for i in range(num_slots) if i not in slots]
    assert torch.equal(ref[1][:, untouched].nan_to_num(), ssm_states[:, untouched].nan_to_num())
    assert torch.equal(ref[1][:, untouched].isnan(), ssm_states[:, untouched].isnan())


@pytest.mark.parametrize("accepted", [[0, 1, 2, 3], [3, 3, 0, 1], [2, 0, 3, 1]])
def test_commit_layers_equals_the_per_layer_twin(accepted: list[int]) -> None:
    _check(accepted, slots=[4, 1, 6, 2], width=4, scratch_width=4, dtype=torch.float32)


def test_padded_sequences_commit_nothing() -> None:
    _check([1, 0, 2, 3], slots=[-1, 3, -1, 5], width=4, scratch_width=4, dtype=torch.float32)


def test_a_step_narrower_than_the_scratch_replays_its_own_entries() -> None:
    # a deferred step's chunks are 2 wide in a scratch built for 1 + 3: accepted 1 = the last column
    _check([0, 1, 1], slots=[2, 5, 1], width=2, scratch_width=4, dtype=torch.float32)


def test_a_one_column_step_replays_its_one_token() -> None:
    _check([0, 0], slots=[3, 1], width=1, scratch_width=4, dtype=torch.float32)


def test_a_state_wider_than_one_column_block_and_grouped_heads() -> None:
    # 4 value heads over 2 key heads, 48 x 48 (two column blocks of 32), and 3 x 1,000 conv elements (two blocks)
    _check([1, 2], slots=[1, 3], width=4, scratch_width=4, dtype=torch.float32, conv=(3, 1000), ssm=(4, 48, 48),
           hk=2)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_commit_layers_at_the_27b_state_shape(dtype: torch.dtype) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    # the 27B's GDN layer: conv window 3 x 10,240, recurrent state 48 x 128 x 128 (fp32) over 16 key heads
    _check([3, 0, 2, 1, 3], slots=[7, -1, 2, 4, 0], width=4, scratch_width=4, dtype=dtype, conv=(3, 10240),
           ssm=(48, 128, 128), layers=4, hk=16)  # fmt: skip


def test_stack_views_finds_the_common_tensor_and_refuses_others() -> None:
    base = torch.arange(5 * 3 * 4, dtype=torch.float32).view(5, 3, 4)
    stacked = stack_views([base[i] for i in range(5)])
    assert stacked is not None and torch.equal(stacked, base)
    assert stack_views([base[i] for i in (0, 2, 4)]) is not None  # equally spaced: a strided stack
    assert torch.equal(stack_views([base[i] for i in (0, 2, 4)]), base[::2])
    assert stack_views([base[0], base[1], base[3]]) is None, "unequal spacing"
    assert stack_views([base[0], torch.zeros(3, 4)]) is None, "two storages"
    assert stack_views([base[0], None]) is None
    assert stack_views([]) is None


def test_the_dispatched_op_runs_the_twin_off_cuda() -> None:
    if DEVICE.type == "cuda":
        pytest.skip("on CUDA the op runs the Triton kernel (the tests above)")
    tensors = [t.clone() for t in _tensors(2, 4, 2, 4, (3, 8), (2, 4, 4), torch.float32, 1)]
    expected = [t.clone() for t in tensors]
    index = torch.tensor([1, 3], dtype=torch.int32)
    accepted = torch.tensor([0, 2])
    spec_state_commit_layers(*tensors, index, accepted, 4)
    spec_state_commit_layers_ref(*expected, index, accepted, 4)
    for t, e in zip(tensors, expected, strict=True):
        assert torch.equal(t.nan_to_num(), e.nan_to_num())


def _replay_matches_the_verify(hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype, slots: list[int]) -> None:
    """The served kernels alone: a verify of W tokens, then for each j >= 1 the commit of j - 1 accepted tokens
    followed by a one-token verify of token j from the committed state. The one-token verify's output must be
    bit-equal to the W-token verify's output for token j: both contract q̂_j with the state after token j, so the
    replayed state has to be the very state the verify held (same step function, tiles and warps)."""
    from deltaserve.kernels.gdn_spec_triton import gdn_verify_triton

    width, num_seqs, num_slots = 4, len(slots), max(slots) + 1
    n = num_seqs * width
    q, k = randn(n, hk, dk, dtype=dtype), randn(n, hk, dk, dtype=dtype)
    v, a, b = randn(n, hv, dv, dtype=dtype), randn(n, hv, dtype=dtype), randn(n, hv, dtype=dtype)
    A_log, dt_bias = randn(hv, dtype=torch.float32), randn(hv, dtype=dtype)
    live = randn(num_slots, hv, dk, dv, dtype=torch.float32)
    index = torch.arange(n, device=DEVICE).view(num_seqs, width)
    state_indices = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    rows = torch.empty(num_seqs, width, verify_row_width(hk, dk, hv, dv), dtype=dtype, device=DEVICE)
    full = gdn_verify_triton(q, k, v, a, b, A_log, dt_bias, live, state_indices, index, rows)
    conv = torch.zeros(1, num_slots, 3, 8, dtype=dtype, device=DEVICE)
    scratch_conv = torch.zeros(1, num_seqs, width, 3, 8, dtype=dtype, device=DEVICE)
    for j in range(1, width):
        state = live.clone()
        accepted = torch.full((num_seqs,), j - 1, dtype=torch.int64, device=DEVICE)
        spec_state_commit_layers_triton(conv, state[None], scratch_conv, rows[None], A_log[None], dt_bias[None],
                                        state_indices, accepted, width)  # fmt: skip
        one = index[:, j : j + 1].contiguous()
        again = gdn_verify_triton(q, k, v, a, b, A_log, dt_bias, state, state_indices, one, torch.empty_like(rows))
        assert torch.equal(again[index[:, j]], full[index[:, j]]), f"token {j}: the replayed state is not the verify's"


def test_the_replayed_state_is_the_verify_kernel_state() -> None:
    _replay_matches_the_verify(2, 4, 16, 16, torch.float32, slots=[2, 0])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_replayed_state_is_the_verify_kernel_state_at_the_27b_shape(dtype: torch.dtype) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    _replay_matches_the_verify(16, 48, 128, 128, dtype, slots=[5, 1, 3])
