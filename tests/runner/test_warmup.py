"""The GPU start-up warm-up's plans: a step larger than one sequence runs as several (as the scheduler would
batch them), so the warm-up reaches max_num_batched_tokens even when it exceeds max_model_len."""

from __future__ import annotations

from pathlib import Path

import torch

from deltaserve.engine.engine import LLMEngine
from deltaserve.engine_config import EngineConfig
from deltaserve.runner.memory import warmup_plan
from deltaserve.step import StepPlan


def test_warmup_plan_splits_a_step_into_sequences_of_at_most_max_len() -> None:
    plan = warmup_plan(0, 100, 40, 16, 1000)
    assert [s.num_new_tokens for s in plan.seqs] == [40, 40, 20]
    assert [s.write_slot for s in plan.seqs] == [0, 1, 2] and [r.row for r in plan.added] == [0, 1, 2]
    assert [s.new_block_ids for s in plan.seqs] == [(0, 1, 2), (3, 4, 5), (6, 7)]  # disjoint, enough for each
    assert all(s.num_computed_tokens == 0 and s.read_slot is None and not s.needs_sample for s in plan.seqs)
    assert [len(r.prompt_token_ids) for r in plan.added] == [40, 40, 20]
    (single,) = warmup_plan(0, 32, 40, 16, 1000).seqs
    assert single.num_new_tokens == 32 and single.new_block_ids == (0, 1)


def test_a_split_warmup_step_runs_through_the_runner(tiny_moe: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_moe), max_model_len=64, max_num_batched_tokens=160))
    runner = engine.runner
    result = runner.run(warmup_plan(0, 160, 64, runner.block_size, runner.vocab_size))
    assert result.token_ids == ((), (), ())  # warm-up rows sample nothing
    runner.execute(StepPlan(1, (), removed=(0, 1, 2)))
    assert runner.table.num_active == 0
    states = runner.model.layers[0].mixer.ssm_states
    assert states is not None and torch.isfinite(states[:3]).all() and states[:3].abs().sum() > 0
