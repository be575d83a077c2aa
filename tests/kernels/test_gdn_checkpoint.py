"""The chunked GDN prefill's in-step checkpoints (docs/prefix-caching.md#where-states-are-saved): the state stored
at the start of a sequence's chunk c equals, bit for bit, the final state of a separate prefill of that sequence's
first 64·c tokens (from the same initial state), for the Triton kernel and for its torch twin; the two twins agree;
asking for a checkpoint changes neither the outputs nor the final states; a sequence without a request writes no
other slot. Runs under TRITON_INTERPRET=1 at fp32 on the CPU; bf16 and fp32 on CUDA, and at the served head shapes
(`gpu`)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from deltaserve.kernels.gdn import gdn_prefill_ref
from deltaserve.kernels.gdn_triton import CHUNK, gdn_prefill_triton

from ._util import DEVICE, DTYPES, assert_close, poisoned_empty, randn, tolerance, varlen_starts
from .test_gdn import _inputs

# three sequences: a request at chunk 2, none, a request at chunk 1
LENGTHS, HAS_INIT, CHUNKS = [150, 70, 130], [True, True, False], [2, -1, 1]
SLOTS, CKPT_SLOTS = [3, 5, 1], [6, 0, 2]  # sequence 1's checkpoint slot (0) is never read: its chunk is -1


def _run(
    op: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...], states: torch.Tensor, case: tuple,
    with_checkpoints: bool,
) -> torch.Tensor:  # fmt: skip
    lengths, has_init, chunks, slots, ckpt_slots = case
    q, k, v, a, b, A_log, dt_bias = inputs
    qsl = varlen_starts(lengths)
    init = torch.tensor(has_init, device=DEVICE)
    slots_t = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    extra = {}
    if with_checkpoints:
        extra = {"checkpoint_chunks": torch.tensor(chunks, dtype=torch.int32, device=DEVICE),
                 "checkpoint_slots": torch.tensor(ckpt_slots, dtype=torch.int32, device=DEVICE)}  # fmt: skip
    with poisoned_empty():
        return op(q, k, v, a, b, A_log, dt_bias, states, qsl, slots_t, init, **extra)


def _alone(
    op: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...], states: torch.Tensor, case: tuple, seq: int
) -> torch.Tensor:
    """The final state of a prefill of only the first 64·chunks[seq] tokens of sequence `seq`, from its slot."""
    lengths, has_init, chunks, slots, _ = case
    start = sum(lengths[:seq])
    length = CHUNK * chunks[seq]
    q, k, v, a, b, A_log, dt_bias = inputs
    parts = (t[start : start + length] for t in (q, k, v, a, b))
    states = states.clone()
    slot_t = torch.tensor([slots[seq]], dtype=torch.int32, device=DEVICE)
    init = torch.tensor([has_init[seq]], device=DEVICE)
    op(*parts, A_log, dt_bias, states, varlen_starts([length]), slot_t, init)
    return states[slots[seq]]


def _check(heads: tuple[int, int, int, int], case: tuple, dtype: torch.dtype, num_slots: int) -> None:
    """Both twins: the checkpoint is the shorter prefill's final state, bit for bit, and changes nothing else; the
    twins' checkpoints agree."""
    hk, hv, dk, dv = heads
    lengths, _, chunks, slots, ckpt_slots = case
    inputs = _inputs(sum(lengths), hk, hv, dk, dv, dtype)
    initial = randn(num_slots, hv, dk, dv, scale=0.1)
    requested = [(seq, ckpt_slots[seq]) for seq, chunk in enumerate(chunks) if chunk >= 1]
    saved = {}
    for name, op in (("kernel", gdn_prefill_triton), ("ref", gdn_prefill_ref)):
        plain = initial.clone()
        out_plain = _run(op, inputs, plain, case, False)
        states = initial.clone()
        out = _run(op, inputs, states, case, True)
        # the request changes nothing else: outputs and final states are the same bits, and every slot but the
        # requested checkpoints' (an unread checkpoint slot among them) untouched
        assert torch.equal(out, out_plain), name
        for slot in set(range(num_slots)) - {dest for _, dest in requested}:
            assert torch.equal(states[slot], plain[slot]), f"{name}: slot {slot}"
        for seq, dest in requested:
            alone = _alone(op, inputs, initial, case, seq)
            if name == "kernel" or DEVICE.type == "cpu":
                assert torch.equal(states[dest], alone), f"{name}: sequence {seq}'s checkpoint differs from a prefill"
            else:  # the twin's batched GEMMs over another chunk count may take another cuBLAS kernel on the GPU
                assert_close(f"{name}: seq {seq}", alone, states[dest], 1e-6)
            assert not torch.equal(states[dest], initial[dest])
            saved[name, seq] = states[dest]
    for seq, _ in requested:
        assert_close(f"seq {seq}", saved["ref", seq], saved["kernel", seq], tolerance(dtype, fp32=2e-5, low=2e-2))


@pytest.mark.parametrize("dtype", DTYPES)
def test_in_step_checkpoint_is_a_shorter_prefills_final_state(dtype: torch.dtype) -> None:
    _check((1, 2, 32, 32), (LENGTHS, HAS_INIT, CHUNKS, SLOTS, CKPT_SLOTS), dtype, num_slots=8)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_in_step_checkpoint_at_the_served_heads(dtype: torch.dtype) -> None:
    """The 35B-A3B layer's heads (16 key, 32 value, 128 x 128: the scan's two dk halves), a 1,000-token prefill
    saving at chunk 9 (576) beside a 700-token one without a request and a 300-token one saving at chunk 4."""
    case = ([1000, 700, 300], [True, False, True], [9, -1, 4], [2, 0, 5], [4, 1, 3])
    _check((16, 32, 128, 128), case, dtype, num_slots=6)
