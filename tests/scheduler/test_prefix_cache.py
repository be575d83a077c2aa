"""The hybrid prefix cache in the scheduler (docs/prefix-caching.md), driven with fake runner results: no model."""

from __future__ import annotations

import hashlib
import random
from array import array
from collections import Counter
from types import SimpleNamespace

import pytest

from deltaserve.engine_config import EngineConfig
from deltaserve.sampling_params import SamplingParams
from deltaserve.scheduler.block_manager import BlockManager, StateSlotPool
from deltaserve.scheduler.prefix_cache import ROOT_HASH, block_hash, chain_hashes, media_keys
from deltaserve.scheduler.scheduler import Scheduler
from deltaserve.scheduler.sequence import Sequence, SequenceStatus
from deltaserve.scheduler.spec import SpecSchedule
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


def make(
    num_blocks: int = 64, num_slots: int = 12, max_seqs: int = 8, budget: int = 512, interval: int = 0
) -> Scheduler:
    return Scheduler(
        BlockManager(num_blocks, 16), StateSlotPool(num_slots), max_seqs, budget, 4000,
        enable_prefix_caching=True, checkpoint_interval=interval, chunk_size=64,
    )  # fmt: skip


def request(name: str, tokens: list[int], max_tokens: int = 1, **params: object) -> Sequence:
    return Sequence(name, list(tokens), max_tokens, sampling=SamplingParams(temperature=0.0, **params))


def run_to_end(scheduler: Scheduler) -> list[StepPlan]:
    plans = []
    while scheduler.has_unfinished():
        plans.append(scheduler.schedule())
        scheduler.update(plans[-1], answer(plans[-1]))
    return plans


def held_blocks(scheduler: Scheduler) -> Counter[int]:
    """Every reference the sequences and checkpoints hold, per block."""
    refs: Counter[int] = Counter()
    for seq in scheduler.running:
        refs.update(seq.block_ids)
    for checkpoint in scheduler.prefix_cache.checkpoints():
        refs.update(checkpoint.block_ids)
    return refs


def assert_accounted(scheduler: Scheduler) -> None:
    """free + held == total for blocks and slots, and every block's refcount is its holders' count."""
    blocks, slots = scheduler.blocks, scheduler.slots
    refs = held_blocks(scheduler)
    assert all(blocks.refcount(b) == refs[b] for b in range(blocks.num_blocks))
    assert blocks.num_free_blocks + len(refs) == blocks.num_blocks
    by_cache = Counter(b for c in scheduler.prefix_cache.checkpoints() for b in c.block_ids)
    cache_only = sum(1 for b, n in by_cache.items() if refs[b] == n)
    assert blocks.num_available_blocks == blocks.num_free_blocks + cache_only
    held_slots = [s.state_slot for s in scheduler.running] + [c.slot for c in scheduler.prefix_cache.checkpoints()]
    assert len(set(held_slots)) == len(held_slots)
    assert slots.num_free_slots + len(held_slots) == slots.num_slots


A = list(range(1000, 1200))  # 200 tokens: 12 full blocks and 8 tokens of a 13th


def test_chain_hashes_follow_every_earlier_token_and_the_media_items() -> None:
    first, second = request("a", A), request("b", A[:100] + [1] + A[101:])
    h1, h2 = chain_hashes(first, 16, 200), chain_hashes(second, 16, 200)
    assert len(h1) == 12 and all(len(h) == 16 for h in h1)
    assert h1[:6] == h2[:6] and all(x != y for x, y in zip(h1[6:], h2[6:], strict=True))  # 100 is in block 6
    assert block_hash(ROOT_HASH, A[:16], ()) == hashlib.blake2b(array("q", A[:16]).tobytes(), digest_size=16).digest()
    assert block_hash(ROOT_HASH, A[:16], (("img-1", 3),)) != block_hash(ROOT_HASH, A[:16], (("img-2", 3),))
    item = SimpleNamespace(identifier="img-1", offset=20, length=10, end=30)
    mm = SimpleNamespace(items=(item,))
    assert media_keys(mm, 16, 32) == (("img-1", 20),) and media_keys(mm, 0, 16) == () and media_keys(mm, 30, 40) == ()


