"""The chunked GDN prefill's in-step checkpoints (docs/prefix-caching.md#where-states-are-saved): the state stored
at the start of a sequence's chunk c equals, bit for bit, the final state of a separate prefill of that sequence's
first 64·c tokens (from the same initial state), for the Triton kernel and for its torch twin; the two twins agree;
asking for a checkpoint changes neither the outputs nor the final states; a sequence without a request writes no
other slot. Runs under TRITON_INTERPRET=1 at fp32 on the CPU; bf16 and fp32 on CUDA (`gpu`)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from deltaserve.kernels.gdn import gdn_prefill_ref
from deltaserve.kernels.gdn_triton import CHUNK, gdn_prefill_triton

from ._util import DEVICE, DTYPES, assert_close, poisoned_empty, randn, tolerance, varlen_starts
from .test_gdn import _inputs

LENGTHS = [150, 70, 130]  # three sequences: a request at chunk 2, none, a request at chunk 1
HAS_INIT = [True, True, False]
CHUNKS = [2, -1, 1]


def _run(
    op: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...], states: torch.Tensor, slots: torch.Tensor,
    with_checkpoints: bool, ckpt_slots: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    q, k, v, a, b, A_log, dt_bias = inputs
    qsl = varlen_starts(LENGTHS)
    init = torch.tensor(HAS_INIT, device=DEVICE)
    extra = {}
    if with_checkpoints:
        extra = {"checkpoint_chunks": torch.tensor(CHUNKS, dtype=torch.int32, device=DEVICE),
                 "checkpoint_slots": ckpt_slots}  # fmt: skip
    with poisoned_empty():
        return op(q, k, v, a, b, A_log, dt_bias, states, qsl, slots, init, **extra)


def _alone(
    op: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...], states: torch.Tensor, seq: int, slot: int
) -> torch.Tensor:
    """The final state of a prefill of only the first 64·CHUNKS[seq] tokens of sequence `seq`, from its slot."""
    start = sum(LENGTHS[:seq])
    length = CHUNK * CHUNKS[seq]
    q, k, v, a, b, A_log, dt_bias = inputs
    parts = (t[start : start + length] for t in (q, k, v, a, b))
    states = states.clone()
    slot_t = torch.tensor([slot], dtype=torch.int32, device=DEVICE)
    init = torch.tensor([HAS_INIT[seq]], device=DEVICE)
    op(*parts, A_log, dt_bias, states, varlen_starts([length]), slot_t, init)
    return states[slot]


@pytest.mark.parametrize("dtype", DTYPES)
def test_in_step_checkpoint_is_a_shorter_prefills_final_state(dtype: torch.dtype) -> None:
    hk, hv, dk, dv = 1, 2, 32, 32
    inputs = _inputs(sum(LENGTHS), hk, hv, dk, dv, dtype)
    num_slots = 8
    initial = randn(num_slots, hv, dk, dv, scale=0.1)
    slots = torch.tensor([3, 5, 1], dtype=torch.int32, device=DEVICE)
    ckpt_slots = torch.tensor([6, 0, 2], dtype=torch.int32, device=DEVICE)  # sequence 1's is unread (-1 chunk)
    saved = {}
    for name, op in (("kernel", gdn_prefill_triton), ("ref", gdn_prefill_ref)):
        plain = initial.clone()
        out_plain = _run(op, inputs, plain, slots, False, ckpt_slots)
        states = initial.clone()
        out = _run(op, inputs, states, slots, True, ckpt_slots)
        # the request changes nothing else: outputs and final states are the same bits, slot 0 (sequence 1's
        # unread checkpoint slot) and every other slot untouched
        assert torch.equal(out, out_plain), name
        for slot in (3, 5, 1, 0, 4, 7):
            assert torch.equal(states[slot], plain[slot]), f"{name}: slot {slot}"
        for seq, dest in ((0, 6), (2, 2)):
            alone = _alone(op, inputs, initial, seq, int(slots[seq]))
            assert torch.equal(states[dest], alone), f"{name}: sequence {seq}'s checkpoint differs from a prefill"
            assert not torch.equal(states[dest], initial[dest])
            saved[name, seq] = states[dest]
    for seq in (0, 2):
        assert_close(f"seq {seq}", saved["ref", seq], saved["kernel", seq], tolerance(dtype, fp32=2e-5, low=2e-2))
