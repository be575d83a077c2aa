"""LLM.prefill_logits: one prefill-only request through the scheduler and the runner, on the tiny checkpoint (fp32).

Its logits must equal, bit for bit, what the runner computes for the plans EngineCore.score used to build by hand
(blocks, slot and row taken behind the scheduler's back): one ScheduledSeq per chunk, then one-token chunks. The
scheduler now plans those chunks itself, so the blocks, slot and row it took come back when the request ends.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deltaserve.engine.engine import LLMEngine
from deltaserve.engine.llm import LLM
from deltaserve.sampling_params import SamplingParams
from deltaserve.step import NewRequest, ScheduledSeq, StepPlan

TOKENS = [(7 * i + 3) % 500 + 5 for i in range(40)]
BUDGET = 16  # max_num_batched_tokens: one chunk of all 40 tokens, and the 17-token chunk, exceed it


def logits_by_hand(engine: LLMEngine, token_ids: list[int], chunks: list[int]) -> torch.Tensor:
    """The runner driven with hand-built plans, as EngineCore.score drove it (idle engine, all blocks up front)."""
    scheduler = engine.scheduler
    blocks = scheduler.blocks.allocate(scheduler.blocks.blocks_needed(len(token_ids), 0))
    slot, row = scheduler.slots.allocate(), scheduler.rows.allocate()
    params = SamplingParams(temperature=0.0, max_tokens=1)
    added = (NewRequest(row, "by-hand", tuple(token_ids), (), params, ()),)
    pieces, start = [], 0
    try:
        for index, size in enumerate(chunks):
            seq = ScheduledSeq(row, start, size, slot, slot if start else None, tuple(blocks) if index == 0 else (),
                               False, return_logits=True)  # fmt: skip
            result = engine.runner.run(StepPlan(-1, (seq,), added if index == 0 else ()))
            pieces.append(torch.frombuffer(bytearray(result.logits[0]), dtype=torch.float32).view(size, -1))
            start += size
    finally:
        engine.runner.run(StepPlan(-1, (), removed=(row,)))
        scheduler.blocks.free(blocks)
        scheduler.slots.free(slot)
        scheduler.rows.free(row)
    return torch.cat(pieces)


@pytest.fixture(scope="module", params=["async", "sync"])
def llm(tiny_dense: Path, request: pytest.FixtureRequest) -> LLM:
    return LLM(tiny_dense, dtype="float32", device="cpu", max_model_len=64, max_num_batched_tokens=BUDGET,
               async_scheduling=request.param == "async")  # fmt: skip


@pytest.mark.parametrize("chunks", [None, [13, 17], [16, 16, 8], [4]])
def test_logits_equal_the_hand_built_plans(llm: LLM, chunks: list[int] | None) -> None:
    # a generate first: the engine has used rows, blocks and slots, and async scheduling leaves a step behind
    llm.generate([{"prompt_token_ids": TOKENS[:10]}], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    engine = llm.engine
    free_blocks = engine.scheduler.blocks.num_free_blocks
    ours = llm.prefill_logits(TOKENS, chunks)
    assert ours.shape == (len(TOKENS), engine.model_config.vocab_size) and ours.dtype == torch.float32
    assert not engine.has_unfinished()
    assert engine.scheduler.blocks.num_free_blocks == free_blocks  # the scheduler took and gave back its blocks
    given = list(chunks or [len(TOKENS)])
    expected = logits_by_hand(engine, TOKENS, given + [1] * (len(TOKENS) - sum(given)))
    assert torch.equal(ours, expected)


def test_prefill_logits_refuses_what_it_cannot_run(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"prefill chunks \[30, 20\] do not fit 40 tokens"):
        llm.prefill_logits(TOKENS, [30, 20])
    with pytest.raises(ValueError, match="1 to 64 tokens, got 65"):
        llm.prefill_logits([5] * 65)
    engine = llm.engine
    engine.add_request("busy", TOKENS[:5], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="idle engine"):
        llm.prefill_logits(TOKENS)
    engine.abort_request("busy")
    assert llm.prefill_logits(TOKENS[:8]).shape[0] == 8
