"""The per-step k policy (scheduler/spec_policy.py) as a unit, from hand-built acceptance histories and batch sizes:
the batch rule, vLLM's num_speculative_tokens_per_batch_size, the acceptance rule at its break-even rate, the probes
that re-measure dropped positions, the start-up and change log lines (rate-limited), and its hooks in the scheduler
(k_step bounds each decode's drafts; applied verify results feed the estimates)."""

from __future__ import annotations

import logging
import random

import pytest

from deltaserve.scheduler.spec import SpecSchedule
from deltaserve.scheduler.spec_policy import FULL, ZERO, KPolicy, batch_schedule_k
from deltaserve.speculative_config import KPolicyConfig, SpeculativeConfig
from deltaserve.step import StepPlan
from tests.scheduler.test_scheduler import answer, make_scheduler, seq
from tests.scheduler.test_spec_schedule import accept

LOGGER = "deltaserve.scheduler.spec_policy"


def policy(k: int = 3, **config: object) -> KPolicy:
    """A policy at a fixed token_cost (measure_cost off, unless given): its rules alone, no step timing."""
    return KPolicy(k, KPolicyConfig(**{"max_batch_tokens": 0, "probe_interval": 1000, "measure_cost": False, **config}))


def feed(p: KPolicy, rates: list[float], num: int = 200) -> None:
    """num verifies of k drafts, each position accepted at the unrates rate given (non-increasing): of every
    20 verifies, the first round(20 x rate) accept position j."""
    for i in range(num):
        accepted = 0
        for rate in rates:
            if i % 20 >= round(20 * rate):
                break
            accepted += 1
        p.observe(len(rates), accepted)


def test_the_batch_rule_lowers_k_until_the_step_fits() -> None:
    p = policy(3, max_batch_tokens=32, token_cost=0.0)
    # decodes x (1 + k) <= 32: 8 x 4, 10 x 3 (10 x 4 = 40), 15 x 2, 16 x 2 = 32, 17 x 1 = 17 ... 31 x 1, 32 x 1
    expected = {1: 3, 8: 3, 9: 2, 10: 2, 11: 1, 16: 1, 17: 0, 40: 0}
    assert {n: p.plan_step(n) for n in expected} == expected
    assert "batch: 40 decodes" in p.reason
    assert policy(3, max_batch_tokens=0, token_cost=0.0).plan_step(1000) == 3  # 0: no batch rule


def test_a_step_whose_decodes_outnumber_the_verify_chunks_drafts_nothing() -> None:
    """The scratch holds 4 verify chunks (SpecSchedule hands the policy its max_verifies): 4 decodes draft k, 5
    draft none (a step of 4 verifies and a plain decode would fit no verify graph and run eager), whatever the
    other rules say; without a cap, 5 draft k."""
    p = policy(3, token_cost=0.0)
    SpecSchedule(3, max_verifies=4, policy=p)
    assert (p.plan_step(4), p.plan_step(5), p.plan_step(64)) == (3, 0, 0)
    assert "memory: 64 decodes, more than the 4 verify chunks" in p.reason
    assert policy(3, token_cost=0.0).plan_step(5) == 3


def test_vllms_batch_size_schedule() -> None:
    schedule = ((1, 4, 3), (8, 16, 1), (32, 64, 0))
    # in a range its k; in a gap the range's before it; past the last range the last one's; never above k
    assert [batch_schedule_k(schedule, b, 3) for b in (1, 4, 5, 7, 8, 16, 20, 32, 64, 500)] == [
        3,
        3,
        3,
        3,
        1,
        1,
        1,
        0,
        0,
        0,
    ]
    assert batch_schedule_k(((1, 2, 5),), 1, 2) == 2
    p = KPolicy(3, None, schedule)  # the vLLM key alone: no acceptance or batch rule
    assert [p.plan_step(n) for n in (2, 10, 40)] == [3, 1, 0]
    assert "num_speculative_tokens_per_batch_size at 40 decodes" in p.reason
    feed(p, [0.0, 0.0, 0.0])  # without k_policy nothing is estimated
    assert p.plan_step(2) == 3


