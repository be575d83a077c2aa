"""The second sighting of an identical prompt hits (docs/prefix-caching.md#where-states-are-saved): the first saves
its repeat point R = floor64(L - 1) inside a prefill chunk (in-step, no extra step), and the second and later ones
resume there; greedy tokens equal the cache-off engine's, fp32 on the CPU on the trained tiny dense / moe / next,
under chunked prefill (a 96-token budget with periodic targets), async scheduling on and off, forced preemption in a
small KV pool, and with MTP speculation (k = 2: the spec-decode counters equal too). The hits are read from the
scheduler's counters and the requests' cached tokens, the chunks from the plans.
"""

from __future__ import annotations

import pytest

from deltaserve.engine.llm import LLM
from deltaserve.tiny.trained import trained_model_dir
from tests.engine import test_prefix_cache_mtp as mtp
from tests.engine.test_prefix_cache_exact import CORPUS, GREEDY, hits_of, make_llm

LENGTH = 250
R = 192  # floor64(LENGTH - 1)


def sightings(llm: LLM) -> tuple[dict[str, list], list[int], list[int]]:
    """The same 250-token prompt alone, again, then twice together with every running request preempted after
    their first step: (outputs, the hits of each round, the chunk sizes the first sighting was planned in)."""
    prompt = llm.engine.tokenizer.encode(CORPUS)[:LENGTH]
    scheduler = llm.engine.scheduler
    planned: list[int] = []
    schedule = scheduler.schedule

    def recording_schedule():  # noqa: ANN202 (Scheduler.schedule's own signature)
        plan = schedule()
        planned.extend(s.num_new_tokens for s in plan.seqs if s.num_computed_tokens < LENGTH)
        return plan

    scheduler.schedule = recording_schedule
    outputs, hits = {}, []
    for round_, names in enumerate((["first"], ["second"], ["third", "fourth"])):
        if round_:
            scheduler.schedule = schedule  # only the first sighting's chunks are recorded
        out, hit = hits_of(llm, dict.fromkeys(names, (prompt, GREEDY)), preempt_at=1 if round_ == 2 else -1)
        outputs |= out
        hits.append(hit)
    return outputs, hits, planned


@pytest.mark.parametrize(("variant", "is_async"), [("dense", True), ("dense", False), ("moe", True), ("next", True)],
                         ids=["dense-async", "dense-sync", "moe-async", "next-async"])  # fmt: skip
def test_the_second_sighting_hits_and_gives_the_tokens_of_the_cache_off_run(variant: str, is_async: bool) -> None:
    model_dir = trained_model_dir(variant)
    off, _, off_chunks = sightings(make_llm(model_dir, False, is_async))
    on_llm = make_llm(model_dir, True, is_async)
    on, hits, on_chunks = sightings(on_llm)
    assert on == off
    # 96-token budget, the periodic target at 128 cuts as before; R (192) is saved inside [128, 224): no extra step
    assert on_chunks == [96, 32, 96, 26] and off_chunks == [96, 96, 58]
    assert hits[0] == 0 and hits[1] == R and hits[2] >= 2 * R
    assert on_llm.engine.scheduler.num_preemptions_total > 0


@pytest.mark.parametrize("variant", ["dense", "next"])
def test_the_second_sighting_hits_with_mtp_and_drafts_as_without_the_cache(variant: str) -> None:
    """k = 2: greedy tokens, the spec-decode counters and the drafts each verify step checked equal the cache-off
    engine's for each sighting; the second hits at R (the in-step checkpoint holds the hidden row of R - 1)."""
    found = {}
    for is_on in (False, True):
        llm, drafts = mtp.make_llm(variant, 2, is_on)
        prompt = llm.engine.tokenizer.encode(CORPUS)[:LENGTH]
        rounds = []
        for name in ("first", "second", "third"):
            drafts.clear()
            outputs, counters, hits = mtp.run(llm, {name: prompt})
            rounds.append((outputs, counters, hits, list(drafts)))
        found[is_on] = rounds
    for index, (on, off) in enumerate(zip(found[True], found[False], strict=True)):
        assert on[0] == off[0] and on[1] == off[1] and on[3] == off[3], f"sighting {index}"
    assert [hits for _, _, hits, _ in found[True]] == [0, R, R]


def test_cache_salt_shares_prefixes_only_within_a_salt() -> None:
    """vLLM's cache_salt on an offline prompt ({"prompt_token_ids": ..., "cache_salt": ...}): a prompt hits only what
    prompts of its own salt cached, with the cache-off engine's tokens; an empty salt is refused before anything is
    queued, as vLLM refuses it."""
    llm = make_llm(trained_model_dir("dense"), is_on=True, is_async=True)
    prompt = llm.engine.tokenizer.encode(CORPUS)[:LENGTH]

    def cached(salt: str | None) -> tuple[int, list[int]]:
        item = {"prompt_token_ids": prompt} if salt is None else {"prompt_token_ids": prompt, "cache_salt": salt}
        (output,) = llm.generate([item], GREEDY, use_tqdm=False)
        return output.num_cached_tokens, list(output.outputs[0].token_ids)

    first, tokens = cached("a")
    assert first == 0 and cached("a") == (R, tokens)
    # another salt, then none: each misses what the others cached and hits its own from its second sighting (in
    # turn: the small pool's LRU may evict an earlier salt's checkpoints)
    assert cached("b") == (0, tokens) and cached("b") == (R, tokens)
    assert cached(None) == (0, tokens) and cached(None) == (R, tokens)
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate([{"prompt_token_ids": prompt}, {"prompt_token_ids": prompt, "cache_salt": ""}], GREEDY)
    assert not llm.engine.has_unfinished()
