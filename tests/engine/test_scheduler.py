"""Scheduler unit tests: the real scheduler driven with fake runner outputs (no model, no tensors)."""

from __future__ import annotations

import random

import pytest

from deltaserve.scheduler.block_manager import BlockManager, StateSlotPool
from deltaserve.scheduler.scheduler import Scheduler
from deltaserve.scheduler.sequence import Sequence, SequenceStatus


def make_scheduler(num_blocks: int = 64, block_size: int = 4, num_slots: int = 8, max_seqs: int = 8,
                   budget: int = 32) -> Scheduler:  # fmt: skip
    return Scheduler(BlockManager(num_blocks, block_size), StateSlotPool(num_slots), max_seqs, budget)


def fake_step(scheduler: Scheduler, seqs: dict[str, Sequence], next_token: int = 7) -> list[str]:
    """Runs one step with a fake runner: every sequence whose chunk reached its end 'samples' next_token."""
    batch = scheduler.schedule()
    scheduler.advance(batch)
    finished = []
    for s in batch.sequences:
        if s.needs_sample:
            seq = seqs[s.seq_id]
            seq.output_token_ids.append(next_token)
            if len(seq.output_token_ids) >= seq.max_tokens:
                scheduler.finish(seq)
                finished.append(seq.seq_id)
    return finished


def test_max_num_seqs_larger_than_slot_pool_names_both_numbers() -> None:
    with pytest.raises(ValueError, match=r"max_num_seqs \(9\).*\(8\)"):
        make_scheduler(num_slots=8, max_seqs=9)


def test_chunked_prefill_respects_budget_and_mixes_decodes() -> None:
    scheduler = make_scheduler(budget=10)
    seqs = {"a": Sequence("a", list(range(3)), max_tokens=5), "b": Sequence("b", list(range(25)), max_tokens=2)}
    for seq in seqs.values():
        scheduler.add(seq)
    batch = scheduler.schedule()
    assert [(s.seq_id, len(s.token_ids)) for s in batch.sequences] == [("a", 3), ("b", 7)]
    assert batch.sequences[0].needs_sample and not batch.sequences[1].needs_sample
    scheduler.advance(batch)
    seqs["a"].output_token_ids.append(1)
    batch = scheduler.schedule()
    # the decode of a comes first, then b's next chunk, within the budget of 10
    assert [(s.seq_id, len(s.token_ids), s.is_decode) for s in batch.sequences] == [("a", 1, True), ("b", 9, False)]
    assert batch.sequences[1].start == 7 and batch.sequences[1].has_initial_state
    assert batch.num_tokens <= 10


def test_preemption_by_recompute_frees_and_restarts() -> None:
    scheduler = make_scheduler(num_blocks=6, block_size=4, budget=64)
    seqs = {name: Sequence(name, list(range(8)), max_tokens=100) for name in "ab"}
    for seq in seqs.values():
        scheduler.add(seq)
    fake_step(scheduler, seqs)  # both prefilled: 2 blocks each, 2 free
    for _ in range(8):
        fake_step(scheduler, seqs)
    assert scheduler.num_preemptions_total >= 1
    assert seqs["b"].num_preemptions >= 1 and seqs["a"].num_preemptions == 0
    # a preempted sequence restarts from zero with its output tokens kept (recompute)
    assert all(s.num_computed_tokens <= s.num_tokens for s in seqs.values())


def test_abort_anywhere_frees_everything() -> None:
    scheduler = make_scheduler(budget=8)
    seqs = {f"s{i}": Sequence(f"s{i}", list(range(10)), max_tokens=4) for i in range(4)}
    for seq in seqs.values():
        scheduler.add(seq)
    fake_step(scheduler, seqs)
    for seq in seqs.values():
        scheduler.finish(seq)
    assert scheduler.blocks.num_free_blocks == scheduler.blocks.num_blocks
    assert scheduler.slots.num_free_slots == scheduler.slots.num_slots
    assert not scheduler.has_unfinished()
    assert all(s.status is SequenceStatus.FINISHED for s in seqs.values())


def test_random_soak_ends_with_everything_free() -> None:
    rng = random.Random(0)
    scheduler = make_scheduler(num_blocks=24, block_size=4, num_slots=6, max_seqs=6, budget=16)
    seqs: dict[str, Sequence] = {}
    done: set[str] = set()
    for i in range(300):
        seq = Sequence(f"r{i}", [1] * rng.randint(1, 30), max_tokens=rng.randint(1, 12))
        seqs[seq.seq_id] = seq
        scheduler.add(seq)
        if rng.random() < 0.1:
            victim = seqs[f"r{rng.randint(0, i)}"]
            if victim.status is not SequenceStatus.FINISHED:
                scheduler.finish(victim)
                done.add(victim.seq_id)
        done.update(fake_step(scheduler, seqs))
    while scheduler.has_unfinished():
        done.update(fake_step(scheduler, seqs))
    assert scheduler.blocks.num_free_blocks == scheduler.blocks.num_blocks
    assert scheduler.slots.num_free_slots == scheduler.slots.num_slots
    assert len(done) == len(seqs)
    for seq in seqs.values():
        if seq.seq_id in done and seq.num_tokens > 0 and seq.output_token_ids:
            assert len(seq.output_token_ids) <= seq.max_tokens
