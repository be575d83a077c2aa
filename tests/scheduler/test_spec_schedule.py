"""Planning speculative decodes (scheduler/spec.py and its hooks in scheduler.py), with fake runner results: k + 1
tokens a decode, k capped by max_tokens / max_model_len / the step budget, no re-planning while a verify is in
flight, computed counts advanced by the accepted tokens, stops inside an accepted run."""

from __future__ import annotations

from deltaserve.sampling_params import StructuredOutputsParams
from deltaserve.scheduler.spec import SpecSchedule
from deltaserve.step import StepPlan, StepResult
from tests.scheduler.test_scheduler import answer, make_scheduler, seq


def spec_scheduler(k: int, **kwargs: object):  # noqa: ANN201
    scheduler = make_scheduler(**kwargs)
    scheduler.spec = SpecSchedule(k)
    return scheduler


def accept(plan: StepPlan, accepted: dict[int, list[int]], next_token: int = 7) -> StepResult:
    """A fake runner: a verify chunk at row r emits accepted[r]; the others sample next_token."""
    tokens = []
    for s in plan.seqs:
        if s.num_draft_tokens:
            tokens.append(tuple(accepted[s.row]))
        else:
            tokens.append((next_token,) if s.needs_sample else ())
    return StepResult(plan.step_id, tuple(tokens))


def test_a_decode_verifies_k_drafts_and_advances_by_the_accepted_count() -> None:
    scheduler = spec_scheduler(3)
    a = seq("a", 5, 20, temperature=0.0)
    scheduler.add(a)
    prefill = scheduler.schedule()
    scheduler.update(prefill, answer(prefill))
    plan = scheduler.schedule()
    (item,) = plan.seqs
    assert (item.num_computed_tokens, item.num_new_tokens, item.num_draft_tokens, item.needs_sample) == (5, 4, 3, True)
    assert len(a.block_ids) * 4 >= 9  # KV blocks for all 1 + k positions
    assert scheduler.schedule().is_empty  # in flight: its position depends on the accepted count
    scheduler.update(plan, accept(plan, {item.row: [11, 12]}))  # one draft accepted, then the target's token
    assert a.output_token_ids == [7, 11, 12] and a.num_computed_tokens == 7 and a.num_inflight_tokens == 0
    again = scheduler.schedule()
    assert again.seqs[0].num_computed_tokens == 7 and again.seqs[0].num_draft_tokens == 3


def test_k_is_capped_by_max_tokens_and_max_model_len_and_the_budget() -> None:
    scheduler = spec_scheduler(4, max_model_len=9)
    a = seq("a", 5, 3, temperature=0.0)  # 3 outputs: after the first, a verify may emit 2 (k = 1)
    b = seq("b", 4, 100, temperature=0.0)  # max_model_len 9: after its first output, 4 more tokens fit (k = 3)
    scheduler.add(a)
    scheduler.add(b)
    prefill = scheduler.schedule()
    scheduler.update(prefill, answer(prefill))
    plan = scheduler.schedule()
    assert [s.num_draft_tokens for s in plan.seqs] == [1, 3]
    tight = spec_scheduler(4, budget=3)
    c = seq("c", 2, 100, temperature=0.0)
    tight.add(c)
    prefill = tight.schedule()
    tight.update(prefill, answer(prefill))
    assert [s.num_draft_tokens for s in tight.schedule().seqs] == [2]  # 1 + k tokens within a 3-token budget


