"""--scheduling-policy on the plain-data scheduler (no model): admission order, preemption victims, requeueing.

vLLM's priority policy: the waiting queue is ordered by (priority, arrival), a lower value first; when KV blocks
run out the running request with the highest (priority, arrival) is preempted, even one already chosen for the
step; a preempted request waits again at its place in that order. FCFS is the control: arrival order, the
latest-admitted request preempted and put back at the head of the queue.
"""

from __future__ import annotations

import random

import pytest

from deltaserve.scheduler.block_manager import BlockManager, StateSlotPool
from deltaserve.scheduler.scheduler import Scheduler
from deltaserve.scheduler.sequence import Sequence

from .test_scheduler import answer, fake_step


def make(policy: str, num_blocks: int = 64, block_size: int = 4, max_seqs: int = 8, budget: int = 32) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size), StateSlotPool(8), max_seqs, budget, 1000, policy)


def seq(name: str, num_prompt: int, max_tokens: int, priority: int = 0) -> Sequence:
    return Sequence(name, list(range(num_prompt)), max_tokens, priority=priority)


def admitted(scheduler: Scheduler) -> list[str]:
    """Plans, answers and applies one step; returns the ids the step admitted (added to the runner's table)."""
    plan = scheduler.schedule()
    scheduler.update(plan, answer(plan))
    return [request.req_id for request in plan.added]


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown scheduling policy 'lifo'"):
        make("lifo")


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_admission_order_under_load_with_late_arrivals(policy: str) -> None:
    """60 requests of random priorities, a third arriving while the others run, through 3 running places: no
    step admits a request while one with a smaller key stays waiting (the key: (priority, arrival) under priority,
    arrival under fcfs), and every request finishes."""
    rng = random.Random(7)
    scheduler = make(policy, num_blocks=256, max_seqs=3, budget=24)
    pending = [seq(f"r{i}", rng.randint(2, 9), rng.randint(1, 6), priority=rng.randint(-3, 3)) for i in range(60)]
    seqs = {item.seq_id: item for item in pending}
    order: list[str] = []
    for item in pending[:40]:
        scheduler.add(item)

    def key(item: Sequence) -> tuple[int, int]:
        return item.priority_key if policy == "priority" else (0, item.arrival_index)

    num_steps = 0
    while scheduler.has_unfinished() or len(order) < 60:
        if num_steps % 4 == 0 and len(pending) > 40:
            scheduler.add(pending.pop(40))  # arrives while the queue is full
        step = admitted(scheduler)
        if step and scheduler.waiting:
            assert max(key(seqs[name]) for name in step) < min(key(item) for item in scheduler.waiting)
        order.extend(step)
        num_steps += 1
        assert num_steps < 1000
    assert sorted(order) == sorted(seqs) and all(item.is_finished for item in seqs.values())
    arrival = sorted(seqs, key=lambda name: seqs[name].arrival_index)
    assert (order == arrival) is (policy == "fcfs")  # priorities reorder; under fcfs they are ignored


def test_all_at_once_runs_lowest_value_first_ties_by_arrival() -> None:
    scheduler = make("priority", max_seqs=1)
    for name, priority in (("a", 2), ("b", 0), ("c", -1), ("d", 0), ("e", 2)):
        scheduler.add(seq(name, 3, 2, priority))
    finished: list[str] = []
    while scheduler.has_unfinished():
        finished += fake_step(scheduler)
    assert finished == ["c", "b", "d", "a", "e"]


def run_until_blocks_run_out(policy: str) -> tuple[Scheduler, list[str], list[str]]:
    """b (priority 9) is admitted first, a (priority 0) one step later; with 3 blocks of 4 tokens, a's decode at
    token 4 finds no free block in step 4, after b's decode was already chosen for that step. c (priority 5)
    arrives just before. Each fits the cache alone (3 + 8 tokens). Returns (scheduler, the ids planned in step 4,
    the waiting ids after it)."""
    scheduler = make(policy, num_blocks=3, block_size=4)
    b, a, c = seq("b", 3, 8, priority=9), seq("a", 3, 8, priority=0), seq("c", 3, 8, priority=5)
    scheduler.add(b)
    fake_step(scheduler)  # b: 3 prompt tokens, 1 block
    scheduler.add(a)
    fake_step(scheduler)  # b decodes token 3; a admitted (1 block)
    fake_step(scheduler)  # b decodes token 4 (its 2nd block, the last free one); a decodes token 3
    scheduler.add(c)
    plan = scheduler.schedule()
    rows = {item.row: item.seq_id for item in scheduler.running}
    planned = [rows[item.row] for item in plan.seqs]
    scheduler.update(plan, answer(plan))
    return scheduler, planned, [item.seq_id for item in scheduler.waiting]


def test_priority_preempts_the_highest_value_even_when_already_planned() -> None:
    scheduler, planned, waiting = run_until_blocks_run_out("priority")
    # b was chosen before a ran out of blocks: it leaves the plan, its blocks go to a; b waits behind c (5 < 9)
    assert planned == ["a"] and waiting == ["c", "b"]
    assert [item.seq_id for item in scheduler.running] == ["a"] and scheduler.num_preemptions_total == 1
    assert scheduler.blocks.num_free_blocks == 3 - 2  # a holds 2 blocks, b's 2 went back
    finished: list[str] = []
    for _ in range(100):
        finished += fake_step(scheduler)
    assert finished == ["a", "c", "b"]
    assert scheduler.blocks.num_free_blocks == 3 and scheduler.slots.num_free_slots == 8


def test_fcfs_preempts_the_latest_admitted_and_requeues_it_first() -> None:
    scheduler, planned, waiting = run_until_blocks_run_out("fcfs")
    # a (admitted last) is the victim whatever its priority; it goes back to the head of the queue
    assert planned == ["b"] and waiting == ["a", "c"]
    assert [item.seq_id for item in scheduler.running] == ["b"] and scheduler.num_preemptions_total == 1