@pytest.mark.parametrize(
    ("rates", "k_step"),
    [
        ([1.0, 1.0, 1.0], 3),
        ([0.9, 0.9, 0.9], 3),
        ([0.9, 0.9, 0.05], 2),  # p_2 = 0.04: below c x tokens per cost of k = 2 (0.15 x 2.71 / 1.3 = 0.31)
        ([0.9, 0.1, 0.0], 1),  # p_1 = 0.09 < 0.15 x 1.9 / 1.15 = 0.25
        ([0.1, 0.1, 0.1], 0),  # p_0 = 0.1 < c, and drafts 1 and 2 that always follow it do not pay: 1.3 / 1.45 < 1
        ([0.5, 0.5, 0.5], 3),  # (1 + 1.5) / 1.45 > 1.5 / 1.15 > 1
        ([0.05, 0.0, 0.0], 0),
    ],
)
def test_the_acceptance_rule_keeps_the_positions_that_pay(rates: list[float], k_step: int) -> None:
    p = policy(3, token_cost=0.15)
    assert p.plan_step(1) == 3  # nothing measured: every position counts as accepted
    feed(p, rates)
    assert p.plan_step(1) == k_step
    assert p.conditional_rates()[0] == pytest.approx(round(20 * rates[0]) / 20, abs=0.05)
    assert ("acceptance: per-position estimates" in p.reason) == (k_step < 3)


def test_the_break_even_rate_follows_the_token_cost() -> None:
    for cost, k_step in ((0.1, 1), (0.3, 0), (0.0, 3)):  # p_0 = 0.25: kept at c = 0.1, dropped at c = 0.3
        p = policy(3, token_cost=cost)
        feed(p, [0.25, 0.0, 0.0])
        assert p.plan_step(1) == k_step


def test_probes_remeasure_dropped_positions_and_a_change_in_traffic_is_seen() -> None:
    p = policy(3, token_cost=0.15, probe_interval=10, window=16)
    feed(p, [0.05, 0.0, 0.0], num=40)
    steps = [p.plan_step(2) for _ in range(30)]
    assert steps == [3 if (i + 1) % 10 == 0 else 0 for i in range(30)]  # every 10th decode step drafts in full
    assert p.plan_step(0) == 0 and p.plan_step(0) == 0  # steps without decodes are no probes
    # the traffic changes: the probes' verifies now accept everything, and k comes back
    k_steps = []
    for _ in range(60):
        k_step = p.plan_step(2)
        if k_step:
            for _ in range(2):
                p.observe(k_step, k_step)
        k_steps.append(k_step)
    assert k_steps[-1] == 3 and k_steps[:9] == [0] * 9


def test_the_log_lines_name_the_parameters_and_each_change_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    with caplog.at_level(logging.INFO, logger=LOGGER):
        p = KPolicy(3, KPolicyConfig(max_batch_tokens=32, probe_interval=1000), clock=lambda: now[0])
        start = caplog.messages[-1]
        for text in ("k = 3 at most", "max_batch_tokens 32", "token_cost 0.15", "probe_interval 1000", "window 64"):
            assert text in start
        assert "first guesses" in start
        caplog.clear()
        p.plan_step(20)  # 20 x 2 > 32: k 0
        assert caplog.messages == [
            "speculative k policy: k 3 -> 0 (batch: 20 decodes x (1 + k) above max_batch_tokens 32)"
        ]
        now[0] = 5.0
        p.plan_step(10)  # k 2, 5 s after the last line: not logged yet
        p.plan_step(9)
        assert len(caplog.messages) == 1
        now[0] = 11.0
        p.plan_step(9)  # the interval passed: the current state
        assert caplog.messages[-1].startswith("speculative k policy: k 0 -> 2 (batch: 9 decodes")
        now[0] = 30.0
        p.plan_step(2)  # back to k: the full count, no rule
        assert (
            caplog.messages[-1]
            == "speculative k policy: k 2 -> 3 (no rule lowers the configured num_speculative_tokens)"
        )
        p.plan_step(2)
        assert len(caplog.messages) == 3  # no change, no line


