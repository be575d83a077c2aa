"""The per-step k policy: how many drafts each decode of a step verifies, from the step's batch and the measured
acceptance (docs/speculative-decoding.md#the-k-policy).

Per step, `KPolicy.plan_step(num_decodes)` sets `k_step` (0 .. k, the configured num_speculative_tokens) for the
step's decodes, the lowest of:
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
Every probe_interval-th step drafts the batch rule's k in full (a probe), so positions the acceptance rule dropped
are measured again and a change in traffic is seen. `num_drafts_next(next_decodes)` is what the runner proposes
after a step (StepPlan.num_drafts_next): the same rules for the step after it, so that a step at k 0 drafts nothing.

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

from deltaserve.speculative_config import KPolicyConfig, SpeculativeConfig

logger = logging.getLogger(__name__)

K_POLICY_LOG_INTERVAL_S = 10.0  # at most one k change line per this many seconds (the latest state is logged)


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
    """Chooses each step's k (module docstring); `k_step` is the step being planned's value."""

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
        self._tried = [0.0] * num_speculative_tokens  # weighted observations per draft position
        self._accepted = [0.0] * num_speculative_tokens  # weighted acceptances per draft position
        self._num_steps = 0
        self._logged_k = num_speculative_tokens  # the k of the last change line (or the start)
        self._last_log_time: float | None = None
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

    # -- the choice ------------------------------------------------------------------------------------

    def best_k(self, k_cap: int) -> int:
        """The acceptance rule: the k' <= k_cap with the most expected tokens per unit of cost."""
        assert self.config is not None
        cost = self.config.token_cost
        best, best_rate, tokens = 0, 1.0, 1.0
        for k_try, rate in enumerate(self.acceptance_rates()[:k_cap], start=1):
            tokens += rate
            per_cost = tokens / (1.0 + cost * k_try)
            if per_cost > best_rate + 1e-12:
                best, best_rate = k_try, per_cost
        return best

    def plan_step(self, num_decodes: int) -> int:
        """Sets and returns k_step for a step whose decodes number num_decodes."""
        config = self.config
        if config is not None:
            self._num_steps += int(num_decodes > 0)  # probes count steps that have decodes to draft for
        is_probe = config is not None and num_decodes > 0 and self._num_steps % config.probe_interval == 0
        k, reason = self._choose(num_decodes, is_probe)
        self.k_step, self.reason = k, reason
        if not is_probe and num_decodes:
            self._maybe_log()
        return k

    def num_drafts_next(self, num_decodes: int) -> int:
        """The drafts to propose after the step plan_step just planned, for a next step of num_decodes decodes
        (the scheduler's estimate): what the rules would choose for it now, in full where it is a probe (so that
        the probe finds the drafts it verifies). A rise of k from results collected in between (better estimates)
        takes effect one step later: the next step verifies at most what this one proposes."""
        config = self.config
        is_probe = config is not None and num_decodes > 0 and (self._num_steps + 1) % config.probe_interval == 0
        return self._choose(num_decodes, is_probe)[0]

    def _choose(self, num_decodes: int, is_probe: bool) -> tuple[int, str]:
        """(k, the reason) for a step of num_decodes decodes; a probe skips the acceptance rule."""
        k, reason = self.k, "no rule lowers the configured num_speculative_tokens"
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
            if not is_probe and config.token_cost > 0:
                k_accept = self.best_k(k)
                if k_accept < k:
                    rates = ", ".join(f"{r:.3f}" for r in self.acceptance_rates())
                    k, reason = (
                        k_accept,
                        (
                            f"acceptance: per-position estimates [{rates}] below break-even at token_cost "
                            f"{config.token_cost}"
                        ),
                    )
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
