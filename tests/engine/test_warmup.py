"""The GPU start-up warm-up's batches: a step larger than one sequence runs as several (as the scheduler would
batch them), so the warm-up reaches max_num_batched_tokens even when it exceeds max_model_len."""

from __future__ import annotations

from pathlib import Path

import torch

from deltaserve.engine.engine import LLMEngine
from deltaserve.engine_config import EngineConfig
from deltaserve.runner.model_runner import warmup_sequences
from deltaserve.scheduler.batch import ScheduledBatch


def test_warmup_sequences_split_a_step_into_sequences_of_at_most_max_len() -> None:
    sequences = warmup_sequences(100, 40, 16)
    assert [len(s.token_ids) for s in sequences] == [40, 40, 20]
    assert [s.state_slot for s in sequences] == [0, 1, 2]
    assert [s.block_ids for s in sequences] == [[0, 1, 2], [3, 4, 5], [6, 7]]  # disjoint, enough for each
    assert all(
        s.start == 0 and not s.needs_sample and s.positions[0] == list(range(len(s.token_ids))) for s in sequences
    )
    (single,) = warmup_sequences(32, 40, 16)
    assert len(single.token_ids) == 32 and single.block_ids == [0, 1]


def test_a_split_warmup_step_runs_through_the_runner(tiny_moe: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_moe), max_model_len=64, max_num_batched_tokens=160))
    out = engine.runner.execute(ScheduledBatch(warmup_sequences(160, 64, engine.runner.block_size)))
    assert out.sampled == {}  # warm-up rows sample nothing
    states = engine.runner.model.layers[0].mixer.ssm_states
    assert states is not None and torch.isfinite(states[:3]).all() and states[:3].abs().sum() > 0
