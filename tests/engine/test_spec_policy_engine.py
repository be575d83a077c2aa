"""The per-step k policy (scheduler/spec_policy.py) in the engine, on the trained tiny dense checkpoint with its MTP
drafts (fp32, CPU): greedy outputs are the outputs without speculation while the policy moves k step by step
(exactness never depends on k), also while it times its own steps (measure_cost, the default); in vLLM's synthetic
acceptance mode a low rate turns drafting down and a high one keeps k at the fixed token_cost; the start-up and change
lines are logged. The tests of the rules themselves fix token_cost (measure_cost false): a CPU step's measured cost is
whatever the machine makes it."""

from __future__ import annotations

import logging

import pytest

from deltaserve.engine.llm import LLM
from deltaserve.sampling_params import SamplingParams
from deltaserve.tiny.trained import trained_model_dir
from tests.engine.test_spec_decode import make_prompts, run

MAX_TOKENS = 24


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def policy_llm(spec: dict) -> tuple[LLM, list[tuple[int, int]]]:
    """An engine with `spec` and a record of (the policy's k_step, the drafts planned) per decode, from its plans."""
    config = {"method": "mtp", "num_speculative_tokens": 3, **spec}
    llm = LLM(trained_model_dir("dense"), dtype="float32", max_num_seqs=8, speculative_config=config)
    scheduler = llm.engine.core.scheduler
    steps: list[tuple[int, int]] = []
    schedule = scheduler.schedule

    def recording_schedule():  # noqa: ANN202 (the scheduler's own signature)
        plan = schedule()
        for item in plan.seqs:
            if item.num_computed_tokens and item.num_new_tokens == 1 + item.num_draft_tokens:  # a decode or a verify
                steps.append((scheduler.spec.policy.k_step, item.num_draft_tokens))
        return plan

    scheduler.schedule = recording_schedule
    return llm, steps


def test_greedy_outputs_do_not_depend_on_the_policys_k() -> None:
    plain = LLM(trained_model_dir("dense"), dtype="float32", max_num_seqs=8)
    prompts = make_prompts(plain)
    expected = [list(o.token_ids) for o in run(plain, prompts, greedy())]
    # batch rule: 5 decodes x (1 + k) <= 12 gives k = 1, one decode k = 3; the acceptance rule measures quickly
    policy = {"max_batch_tokens": 12, "probe_interval": 4, "window": 8, "min_samples": 2, "measure_cost": False}
    spec = {"k_policy": policy}
    llm, steps = policy_llm(spec)
    assert [list(o.token_ids) for o in run(llm, prompts, greedy())] == expected
    for prompt, tokens in zip(prompts, expected, strict=True):
        assert list(run(llm, [prompt], greedy())[0].token_ids) == tokens
    k_steps = {k_step for k_step, _ in steps}
    assert {0, 1, 3}.issubset(k_steps), k_steps  # the policy moved k: off, batch-capped and in full


@pytest.mark.parametrize(("rates", "max_share"), [([0.05, 0.0, 0.0], 0.25), ([0.95, 0.9, 0.85], None)])
def test_synthetic_low_acceptance_turns_drafting_down_and_high_keeps_k(
    rates: list[float], max_share: float | None, caplog: pytest.LogCaptureFixture
) -> None:
    spec = {
        "rejection_sample_method": "synthetic",
        "synthetic_acceptance_rates": rates,
        "k_policy": {"measure_cost": False},  # the defaults at the fixed token_cost
    }
    with caplog.at_level(logging.INFO, logger="deltaserve.scheduler.spec_policy"):
        llm, steps = policy_llm(spec)
        run(llm, make_prompts(llm), greedy(40))
    assert any("speculative k policy: k = 3 at most" in m and "token_cost 0.15" in m for m in caplog.messages)
    changes = [m for m in caplog.messages if m.startswith("speculative k policy: k 3 -> ")]
    drafting = sum(k > 0 for _, k in steps) / len(steps)
    if max_share is not None:
        assert drafting < max_share, drafting
        assert changes and changes[0].startswith("speculative k policy: k 3 -> 0 (acceptance: per-position")
    else:
        # every decode drafts k = 3 but where max_tokens caps it (a verify's k + 1 tokens must fit)
        assert sum(k == 3 for _, k in steps) / len(steps) > 0.8 and not changes


def test_a_policy_that_times_its_steps_keeps_greedy_outputs_and_measures_both_sides() -> None:
    """measure_cost on (the default), with the immature cadence's zero runs between the rule's verify steps: greedy
    tokens equal those without MTP, and the 4-decode bucket holds samples of plain steps and of steps with drafts.
    What k the measured cost then picks depends on this CPU's timings, so only the measurement is checked here."""
    plain = LLM(trained_model_dir("dense"), dtype="float32", max_num_seqs=8)
    prompts = make_prompts(plain)[:4]
    expected = [list(o.token_ids) for o in run(plain, prompts, greedy(32))]
    llm, steps = policy_llm({"k_policy": {"min_samples": 2, "window": 8}})
    assert [list(o.token_ids) for o in run(llm, prompts, greedy(32))] == expected
    policy = llm.engine.core.scheduler.spec.policy
    plain_samples, draft_samples = policy.step_cost.samples(4)
    assert plain_samples >= 1 and draft_samples >= 1, (plain_samples, draft_samples)
    assert {0, 3} <= {k for _, k in steps}