def test_the_scheduler_plans_k_step_and_feeds_the_policy() -> None:
    scheduler = make_scheduler()
    p = policy(3, token_cost=0.15, min_samples=1, window=1000)
    scheduler.spec = SpecSchedule(3, policy=p)
    a = seq("a", 5, 100, temperature=0.0)
    scheduler.add(a)
    plan = scheduler.schedule()
    scheduler.update(plan, answer(plan))
    drafts = []
    for _ in range(4):
        plan = scheduler.schedule()
        (item,) = plan.seqs
        drafts.append(item.num_draft_tokens)
        # every draft rejected: the verify emits only the target's token
        scheduler.update(plan, accept(plan, {item.row: [12]}) if item.num_draft_tokens else answer(plan))
    assert drafts == [3, 0, 0, 0]  # position 0 measured at rate 0: no drafting
    assert p.conditional_rates()[0] == 0.0 and a.num_computed_tokens == 5 + 4


def test_from_config_builds_the_policy_asked_for_and_logs_when_it_is_off(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert KPolicy.from_config(SpeculativeConfig(num_speculative_tokens=2)) is None
        assert caplog.messages[-1].startswith("speculative k policy: off, every decode drafts k = 2")
        on = KPolicy.from_config(SpeculativeConfig(num_speculative_tokens=2, k_policy=KPolicyConfig()))
        assert on is not None and on.config == KPolicyConfig() and on.batch_schedule is None
        scheduled = KPolicy.from_config(
            SpeculativeConfig(num_speculative_tokens=2, num_speculative_tokens_per_batch_size=((1, 4, 1),))
        )
        assert scheduled is not None and scheduled.config is None and scheduled.plan_step(2) == 1
        assert "num_speculative_tokens_per_batch_size [[1, 4, 1]]; k_policy off" in caplog.messages[-2]


def test_the_plan_asks_for_the_drafts_the_next_step_may_verify_and_a_verify_uses_no_more() -> None:
    """StepPlan.num_drafts_next is the policy's k for the decodes of the next step (the batch rules' k before a
    probe); a decode drafts at most what the last plan that sampled its sequence asked for, also when that plan is
    still in flight (async scheduling); without a policy the plan leaves it to the runner's k (None)."""
    scheduler = make_scheduler()
    p = policy(3, token_cost=0.15, min_samples=1, window=1000, probe_interval=4)
    scheduler.spec = SpecSchedule(3, policy=p)
    a = seq("a", 5, 100, temperature=0.0)
    scheduler.add(a)
    plan = scheduler.schedule()
    assert plan.num_drafts_next == 3 and a.num_drafts_ready == 3  # a fresh policy drafts k
    scheduler.update(plan, answer(plan))
    record = []  # (drafts planned, num_drafts_next) per step
    for i in range(7):
        if i == 5:  # the traffic changes: every position now accepted, k_step back to 3 at once
            for _ in range(50):
                p.observe(3, 3)
        plan = scheduler.schedule()
        (item,) = plan.seqs
        record.append((item.num_draft_tokens, plan.num_drafts_next))
        scheduler.update(plan, accept(plan, {item.row: [12]}) if item.num_draft_tokens else answer(plan))
    # the first verify's drafts are all rejected: k_step 0 and nothing proposed, but the 4th decode step is a probe,
    # so the 3rd proposes its 3 (the 4th none: the rule says 0 for the 5th); at the 6th k_step is 3 again, but the
    # 5th proposed 0: the 6th verifies none, the 7th 3
    assert record == [(3, 3), (0, 0), (0, 3), (3, 0), (0, 0), (0, 3), (3, 3)]
    # async: the next step is planned before this one is collected; its verify is capped by this plan's proposal
    scheduler.spec = SpecSchedule(3, policy=policy(3, max_batch_tokens=7))
    b = seq("b", 5, 100, temperature=0.0)
    scheduler.add(b)
    first = scheduler.schedule()  # a verify of a (1 decode x (1 + 3) fits 7), b's prefill
    # next come 2 decodes (a once collected, b behind its prefill): 2 x (1 + 2) fits 7
    assert [s.num_draft_tokens for s in first.seqs] == [3, 0] and first.num_drafts_next == 2
    scheduler.update(first, accept(first, {a.row: [12]}))
    c = seq("c", 5, 100, temperature=0.0)
    scheduler.add(c)
    second = scheduler.schedule()  # a and b verify 2 drafts; c's prefill; next come 3 decodes: k 1
    assert [s.num_draft_tokens for s in second.seqs] == [2, 2, 0] and second.num_drafts_next == 1
    third = scheduler.schedule()  # second in flight: c decodes behind its prefill, k_step 3 but 1 draft proposed
    assert scheduler.spec.policy.k_step == 3 and [(s.row, s.num_draft_tokens) for s in third.seqs] == [(c.row, 1)]
    scheduler.spec = SpecSchedule(3)  # vLLM's fixed k: the plan leaves the count to the runner
    scheduler.update(second, accept(second, {a.row: [12], b.row: [13]}))
    scheduler.update(third, accept(third, {c.row: [14]}))
    plan = scheduler.schedule()
    assert plan.num_drafts_next is None and [s.num_draft_tokens for s in plan.seqs] == [1, 1, 1]
    scheduler.update(plan, accept(plan, {a.row: [12], b.row: [13], c.row: [14]}))
    assert [s.num_draft_tokens for s in scheduler.schedule().seqs] == [3, 3, 3]


# -- the measured step cost (k_policy.measure_cost, scheduler/step_cost.py) ---------------------------------------

PUBLISHED = [0.917, 0.837, 0.648]  # conditional per-position acceptance (Qwen3.6-27B, k = 3)
MOE_C1 = {False: 0.0024, True: 0.0109}  # period of a plain step, of a step at k 3 (35B-A3B shape, 1 decode)
DENSE_C1 = {False: 0.01324, True: 0.01479}  # the 27B shape: a 4-token step costs little more than a 1-token one


class Clock:
    """The policy's clock, driven by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def measuring(clock: Clock, k: int = 3, **config: object) -> KPolicy:
    return KPolicy(k, KPolicyConfig(**{"max_batch_tokens": 0, **config}), clock=clock)


def simulate(
    p: KPolicy, clock: Clock, periods: dict[bool, float], num_steps: int, num_decodes: int = 1
) -> list[tuple[int, str | None, int, int]]:
    """Drives p as the scheduler and a synchronous runner would: per step plan_step, then num_drafts_next (the
    proposal; the step after verifies at most it), the step runs for its kind's period (the first step after a change
    of kind 5 ms longer: it is no steady-state sample, and were it one the means would show it), each decode's
    verify accepts by the PUBLISHED rates (seeded), and the step is collected. Returns (k_step, probe, drafts
    verified, drafts proposed after it) per step."""
    rng = random.Random(0)
    proposed, last_kind, record = p.k, None, []
    for _ in range(num_steps):
        k_step = p.plan_step(num_decodes)
        drafts = min(k_step, proposed)
        proposed = p.num_drafts_next(num_decodes)
        clock.now += periods[drafts > 0] + (0.005 if last_kind not in (None, drafts > 0) else 0.0)
        last_kind = drafts > 0
        for _ in range(num_decodes if drafts else 0):
            accepted = 0
            while accepted < drafts and rng.random() < PUBLISHED[accepted]:
                accepted += 1
            p.observe(drafts, accepted)
        p.step_collected(num_decodes, drafts * num_decodes, True)
        record.append((k_step, p.probe, drafts, proposed))
    return record


def settled_from(record: list[tuple[int, str | None, int, int]], k_step: int) -> int:
    """The first step from which every step that is no probe runs at k_step."""
    off = [i for i, (k, probe, _, _) in enumerate(record) if probe is None and k != k_step]
    return off[-1] + 1 if off else 0


def test_a_measured_expensive_verify_turns_drafting_off_and_a_cheap_one_keeps_k(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The first H200 run's figures: on the 35B-A3B shape at c1 a step at k 3 costs 10.9 ms against 2.4 ms, c =
    (10.9 / 2.4 - 1) / 3 = 1.18, and at the published acceptance no k pays ((1 + 0.917 + 0.767 + 0.497) / (1 + 3c) <
    1): the policy drafts nothing but its probes. On the 27B shape (14.79 against 13.24 ms, c = 0.039) it keeps k 3.
    The prior (0.15) alone would keep k 3 on both."""
    clock = Clock()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        p = measuring(clock)
        record = simulate(p, clock, MOE_C1, 300)
    assert p.step_cost.periods(1) == pytest.approx((0.0024, 0.0109, 3.0))  # steady-state periods only
    assert p.token_cost_at(1) == (pytest.approx((0.0109 / 0.0024 - 1) / 3), "measured token_cost 1.18 at 1 decode")
    assert settled_from(record, 0) <= 60
    assert {probe for _, probe, drafts, _ in record[60:] if drafts} == {FULL}  # only full probes draft
    changes = [m for m in caplog.messages if m.startswith("speculative k policy: k 3 -> 0")]
    assert changes and changes[0].endswith("below break-even at measured token_cost 1.18 at 1 decode)"), changes
    clock = Clock()
    p = measuring(clock)
    record = simulate(p, clock, DENSE_C1, 300)
    assert p.token_cost_at(1)[0] == pytest.approx((0.01479 / 0.01324 - 1) / 3)
    assert settled_from(record, 3) <= 60
    assert {k_step for k_step, probe, _, _ in record if probe == ZERO} == {0}  # its zero probes still time plain steps


