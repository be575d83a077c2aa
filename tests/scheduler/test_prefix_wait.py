"""Waiting for an in-flight prefix (scheduler/prefix_wait.py, docs/prefix-caching.md#waiting-for-an-in-flight-prefix),
read from the plans with fake runner results: requests that arrive together with a shared prefix wait for the first
one's checkpoint at the branch point instead of each prefilling the prefix, the queue behind them is not blocked,
nothing starves when the prefill they wait for goes away, and a prompt-logprobs request never waits."""

from __future__ import annotations

import pytest

from deltaserve.scheduler.block_manager import BlockManager, StateSlotPool
from deltaserve.scheduler.prefix_wait import MIN_WAIT_TOKENS
from deltaserve.scheduler.scheduler import Scheduler
from deltaserve.scheduler.sequence import SequenceStatus
from deltaserve.step import StepPlan
from tests.scheduler.test_prefix_cache import A, answer, assert_accounted, make, request


def drive(scheduler: Scheduler, is_async: bool) -> list[tuple[StepPlan, dict[int, str]]]:
    """Runs to the end; async: each step is planned before the previous one's result is collected. Each plan comes
    with its rows' request ids (a finished sequence gives its row back)."""
    plans: list[tuple[StepPlan, dict[int, str]]] = []
    pending: list[StepPlan] = []
    while scheduler.has_unfinished() or pending:
        if scheduler.has_unfinished():
            plan = scheduler.schedule()
            plans.append((plan, {seq.row: seq.seq_id for seq in scheduler.running}))
            pending.append(plan)
        if len(pending) > int(is_async) or not scheduler.has_unfinished():
            done = pending.pop(0)
            scheduler.update(done, answer(done))
    return plans


def prefill_tokens(plans: list[tuple[StepPlan, dict[int, str]]]) -> int:
    """Tokens computed over a run, decodes (one-token chunks past a prompt) left out."""
    return sum(s.num_new_tokens for plan, _ in plans for s in plan.seqs if not s.is_decode)


def suffix(index: int, length: int = 20) -> list[int]:
    return list(range(5000 + 100 * index, 5000 + 100 * index + length))


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_requests_that_arrive_together_wait_for_the_first_ones_branch_checkpoint(is_async: bool) -> None:
    scheduler = make(num_blocks=256, num_slots=16, max_seqs=12, budget=1024)
    group = [request(f"a{i}", A + suffix(i)) for i in range(8)]  # 200 shared tokens + 20 of each: B = 192
    other = request("other", list(range(9000, 9100)))  # shares nothing: admitted behind the waiters
    for seq in [*group, other]:
        scheduler.add(seq)
    plans = drive(scheduler, is_async)
    # step 0: a0 whole (its repeat point R = 192 = B saved inside its chunk, its end 220) and `other`; a1..a7 wait
    first, names = plans[0]
    assert sorted(names[s.row] for s in first.seqs) == ["a0", "other"]
    assert [p for s in first.seqs if names[s.row] == "a0" for p, _ in s.checkpoints] == [192, 220]
    # a1..a7 start at 192 with their 28 own tokens, on the first step planned after step 0 was collected (async:
    # step 1 is planned while step 0 is in flight, and they wait for its pending checkpoint)
    resumed, names = plans[2 if is_async else 1]
    found = sorted((names[s.row], s.num_computed_tokens, s.num_new_tokens) for s in resumed.seqs if not s.is_decode)
    assert found == [(f"a{i}", 192, 28) for i in range(1, 8)]
    assert all(seq.num_cached_tokens == 192 for seq in group[1:]) and group[0].num_cached_tokens == 0
    # 220 + 7 * 28 + 100, where admitting all together computed every prompt whole (8 * 220 + 100)
    assert prefill_tokens(plans) == 220 + 7 * 28 + 100
    assert scheduler.prefix_cache_hits == 7 * 192
    assert_accounted(scheduler)


def test_a_prefill_planned_this_step_is_cut_at_a_waiters_branch_point_off_its_grid() -> None:
    scheduler = make(budget=100)
    scheduler.add(a := request("a", A[:150] + suffix(0)))
    first = scheduler.schedule()  # a: [0, 100)
    scheduler.update(first, answer(first))
    scheduler.add(b := request("b", A[:150] + suffix(1)))  # shares 9 full blocks: B = floor64(144) = 128
    second = scheduler.schedule()
    # a's chunk [100, 170) was planned before b came up (30 tokens of budget left for it): cut at 128, which is off
    # its grid (100 + 64 j), and the 42 tokens it gives back go to no one (b waits)
    ((item,),) = [[s for s in second.seqs if s.row == a.row]]
    assert (item.num_computed_tokens, item.num_new_tokens) == (100, 28)
    assert [p for p, _ in item.checkpoints] == [128]
    assert b.status is SequenceStatus.WAITING and all(s.row != b.row for s in second.seqs)
    scheduler.update(second, answer(second))
    third = scheduler.schedule()
    assert [(s.num_computed_tokens, s.num_new_tokens) for s in third.seqs if s.row == b.row] == [(128, 42)]
    scheduler.update(third, answer(third))
    drive(scheduler, False)
    assert_accounted(scheduler)


