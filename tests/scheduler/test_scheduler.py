"""Scheduler unit tests: the real scheduler driven with fake runner results (no model, no tensors).

Plans are plain data (deltaserve/step.py); a fake runner answers each with the token it "sampled".
"""

from __future__ import annotations

import pickle
import random

import pytest

from deltaserve.sampling_params import SamplingParams
from deltaserve.scheduler.block_manager import BlockManager, StateSlotPool
from deltaserve.scheduler.scheduler import Scheduler
from deltaserve.scheduler.sequence import Sequence, SequenceStatus
from deltaserve.step import StepPlan, StepResult


def make_scheduler(num_blocks: int = 64, block_size: int = 4, num_slots: int = 8, max_seqs: int = 8,
                   budget: int = 32, max_model_len: int = 1000) -> Scheduler:  # fmt: skip
    return Scheduler(BlockManager(num_blocks, block_size), StateSlotPool(num_slots), max_seqs, budget, max_model_len)


def seq(name: str, num_prompt: int, max_tokens: int, **params: object) -> Sequence:
    return Sequence(name, list(range(num_prompt)), max_tokens, sampling=SamplingParams(**params))


def answer(plan: StepPlan, next_token: int = 7) -> StepResult:
    """A fake runner: every sequence whose chunk reaches its end 'samples' next_token."""
    return StepResult(plan.step_id, tuple((next_token,) if s.needs_sample else () for s in plan.seqs))


def fake_step(scheduler: Scheduler, next_token: int = 7) -> list[str]:
    """Plans, answers and applies one step; returns the ids of the sequences that finished in it."""
    plan = scheduler.schedule()
    return [s.seq_id for s, _, _ in scheduler.update(plan, answer(plan, next_token)) if s.is_finished]


def by_row(scheduler: Scheduler, plan: StepPlan) -> list[tuple[str, int]]:
    rows = {s.row: s.seq_id for s in scheduler.running}
    return [(rows[s.row], s.num_new_tokens) for s in plan.seqs]


def test_max_num_seqs_larger_than_slot_pool_names_both_numbers() -> None:
    with pytest.raises(ValueError, match=r"max_num_seqs \(9\).*\(8\)"):
        make_scheduler(num_slots=8, max_seqs=9)


def test_the_plan_is_plain_picklable_data() -> None:
    scheduler = make_scheduler()
    scheduler.add(seq("a", 5, 3, temperature=0.5, seed=3, stop=["x"]))
    plan = scheduler.schedule()
    assert pickle.loads(pickle.dumps(plan)) == plan
    (added,) = plan.added
    assert added.prompt_token_ids == (0, 1, 2, 3, 4) and added.sampling.seed == 3
    (item,) = plan.seqs
    assert item.read_slot is None and item.row == added.row
    assert item.new_block_ids == (0, 1) and item.num_draft_tokens == 0 and item.checkpoints == ()
    result = answer(plan)
    assert pickle.loads(pickle.dumps(result)) == result


def test_chunked_prefill_respects_budget_and_mixes_decodes() -> None:
    scheduler = make_scheduler(budget=10)
    for item in (seq("a", 3, 5), seq("b", 25, 2)):
        scheduler.add(item)
    plan = scheduler.schedule()
    assert by_row(scheduler, plan) == [("a", 3), ("b", 7)]
    assert plan.seqs[0].needs_sample and not plan.seqs[1].needs_sample
    scheduler.update(plan, answer(plan))
    plan = scheduler.schedule()
    # the decode of a comes first, then b's next chunk, within the budget of 10
    assert by_row(scheduler, plan) == [("a", 1), ("b", 9)]
    assert plan.seqs[0].is_decode and not plan.seqs[1].is_decode
    assert plan.seqs[1].num_computed_tokens == 7 and plan.seqs[1].read_slot == plan.seqs[1].write_slot
    assert plan.num_tokens <= 10
    # the second plan sends only the blocks b gained: a holds block 0, b's first 7 tokens blocks 1-2, 16 need 4
    assert plan.seqs[1].new_block_ids == (3, 4) and plan.seqs[0].new_block_ids == () and plan.added == ()


def test_async_planning_counts_tokens_in_flight() -> None:
    """Step N+1 is planned before step N's result: the pending sampled token is planned as the next decode, and
    update() advances computed counts only when the result comes back."""
    scheduler = make_scheduler(budget=8)
    a = seq("a", 6, 4)
    scheduler.add(a)
    first = scheduler.schedule()
    assert [(s.num_computed_tokens, s.num_new_tokens, s.needs_sample) for s in first.seqs] == [(0, 6, True)]
    second = scheduler.schedule()
    assert [(s.num_computed_tokens, s.num_new_tokens, s.needs_sample) for s in second.seqs] == [(6, 1, True)]
    assert a.num_computed_tokens == 0 and a.num_inflight_tokens == 7 and a.output_token_ids == []
    scheduler.update(first, answer(first, 11))
    assert a.num_computed_tokens == 6 and a.output_token_ids == [11]
    scheduler.update(second, answer(second, 12))
    assert a.num_computed_tokens == 7 and a.output_token_ids == [11, 12] and a.num_inflight_tokens == 0