def test_the_prior_decides_until_both_sides_of_the_bucket_are_measured(caplog: pytest.LogCaptureFixture) -> None:
    """A prior of 2.0 drafts nothing; the full runs of the immature cadence measure the drafts side, and once the
    cheap verify is measured the policy drafts k."""
    clock = Clock()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        p = measuring(clock, token_cost=2.0)
        assert p.token_cost_at(1) == (2.0, "token_cost 2.0 (prior)")
        record = simulate(p, clock, DENSE_C1, 5)
        assert [k for k, *_ in record] == [0] * 5 and p.token_cost_at(1)[1] == "token_cost 2.0 (prior)"
        assert caplog.messages[-1].endswith("below break-even at token_cost 2.0 (prior))")
        record += simulate(p, clock, DENSE_C1, 55)
    assert p.step_cost.samples(1)[1] >= 8 and settled_from(record, 3) <= 40
    assert p.token_cost_at(1)[1] == "measured token_cost 0.04 at 1 decode"
    assert p.token_cost_at(2) == (2.0, "token_cost 2.0 (prior)")  # another bucket: not measured yet


def test_an_unmeasured_bucket_starts_from_the_largest_c_measured_below_it() -> None:
    """The H200's c8 run after c1 on one server (2026-12-05): c1 had measured c = 1.01 and drafting off, and the 5-8
    bucket, unmeasured, took the prior 0.15 and drafted k 3 until its own samples came in (TPOT 10.68 ms against
    6.71 without MTP). Now an unmeasured bucket starts from the largest c measured below it (where that exceeds the
    prior), so the c8 steps start at k 0; the immature cadence still measures the bucket, and its own c then rules
    (here a cheap verify at 8 decodes: k 3)."""
    clock = Clock()
    p = measuring(clock)
    simulate(p, clock, MOE_C1, 120)
    c1 = p.token_cost_at(1)[0]
    assert c1 == pytest.approx((0.0109 / 0.0024 - 1) / 3)
    assert p.token_cost_at(8) == (c1, "token_cost 1.18 (measured at 1 decode, until this bucket is)")
    assert p.step_cost.largest_below(1) is None and p.step_cost.largest_below(2) == (c1, 1)
    record = simulate(p, clock, DENSE_C1, 6, num_decodes=8)
    assert [k for k, probe, _, _ in record if probe is None] == [0] * 5  # not the prior's k 3
    record += simulate(p, clock, DENSE_C1, 80, num_decodes=8)
    assert p.token_cost_at(8)[1] == "measured token_cost 0.04 at 5-8 decodes" and settled_from(record, 3) <= 60
    # a prior above what was measured below stays the prior
    clock = Clock()
    p = measuring(clock, token_cost=2.0)
    simulate(p, clock, MOE_C1, 120)
    assert p.token_cost_at(8) == (2.0, "token_cost 2.0 (prior)")