def test_block_references_are_counted() -> None:
    blocks = BlockManager(4, 16)
    ids = blocks.allocate(2)
    blocks.share(ids[:1])
    blocks.free(ids)
    assert blocks.num_free_blocks == 3 and blocks.refcount(ids[0]) == 1
    blocks.free(ids[:1])
    assert blocks.num_free_blocks == 4
    with pytest.raises(RuntimeError, match="freed more often"):
        blocks.free(ids[:1])
    with pytest.raises(RuntimeError, match="cannot be shared"):
        blocks.share(ids[:1])


def test_a_second_request_of_a_shared_prefix_computes_only_its_new_tokens() -> None:
    scheduler = make()
    scheduler.add(request("a", A))
    (plan,) = run_to_end(scheduler)[:1]
    (item,) = plan.seqs
    # R, the repeat point floor64(199), inside the chunk, and E, the prompt's end
    assert [position for position, _ in item.checkpoints] == [192, 200]
    a_blocks = item.new_block_ids
    # b shares a's first 150 tokens: no checkpoint there, but a branch point at floor64(9 blocks) = 128, saved
    # inside its one chunk (its own R at 192 is not: one in-step checkpoint a chunk, the first)
    scheduler.add(request("b", A[:150] + list(range(5000, 5050))))
    plans = run_to_end(scheduler)
    assert plans[0].seqs[0].num_computed_tokens == 0 and plans[0].seqs[0].num_new_tokens == 200
    ((branch_position, branch_slot), (end_position, _)) = plans[0].seqs[0].checkpoints
    assert (branch_position, end_position) == (128, 200)
    b_blocks = plans[0].seqs[0].new_block_ids
    assert scheduler.prefix_cache_hits == 0 and scheduler.prefix_cache_queries == 400
    # c shares the same 150: it hits b's branch checkpoint and computes only its own tokens
    scheduler.add(c := request("c", A[:150] + list(range(7000, 7030))))
    plan = scheduler.schedule()
    (item,) = plan.seqs
    assert (item.num_computed_tokens, item.num_new_tokens) == (128, 52)
    assert item.read_slot == branch_slot and item.write_slot != branch_slot
    assert item.new_block_ids[:8] == b_blocks[:8] and plan.block_copies == ()
    assert c.num_cached_tokens == 128
    assert (scheduler.prefix_cache_queries, scheduler.prefix_cache_hits) == (580, 128)
    scheduler.update(plan, answer(plan))
    # d extends a's prompt: it hits a's prompt-end checkpoint inside block 12, which it gets a copy of
    scheduler.add(request("d", A + [9, 9, 9]))
    plan = scheduler.schedule()
    (item,) = plan.seqs
    assert (item.num_computed_tokens, item.num_new_tokens) == (200, 3)
    assert item.new_block_ids[:12] == a_blocks[:12] and plan.block_copies == ((a_blocks[12], item.new_block_ids[12]),)
    scheduler.update(plan, answer(plan))
    run_to_end(scheduler)
    assert_accounted(scheduler)


def test_a_checkpoint_is_not_matched_before_the_step_that_writes_it_is_collected() -> None:
    scheduler = make()
    scheduler.add(request("a", A))
    first = scheduler.schedule()
    scheduler.add(b := request("b", A + [1, 2]))  # planned while a's step is in flight (async scheduling)
    second = scheduler.schedule()
    # not matched: b waits for the pending checkpoint at 200 (scheduler/prefix_wait.py), not admitted at it
    assert b.status is SequenceStatus.WAITING and b.row is None and not second.seqs
    scheduler.update(first, answer(first))
    third = scheduler.schedule()  # a's step is collected: b hits its prompt end
    assert [s.num_computed_tokens for s in third.seqs if s.row == b.row] == [200]
    scheduler.update(second, answer(second))
    scheduler.update(third, answer(third))
    run_to_end(scheduler)
    scheduler.add(request("c", A + [3]))
    plan = scheduler.schedule()
    assert plan.seqs[0].num_computed_tokens == 200


