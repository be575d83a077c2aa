"""The hybrid prefix cache in the scheduler (docs/prefix-caching.md), driven with fake runner results: no model."""

from __future__ import annotations

import pytest

from deltaserve.engine_config import EngineConfig
from deltaserve.sampling_params import SamplingParams
from deltaserve.scheduler.block_manager import BlockManager, StateSlotPool
from deltaserve.scheduler.scheduler import Scheduler
from deltaserve.scheduler.sequence import Sequence
from deltaserve.step import StepPlan, StepResult


def answer(plan: StepPlan, next_token: int = 7) -> StepResult:
    """A fake runner: every sequence whose chunk reaches its end 'samples' next_token."""
    return StepResult(plan.step_id, tuple((next_token,) if s.needs_sample else () for s in plan.seqs))


def test_engine_config_turns_the_cache_on_by_default_and_checks_its_fields() -> None:
    config = EngineConfig("m")
    assert config.enable_prefix_caching and config.num_checkpoint_slots is None
    assert config.prefix_cache_checkpoint_interval == 8192
    with pytest.raises(ValueError, match="prefix_cache_checkpoint_interval must be 0"):
        EngineConfig("m", prefix_cache_checkpoint_interval=-64)
    with pytest.raises(ValueError, match="num_checkpoint_slots must be at least 0"):
        EngineConfig("m", num_checkpoint_slots=-1)


def test_with_the_cache_off_nothing_is_looked_up_or_saved() -> None:
    scheduler = Scheduler(BlockManager(64, 16), StateSlotPool(8), 4, 256, 1000, enable_prefix_caching=False)
    for index in range(3):
        scheduler.add(Sequence(f"r{index}", list(range(200)), 2, sampling=SamplingParams(temperature=0.0)))
        while scheduler.has_unfinished():
            plan = scheduler.schedule()
            assert all(not s.checkpoints and s.num_computed_tokens in (0, 200, 201) for s in plan.seqs)
            scheduler.update(plan, answer(plan))
    assert scheduler.prefix_cache_queries == scheduler.prefix_cache_hits == 0
    assert scheduler.blocks.num_free_blocks == 64 and scheduler.slots.num_free_slots == 8
    assert scheduler.reset_prefix_cache()
