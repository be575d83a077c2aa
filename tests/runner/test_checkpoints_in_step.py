"""In-step prefix-cache checkpoints on the runner alone (runner/step_checkpoints.py, docs/prefix-caching.md): a
prefill chunk [0, 100) that saves its state at 64 inside the step leaves in the checkpoint slot what a chunk
[0, 64) saving at its end leaves (every GDN layer's conv window and recurrent state, the first layer's bit for bit;
with the MTP layer the hidden row of 63), while a sequence beside it in the same step asks for none; a sequence
resumed from it continues as from the chunk-end one (tests/kernels/test_gdn_checkpoint.py has the kernel's bits);
positions off the chunk's grid, or two inside one chunk, are refused by name.
fp32 on the CPU, the trained tiny dense / moe / next (and dense with its MTP layer loaded)."""

from __future__ import annotations

import pytest
import torch

from deltaserve.engine.llm import LLM
from deltaserve.sampling_params import SamplingParams
from deltaserve.step import NewRequest, ScheduledSeq, StepPlan
from deltaserve.tiny.trained import trained_model_dir

from .test_checkpoints import _held, _logits

TOKENS = [(11 * i + 5) % 400 + 7 for i in range(100)]
OTHER = [(7 * i + 3) % 300 + 11 for i in range(80)]
P = 64
PARAMS = SamplingParams(temperature=0.0, max_tokens=1)


@pytest.fixture(scope="module", params=["dense", "moe", "next", "dense-mtp"])
def llm(request: pytest.FixtureRequest) -> LLM:
    variant, _, mtp = request.param.partition("-")
    spec = {"speculative_config": {"method": "mtp", "num_speculative_tokens": 1}} if mtp else {}
    engine = LLM(trained_model_dir(variant), dtype="float32", device="cpu", max_model_len=128,
                 async_scheduling=False, **spec)  # fmt: skip
    yield engine
    engine.shutdown()


def _slot_state(llm: LLM, slot: int) -> list[torch.Tensor]:
    model = llm.engine.runner.model
    parts = []
    for layer in model.layers:
        if not layer.is_full_attention:
            parts += [layer.linear_attn.conv_states[slot].clone(), layer.linear_attn.ssm_states[slot].clone()]
    if model.mtp is not None:
        parts.append(model.mtp.slot_hidden[slot].clone())
    return parts


def test_an_in_step_checkpoint_is_the_chunk_end_one(llm: LLM) -> None:
    runner = llm.engine.runner
    block_size = llm.engine.scheduler.blocks.block_size
    tail = len(TOKENS) - P
    with _held(llm, 4, 6, [(len(TOKENS), 0), (len(OTHER), 0), (len(TOKENS), 0), (len(TOKENS), P // block_size)]) as (
        (row_a, row_c, row_e, row_b), (slot_a, slot_c, slot_e, slot_b, inner, end), (blocks_a, blocks_c, blocks_e,
                                                                                    blocks_b),
    ):  # fmt: skip
        # A: [0, 100) in one step saving at 64 inside it; C beside it asks for nothing
        a = ScheduledSeq(row_a, 0, len(TOKENS), slot_a, None, tuple(blocks_a), False, checkpoints=((P, inner),))
        c = ScheduledSeq(row_c, 0, len(OTHER), slot_c, None, tuple(blocks_c), False)
        added = (NewRequest(row_a, "a", tuple(TOKENS), (), PARAMS, ()), NewRequest(row_c, "c", tuple(OTHER), (),
                                                                                  PARAMS, ()))  # fmt: skip
        runner.run(StepPlan(-1, (a, c), added))
        # E: the same tokens, [0, 64) saving at its end, then [64, 100): the logits a resumed sequence must give
        e = ScheduledSeq(row_e, 0, P, slot_e, None, tuple(blocks_e), False, checkpoints=((P, end),))
        runner.run(StepPlan(-1, (e,), (NewRequest(row_e, "e", tuple(TOKENS), (), PARAMS, ()),)))
        rest = ScheduledSeq(row_e, P, tail, slot_e, slot_e, (), False, return_logits=True)
        expected = _logits(runner.run(StepPlan(-1, (rest,))).logits[0], tail)
        # the first GDN layer's conv window and state are the same bits (its inputs are per-row); deeper layers see
        # the other rows' rounding of a 180-row step against a 64-row one (MoE, Next), so within fp32 rounding
        states = zip(_slot_state(llm, inner), _slot_state(llm, end), strict=True)
        for i, (got, want) in enumerate(states):
            if i < 2:
                assert torch.equal(got, want), f"state part {i} of the in-step checkpoint differs from the chunk end's"
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=f"state part {i}")
        # B: resumed over A's KV of [0, 64), from the in-step checkpoint and from the chunk-end one, and E's own
        # continuation: equal up to that rounding
        table = tuple(blocks_a[: P // block_size]) + tuple(blocks_b)
        resumed = []
        for read in (inner, end):
            runner.run(StepPlan(-1, (), removed=(row_b,)))
            b = ScheduledSeq(row_b, P, tail, slot_b, read, table, False, return_logits=True)
            result = runner.run(StepPlan(-1, (b,), (NewRequest(row_b, "b", tuple(TOKENS), (), PARAMS, ()),)))
            resumed.append(_logits(result.logits[0], tail))
        torch.testing.assert_close(resumed[0], resumed[1], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(resumed[0], expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("checkpoints", "message"),
    [
        (((32, 9),), r"position 32 is neither this chunk's end \(100\) nor on its GDN chunk grid"),
        (((64, 9), (65, 10)), r"position 65 is neither"),
        (((0, 9),), r"position 0 is neither"),
        (((64, 9), (64, 10)), r"positions 64 and 64 are both inside the chunk"),
    ],
)
def test_positions_off_the_grid_are_refused(llm: LLM, checkpoints: tuple, message: str) -> None:
    runner = llm.engine.runner
    with _held(llm, 1, 0, [(len(TOKENS), 0)]) as ((row,), _, (blocks,)):
        seq = ScheduledSeq(row, 0, len(TOKENS), 0, None, tuple(blocks), False, checkpoints=checkpoints)
        with pytest.raises(ValueError, match=message):
            runner.run(StepPlan(-1, (seq,), (NewRequest(row, "r", tuple(TOKENS), (), PARAMS, ()),)))
