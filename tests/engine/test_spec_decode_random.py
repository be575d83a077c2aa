"""Speculative decoding of randomly sampled requests and vLLM's synthetic acceptance mode, end to end on the trained
tiny dense checkpoint (fp32, CPU) with its MTP drafts: seeded requests reproduce (whatever the batch and across
engines), random rows accept drafts, the logprobs reported are the emitted tokens', and the synthetic rates pin the
per-position acceptance. The random rule's distribution is checked by chi-square in tests/sampler/test_rejection.py.
"""

from __future__ import annotations

import pytest

from deltaserve.engine.llm import LLM
from deltaserve.sampling_params import SamplingParams
from deltaserve.tiny.trained import trained_model_dir
from tests.engine.test_spec_decode import make_prompts, run
from tests.engine.test_spec_decode_mtp import mtp_llm

MTP_K2 = {"method": "mtp", "num_speculative_tokens": 2}


def sampled(seed: int | None, **kwargs: object) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=0.95, seed=seed, max_tokens=20, ignore_eos=True, **kwargs)


@pytest.fixture(scope="module")
def spec_engine() -> tuple[LLM, dict]:
    return mtp_llm("dense", 2)


def test_seeded_requests_reproduce_and_accept_drafts(spec_engine: tuple[LLM, dict]) -> None:
    llm, stats = spec_engine
    prompts = make_prompts(llm)
    params = [sampled(seed=100 + i) for i in range(len(prompts))]
    first = [list(o.token_ids) for o in run(llm, prompts, params)]
    assert stats["verifies"] > 0 and stats["accepted_per_position"][0] > 0  # random rows speculate and accept
    # again in the same engine, alone (another batch), and in a fresh engine (other slots, rows, blocks)
    assert [list(o.token_ids) for o in run(llm, prompts, params)] == first
    assert list(run(llm, prompts[2:3], params[2:3])[0].token_ids) == first[2]
    fresh = LLM(trained_model_dir("dense"), dtype="float32", max_num_seqs=8, speculative_config=MTP_K2)
    assert [list(o.token_ids) for o in run(fresh, prompts, params)] == first
    other = [list(o.token_ids) for o in run(llm, prompts, [sampled(seed=7 + i) for i in range(len(prompts))])]
    assert other != first


def test_seeded_requests_give_the_tokens_without_mtp_also_when_preempted(spec_engine: tuple[LLM, dict]) -> None:
    """The coupled rule (sampler/rejection.py): a seeded row's drafts are judged by its own seeded draws, so it emits
    the tokens of the engine without MTP, also when preempted (its restart draws a token with no draft where the
    uninterrupted run verified one: the API differential soak saw a seeded request repeated under load differ)."""
    llm, stats = spec_engine
    prompts = make_prompts(llm)[:2]
    params = [sampled(seed=40 + i) for i in range(len(prompts))]
    plain = LLM(trained_model_dir("dense"), dtype="float32", max_num_seqs=8)
    expected = [list(o.token_ids) for o in run(plain, prompts, params)]
    before = stats["verifies"]
    assert [list(o.token_ids) for o in run(llm, prompts, params)] == expected
    assert stats["verifies"] > before
    engine = llm.engine
    for preempt_at in (1, 2, 3):
        states = []
        for i, (prompt, param) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(f"preempted-{preempt_at}-{i}", prompt, param)
            states.append(engine.requests[f"preempted-{preempt_at}-{i}"])
        step = 0
        while engine.has_unfinished():
            if step == preempt_at:
                assert engine.scheduler.preempt_all() == len(prompts)
            engine.step()
            step += 1
        assert [list(s.final_output().outputs[0].token_ids) for s in states] == expected, preempt_at


def test_logprobs_are_the_emitted_tokens(spec_engine: tuple[LLM, dict]) -> None:
    llm, stats = spec_engine
    prompts = make_prompts(llm)
    before = stats["accepted_per_position"][0]
    for output in run(llm, prompts, [sampled(seed=i, logprobs=1) for i in range(len(prompts))]):
        assert len(output.logprobs) == len(output.token_ids)
        for token, entries in zip(output.token_ids, output.logprobs, strict=True):
            assert token in entries and entries[token].logprob <= 0.0
    assert stats["accepted_per_position"][0] > before


def test_synthetic_rates_pin_the_acceptance() -> None:
    rates = [0.9, 0.5]
    config = {**MTP_K2, "rejection_sample_method": "synthetic", "synthetic_acceptance_rates": rates}
    llm = LLM(trained_model_dir("dense"), dtype="float32", max_num_seqs=8, speculative_config=config)
    core = llm.engine.core
    counts = {"verifies": 0, "per_position": [0, 0]}
    update = core.scheduler.update

    def counting_update(plan, result):  # noqa: ANN001, ANN202 (the scheduler's own signature)
        for item, tokens in zip(plan.seqs, result.token_ids, strict=True):
            if item.num_draft_tokens == 2:
                counts["verifies"] += 1
                for j in range(len(tokens) - 1):
                    counts["per_position"][j] += 1
        return update(plan, result)

    core.scheduler.update = counting_update
    prompts = make_prompts(llm) * 4
    outputs = run(llm, prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=0))
    assert all(len(o.token_ids) == 40 for o in outputs)
    for output in outputs:  # the logprobs are the emitted tokens' (accepted drafts are emitted whatever they are)
        assert all(token in entries for token, entries in zip(output.token_ids, output.logprobs, strict=True))
    verifies = counts["verifies"]
    assert verifies > 150
    for observed, rate in zip(counts["per_position"], rates, strict=True):
        # binomial: 4 standard deviations at these counts is below 0.16
        assert abs(observed / verifies - rate) < 0.16, (counts, rates)