def test_generation_end_hands_the_live_state_over_after_its_last_step_in_flight() -> None:
    scheduler = make()
    scheduler.add(a := request("a", A[:100], max_tokens=10))
    a.eos_token_ids = frozenset({0})
    plans = [scheduler.schedule(), scheduler.schedule()]  # the prefill, and the decode of its token behind it
    for token in (7, 7, 0):  # a's third token is eos: it finishes while the decode of that token is in flight
        scheduler.update(plans[0], answer(plans.pop(0), token))
        plans.append(scheduler.schedule())
    assert a.is_finished and a.output_token_ids == [7, 7, 0]
    (handed,) = [c for c in scheduler.prefix_cache.checkpoints() if c.position not in (64, 100)]  # not R nor E
    assert handed.position == 103 and not handed.is_ready  # prompt + the three outputs: the last one runs still
    scheduler.add(request("b", A[:100] + [7, 7, 0, 5]))
    plan = scheduler.schedule()
    assert plan.seqs[0].num_computed_tokens == 100  # the prompt-end checkpoint: the handover is pending
    scheduler.update(plans[0], answer(plans.pop(0)))
    assert handed.is_ready
    scheduler.update(plan, answer(plan))
    run_to_end(scheduler)
    scheduler.add(request("c", A[:100] + [7, 7, 0, 5]))
    plan = scheduler.schedule()
    assert plan.seqs[0].num_computed_tokens == 103 and plan.seqs[0].read_slot == handed.slot
    scheduler.update(plan, answer(plan))
    run_to_end(scheduler)
    assert_accounted(scheduler)


def test_periodic_checkpoints_are_saved_inside_chunks_on_their_grid_or_end_them() -> None:
    """One in-step checkpoint a chunk, on its grid: the next target ends the chunk (its end save); a target off the
    grid of a chunk that starts at an unaligned hit ends the chunk too, as before in-step saving."""
    scheduler = make(interval=64)
    scheduler.add(request("a", A))
    plans = run_to_end(scheduler)
    chunks = [(s.num_computed_tokens, s.num_new_tokens, [p for p, _ in s.checkpoints]) for p in plans for s in p.seqs]
    assert chunks[:2] == [(0, 128, [64, 128]), (128, 72, [192, 200])]
    # b hits a's prompt end at 200: 256 is off its chunk's grid (200 + 64 j) and ends it; 320 is on the next one's
    scheduler.add(request("b", A + list(range(3000, 3150))))
    plans = run_to_end(scheduler)
    chunks = [(s.num_computed_tokens, s.num_new_tokens, [p for p, _ in s.checkpoints]) for p in plans for s in p.seqs]
    assert chunks[:2] == [(200, 56, [256]), (256, 94, [320, 350])]
    with pytest.raises(ValueError, match=r"multiple of the GDN chunk size \(64\)"):
        make(interval=100)


def test_prompt_logprobs_requests_compute_their_prompt_uncut_but_still_write_checkpoints() -> None:
    scheduler = make()
    scheduler.add(request("a", A))
    run_to_end(scheduler)
    scheduler.add(request("b", A + [4, 4], prompt_logprobs=1))
    plan = scheduler.schedule()
    # the whole prompt in one chunk, as with the cache off (no branch cut at 192): only its prompt end is saved
    (chunk,) = plan.seqs
    assert (chunk.num_computed_tokens, chunk.num_new_tokens, [p for p, _ in chunk.checkpoints]) == (0, 202, [202])
    assert scheduler.prefix_cache_queries == 200  # no lookup counted for b
    scheduler.update(plan, answer(plan))
    run_to_end(scheduler)
    scheduler.add(request("c", A + [4, 4, 5]))  # a longer prompt without prompt logprobs hits b's prompt end
    assert scheduler.schedule().seqs[0].num_computed_tokens == 202


def test_checkpoints_are_evicted_before_a_running_sequence_is_preempted() -> None:
    scheduler = make(num_blocks=40, num_slots=10, max_seqs=2)
    for index in range(2):  # two finished prompts: their checkpoints hold 26 of the 40 blocks
        scheduler.add(request(f"old{index}", [index * 10_000 + t for t in A]))
        run_to_end(scheduler)
    assert scheduler.blocks.num_free_blocks == 40 - 26
    scheduler.add(request("new", list(range(50_000, 50_500)), max_tokens=4))  # 32 blocks
    run_to_end(scheduler)
    assert scheduler.num_preemptions_total == 0
    assert_accounted(scheduler)


def run_async(scheduler: Scheduler, max_steps: int) -> int:
    """Drives to the end with two steps in flight, as the engine's async loop does; returns the steps planned, and
    fails when max_steps pass without the end (no progress)."""
    inflight: list[StepPlan] = []
    for step in range(max_steps):
        if not scheduler.has_unfinished() and not inflight:
            return step
        if scheduler.has_unfinished():
            inflight.append(scheduler.schedule())
        if len(inflight) == 2 or not scheduler.has_unfinished() or not inflight[-1].seqs:
            plan = inflight.pop(0)
            scheduler.update(plan, answer(plan))
    raise AssertionError(f"not finished after {max_steps} steps: {scheduler.num_preemptions_total} preemptions")


