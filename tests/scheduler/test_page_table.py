"""The one pool's page table (scheduler/block_manager.py PageTable, docs/ARCHITECTURE.md, "One pool").

Checks the allocator alone against a brute-force model (pages lowest first, runs highest fully free first, the
counts exact through random traffic and through the lazy heaps' rebuilds), the KV block pool and the state slot pool
sharing one table (refcounts, no page both a block and inside a held slot, sizes that must match, the split pool
unchanged), a scheduler soak on a shared pool that must end with every page free, and the admission rule counting a
new slot's pages (and waiting for a free run). No model, no tensors: a fake runner answers each plan.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from deltaserve.sampling_params import SamplingParams
from deltaserve.scheduler.block_manager import BlockManager, PageTable, StateSlotPool
from deltaserve.scheduler.scheduler import Scheduler
from deltaserve.scheduler.sequence import Sequence, SequenceStatus
from deltaserve.step import StepPlan, StepResult


def run_pages(run: int, per_slot: int) -> set[int]:
    return set(range(run * per_slot, (run + 1) * per_slot))


def model_free_runs(pages: PageTable, held: set[int]) -> list[int]:
    """Brute force: the runs none of whose pages is held."""
    return [s for s in range(pages.num_runs) if not held & run_pages(s, pages.pages_per_slot)]


def exercise(pages: PageTable, rng: random.Random, num_ops: int) -> int:
    """Random take / give / take_run / give_run, each answer and count checked against a model recomputed from the
    set of held pages; phases of filling and of draining reach both a full and an empty table. Returns how often
    the free-page heap was rebuilt (a give pushed no entry)."""
    blocks: set[int] = set()  # pages held one by one
    runs: set[int] = set()  # runs held whole
    rebuilds = 0
    held: set[int] = set()
    for index in range(num_ops):
        free = sorted(set(range(pages.num_pages)) - held)
        filling = (index // 200) % 2 == 0
        op = rng.random()
        if op < (0.45 if filling else 0.2):
            n = rng.randint(0, min(len(free), 6))
            assert pages.take(n) == free[:n]
            blocks.update(free[:n])
        elif op < 0.7 and blocks:
            page = rng.choice(sorted(blocks))
            before = len(pages._heap)  # the lazy heap's length: a give pushes one entry, unless it rebuilds
            pages.give(page)
            rebuilds += len(pages._heap) <= before
            blocks.remove(page)
        elif op < (0.9 if filling else 0.8):
            expected = max(model_free_runs(pages, held), default=None)
            assert pages.take_run() == expected
            if expected is not None:
                runs.add(expected)
        elif runs:
            run = rng.choice(sorted(runs))
            before = len(pages._heap)
            pages.give_run(run)
            rebuilds += len(pages._heap) < before + pages.pages_per_slot
            runs.remove(run)
        held = blocks.union(*(run_pages(s, pages.pages_per_slot) for s in runs))
        assert pages.num_free == pages.num_pages - len(held)
        assert pages.num_free_runs == len(model_free_runs(pages, held))
        assert len(pages._heap) <= 2 * pages.num_pages and len(pages._runs) <= 2 * pages.num_runs  # rebuild bounds
    return rebuilds


# -- the page table alone ----------------------------------------------------------------------------------------


def test_pages_go_out_lowest_first_and_runs_highest_fully_free_first() -> None:
    pages = PageTable(40, 10)
    assert (pages.num_runs, pages.num_free, pages.num_free_runs) == (4, 40, 4)
    assert pages.take(3) == [0, 1, 2]
    assert pages.take_run() == 3 and pages.take_run() == 2
    assert pages.take(2) == [3, 4]
    pages.give(1)
    assert pages.take(2) == [1, 5]
    assert pages.take_run() == 1 and pages.take_run() is None  # run 0 holds blocks
    assert (pages.num_free, pages.num_free_runs) == (40 - 6 - 30, 0)


def test_a_run_with_one_taken_page_is_skipped_until_that_page_comes_back() -> None:
    pages = PageTable(30, 10)
    assert pages.take(11) == list(range(11))  # page 10 is the first of run 1
    assert pages.num_free_runs == 1 and pages.take_run() == 2
    assert pages.take_run() is None and pages.num_free_runs == 0
    pages.give(5)  # run 0 still holds 9 of its pages
    assert pages.take_run() is None
    pages.give(10)
    assert pages.num_free_runs == 1 and pages.take_run() == 1
    pages.give_run(1)
    assert pages.take(1) == [5] and pages.take(1) == [10]  # a run given back serves blocks again, lowest first


def test_pages_past_the_last_run_serve_blocks_but_never_a_run() -> None:
    pages = PageTable(25, 10)
    assert pages.num_runs == 2
    assert [pages.take_run(), pages.take_run(), pages.take_run()] == [1, 0, None]
    assert pages.num_free == 5 and pages.take(5) == [20, 21, 22, 23, 24]
    pages.give(22)
    assert (pages.num_free, pages.num_free_runs) == (1, 0) and pages.take_run() is None
    pages.give_run(0)
    assert pages.num_free_runs == 1 and pages.take(2) == [0, 1] and pages.num_free_runs == 0


def test_misuse_raises_and_changes_nothing() -> None:
    for num_pages, per_slot in ((9, 10), (10, 0)):
        with pytest.raises(ValueError, match="hold no run"):
            PageTable(num_pages, per_slot)
    pages = PageTable(20, 5)
    with pytest.raises(RuntimeError, match="given back while free"):
        pages.give(3)
    pages.take(18)
    with pytest.raises(RuntimeError, match="asked for 3 pages with 2 free"):
        pages.take(3)
    assert (pages.num_free, pages.num_free_runs) == (2, 0) and pages.take(2) == [18, 19]
    pages.give_run(1)
    with pytest.raises(RuntimeError, match="not held whole"):
        pages.give_run(1)
    pages.give(12)  # run 2 now held in part: refused whole, and nothing of it given back
    with pytest.raises(RuntimeError, match="not held whole"):
        pages.give_run(2)
    assert (pages.num_free, pages.num_free_runs) == (6, 1)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_operations_match_a_brute_force_model(seed: int) -> None:
    exercise(PageTable(53, 7), random.Random(seed), 3000)  # 7 runs and 4 pages past the last


def test_the_lazy_heaps_rebuilds_keep_every_answer_exact() -> None:
    assert exercise(PageTable(10, 5), random.Random(7), 6000) > 20  # 2 runs: give_run pushes often
    pages = PageTable(20, 5)
    pages.take(6)  # run 0, and page 5 of run 1
    for _ in range(4):  # run 1 freed and taken again: four stale entries beside the four runs
        pages.give(5)
        assert pages.take(1) == [5]
    for page in range(6):  # page 4 frees run 0 and overflows the run heap: the rebuild keeps run 0
        pages.give(page)
    assert [pages.take_run() for _ in range(5)] == [3, 2, 1, 0, None]


def test_the_run_heap_stays_bounded_under_block_churn() -> None:
    """Each time a run becomes fully free it is pushed onto the lazy run heap, and only take_run pops: blocks taken
    and given inside a run, with no slot taken between, must not grow that heap without bound (a server's leak)."""
    pages = PageTable(20, 5)
    for _ in range(5000):
        (page,) = pages.take(1)
        pages.give(page)
        assert len(pages._runs) <= 2 * pages.num_runs
    assert [pages.take_run() for _ in range(5)] == [3, 2, 1, 0, None] and pages.num_free == 0


# -- blocks and slots on one table -------------------------------------------------------------------------------


def test_blocks_and_slots_share_one_table_with_refcounts() -> None:
    pages = PageTable(40, 10)
    blocks, slots = BlockManager(40, 4, pages), StateSlotPool(4, pages)
    assert slots.pages_per_slot == 10 and slots.num_free_slots == 4
    assert slots.allocate() == 3 and blocks.num_free_blocks == 30
    assert blocks.allocate(11) == list(range(11))  # run 0, and page 10 of run 1
    assert slots.allocate() == 2 and slots.allocate() is None and slots.num_free_slots == 0
    blocks.share([10], by_cache=True)  # a checkpoint holds block 10 too
    blocks.free([10])
    assert blocks.refcount(10) == 1 and blocks.num_available_blocks == blocks.num_free_blocks + 1
    assert slots.allocate() is None  # a block only a checkpoint holds still holds its page
    blocks.free([10], by_cache=True)
    assert slots.num_free_slots == 1 and slots.allocate() == 1
    with pytest.raises(RuntimeError, match="asked for 1 KV blocks with 0 free"):
        blocks.allocate(1)
    for slot in (1, 2, 3):
        slots.free(slot)
    blocks.free(list(range(10)))
    assert (pages.num_free, pages.num_free_runs, blocks.num_free_blocks, slots.num_free_slots) == (40, 4, 40, 4)


def test_random_traffic_never_puts_a_block_inside_a_held_slot() -> None:
    rng = random.Random(3)
    pages = PageTable(64, 8)
    blocks, slots = BlockManager(64, 4, pages), StateSlotPool(8, pages)
    holders: list[tuple[list[int], bool]] = []  # (block ids, by_cache)
    held_slots: set[int] = set()
    for _ in range(3000):
        op = rng.random()
        if op < 0.3 and blocks.can_allocate(n := rng.randint(1, 5)):
            holders.append((blocks.allocate(n), False))
        elif op < 0.4 and holders:
            holders.append((list(rng.choice(holders)[0]), True))
            blocks.share(holders[-1][0], by_cache=True)
        elif op < 0.65 and holders:
            block_ids, by_cache = holders.pop(rng.randrange(len(holders)))
            blocks.free(block_ids, by_cache=by_cache)
        elif op < 0.85:
            slot = slots.allocate()
            assert slot not in held_slots
            if slot is not None:
                held_slots.add(slot)
        elif held_slots:
            slots.free(slot := rng.choice(sorted(held_slots)))
            held_slots.remove(slot)
        in_blocks = {b for b in range(64) if blocks.refcount(b) > 0}
        in_slots = set().union(*(run_pages(s, 8) for s in held_slots))
        assert not in_blocks & in_slots
        assert blocks.num_free_blocks == 64 - len(in_blocks) - len(in_slots)
        assert slots.num_free_slots == len(model_free_runs(pages, in_blocks | in_slots))
    for block_ids, by_cache in holders:
        blocks.free(block_ids, by_cache=by_cache)
    for slot in held_slots:
        slots.free(slot)
    assert (pages.num_free, pages.num_free_runs, blocks.num_available_blocks) == (64, 8, 64)


def test_pools_must_match_the_table_they_share() -> None:
    pages = PageTable(45, 10)  # 4 runs
    with pytest.raises(ValueError, match="44 blocks, 45 pages"):
        BlockManager(44, 4, pages)
    with pytest.raises(ValueError, match="5 slots, 4 runs"):
        StateSlotPool(5, pages)
    assert BlockManager(45, 4, pages).num_free_blocks == 45 and StateSlotPool(4, pages).num_free_slots == 4


def test_the_split_pool_hands_ids_out_first_in_first_out() -> None:
    blocks, slots = BlockManager(6, 4), StateSlotPool(3)
    assert blocks.pages is None and slots.pages_per_slot == 0
    assert blocks.allocate(3) == [0, 1, 2] and [slots.allocate() for _ in range(3)] == [0, 1, 2]
    blocks.free([1])
    blocks.free([0])
    slots.free(2)
    slots.free(0)
    assert blocks.allocate(4) == [3, 4, 5, 1] and slots.allocate() == 2 and slots.allocate() == 0
    assert blocks.num_free_blocks == 1 and slots.allocate() is None


# -- the scheduler on a shared pool ------------------------------------------------------------------------------


def answer(plan: StepPlan) -> StepResult:
    """A fake runner: every sequence whose chunk reaches its end 'samples' token 7."""
    return StepResult(plan.step_id, tuple((7,) if s.needs_sample else () for s in plan.seqs))


def request(name: str, tokens: list[int], max_tokens: int) -> Sequence:
    return Sequence(name, tokens, max_tokens, sampling=SamplingParams(temperature=0.0))


def shared_scheduler(num_pages: int, per_slot: int, max_seqs: int, cache: bool = False) -> Scheduler:
    pages = PageTable(num_pages, per_slot)
    blocks, slots = BlockManager(num_pages, 4, pages), StateSlotPool(pages.num_runs, pages)
    return Scheduler(blocks, slots, max_seqs, 64, 440, enable_prefix_caching=cache, chunk_size=16)


def run_to_end(scheduler: Scheduler, holds: Callable[[], bool] = lambda: True, max_steps: int = 500) -> None:
    """Plans and answers one step at a time until nothing is left; fails where holds() is false after a step, or
    past max_steps."""
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return
        scheduler.update(plan := scheduler.schedule(), answer(plan))
        assert holds()
    raise AssertionError(f"not finished in {max_steps} steps: {scheduler.num_preemptions_total} preemptions")


def assert_disjoint(scheduler: Scheduler) -> None:
    """No page is both a KV block someone holds and inside a run held as a slot; the table counts the rest free."""
    pages, cache = scheduler.blocks.pages, scheduler.prefix_cache
    held_slots = [s.state_slot for s in scheduler.running if s.state_slot is not None]
    held_blocks = {b for s in scheduler.running for b in s.block_ids}
    if cache is not None:
        held_slots += [c.slot for c in cache.checkpoints()]
        held_blocks.update(b for c in cache.checkpoints() for b in c.block_ids)
    assert len(set(held_slots)) == len(held_slots)
    in_slots = set().union(*(run_pages(s, pages.pages_per_slot) for s in held_slots))
    assert not held_blocks & in_slots, sorted(held_blocks & in_slots)
    assert pages.num_free == pages.num_pages - len(held_blocks) - len(in_slots)


@pytest.mark.parametrize("cache", [False, True], ids=["cache-off", "cache-on"])
@pytest.mark.parametrize("in_flight", [1, 2])
def test_soak_on_a_shared_pool_ends_with_every_page_free(cache: bool, in_flight: int) -> None:
    """120 pages, runs of 10, 4-token blocks: prompts of up to 400 tokens (100 blocks + a slot's 10 pages: most of
    the pool) beside short ones, a few repeated (prefix-cache hits), one or two steps in flight."""
    rng = random.Random(11)
    scheduler = shared_scheduler(120, 10, 8, cache)
    pages = scheduler.blocks.pages
    shared = [[rng.randrange(1, 9999) for _ in range(rng.randrange(200, 400))] for _ in range(2)]
    seqs: list[Sequence] = []
    inflight: list[StepPlan] = []
    waited = most_used = 0
    for _ in range(3000):
        if len(seqs) < 40 and rng.random() < 0.2:
            kind = rng.random()
            if kind < 0.25:
                tokens = rng.choice(shared) + [rng.randrange(1, 9999) for _ in range(rng.randrange(1, 30))]
            else:
                length = rng.randrange(150, 400) if kind < 0.6 else rng.randrange(1, 40)
                tokens = [rng.randrange(1, 9999) for _ in range(length)]
            seqs.append(request(f"r{len(seqs)}", tokens, min(rng.randrange(1, 40), 440 - len(tokens))))
            scheduler.add(seqs[-1])
        if len(seqs) == 40 and not scheduler.has_unfinished() and not inflight:
            break
        if scheduler.has_unfinished():
            inflight.append(scheduler.schedule())
        if inflight and (len(inflight) == in_flight or not scheduler.has_unfinished()):
            plan = inflight.pop(0)
            scheduler.update(plan, answer(plan))
        assert_disjoint(scheduler)
        waited += scheduler.num_waiting_for_capacity > 0
        most_used = max(most_used, pages.num_pages - pages.num_free)
    else:
        raise AssertionError(f"not finished in 3000 steps: {scheduler.num_preemptions_total} preemptions")
    assert waited > 0 and most_used >= 100  # the pool was contended
    assert scheduler.num_preemptions_total <= 10
    assert all(s.finish_reason == "length" and len(s.output_token_ids) == s.max_tokens for s in seqs)
    if cache:
        assert scheduler.prefix_cache_hits > 0 and pages.num_free < 120  # checkpoints hold pages until reset
        assert scheduler.reset_prefix_cache()
    assert (pages.num_free, pages.num_free_runs) == (120, 12)


@pytest.mark.parametrize("shared", [True, False], ids=["one-pool", "split"])
def test_admission_counts_the_new_slots_pages(shared: bool) -> None:
    """a (40 tokens) runs: 11 blocks once it decodes, and in one pool its slot's 10 pages: 39 of 60 pages free. b's
    120 tokens (30 blocks, 16 of them in its first chunk) fit in those, its blocks and a slot's 10 pages do not: one
    pool makes b wait for a; split, b's blocks come from 49 free ones and its slot from a pool of its own."""
    if shared:
        scheduler = shared_scheduler(60, 10, 4)
    else:
        scheduler = Scheduler(BlockManager(60, 4), StateSlotPool(6), 4, 64, 440)
    scheduler.add(a := request("a", list(range(40)), 4))
    scheduler.update(plan := scheduler.schedule(), answer(plan))
    scheduler.add(b := request("b", list(range(100, 220)), 2))
    scheduler.update(plan := scheduler.schedule(), answer(plan))
    assert len(a.block_ids) == 11
    if shared:
        assert b.status is SequenceStatus.WAITING and scheduler.num_waiting_for_capacity == 1
        assert scheduler.blocks.num_free_blocks == 39 and b.state_slot is None and b.block_ids == []
    else:
        assert b.status is SequenceStatus.RUNNING and b.state_slot is not None and len(b.block_ids) == 16
    run_to_end(scheduler, lambda: not shared or b.status is not SequenceStatus.RUNNING or a.is_finished)
    assert len(a.output_token_ids) == 4 and len(b.output_token_ids) == 2
    assert scheduler.blocks.num_free_blocks == 60 and scheduler.slots.num_free_slots == 6


def test_a_slots_pages_are_reserved_with_the_blocks_evicting_checkpoints_for_them() -> None:
    """c's 40 tokens end as two checkpoints (at 32 and 40: two runs, 10 blocks): 10 pages free, all of run 3. d's 10
    blocks fit in those, its slot beside them does not: the admission evicts a checkpoint for the slot's pages
    (reserving the blocks alone, the slot would take the 10 free pages and the blocks' allocation would fail)."""
    scheduler = shared_scheduler(40, 10, 1, cache=True)
    pages, cache = scheduler.blocks.pages, scheduler.prefix_cache
    scheduler.add(c := request("c", list(range(40)), 1))
    scheduler.update(plan := scheduler.schedule(), answer(plan))
    assert c.is_finished and cache.num_checkpoints == cache.num_ready == 2
    assert (pages.num_free, pages.num_free_runs) == (10, 1)
    older = cache.checkpoints()[0]
    scheduler.add(d := request("d", list(range(500, 540)), 2))
    scheduler.update(plan := scheduler.schedule(), answer(plan))
    assert d.status is SequenceStatus.RUNNING and d.state_slot == 3 and d.block_ids == list(range(10, 20))
    assert older not in cache.checkpoints()  # evicted for the slot's pages (d's own chunk then saved two more)
    assert_disjoint(scheduler)
    run_to_end(scheduler)
    assert scheduler.reset_prefix_cache() and (pages.num_free, pages.num_free_runs) == (40, 4)


@pytest.mark.parametrize("cache", [False, True], ids=["cache-off", "cache-on"])
def test_admission_waits_for_a_free_run_and_allocates_nothing_meanwhile(cache: bool) -> None:
    """36 of 40 pages free but one page of every run held (by an outside holder here): an 8-token prompt's 2 blocks
    and 10 slot pages fit the count, yet no slot is to be had; it waits, holding nothing, until a run frees."""
    scheduler = shared_scheduler(40, 10, 2, cache)
    pages = scheduler.blocks.pages
    taken = pages.take(31)
    for page in taken:
        if page % 10:
            pages.give(page)
    assert (pages.num_free, pages.num_free_runs) == (36, 0)
    scheduler.add(a := request("a", list(range(8)), 3))
    assert scheduler.schedule().is_empty
    assert a.status is SequenceStatus.WAITING and a.block_ids == [] and a.state_slot is None and a.row is None
    assert pages.num_free == 36 and scheduler.rows.num_free == 2 and scheduler.num_waiting_for_capacity == 1
    pages.give(20)
    scheduler.update(plan := scheduler.schedule(), answer(plan))
    assert a.status is SequenceStatus.RUNNING and a.state_slot == 2 and a.block_ids == [1, 2]
    run_to_end(scheduler)
    assert scheduler.reset_prefix_cache() and len(a.output_token_ids) == 3
    assert (pages.num_free, pages.num_free_runs) == (37, 1)  # pages 0, 10 and 30 still held outside