def test_what_speculates() -> None:
    """Penalties, random sampling, multi-token bad words and grammars speculate, a grammar that starts after a given
    token too (the engine masks the positions after that token where a draft is it); a sequence on its last token
    does not (a verify emits up to k + 1)."""
    scheduler = spec_scheduler(2)
    later = StructuredOutputsParams(regex="[0-9]+", start_after_token_id=9)
    for name, params in (
        ("penalty", {"temperature": 0.0, "presence_penalty": 1.0}),
        ("bad words", {"temperature": 0.0, "bad_words_token_ids": [[5, 6]]}),
        ("grammar", {"temperature": 0.0, "structured_outputs": StructuredOutputsParams(regex="[0-9]+")}),
        ("later", {"temperature": 0.0, "structured_outputs": later}),
        ("random", {"temperature": 0.8}),
    ):
        scheduler.add(seq(name, 3, 10, **params))
    scheduler.add(seq("last", 3, 2, temperature=0.0))
    prefill = scheduler.schedule()
    scheduler.update(prefill, answer(prefill))
    plan = scheduler.schedule()  # plain decodes first: the one on its last token, then the verify chunks
    # rows in the order added: penalty, bad words, grammar, later, random, last
    assert [(s.row, s.num_draft_tokens) for s in plan.seqs] == [(5, 0), (0, 2), (1, 2), (2, 2), (3, 2), (4, 2)]


def test_verify_chunks_sit_between_decodes_and_prefills() -> None:
    scheduler = spec_scheduler(2)
    scheduler.add(seq("plain", 3, 2, temperature=0.7))  # on its last token: a plain decode
    scheduler.add(seq("spec", 3, 10, temperature=0.0))
    prefill = scheduler.schedule()
    scheduler.update(prefill, answer(prefill))
    scheduler.add(seq("new", 6, 10, temperature=0.0))
    plan = scheduler.schedule()
    assert [(s.num_new_tokens, s.num_draft_tokens) for s in plan.seqs] == [(1, 0), (3, 2), (6, 0)]


def test_a_stop_inside_the_accepted_run_drops_the_rest() -> None:
    scheduler = spec_scheduler(3)
    a = seq("a", 4, 20, temperature=0.0, stop_token_ids=[12])
    scheduler.add(a)
    prefill = scheduler.schedule()
    scheduler.update(prefill, answer(prefill))
    plan = scheduler.schedule()
    scheduler.update(plan, accept(plan, {plan.seqs[0].row: [11, 12, 13, 14]}))
    assert a.output_token_ids == [7, 11, 12] and a.is_finished and a.finish_reason == "stop"
    assert scheduler.blocks.num_free_blocks == scheduler.blocks.num_blocks


def test_preemption_clears_the_inflight_verify() -> None:
    scheduler = spec_scheduler(2)
    a = seq("a", 4, 20, temperature=0.0)
    scheduler.add(a)
    prefill = scheduler.schedule()
    scheduler.update(prefill, answer(prefill))
    plan = scheduler.schedule()
    assert plan.seqs[0].num_draft_tokens == 2
    scheduler.preempt_all()
    scheduler.update(plan, accept(plan, {plan.seqs[0].row: [1, 2, 3]}))  # stale: dropped
    assert a.num_inflight_verifies == 0 and a.output_token_ids == [7]
    resumed = scheduler.schedule()
    assert resumed.seqs[0].num_new_tokens == 5 and resumed.seqs[0].num_draft_tokens == 0  # prompt + output, recomputed


def test_verify_chunks_per_step_are_capped_by_the_scratch() -> None:
    """The runner's scratch holds max_verifies verify chunks; the other decodes of the step go one token at a time."""
    scheduler = make_scheduler()
    scheduler.spec = SpecSchedule(2, max_verifies=1)
    for name in ("a", "b", "c"):
        scheduler.add(seq(name, 3, 10, temperature=0.0))
    prefill = scheduler.schedule()
    scheduler.update(prefill, answer(prefill))
    plan = scheduler.schedule()
    assert sorted(s.num_draft_tokens for s in plan.seqs) == [0, 0, 2]
    assert [s.num_draft_tokens for s in plan.seqs] == [0, 0, 2]  # plain decodes first, then the verify chunk