def test_a_sequence_waits_for_blocks_pending_checkpoints_hold_instead_of_preempting_itself() -> None:
    """a (64 tokens) and b (416) fill all 30 blocks in one step. a's decode, planned while that step is in flight,
    needs a 31st: b is preempted, but its blocks stay with b's prompt-end checkpoint until the step is collected.
    Were a to preempt itself as well, the two would restart from cache hits and meet again, forever (seen with a
    small KV cache under async scheduling); a waits a step instead and evicts the checkpoint once it is ready."""
    # 3 checkpoint slots: a's prompt end, b's repeat point at 384 and b's prompt end (which holds all b's blocks)
    scheduler = Scheduler(
        BlockManager(30, 16), StateSlotPool(7), 4, 512, 4000, enable_prefix_caching=True, chunk_size=64
    )  # fmt: skip
    scheduler.add(a := request("a", range(1000, 1064), max_tokens=40, ignore_eos=True))
    scheduler.add(b := request("b", range(5000, 5416), max_tokens=40, ignore_eos=True))
    first = scheduler.schedule()
    assert len(first.seqs) == 2 and scheduler.blocks.num_free_blocks == 0
    second = scheduler.schedule()
    assert second.seqs == () and scheduler.num_preemptions_total == 1
    assert a.status is SequenceStatus.RUNNING and b.status is SequenceStatus.WAITING
    assert scheduler.num_waiting_for_capacity == 1  # b; nothing is admitted while a waits
    scheduler.update(first, answer(first))
    third = scheduler.schedule()
    # a decodes, having evicted checkpoints for its block; b, whose one 416-token chunk (its branch point at 384 is
    # saved inside it, no cut) does not fit beside a, waits for the room
    assert [(s.num_computed_tokens, s.num_new_tokens) for s in third.seqs] == [(64, 1)]
    assert b.status is SequenceStatus.WAITING
    scheduler.update(third, answer(third))
    run_async(scheduler, 2_000)
    assert a.is_finished and b.is_finished and a.num_preemptions == 0  # b, which cannot fit beside a, may be again
    assert_accounted(scheduler)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_two_steps_in_flight_on_a_small_pool_always_finish(seed: int) -> None:
    """Random 100-300 token prompts, 50-150 outputs, 30 blocks (a sequence needs up to 29): progress, not a
    livelock, and a preemption is rare (before the fix above, seeds 0 and 1 livelocked)."""
    rng = random.Random(seed)
    scheduler = Scheduler(
        BlockManager(30, 16), StateSlotPool(6), 4, 512, 512, enable_prefix_caching=True, chunk_size=64
    )  # fmt: skip
    for index in range(8):
        tokens = [rng.randrange(50_000) for _ in range(rng.randrange(100, 301))]
        scheduler.add(request(f"r{index}", tokens, max_tokens=rng.randrange(50, 151), ignore_eos=True))
    steps = run_async(scheduler, 3_000)
    print(f"seed {seed}: {steps} steps, {scheduler.num_preemptions_total} preemptions")
    assert scheduler.num_preemptions_total <= 20
    assert_accounted(scheduler)
    assert scheduler.reset_prefix_cache()
    assert scheduler.blocks.num_free_blocks == 30 and scheduler.slots.num_free_slots == 6


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_speculating_with_async_verify_on_a_small_pool_always_finishes(policy: str) -> None:
    """Verify chunks of up to 1 + 3 tokens that accept a random count, chained chunks planned behind them (async
    verify), eos inside accepted runs, aborts and shared prefixes, two steps in flight on a 26-block pool (a sequence
    needs up to 23; ~90 preemptions, and a sequence waits for blocks pending checkpoints hold once or twice): every run
    finishes, every block and slot is accounted for after every step, and a fake runner that tracks each row's true
    next start finds every chunk that is not chained starting there, every chained one at or past it (its blocks
    cover the true span)."""
    rng = random.Random(5)
    scheduler = Scheduler(
        BlockManager(26, 16), StateSlotPool(8), 4, 96, 512, policy=policy, enable_prefix_caching=True,
        checkpoint_interval=64, chunk_size=64,
    )  # fmt: skip
    scheduler.spec = SpecSchedule(3, async_verify=True)
    prefixes = [[rng.randrange(1, 50_000) for _ in range(rng.randrange(40, 250))] for _ in range(3)]
    next_start: dict[int, int] = {}  # the fake runner's record: row -> where its next chunk really starts
    moved = 0

    def execute(plan: StepPlan) -> StepResult:
        nonlocal moved
        for row in (*plan.removed, *(r.row for r in plan.added)):
            next_start.pop(row, None)
        tokens = []
        for s in plan.seqs:
            start = s.num_computed_tokens
            if s.is_chained:  # the runner moves it back to where its verify's accepted run really ended
                assert next_start[s.row] <= start
                moved += start - next_start[s.row]
                start = next_start[s.row]
            elif s.needs_sample and s.row in next_start:
                assert next_start[s.row] == start
            count = rng.randrange(1, s.num_draft_tokens + 2) if s.needs_sample else 0
            tokens.append(tuple(0 if rng.random() < 0.04 else 7 for _ in range(count)))  # 0: eos
            if s.needs_sample:
                next_start[s.row] = start + (count if s.num_draft_tokens else s.num_new_tokens)
        return StepResult(plan.step_id, tuple(tokens))

    inflight: list[tuple[StepPlan, StepResult]] = []
    live: list[Sequence] = []
    for step in range(1_500):
        if step < 300 and rng.random() < 0.3:
            tokens = rng.choice(prefixes)[: rng.randrange(1, 250)] + [rng.randrange(1, 50_000) for _ in range(40)]
            live.append(Sequence(f"r{step}", tokens, rng.randrange(1, 60), sampling=SamplingParams(temperature=0.0),
                                 eos_token_ids=frozenset({0}), priority=rng.randrange(3)))  # fmt: skip
            scheduler.add(live[-1])
        if rng.random() < 0.02 and live:
            scheduler.finish(rng.choice(live))  # an abort
        plan = scheduler.schedule() if scheduler.has_unfinished() else None
        if plan is not None and plan.seqs:
            inflight.append((plan, execute(plan)))
        if inflight and (len(inflight) == 2 or plan is None or not plan.seqs):
            scheduler.update(*inflight.pop(0))
        live = [s for s in live if not s.is_finished]
        assert_accounted(scheduler)
        if step >= 300 and plan is None and not inflight:
            break
    else:
        raise AssertionError(f"{len(scheduler.running)} running, {len(scheduler.waiting)} waiting: no end")
    assert moved > 0 and scheduler.num_preemptions_total > 0 and scheduler.prefix_cache_hits > 0
    assert scheduler.reset_prefix_cache()
    assert scheduler.blocks.num_free_blocks == 26 and scheduler.slots.num_free_slots == 8


