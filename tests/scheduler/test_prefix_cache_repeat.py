"""The repeat point and in-step checkpoints in the scheduler's plans (scheduler/checkpoint_targets.py,
docs/prefix-caching.md#where-states-are-saved): the second sighting of an identical prompt hits at R, the deepest
64-token grid position before its last token, which the first saved inside its chunk (no extra step); a branch point
inside a chunk no longer splits it; a request that asks for prompt logprobs saves R inside its uncut chunk; a grid
off an unaligned start is the chunk's own."""

from __future__ import annotations

from deltaserve.scheduler.checkpoint_targets import repeat_point
from tests.scheduler.test_prefix_cache import A, assert_accounted, make, request, run_to_end


def chunks_of(plans: list) -> list[tuple[int, int, list[int]]]:
    return [(s.num_computed_tokens, s.num_new_tokens, [p for p, _ in s.checkpoints]) for p in plans for s in p.seqs]


def test_the_second_sighting_of_a_prompt_hits_its_repeat_point() -> None:
    scheduler = make()
    cached = []
    for name in ("first", "second", "third"):
        scheduler.add(seq := request(name, A))
        plans = run_to_end(scheduler)
        cached.append(seq.num_cached_tokens)
        if name == "first":  # one chunk, as with the cache off: R = floor64(199) inside it, E at its end
            assert chunks_of(plans) == [(0, 200, [192, 200])]
        else:  # resumes at R; E is cached already and R is the chunk's own start: nothing saved
            assert chunks_of(plans) == [(192, 8, [])]
    assert cached == [0, 192, 192]
    assert (scheduler.prefix_cache_queries, scheduler.prefix_cache_hits) == (600, 384)
    assert_accounted(scheduler)


def test_the_repeat_point_is_on_the_grid_of_the_hit() -> None:
    assert repeat_point(request("a", A), 0, 64) == 192
    assert repeat_point(request("a", A), 130, 64) == 194  # 130 + 64: a grid off an unaligned resume start
    assert repeat_point(request("a", A), 136, 64) == 0  # 136 + 64 = 200 is the last token's end: none
    assert repeat_point(request("a", A[:64]), 0, 64) == 0


def test_a_branch_point_inside_a_chunk_does_not_split_it() -> None:
    scheduler = make()
    scheduler.add(request("a", A))
    run_to_end(scheduler)
    # b shares 150 tokens: its branch point 128 is on its chunk's grid, saved inside it
    scheduler.add(request("b", A[:150] + list(range(5000, 5050))))
    assert chunks_of(run_to_end(scheduler))[0] == (0, 200, [128, 200])
    # c shares them too: it hits 128 and computes only its own tokens
    scheduler.add(c := request("c", A[:150] + list(range(7000, 7030))))
    assert chunks_of(run_to_end(scheduler))[0][:2] == (128, 52) and c.num_cached_tokens == 128
    assert_accounted(scheduler)


def test_a_chunk_split_by_the_budget_saves_the_repeat_point_in_its_last_chunk() -> None:
    scheduler = make(budget=128)
    scheduler.add(request("a", A))
    assert chunks_of(run_to_end(scheduler)) == [(0, 128, []), (128, 72, [192, 200])]
    scheduler.add(b := request("b", A))
    run_to_end(scheduler)
    assert b.num_cached_tokens == 192


def test_prompt_logprobs_requests_save_the_repeat_point_in_their_uncut_chunk() -> None:
    scheduler = make()
    scheduler.add(request("a", A, prompt_logprobs=1))
    assert chunks_of(run_to_end(scheduler)) == [(0, 200, [192, 200])]
    scheduler.add(b := request("b", A))
    run_to_end(scheduler)
    assert b.num_cached_tokens == 192
    # periodic targets at 64, 128 and 192: the first is saved inside its one chunk, the others skipped, none cuts it
    scheduler = make(interval=64)
    scheduler.add(request("a", A, prompt_logprobs=1))
    assert chunks_of(run_to_end(scheduler)) == [(0, 200, [64, 200])]