def test_a_prompts_last_token_after_a_chunk_that_sampled_nothing_verifies_no_drafts() -> None:
    # a 9-token prompt at a 8-token budget: the prefill leaves one token, whose chunk looks like a decode but follows
    # a step that sampled nothing, so the runner holds no drafts for the sequence's row
    scheduler = spec_scheduler(3, budget=8)
    a = seq("a", 9, 20, temperature=0.0)
    scheduler.add(a)
    first = scheduler.schedule()
    assert [(s.num_new_tokens, s.needs_sample) for s in first.seqs] == [(8, False)]
    scheduler.update(first, answer(first))
    last = scheduler.schedule()
    (item,) = last.seqs
    assert (item.num_computed_tokens, item.num_new_tokens, item.num_draft_tokens, item.needs_sample) == (8, 1, 0, True)
    scheduler.update(last, answer(last))
    decode = scheduler.schedule()  # the last token's step sampled it: its drafts follow
    assert decode.seqs[0].num_draft_tokens == 3


def test_async_verify_plans_the_next_chunk_behind_a_verify_in_flight() -> None:
    """With async_verify the decode behind a verify in flight is planned at the start that assumes every draft
    accepted (ScheduledSeq.is_chained); the counters follow the accepted counts when the results come back, and the
    length caps count the verify's 1 + k outputs while it is in flight."""
    scheduler = make_scheduler()
    scheduler.spec = SpecSchedule(3, async_verify=True)
    a = seq("a", 5, 9, temperature=0.0)
    scheduler.add(a)
    prefill = scheduler.schedule()
    scheduler.update(prefill, answer(prefill))
    first = scheduler.schedule()
    second = scheduler.schedule()  # planned before `first` is collected
    (one,), (two,) = first.seqs, second.seqs
    assert (one.num_computed_tokens, one.num_new_tokens, one.is_chained) == (5, 4, False)
    assert (two.num_computed_tokens, two.num_new_tokens, two.num_draft_tokens, two.is_chained) == (9, 4, 3, True)
    assert len(a.block_ids) * 4 >= 9 + 4 + 2  # the optimistic span and the drafter's lookahead
    assert a.num_pending_outputs == 8 and scheduler.schedule().is_empty  # two verifies in flight: no third
    scheduler.update(first, accept(first, {one.row: [11, 12]}))  # one draft accepted: the chained chunk starts at 7
    assert a.output_token_ids == [7, 11, 12] and a.num_computed_tokens == 7 and a.num_pending_outputs == 4
    third = scheduler.schedule()  # behind `second`, which is still in flight
    assert third.seqs[0].num_computed_tokens == 7 + 4 and third.seqs[0].is_chained
    scheduler.update(second, accept(second, {two.row: [13, 14, 15, 16]}))
    assert a.num_computed_tokens == 11 and a.output_token_ids[-4:] == [13, 14, 15, 16]
    (item,) = third.seqs
    assert item.num_draft_tokens == 1  # 9 outputs at most: 3 seen and 4 in flight when planned leave 2
    scheduler.update(third, accept(third, {item.row: [17, 18]}))
    assert a.is_finished and len(a.output_token_ids) == 9 and a.num_pending_outputs == 0


def test_rows_whose_next_step_depends_on_the_accepted_count_do_not_chain() -> None:
    spec = SpecSchedule(2, async_verify=True)
    plain = seq("a", 5, 20, temperature=0.0)
    plain.num_inflight_verifies = 1
    assert spec.can_chain(plain) and not SpecSchedule(2).can_chain(plain)
    grammar = seq("g", 5, 20, temperature=0.0, structured_outputs=StructuredOutputsParams(regex="[ab]+"))
    seeded = seq("s", 5, 20, temperature=0.7, seed=3)
    unseeded = seq("u", 5, 20, temperature=0.7)
    under = seq("m", 5, 20, temperature=0.0, min_tokens=4)
    for each in (grammar, seeded, unseeded, under):
        each.num_inflight_verifies = 1
    assert [spec.can_chain(s) for s in (grammar, seeded, unseeded, under)] == [False, False, True, False]
    under.output_token_ids = [1, 2, 3, 4]
    plain.num_inflight_verifies = 2
    assert spec.can_chain(under) and not spec.can_chain(plain)