def test_reserve_evicts_nothing_when_every_evictable_block_would_not_be_enough() -> None:
    """A checkpoint whose blocks a running sequence shares frees none when evicted: it stays for the restart."""
    scheduler = make(num_blocks=20, max_seqs=2)
    scheduler.add(request("a", A, max_tokens=50, ignore_eos=True))
    plan = scheduler.schedule()
    scheduler.update(plan, answer(plan))
    cache = scheduler.prefix_cache
    checkpoints = cache.checkpoints()  # R at 192 and E at 200
    assert sorted(c.position for c in checkpoints) == [192, 200] and all(c.is_ready for c in checkpoints)
    assert scheduler.blocks.num_free_blocks == 20 - 13
    assert not cache.reserve_blocks(8) and cache.checkpoints() == checkpoints
    assert cache.reserve_blocks(7) and cache.checkpoints() == checkpoints


def test_reset_drops_every_ready_checkpoint() -> None:
    scheduler = make()
    scheduler.add(request("a", A))
    run_to_end(scheduler)
    scheduler.add(request("b", A[:100] + [1, 2, 3]))
    plan = scheduler.schedule()  # b's branch checkpoint at 64 (inside its chunk) and its prompt end are pending
    assert not scheduler.reset_prefix_cache()
    assert [c.position for c in scheduler.prefix_cache.checkpoints()] == [64, 103]  # in its one chunk, and E
    scheduler.update(plan, answer(plan))
    run_to_end(scheduler)
    assert scheduler.reset_prefix_cache() and scheduler.prefix_cache.num_checkpoints == 0
    assert scheduler.blocks.num_free_blocks == 64 and scheduler.slots.num_free_slots == 12