def test_probes_run_three_steps_full_and_zero_by_turns_fed_by_the_immature_cadence_and_predicted() -> None:
    clock = Clock()
    p = measuring(clock)
    record = simulate(p, clock, MOE_C1, 160)
    probes = {step: probe for step, (_, probe, _, _) in enumerate(record, start=1) if probe is not None}
    # the rule drafts at first (the prior): zero runs every 6th step until the plain side has 8 (weighted) samples,
    # 2 a run (a run's first step follows a change of kind), with the drafts side measured by the rule's own steps
    immature = {s: ZERO for start in (6, 12, 18, 24, 30) for s in range(start, start + 3)}
    # then every probe_interval (50) steps, full and zero by turns
    regular = {s: kind for start, kind in ((50, FULL), (100, ZERO), (150, FULL)) for s in range(start, start + 3)}
    assert probes == immature | regular
    # num_drafts_next predicted every probe: the step before a full probe proposed k, the one before a zero probe none
    for step, probe in probes.items():
        assert record[step - 2][3] == (3 if probe == FULL else 0), step
    assert all(drafts == k for k, _, drafts, _ in record)  # no step was planned more drafts than proposed
    # a bucket lacking the drafts side while the rule drafts nothing gets full runs instead
    p = measuring(Clock(), token_cost=2.0)
    assert [(p.plan_step(1), p.probe) for _ in range(9)][5:] == [(3, FULL)] * 3 + [(0, None)]
    # token_cost 0 (no acceptance rule) and measure_cost false measure nothing: one full probe every probe_interval
    for config in ({"token_cost": 0.0}, {"measure_cost": False}):
        p = measuring(Clock(), probe_interval=4, **config)
        assert p.step_cost is None
        assert [p.plan_step(1) == 3 and p.probe for _ in range(8)] == [None, None, None, FULL] * 2