def test_a_length_capped_sequence_is_not_planned_past_its_last_token() -> None:
    scheduler = make_scheduler()
    a = seq("a", 4, 1)
    scheduler.add(a)
    first = scheduler.schedule()
    assert scheduler.schedule().is_empty  # its one output is in flight: nothing more to compute
    (done,) = scheduler.update(first, answer(first))
    assert done[0] is a and a.finish_reason == "length"


def test_stale_results_are_dropped_after_a_finish_or_a_preemption() -> None:
    scheduler = make_scheduler(budget=16)
    a, b = seq("a", 3, 100, min_tokens=0), seq("b", 3, 100)
    scheduler.add(a)
    scheduler.add(b)
    first = scheduler.schedule()
    second = scheduler.schedule()  # both decode again, planned before the first result
    a.eos_token_ids = frozenset({5})
    scheduler.update(first, answer(first, 5))  # a stops on eos; b gets 5
    assert a.is_finished and a.finish_reason == "stop" and b.output_token_ids == [5]
    assert scheduler.num_preemptions_total == 0
    scheduler.preempt_all()  # b's in-flight decode is now stale too
    touched = scheduler.update(second, answer(second, 9))
    assert touched == [] and a.output_token_ids == [5] and b.output_token_ids == [5]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.num_inflight_tokens == 0
    plan = scheduler.schedule()
    (added,) = plan.added
    # the resumed sequence is re-added with its outputs as prompt tokens, and its old row was removed first
    assert added.prompt_token_ids == (0, 1, 2, 5) and added.output_token_ids == (5,)
    assert sorted(plan.removed) == [0, 1]


def test_preemption_by_recompute_frees_and_restarts() -> None:
    scheduler = make_scheduler(num_blocks=6, block_size=4, budget=64)
    seqs = {name: seq(name, 8, 100) for name in "ab"}
    for item in seqs.values():
        scheduler.add(item)
    fake_step(scheduler)  # both prefilled: 2 blocks each, 2 free
    for _ in range(8):
        fake_step(scheduler)
    assert scheduler.num_preemptions_total >= 1
    assert seqs["b"].num_preemptions >= 1 and seqs["a"].num_preemptions == 0
    # a preempted sequence restarts from zero with its output tokens kept (recompute)
    assert all(s.num_computed_tokens <= s.num_tokens for s in seqs.values())


def test_a_prompt_waits_for_room_for_all_of_it_instead_of_being_preempted_part_way() -> None:
    """Long prompts into a cache that holds two of them, prefilled in chunks beside decodes: a third is admitted
    only once its whole prompt fits beside what the running ones' tokens still need, so nothing is preempted and
    no token is computed twice (admitted on its first chunk's room, it filled the free blocks, the running
    decodes then needed them, and as the latest admitted it was preempted and recomputed from zero, again and
    again: the 27B's 16K prompts at c16 on an H100)."""
    scheduler = make_scheduler(num_blocks=30, block_size=4, num_slots=4, max_seqs=4, budget=8)
    seqs = [seq(name, 40, 16) for name in "abcd"]  # 14 blocks each at the end: two fit in 30, not three
    for item in seqs:
        scheduler.add(item)
    computed = steps = 0
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        computed += plan.num_tokens
        scheduler.update(plan, answer(plan))
        steps += 1
        assert steps < 500
    assert scheduler.num_preemptions_total == 0
    assert computed == sum(item.num_tokens - 1 for item in seqs)  # every prompt token and output but the last once
    assert all(len(item.output_token_ids) == 16 for item in seqs)
    assert scheduler.blocks.num_free_blocks == scheduler.blocks.num_blocks


def test_a_prompt_that_fits_whole_is_admitted_beside_a_running_prefill() -> None:
    """The rule counts what the running sequences still need, not more: a short prompt that fits beside the rest of
    a long prefill starts in the same step."""
    scheduler = make_scheduler(num_blocks=16, block_size=4, budget=28)
    long, short = seq("long", 40, 2), seq("short", 8, 2)
    scheduler.add(long)
    scheduler.add(short)
    plan = scheduler.schedule()  # long takes the whole budget
    assert by_row(scheduler, plan) == [("long", 28)]
    scheduler.update(plan, answer(plan))
    scheduler.add(seq("big", 40, 2))  # 10 blocks: beside long's 10 and short's 2, 4 are left
    plan = scheduler.schedule()
    assert by_row(scheduler, plan) == [("long", 12), ("short", 8)]  # big waits, 8 tokens of budget unused
    assert scheduler.num_waiting == 1 and scheduler.num_waiting_for_capacity == 1


