"""The lone-prefill step budget (Scheduler.lone_prefill_tokens, engine/budget.py step_budgets): a step whose only work
is one prompt's prefill takes the larger budget; a step with a decode, a second prompt, or a prefill-only request in
it keeps max_num_batched_tokens. Read from the plans of the real scheduler with a fake runner."""

from __future__ import annotations

from deltaserve.scheduler.block_manager import BlockManager, StateSlotPool
from deltaserve.scheduler.scheduler import Scheduler
from tests.scheduler.test_scheduler import answer, by_row, seq


def make(budget: int = 8, lone: int = 32, num_blocks: int = 64) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, 4), StateSlotPool(8), 8, budget, 1000, lone_prefill_tokens=lone)


def test_a_prompt_alone_is_chunked_at_the_lone_budget() -> None:
    scheduler = make()
    scheduler.add(seq("a", 70, 3))
    sizes = []
    while True:
        plan = scheduler.schedule()
        sizes.append(plan.num_tokens)
        scheduler.update(plan, answer(plan))
        if plan.seqs[0].needs_sample:
            break
    assert sizes == [32, 32, 6]
    # its decodes are single tokens, as always
    plan = scheduler.schedule()
    assert by_row(scheduler, plan) == [("a", 1)]


def test_without_a_lone_budget_the_same_prompt_takes_the_step_budget() -> None:
    scheduler = Scheduler(BlockManager(64, 4), StateSlotPool(8), 8, 8, 1000)
    assert scheduler.lone_prefill_tokens == 8
    scheduler.add(seq("a", 70, 3))
    plan = scheduler.schedule()
    assert plan.num_tokens == 8


def test_a_second_prompt_or_a_decode_brings_the_step_budget_back() -> None:
    scheduler = make()
    scheduler.add(seq("a", 40, 3))
    scheduler.add(seq("b", 40, 3))
    plan = scheduler.schedule()
    assert plan.num_tokens == 8  # two prompts waiting: the default budget's trade applies
    scheduler = make()
    scheduler.add(seq("a", 5, 10))
    plan = scheduler.schedule()
    scheduler.update(plan, answer(plan))  # a now decodes
    scheduler.add(seq("b", 40, 3))
    plan = scheduler.schedule()
    assert by_row(scheduler, plan) == [("a", 1), ("b", 7)]


def test_a_prompt_arriving_alone_after_others_finished_gets_the_lone_budget_again() -> None:
    scheduler = make()
    scheduler.add(seq("a", 4, 1))
    plan = scheduler.schedule()
    finished = [s.seq_id for s, _, _ in scheduler.update(plan, answer(plan)) if s.is_finished]
    assert finished == ["a"] and not scheduler.running
    scheduler.add(seq("b", 50, 2))
    assert scheduler.schedule().num_tokens == 32


def test_the_lone_budget_is_never_below_the_step_budget() -> None:
    assert make(budget=16, lone=0).lone_prefill_tokens == 16
    assert make(budget=16, lone=4).lone_prefill_tokens == 16


def test_planned_ahead_under_async_scheduling_the_next_chunk_is_lone_too() -> None:
    scheduler = make()
    scheduler.add(seq("a", 70, 3))
    first = scheduler.schedule()
    second = scheduler.schedule()  # planned from the in-flight counters, before the first step's result
    assert (first.num_tokens, second.num_tokens) == (32, 32)
    assert second.seqs[0].num_computed_tokens == 32
