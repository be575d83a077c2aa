"""The per-step k policy: how many drafts each decode of a step verifies, from the step's batch and the measured
acceptance (docs/speculative-decoding.md#the-k-policy).

Per step, `KPolicy.plan_step(num_decodes)` sets `k_step` (0 .. k, the configured num_speculative_tokens) for the
step's decodes: 0 when they outnumber the verify chunks the runner's scratch holds (`max_verifies`: such a step would
verify some and decode the rest, and fit no verify graph), else the lowest of:
- vLLM's `num_speculative_tokens_per_batch_size` schedule at the step's decode count, where one is configured;
- the batch rule (k_policy.max_batch_tokens = B): the largest k' with decodes x (1 + k') <= B, 0 when even k' = 1
  exceeds it. A MoE verify reads up to (1 + k') x the experts a decode does; at a large batch the experts are read
  anyway, so a draft no longer saves a read;
- the acceptance rule (k_policy.token_cost = c): with the cost model "a decode that verifies k' drafts costs
  1 + c k' plain decode steps", and p_j the measured unconditional acceptance of draft position j (the product of
  the per-position conditional estimates), a step emits (1 + p_0 + ... + p_(k'-1)) / (1 + c k') tokens per unit of
  cost; the rule takes the k' that maximises it (the smallest of equal ones). So a trailing position is dropped
  exactly when its p_j is below c times the tokens per cost of the positions before it (the break-even rate), and
  k' = 0 when p_0 < c.
The acceptance rule's c is measured where k_policy.measure_cost is on (the default): the policy times its own
steps (`step_collected`, called by the scheduler for every collected plan) and keeps, per batch bucket of the
decode count (1, 2, 3-4, 5-8, ...), the mean period of plain steps (T0) and of steps with drafts (P, with their
drafts per decode k_eff) in a StepCost (scheduler/step_cost.py); a bucket's c is max(0, (P / T0 - 1) / k_eff) once
both sides have min_samples samples, token_cost (the prior) before. A period is a sample only in steady state: the
plan and the plan collected before it are both decode-only (every chunk a decode or a verify chunk of a computed
sequence), of the same bucket and the same kind (drafts or none), and it is below STEADY_PERIOD_S (an idle gap is no
step). The kind matters because under async scheduling a plain decode is planned while the step before it runs, but
a speculating sequence is not planned again until its verify is collected, so the first step after a change of kind
does not cost what a run of its kind costs.

Probes: without measurement, every probe_interval-th counted step (one with decodes) drafts the batch rules' k in full
(the acceptance rule skipped), so positions the acceptance rule dropped are measured again and a change in traffic is
seen. With measurement, probes are runs of PROBE_RUN_STEPS counted steps (the first of a run is no sample, above): at
every probe_interval-th counted step, "full" runs (as above) and "zero" runs (k 0, which time plain steps while the
rule drafts) by turns; and while the bucket of a step's decode count lacks min_samples on a side, a run of that side's
kind at every IMMATURE_PROBE_INTERVAL-th counted step (both lacking: the kind the rule is not running now), so a
bucket is measured within a few dozen steps. token_cost 0 turns the acceptance rule off, and with it the measurement
and its runs. `num_drafts_next(next_decodes)` is what the runner proposes after a step
(StepPlan.num_drafts_next): the same rules for the step after it, probes included (a zero step needs no drafts
proposed, a full one k); with measurement its probe decision is kept for that step, so the step does what its
proposal assumed.

The estimates come from the results the scheduler applies (`observe`): a verify of n drafts that accepted a of them
tried positions 0 .. min(a, n - 1) and accepted positions 0 .. a - 1. Each position keeps exponentially weighted
counts over about `window` observations; a position with fewer than `min_samples` (weighted) observations counts as
always accepted, so drafting starts at full k and every position is measured before it can be dropped.

Plain Python, no torch; the engine core builds one per engine, the scheduler drives it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from deltaserve.scheduler.step_cost import StepCost, bucket_label, bucket_of
from deltaserve.speculative_config import KPolicyConfig, SpeculativeConfig

logger = logging.getLogger(__name__)

K_POLICY_LOG_INTERVAL_S = 10.0  # at most one k change line per this many seconds (the latest state is logged)
PROBE_RUN_STEPS = 3  # counted steps of a measuring probe run: the first is no steady-state sample, the others are
IMMATURE_PROBE_INTERVAL = 6  # counted steps between the runs that feed a bucket's side lacking samples
STEADY_PERIOD_S = 1.0  # a collected-step period at or above this is an idle gap, not a step's cost
FULL, ZERO = "full", "zero"  # probe kinds: the acceptance rule skipped / no drafts at all


def batch_schedule_k(schedule: tuple[tuple[int, int, int], ...], batch_size: int, k: int) -> int:
    """vLLM's num_speculative_tokens_per_batch_size at `batch_size` (validated, sorted ranges from 1): the k of the
    range holding it, in a gap the range's before it, past the last range the last one's; never above k."""
    chosen = k
    for first, _, k_range in schedule:
        if first > batch_size:
            break
        chosen = k_range
    return min(chosen, k)


class KPolicy:
    """Chooses each step's k (module docstring); `k_step` is the step being planned's value, `probe` its probe kind
    (FULL, ZERO or None)."""

    def __init__(
        self,
        num_speculative_tokens: int,
        config: KPolicyConfig | None = None,
        batch_schedule: tuple[tuple[int, int, int], ...] | None = None,
        log_interval_s: float = K_POLICY_LOG_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.k = num_speculative_tokens
        self.config = config
        self.batch_schedule = batch_schedule
        self.log_interval_s = log_interval_s
        self.clock = clock
        self.k_step = num_speculative_tokens
        self.reason = "start"
        # the verify chunks a step may hold (the runner's scratch; SpecSchedule sets it); None: no cap
        self.max_verifies: int | None = None
        self.probe: str | None = None
        self._tried = [0.0] * num_speculative_tokens  # weighted observations per draft position
        self._accepted = [0.0] * num_speculative_tokens  # weighted acceptances per draft position
        self._num_steps = 0
        self._logged_k = num_speculative_tokens  # the k of the last change line (or the start)
        self._last_log_time: float | None = None
        # the measurement (None: c is token_cost everywhere)
        is_measuring = config is not None and config.measure_cost and config.token_cost > 0
        self._cost = StepCost(config.window, config.min_samples) if is_measuring else None
        self._run: tuple[int, str] | None = None  # (first counted step, kind) of the latest measuring probe run
        self._num_regular_runs = 0  # probe_interval runs started: they alternate FULL and ZERO
        self._kept: tuple[int, str | None, bool] | None = None  # num_drafts_next's probe decision for a step
        self._last_collected: tuple[float, tuple[int, bool] | None] | None = None  # (time, steady shape or None)
        logger.info("%s", self.describe())

    @classmethod
    def from_config(cls, spec: SpeculativeConfig) -> KPolicy | None:
        """The policy a SpeculativeConfig asks for; None where it asks for vLLM's fixed k."""
        if spec.k_policy is None and spec.num_speculative_tokens_per_batch_size is None:
            logger.info(
                "speculative k policy: off, every decode drafts k = %d (vLLM's fixed k; the deltaserve-only "
                "speculative_config key k_policy turns it on)",
                spec.num_speculative_tokens,
            )
            return None
        return cls(spec.num_speculative_tokens, spec.k_policy, spec.num_speculative_tokens_per_batch_size)

    def describe(self) -> str:
        parts = [f"speculative k policy: k = {self.k} at most"]
        if self.batch_schedule is not None:
            parts.append(f"num_speculative_tokens_per_batch_size {[list(e) for e in self.batch_schedule]}")
        config = self.config
        if config is None:
            parts.append("k_policy off")
        else:
            parts.append(
                f"k_policy max_batch_tokens {config.max_batch_tokens} (decodes x (1 + k) per step), token_cost "
                f"{config.token_cost} (a verify of k drafts costs 1 + {config.token_cost} k decodes), probe_interval "
                f"{config.probe_interval} steps, window {config.window}, min_samples {config.min_samples} "
                "(first guesses, not yet measured)"
            )
            if self._cost is not None:
                parts.append(
                    "measure_cost on: each batch bucket's token_cost is measured from the policy's own step times "
                    f"(token_cost {config.token_cost} is the prior until then), probes are runs of "
                    f"{PROBE_RUN_STEPS} steps, full and zero by turns"
                )
            elif config.measure_cost:
                parts.append("measure_cost on, but nothing to measure: token_cost 0 turns the acceptance rule off")
            else:
                parts.append(f"measure_cost off: token_cost {config.token_cost} at every batch size")
        return "; ".join(parts)

    # -- the estimates ---------------------------------------------------------------------------------

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        """One applied verify result: num_drafts drafts, the first num_accepted of them accepted."""
        if self.config is None:
            return
        keep = 1.0 - 1.0 / self.config.window
        num_drafts = min(num_drafts, self.k)
        for position in range(min(num_accepted + 1, num_drafts)):
            self._tried[position] = self._tried[position] * keep + 1.0
            self._accepted[position] = self._accepted[position] * keep + float(position < num_accepted)

    def conditional_rates(self) -> list[float]:
        """Per draft position, the estimated probability that it is accepted given the ones before it were."""
        min_samples = 0 if self.config is None else self.config.min_samples
        return [
            accepted / tried if tried >= max(min_samples, 1e-9) else 1.0
            for tried, accepted in zip(self._tried, self._accepted, strict=True)
        ]

    def acceptance_rates(self) -> list[float]:
        """Per draft position j, the estimated unconditional probability that drafts 0 .. j are all accepted."""
        rates, product = [], 1.0
        for rate in self.conditional_rates():
            product *= rate
            rates.append(product)
        return rates

    @property
    def step_cost(self) -> StepCost | None:
        """The step-cost measurement (read it, never feed it: step_collected does); None when not measuring."""
        return self._cost

    def step_collected(self, num_decodes: int, num_drafts: int, is_decode_only: bool) -> None:
        """One collected plan: its decodes (plain or verify chunks), the drafts they verified, and whether every
        chunk of it was one; its period since the plan collected before it is a sample in steady state only."""
        if self._cost is None:
            return
        now = self.clock()
        shape = (bucket_of(num_decodes), num_drafts > 0) if is_decode_only and num_decodes else None
        last, self._last_collected = self._last_collected, (now, shape)
        if shape is None or last is None or last[1] != shape or now - last[0] >= STEADY_PERIOD_S:
            return
        self._cost.add(num_decodes, num_drafts, now - last[0])

    def token_cost_at(self, num_decodes: int) -> tuple[float, str]:
        """(c, where it comes from) for a step of num_decodes decodes: the bucket's measured c, else token_cost."""
        assert self.config is not None
        prior = self.config.token_cost
        if self._cost is None:
            return prior, f"token_cost {prior}"
        measured = self._cost.token_cost(num_decodes)
        if measured is not None:
            return measured, f"measured token_cost {measured:.2f} at {bucket_label(num_decodes)}"
        # An unmeasured bucket starts from the largest c measured at fewer decodes where that exceeds the prior: c
        # does not fall as the batch grows (more verify tokens per step leave the memory-bound regime, and a MoE
        # verify reads more experts), and on the H200 the prior 0.15 kept k = 3 through a c8 run's first hundreds of
        # steps after c1 had measured c = 1.01 (docs/speculative-decoding.md#the-k-policy).
        below = self._cost.largest_below(num_decodes)
        if below is not None and below[0] > prior:
            return below[0], f"token_cost {below[0]:.2f} (measured at {bucket_label(below[1])}, until this bucket is)"
        return prior, f"token_cost {prior} (prior)"

    # -- the choice ------------------------------------------------------------------------------------

    def best_k(self, k_cap: int, num_decodes: int = 1) -> int:
        """The acceptance rule: the k' <= k_cap with the most expected tokens per unit of cost, at the c of a step
        of num_decodes decodes."""
        cost = self.token_cost_at(num_decodes)[0]
        best, best_rate, tokens = 0, 1.0, 1.0
        for k_try, rate in enumerate(self.acceptance_rates()[:k_cap], start=1):
            tokens += rate
            per_cost = tokens / (1.0 + cost * k_try)
            if per_cost > best_rate + 1e-12:
                best, best_rate = k_try, per_cost
        return best

    def plan_step(self, num_decodes: int) -> int:
        """Sets and returns k_step (and probe) for a step whose decodes number num_decodes."""
        config = self.config
        if config is not None:
            self._num_steps += int(num_decodes > 0)  # probes count steps that have decodes to draft for
        step, kept = self._num_steps, self._kept
        if kept is not None and kept[0] == step and num_decodes and self._cost is not None:
            kind, starts_run = kept[1], kept[2]  # what the proposal for this step assumed
        else:
            kind, starts_run = self._probe_at(step, num_decodes)
        if num_decodes:
            self._kept = None
        if starts_run and kind is not None:
            self._run = (step, kind)
            self._num_regular_runs += int(step % config.probe_interval == 0)
        k, reason = self._choose(num_decodes, kind)
        self.k_step, self.reason, self.probe = k, reason, kind
        if kind is None and num_decodes:
            self._maybe_log()
        return k

    def num_drafts_next(self, num_decodes: int) -> int:
        """The drafts to propose after the step plan_step just planned, for a next step of num_decodes decodes
        (the scheduler's estimate): what the rules would choose for it now, in full where it is a full probe (so
        that the probe finds the drafts it verifies), none where it is a zero probe; with measurement the probe
        decision is kept for that step. A rise of k from results collected in between (better estimates) takes
        effect one step later: the next step verifies at most what this one proposes."""
        step = self._num_steps + 1
        kind, starts_run = self._probe_at(step, num_decodes)
        if self._cost is not None and num_decodes:
            self._kept = (step, kind, starts_run)
        return self._choose(num_decodes, kind)[0]

    def _probe_at(self, step: int, num_decodes: int) -> tuple[str | None, bool]:
        """(the probe kind of counted step `step` with num_decodes decodes, whether a measuring run starts there)."""
        config = self.config
        if config is None or not num_decodes:
            return None, False
        if self._cost is None:
            return (FULL if step % config.probe_interval == 0 else None), False
        if self._run is not None and step < self._run[0] + PROBE_RUN_STEPS:
            return self._run[1], False
        if step % config.probe_interval == 0:
            return (ZERO if self._num_regular_runs % 2 else FULL), True
        if step % IMMATURE_PROBE_INTERVAL == 0:
            lacks_plain, lacks_drafts = self._cost.lacking(num_decodes)
            # both lacking: the side the rule does not run now (its own steps feed the other)
            if lacks_plain and (not lacks_drafts or self._choose(num_decodes, None)[0] > 0):
                return ZERO, True
            if lacks_drafts:
                return FULL, True
        return None, False

    def _choose(self, num_decodes: int, probe: str | None) -> tuple[int, str]:
        """(k, the reason) for a step of num_decodes decodes; a full probe skips the acceptance rule, a zero probe
        drafts nothing."""
        k, reason = self.k, "no rule lowers the configured num_speculative_tokens"
        if self.max_verifies is not None and num_decodes > self.max_verifies:
            # a step past the scratch would verify some decodes and decode the rest, outside every verify graph
            return 0, f"memory: {num_decodes} decodes, more than the {self.max_verifies} verify chunks of the scratch"
        if self.batch_schedule is not None:
            k_schedule = batch_schedule_k(self.batch_schedule, max(num_decodes, 1), self.k)
            if k_schedule < k:
                k, reason = k_schedule, f"num_speculative_tokens_per_batch_size at {num_decodes} decodes"
        config = self.config
        if config is not None:
            limit = config.max_batch_tokens
            if limit and num_decodes:
                k_batch = k
                while k_batch > 0 and num_decodes * (1 + k_batch) > limit:
                    k_batch -= 1
                if k_batch < k:
                    k, reason = k_batch, f"batch: {num_decodes} decodes x (1 + k) above max_batch_tokens {limit}"
            if probe == ZERO and k > 0:
                k, reason = 0, "probe: a run of plain steps, timed against the steps with drafts"
            elif probe is None and config.token_cost > 0:
                k_accept = self.best_k(k, num_decodes)
                if k_accept < k:
                    rates = ", ".join(f"{r:.3f}" for r in self.acceptance_rates())
                    source = self.token_cost_at(num_decodes)[1]
                    k, reason = k_accept, f"acceptance: per-position estimates [{rates}] below break-even at {source}"
        return k, reason

    def _maybe_log(self) -> None:
        """A change of k since the last line, at most one line per log_interval_s (the current state then)."""
        if self.k_step == self._logged_k:
            return
        now = self.clock()
        if self._last_log_time is not None and now - self._last_log_time < self.log_interval_s:
            return
        logger.info("speculative k policy: k %d -> %d (%s)", self._logged_k, self.k_step, self.reason)
        self._logged_k = self.k_step
        self._last_log_time = now