def test_a_step_runs_the_probe_its_proposal_assumed() -> None:
    """A sample collected between a plan's num_drafts_next and the next plan_step may change the immature cadence's
    choice; the step keeps the probe decision its proposal was made for (here a zero run, not a full one that would
    find no drafts)."""
    clock = Clock()
    p = measuring(clock, min_samples=1)
    for _ in range(5):
        p.plan_step(1)
    p.step_collected(1, 0, True)  # no sample: no collected plan before it
    assert p.step_cost.lacking(1) == (True, True)
    assert p.num_drafts_next(1) == 0  # the 6th counted step starts a zero run: nothing to propose
    clock.now += 0.002
    p.step_collected(1, 0, True)  # the plain side is measured now: left alone, the 6th would start a full run
    assert p.step_cost.lacking(1) == (False, True)
    assert [(p.plan_step(1), p.probe) for _ in range(4)] == [(0, ZERO)] * 3 + [(3, None)]


def test_only_steady_state_periods_are_samples() -> None:
    """A sample is a decode-only plan after a decode-only plan of the same bucket and kind, less than 1 s after it;
    a change of kind, a mixed plan (a prefill chunk beside the decodes) and an idle gap are none."""
    clock = Clock()
    p = measuring(clock, window=4)
    keep = 1.0 - 1.0 / 4
    steps = [  # (time, decodes, drafts, decode-only, (plain, drafts) samples of bucket 1 after it)
        (0.000, 1, 0, True, (0, 0)),  # nothing before it
        (0.002, 1, 0, True, (1, 0)),
        (0.004, 1, 3, True, (1, 0)),  # a change of kind
        (0.015, 1, 3, True, (1, 1)),
        (0.030, 2, 5, False, (1, 1)),  # a mixed plan
        (0.040, 1, 3, True, (1, 1)),  # after a mixed plan
        (0.051, 1, 3, True, (1, 1 + keep)),
        (2.051, 1, 3, True, (1, 1 + keep)),  # a 2 s gap: idle, not a step
        (2.062, 1, 3, True, (1, 1 + keep + keep**2)),
        (2.070, 2, 6, True, (1, 1 + keep + keep**2)),  # another bucket
    ]
    for now, decodes, drafts, decode_only, samples in steps:
        clock.now = now
        p.step_collected(decodes, drafts, decode_only)
        assert p.step_cost.samples(1) == pytest.approx(samples), now
    assert p.step_cost.samples(2) == (0, 0)
    assert p.step_cost.periods(1) == pytest.approx((0.002, 0.011, 3.0))
    for now, decodes in ((2.080, 3), (2.090, 4), (2.095, 5)):  # 3 and 4 share a bucket, 5 starts the next
        clock.now = now
        p.step_collected(decodes, 0, True)
    assert p.step_cost.samples(4) == (1, 0) and p.step_cost.samples(5) == (0, 0)
    # min_samples (8) above what a window of 4 can weigh (4 at most): window / 2 samples measure a side
    assert p.step_cost.lacking(1) == (True, False) and p.step_cost.lacking(4) == (True, True)


