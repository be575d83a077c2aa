"""spec_state_commit_layers_triton (kernels/gdn_spec_commit_triton.py, the verify step's commit over every GDN layer
in one launch) against its twin spec_state_commit_layers_ref, which is the per-layer spec_state_commit: whole state
tensors bit-equal afterwards (a copy; every slot the commit must not touch keeps its NaN poison or its old value),
padded sequences (slot -1), every accepted count 0 .. W - 1, a step narrower than the scratch, a one-column step
(no recurrent copy), and the stacking of per-layer views (runner/spec_commit.py) that lets the runner call it. Under
TRITON_INTERPRET=1 on the CPU in fp32, and on the GPU at the 27B's per-layer state shape in bf16 / fp32."""

from __future__ import annotations

import pytest
import torch

from deltaserve.kernels import spec_state_commit_layers
from deltaserve.kernels.gdn_spec import spec_state_commit_layers_ref
from deltaserve.kernels.gdn_spec_commit_triton import spec_state_commit_layers_triton
from deltaserve.runner.spec_commit import stack_views

from ._util import DEVICE, randn


def _tensors(layers: int, slots: int, seqs: int, width: int, conv: tuple[int, int], ssm: tuple[int, int, int],
             dtype: torch.dtype) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """States [L, slots, ...] with slot 0 NaN (a slot no live sequence commits to: any write there shows), scratch
    [L, seqs + 1, width, ...] random (one spare sequence)."""
    conv_states = randn(layers, slots, *conv, dtype=dtype)
    ssm_states = randn(layers, slots, *ssm, dtype=torch.float32)
    conv_states[:, 0] = float("nan")
    ssm_states[:, 0] = float("nan")
    scratch_conv = randn(layers, seqs + 1, width, *conv, dtype=dtype)
    scratch_ssm = randn(layers, seqs + 1, width - 1, *ssm, dtype=torch.float32)
    return conv_states, ssm_states, scratch_conv, scratch_ssm


def _check(
    accepted: list[int],
    slots: list[int],
    width: int,
    scratch_width: int,
    dtype: torch.dtype,
    conv: tuple[int, int] = (3, 40),
    ssm: tuple[int, int, int] = (2, 8, 8),
    layers: int = 3,
) -> None:
    num_slots = max(slots) + 2
    tensors = _tensors(layers, num_slots, len(slots), scratch_width, conv, ssm, dtype)
    index = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    num_accepted = torch.tensor(accepted, dtype=torch.int64, device=DEVICE)
    ref = [t.clone() for t in tensors]
    spec_state_commit_layers_ref(*ref, index, num_accepted, width)
    out = [t.clone() for t in tensors]
    spec_state_commit_layers_triton(*out, index, num_accepted, width)
    for name, r, o in zip(("conv_states", "ssm_states"), ref[:2], out[:2], strict=True):
        assert torch.equal(r.isnan(), o.isnan()), f"{name}: a slot written or left unlike the twin"
        assert torch.equal(r.nan_to_num(), o.nan_to_num()), f"{name}: differs from the twin"
    for r, o in zip(ref[2:], out[2:], strict=True):
        assert torch.equal(r, o), "the scratch is read only"
    # the twin itself: what it wrote is the scratch entry of the accepted count, and nothing else moved
    conv_states, ssm_states, scratch_conv, scratch_ssm = tensors
    for s, (a, slot) in enumerate(zip(accepted, slots, strict=True)):
        if slot < 0:
            continue
        assert torch.equal(ref[0][:, slot], scratch_conv[:, s, min(a, scratch_width - 1)])
        expected = scratch_ssm[:, s, a] if a < width - 1 else ssm_states[:, slot]  # in place: as it was (NaN at 0)
        assert torch.equal(ref[1][:, slot].nan_to_num(), expected.nan_to_num())
        assert torch.equal(ref[1][:, slot].isnan(), expected.isnan())
    untouched = [i for i in range(num_slots) if i not in slots]
    assert torch.equal(ref[1][:, untouched].isnan(), ssm_states[:, untouched].isnan())


@pytest.mark.parametrize("accepted", [[0, 1, 2, 3], [3, 3, 0, 1], [2, 0, 3, 1]])
def test_commit_layers_equals_the_per_layer_twin(accepted: list[int]) -> None:
    _check(accepted, slots=[4, 1, 6, 2], width=4, scratch_width=4, dtype=torch.float32)


def test_padded_sequences_commit_nothing() -> None:
    _check([1, 0, 2, 3], slots=[-1, 3, -1, 5], width=4, scratch_width=4, dtype=torch.float32)


def test_a_step_narrower_than_the_scratch_copies_its_own_entries() -> None:
    # a deferred step's chunks are 2 wide in a scratch built for 1 + 3: accepted 1 = the last column, in place
    _check([0, 1, 1], slots=[2, 5, 1], width=2, scratch_width=4, dtype=torch.float32)


def test_a_one_column_step_copies_no_recurrent_state() -> None:
    _check([0, 0], slots=[3, 1], width=1, scratch_width=4, dtype=torch.float32)


def test_a_state_longer_than_one_block_is_copied_whole() -> None:
    # 2 x 48 x 48 = 4,608 recurrent elements and 3 x 1,000 conv elements: several blocks of each
    _check([1, 2], slots=[1, 3], width=4, scratch_width=4, dtype=torch.float32, conv=(3, 1000), ssm=(2, 48, 48))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_commit_layers_at_the_27b_state_shape(dtype: torch.dtype) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    # the 27B's GDN layer: conv window 3 x 10,240, recurrent state 48 x 128 x 128 (fp32)
    _check([3, 0, 2, 1, 3], slots=[7, -1, 2, 4, 0], width=4, scratch_width=4, dtype=dtype, conv=(3, 10240),
           ssm=(48, 128, 128), layers=4)  # fmt: skip


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
    tensors = [t.clone() for t in _tensors(2, 4, 2, 4, (3, 8), (2, 4, 4), torch.float32)]
    expected = [t.clone() for t in tensors]
    index = torch.tensor([1, 3], dtype=torch.int32)
    accepted = torch.tensor([0, 2])
    spec_state_commit_layers(*tensors, index, accepted, 4)
    spec_state_commit_layers_ref(*expected, index, accepted, 4)
    for t, e in zip(tensors, expected, strict=True):
        assert torch.equal(t.nan_to_num(), e.nan_to_num())