@pytest.mark.parametrize("seed", [0, 1])
def test_soak_every_block_and_slot_is_accounted_for(seed: int) -> None:
    """Random prompts over a few shared prefixes, two steps in flight, a small block and slot pool, aborts."""
    rng = random.Random(seed)
    scheduler = make(num_blocks=40, num_slots=6, max_seqs=4, budget=96, interval=64)
    prefixes = [[rng.randrange(50_000) for _ in range(rng.randrange(40, 300))] for _ in range(3)]
    inflight: list[StepPlan] = []
    live: list[Sequence] = []
    for step in range(400):
        if rng.random() < 0.3 and len(live) < 12:
            prefix = rng.choice(prefixes)
            tokens = prefix[: rng.randrange(1, len(prefix) + 1)] + [
                rng.randrange(50_000) for _ in range(rng.randrange(0, 90))
            ]
            live.append(request(f"r{step}", tokens, max_tokens=rng.randrange(1, 40), ignore_eos=False))
            scheduler.add(live[-1])
        if rng.random() < 0.03 and live:
            scheduler.finish(rng.choice(live))  # an abort
        inflight.append(scheduler.schedule())
        if len(inflight) == 2 or not scheduler.has_unfinished():
            plan = inflight.pop(0)
            scheduler.update(plan, answer(plan, next_token=rng.choice([7, 7, 7, 0])))
        live = [s for s in live if not s.is_finished]
        assert_accounted(scheduler)
    while inflight or scheduler.has_unfinished():
        if scheduler.has_unfinished():
            inflight.append(scheduler.schedule())
        plan = inflight.pop(0)
        scheduler.update(plan, answer(plan))
    assert scheduler.prefix_cache_hits > 0 and scheduler.num_preemptions_total > 0
    assert_accounted(scheduler)
    assert scheduler.reset_prefix_cache()
    assert scheduler.blocks.num_free_blocks == 40 and scheduler.slots.num_free_slots == 6


def test_a_new_checkpoint_never_evicts_the_one_its_chunk_reads() -> None:
    """One checkpoint slot: b reads a's checkpoint from it, so b's own prompt-end checkpoint finds no slot and is
    skipped (the runner refuses a checkpoint into the chunk's read slot)."""
    scheduler = make(num_slots=2, max_seqs=1)
    scheduler.add(request("a", A[:60]))  # no repeat point below 64 tokens: its prompt end alone
    (plan,) = run_to_end(scheduler)
    ((_, slot),) = plan.seqs[0].checkpoints
    scheduler.add(request("b", A[:60] + [5, 6]))
    plan = scheduler.schedule()
    (item,) = plan.seqs
    assert item.read_slot == slot and item.num_computed_tokens == 60 and item.checkpoints == ()
    scheduler.update(plan, answer(plan))
    run_to_end(scheduler)
    assert_accounted(scheduler)


@pytest.mark.parametrize("has_mtp", [False, True], ids=["no-mtp", "mtp"])
def test_with_the_mtp_layer_a_hit_copies_the_block_holding_its_last_cached_token(has_mtp: bool) -> None:
    """A hit at P shares the checkpoint's blocks before the one holding P - 1 and copies that one when the model
    has an MTP layer (the hit rewrites its MTP entry at P - 1); without it, every full block is shared and only a
    partial one is copied."""
    scheduler = make()
    scheduler.prefix_cache.rewrites_last_row = has_mtp
    for prompt, extra in ((A[:192], [5, 6]), (A, [7, 8])):  # a checkpoint on a block boundary (192), inside one (200)
        scheduler.add(request("first", prompt))
        (first,) = run_to_end(scheduler)[0].seqs
        scheduler.add(request("next", prompt + extra))
        plan = scheduler.schedule()
        (item,) = plan.seqs
        position = len(prompt)
        assert (item.num_computed_tokens, item.num_new_tokens) == (position, 2)
        shared = (position - 1) // 16 if has_mtp else position // 16  # 11 / 12 at 192, 12 at 200
        assert item.new_block_ids[:shared] == first.new_block_ids[:shared]
        assert not set(item.new_block_ids[shared:]) & set(first.new_block_ids)  # the rest are its own
        copies = ((first.new_block_ids[shared], item.new_block_ids[shared]),) if shared * 16 < position else ()
        assert plan.block_copies == copies
        scheduler.update(plan, answer(plan))
        run_to_end(scheduler)
        assert_accounted(scheduler)