def test_a_waiter_is_admitted_next_step_when_the_prefill_it_waits_for_is_aborted_before_the_branch_point() -> None:
    scheduler = make(budget=300, interval=128)
    shared = list(range(1000, 1400))  # 25 full blocks: B = 384
    scheduler.add(a := request("a", shared + suffix(0)))
    scheduler.add(b := request("b", shared + suffix(1)))
    first = scheduler.schedule()
    # a's chunk ends on its periodic target 256 (128 is saved inside it), the 44 tokens left would go to b, which
    # waits for a's 384 instead (a gains that target)
    assert [(s.row, s.num_new_tokens) for s in first.seqs] == [(a.row, 256)] and b.status is SequenceStatus.WAITING
    assert 384 in a.checkpoint_targets
    scheduler.update(first, answer(first))
    scheduler.finish(a)  # aborted before 384: nothing will write b's checkpoint there
    second = scheduler.schedule()
    # b is admitted at once, at the deepest checkpoint a did write
    assert [(s.row, s.num_computed_tokens) for s in second.seqs] == [(b.row, 256)]
    scheduler.update(second, answer(second))
    drive(scheduler, False)
    assert b.status is SequenceStatus.FINISHED
    assert_accounted(scheduler)


def test_a_waiter_ahead_of_a_preempted_prefill_is_admitted_and_the_prefill_then_waits_for_it() -> None:
    scheduler = Scheduler(
        BlockManager(64, 16), StateSlotPool(12), 8, 100, 4000, policy="priority", enable_prefix_caching=True
    )
    scheduler.add(a := request("a", A + suffix(0)))
    first = scheduler.schedule()  # a: [0, 100)
    b = request("b", A + suffix(1))
    b.priority = -1
    scheduler.add(b)  # arrives while a computes the shared 192
    scheduler.update(first, answer(first))
    scheduler.preempt_all()  # before a reaches 192: a goes back behind b (priority order)
    second = scheduler.schedule()
    # b is admitted from 0 (nothing computes its prefix any more); a, behind it, waits for b's 192 in turn
    assert [(s.row, s.num_computed_tokens, s.num_new_tokens) for s in second.seqs] == [(b.row, 0, 100)]
    assert a.status is SequenceStatus.WAITING and scheduler.waiting[0] is a
    scheduler.update(second, answer(second))
    drive(scheduler, False)
    assert scheduler.prefix_cache_hits == 192  # a's second admission (its num_cached_tokens stays its first's, 0)
    assert_accounted(scheduler)


def test_a_prompt_logprobs_request_never_waits() -> None:
    scheduler = make(budget=1024)
    scheduler.add(a := request("a", A + suffix(0)))
    scheduler.add(b := request("b", A + suffix(1), prompt_logprobs=1))
    scheduler.add(c := request("c", A + suffix(2)))
    first = scheduler.schedule()
    items = {s.row: s for s in first.seqs}
    assert set(items) == {a.row, b.row} and c.status is SequenceStatus.WAITING
    assert (items[b.row].num_computed_tokens, items[b.row].num_new_tokens) == (0, 220)
    scheduler.update(first, answer(first))
    drive(scheduler, False)
    assert c.num_cached_tokens == 192 and b.num_cached_tokens == 0


def test_a_shared_prefix_shorter_than_the_minimum_is_not_waited_for() -> None:
    scheduler = make(budget=1024)
    shared = MIN_WAIT_TOKENS - 64  # one GDN chunk
    scheduler.add(a := request("a", A[:shared] + suffix(0, 100)))
    scheduler.add(b := request("b", A[:shared] + suffix(1, 100)))
    first = scheduler.schedule()
    assert {s.row for s in first.seqs} == {a.row, b.row}


def test_a_waiter_admission_does_not_reach_still_gets_its_branch_point_saved() -> None:
    scheduler = make(budget=100)
    scheduler.add(a := request("a", A + suffix(0)))
    scheduler.add(b := request("b", A + suffix(1)))  # B = 192
    first = scheduler.schedule()  # a's chunk [0, 100) takes the whole budget: admission stops before b
    assert [s.row for s in first.seqs] == [a.row] and 192 in a.checkpoint_targets
    scheduler.update(first, answer(first))
    second = scheduler.schedule()  # a's chunk [100, 200) would pass 192 off its grid: cut there
    assert [(s.num_computed_tokens, s.num_new_tokens, [p for p, _ in s.checkpoints]) for s in second.seqs] == [
        (100, 92, [192])
    ]
    scheduler.update(second, answer(second))
    third = scheduler.schedule()
    assert [(s.num_computed_tokens, s.num_new_tokens) for s in third.seqs if s.row == b.row] == [(192, 28)]
    scheduler.update(third, answer(third))
    drive(scheduler, False)
    assert_accounted(scheduler)