def test_abort_anywhere_frees_everything() -> None:
    scheduler = make_scheduler(budget=8)
    seqs = {f"s{i}": seq(f"s{i}", 10, 4) for i in range(4)}
    for item in seqs.values():
        scheduler.add(item)
    fake_step(scheduler)
    for item in seqs.values():
        scheduler.finish(item)
    assert scheduler.blocks.num_free_blocks == scheduler.blocks.num_blocks
    assert scheduler.slots.num_free_slots == scheduler.slots.num_slots
    assert scheduler.rows.num_free == scheduler.rows.num_ids
    assert not scheduler.has_unfinished()
    assert all(s.status is SequenceStatus.FINISHED for s in seqs.values())


@pytest.mark.parametrize("num_in_flight", [1, 2])
def test_random_soak_ends_with_everything_free(num_in_flight: int) -> None:
    rng = random.Random(num_in_flight)
    scheduler = make_scheduler(num_blocks=24, block_size=4, num_slots=6, max_seqs=6, budget=16)
    seqs: dict[str, Sequence] = {}
    done: set[str] = set()
    pending: list[StepPlan] = []

    def step() -> None:
        pending.append(scheduler.schedule())
        while len(pending) >= num_in_flight or (pending and not scheduler.has_unfinished()):
            plan = pending.pop(0)
            done.update(s.seq_id for s, _, _ in scheduler.update(plan, answer(plan)) if s.is_finished)

    for i in range(300):
        item = seq(f"r{i}", rng.randint(1, 30), rng.randint(1, 12))
        seqs[item.seq_id] = item
        scheduler.add(item)
        if rng.random() < 0.1:
            victim = seqs[f"r{rng.randint(0, i)}"]
            if victim.status is not SequenceStatus.FINISHED:
                scheduler.finish(victim)
                done.add(victim.seq_id)
        if rng.random() < 0.03:
            scheduler.preempt_all()
        step()
    while scheduler.has_unfinished() or pending:
        step()
    assert scheduler.blocks.num_free_blocks == scheduler.blocks.num_blocks
    assert scheduler.slots.num_free_slots == scheduler.slots.num_slots
    assert scheduler.rows.num_free == scheduler.rows.num_ids
    assert len(done) == len(seqs)
    for item in seqs.values():
        assert len(item.output_token_ids) <= item.max_tokens
        if item.finish_reason == "length":
            assert len(item.output_token_ids) == item.max_tokens


def prefill_only(name: str, num_prompt: int, chunks: tuple[int, ...]) -> Sequence:
    return Sequence(name, list(range(num_prompt)), 1, sampling=SamplingParams(temperature=0.0), logits_chunks=chunks)


def logits_answer(plan: StepPlan) -> StepResult:
    """A fake runner that also returns each return_logits chunk's 'logits': its positions as bytes."""
    logits = tuple(
        bytes(range(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens)) if s.return_logits else None
        for s in plan.seqs
    )
    return StepResult(plan.step_id, tuple((7,) if s.needs_sample else () for s in plan.seqs), logits=logits)


def test_prefill_only_runs_its_chunks_whole_samples_nothing_and_frees_everything() -> None:
    scheduler = make_scheduler(num_blocks=16, budget=8)
    scheduler.add(seq("gen", 3, 4))
    scheduler.add(prefill_only("logits", 14, (6, 7, 1)))
    plans, finished = [], []
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        plans.append(plan)
        finished += [s for s, tokens, _ in scheduler.update(plan, logits_answer(plan)) if s.is_finished and not tokens]
    chunks = [(s.num_computed_tokens, s.num_new_tokens) for p in plans for s in p.seqs if s.return_logits]
    assert chunks == [(0, 6), (6, 7), (13, 1)]  # whole chunks: the first waits a step ("gen" took 3 of the 8)
    assert [len(p.seqs) for p in plans][:2] == [1, 2]
    assert not any(s.needs_sample for p in plans for s in p.seqs if s.return_logits)
    (done,) = finished
    assert done.seq_id == "logits" and done.finish_reason == "stop" and done.output_token_ids == []
    assert b"".join(done.logits) == bytes(range(14))
    assert scheduler.blocks.num_free_blocks == 16 and scheduler.slots.num_free_slots == 8


def test_prefill_only_chunk_above_the_budget_runs_first_in_a_step() -> None:
    scheduler = make_scheduler(budget=8)
    scheduler.add(prefill_only("logits", 20, (20,)))
    plan = scheduler.schedule()
    assert [(s.num_new_tokens, s.return_logits) for s in plan.seqs] == [(20, True)]
    (entry,) = scheduler.update(plan, logits_answer(plan))
    assert entry[0].is_finished and b"".join(entry[0].logits) == bytes(range(20))


def test_preempted_prefill_only_recomputes_its_logits() -> None:
    scheduler = make_scheduler(budget=8)
    scheduler.add(prefill_only("logits", 12, (4, 4, 4)))
    plan = scheduler.schedule()
    scheduler.update(plan, logits_answer(plan))
    assert scheduler.preempt_all() == 1
    finished = []
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        finished += [s for s, _, _ in scheduler.update(plan, logits_answer(plan)) if s.is_finished]
    (done,) = finished
    assert done.num_preemptions == 1 and b"".join(done.logits) == bytes(range(12))