def test_eviction_takes_unprotected_checkpoints_first_and_protection_ages_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A checkpoint two sequences hit is evicted only after every unprotected one; one sequence's repeated lookups
    count once; protected checkpoints beyond 3/4 of all go back to plain LRU, least recently used first."""
    from deltaserve.scheduler.prefix_cache import PrefixCache

    blocks, slots = BlockManager(64, 16), StateSlotPool(8)

    def held_by_cache() -> tuple[int, ...]:
        """A block a finished sequence left to a checkpoint: allocated, shared by the cache, freed by its owner."""
        block_ids = blocks.allocate(1)
        blocks.share(block_ids, by_cache=True)
        blocks.free(block_ids)
        return tuple(block_ids)

    cache = PrefixCache(blocks, slots, max_pending=8, chunk_size=64)
    added = []
    for index in range(4):  # four ready checkpoints, one block and one slot each; LRU order 0, 1, 2, 3
        cache.add((bytes([index]), (), ()), 16, slots.allocate(), held_by_cache(), None)
        added.append(cache.checkpoints()[-1])
    first = added[0]
    monkeypatch.setattr(cache, "_match", lambda seq, is_ready: first)
    a, b = request("a", [1] * 20), request("b", [1] * 20)
    cache.lookup(a)
    cache.lookup(a)  # the same sequence again: still one hitter
    assert first.num_hitters == 1 and not first.is_protected
    cache.lookup(b)
    assert first.num_hitters == 2 and first.is_protected
    assert [c.key[0][0] for c in cache.checkpoints()] == [1, 2, 3, 0]  # the hit made it the most recent too
    assert cache.contains(added[1].key)  # 1 is now the most recently used: LRU alone would evict 0 before it
    # eviction: the unprotected ones in LRU order, the protected one last
    order = []
    while cache.num_checkpoints:
        before = {c.key[0][0] for c in cache.checkpoints()}
        assert cache.evict_one()
        order += sorted(before - {c.key[0][0] for c in cache.checkpoints()})
    assert order == [2, 3, 1, 0] and slots.num_free_slots == 8 and blocks.num_free_blocks == 64

    # ageing: with four checkpoints at most three stay protected; the least recently used protected one goes back
    cache = PrefixCache(blocks, slots, max_pending=8, chunk_size=64)
    for index in range(4):
        cache.add((bytes([index]), (), ()), 16, slots.allocate(), held_by_cache(), None)
    for checkpoint in cache.checkpoints():
        monkeypatch.setattr(cache, "_match", lambda seq, is_ready, c=checkpoint: c)
        cache.lookup(request(f"x{checkpoint.key[0][0]}", [1] * 20))
        cache.lookup(request(f"y{checkpoint.key[0][0]}", [1] * 20))
    assert [c.is_protected for c in cache.checkpoints()] == [False, True, True, True]
    assert cache.checkpoints()[0].key[0][0] == 0


def test_a_new_checkpoint_never_evicts_a_protected_one_but_a_running_sequence_may(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With every slot held by protected checkpoints, a prefill's new checkpoint is skipped (nothing is evicted for
    it), while an admission's slot still evicts the least recently used protected one."""
    from deltaserve.scheduler.prefix_cache import PrefixCache

    blocks, slots = BlockManager(16, 16), StateSlotPool(2)
    cache = PrefixCache(blocks, slots, max_pending=2, chunk_size=64)
    for index in range(2):
        block_ids = blocks.allocate(1)
        blocks.share(block_ids, by_cache=True)
        blocks.free(block_ids)
        cache.add((bytes([index]), (), ()), 16, slots.allocate(), tuple(block_ids), None)
    for checkpoint in cache.checkpoints():
        monkeypatch.setattr(cache, "_match", lambda seq, is_ready, c=checkpoint: c)
        for name in ("x", "y"):
            cache.lookup(request(f"{name}{checkpoint.key[0][0]}", [1] * 20))
    assert [c.is_protected for c in cache.checkpoints()] == [False, True]  # 3/4 of 2: one stays protected
    cache.checkpoints()[0].is_protected = True  # both protected: what a prefix-heavy pool looks like
    seq = request("new", list(range(40)))
    seq.block_ids = blocks.allocate(3)
    assert cache.checkpoint_at(seq, 32, step_id=1, read_slot=None) == ()
    assert cache.num_checkpoints == 2 and slots.num_free_slots == 0
    assert cache.take_slot() is not None and [c.key[0][0] for c in cache.checkpoints()] == [1]