def test_the_scheduler_reports_each_collected_plan() -> None:
    """Scheduler.update hands the policy every collected plan's decodes, drafts and whether it was decode-only: a
    prefill and a plan mixing a prefill chunk with the decodes are not samples, its decodes and verifies are."""
    clock = Clock()
    scheduler = make_scheduler()
    p = measuring(clock, min_samples=1)
    scheduler.spec = SpecSchedule(3, policy=p)
    calls = []
    collected = p.step_collected
    p.step_collected = lambda *shape: (calls.append(shape), collected(*shape))  # type: ignore[method-assign]
    a = seq("a", 5, 100, temperature=0.0)
    scheduler.add(a)

    def step() -> StepPlan:
        plan = scheduler.schedule()
        clock.now += 0.010 if any(s.num_draft_tokens for s in plan.seqs) else 0.002
        verifies = {s.row: [12] for s in plan.seqs if s.num_draft_tokens}
        scheduler.update(plan, accept(plan, verifies) if verifies else answer(plan))
        return plan

    for _ in range(12):
        step()
    assert calls[0] == (0, 0, False)  # a's prefill
    assert set(calls[1:]) == {(1, 3, True), (1, 0, True)}  # verifies, and zero probes' decodes
    assert p.step_cost.periods(1) == pytest.approx((0.002, 0.010, 3.0))
    before = p.step_cost.samples(1)
    scheduler.add(seq("b", 5, 100, temperature=0.0))
    plan = step()
    assert len(plan.seqs) == 2 and calls[-1][2] is False  # a's decode beside b's prefill
    step()  # a and b decode: another bucket, after a mixed plan
    assert p.step_cost.samples(1) == before and calls[-1][:1] == (2,)
