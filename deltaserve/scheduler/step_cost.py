"""The k policy's measured step cost: what a step with drafts costs against a plain decode step, per batch bucket
(docs/speculative-decoding.md#the-k-policy).

The acceptance rule's cost model is "a decode that verifies k' drafts costs 1 + c k' plain decode steps". StepCost
measures c instead of taking a guess: per bucket of the step's decode count (1, 2, 3-4, 5-8, ...: bucket
(n - 1).bit_length(), since a step's cost grows with its batch and a c measured at one decode says little about 64),
it keeps exponentially weighted means over about `window` samples of
- T0, the collected-step period of steps without drafts, and
- P and k_eff, the period of steps with drafts and their drafts per decode,
and the bucket's c is max(0, (P / T0 - 1) / k_eff) once both sides have at least `min_samples` (weighted) samples,
or window / 2 where min_samples is more: a weighted count never reaches window, and a side that could never be
measured would keep the policy probing it forever. Before that the caller uses its prior (k_policy.token_cost).

Which steps are samples (steady state only) is the policy's decision (scheduler/spec_policy.py,
KPolicy.step_collected); this module only averages. Plain Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class WeightedMean:
    """An exponentially weighted mean: each sample weighs 1, earlier ones decay by `keep` per sample."""

    keep: float  # 1 - 1 / window
    count: float = 0.0  # weighted samples: 1 + keep + keep^2 + ... (at most window)
    total: float = 0.0  # weighted sum of the samples

    def add(self, value: float) -> None:
        self.count = self.count * self.keep + 1.0
        self.total = self.total * self.keep + value

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0


@dataclass
class BucketCost:
    """One batch bucket's estimates: plain steps' period, and steps with drafts' period and drafts per decode."""

    plain: WeightedMean  # T0, seconds
    drafts: WeightedMean  # P, seconds
    drafts_per_decode: WeightedMean = field(init=False)  # k_eff

    def __post_init__(self) -> None:
        self.drafts_per_decode = WeightedMean(self.drafts.keep)


def bucket_of(num_decodes: int) -> int:
    """The batch bucket of a step of num_decodes (>= 1) decodes: 1 -> 0, 2 -> 1, 3-4 -> 2, 5-8 -> 3, ..."""
    return (max(num_decodes, 1) - 1).bit_length()


def bucket_label(num_decodes: int) -> str:
    """The decode counts of num_decodes' bucket, for the log: "1 decode", "2 decodes", "3-4 decodes", ..."""
    bucket = bucket_of(num_decodes)
    if bucket <= 1:
        return "1 decode" if bucket == 0 else "2 decodes"
    return f"{2 ** (bucket - 1) + 1}-{2**bucket} decodes"


class StepCost:
    """Per batch bucket, the measured c (module docstring); read-only to everyone but its owner, the policy."""

    def __init__(self, window: int, min_samples: int) -> None:
        self.keep = 1.0 - 1.0 / window
        # reachable: after n samples the weighted count is window (1 - keep^n), window / 2 after about 0.7 window
        self.min_samples = min(float(min_samples), window / 2)
        self._buckets: dict[int, BucketCost] = {}

    def add(self, num_decodes: int, num_drafts: int, period: float) -> None:
        """One steady-state sample: a collected step of num_decodes decodes verifying num_drafts drafts in all
        took `period` seconds since the step before it."""
        bucket = self._buckets.get(bucket_of(num_decodes))
        if bucket is None:
            bucket = self._buckets[bucket_of(num_decodes)] = BucketCost(
                WeightedMean(self.keep), WeightedMean(self.keep)
            )
        if num_drafts:
            bucket.drafts.add(period)
            bucket.drafts_per_decode.add(num_drafts / num_decodes)
        else:
            bucket.plain.add(period)

    def samples(self, num_decodes: int) -> tuple[float, float]:
        """(plain, with drafts) weighted sample counts of num_decodes' bucket."""
        bucket = self._buckets.get(bucket_of(num_decodes))
        return (0.0, 0.0) if bucket is None else (bucket.plain.count, bucket.drafts.count)

    def periods(self, num_decodes: int) -> tuple[float, float, float]:
        """(T0, P, k_eff) means of num_decodes' bucket (0.0 where a side has no sample)."""
        bucket = self._buckets.get(bucket_of(num_decodes))
        if bucket is None:
            return 0.0, 0.0, 0.0
        return bucket.plain.mean, bucket.drafts.mean, bucket.drafts_per_decode.mean

    def lacking(self, num_decodes: int) -> tuple[bool, bool]:
        """(plain side, drafts side) of num_decodes' bucket: True where it has fewer than min_samples samples."""
        plain, drafts = self.samples(num_decodes)
        floor = max(self.min_samples, 1e-9)  # min_samples 0 still needs one sample to divide by
        return plain < floor, drafts < floor

    def largest_below(self, num_decodes: int) -> tuple[float, int] | None:
        """(c, the top decode count of its bucket) of the largest measured c among the buckets below num_decodes';
        None where none is measured."""
        found = None
        for bucket in range(bucket_of(num_decodes)):
            top = 2**bucket  # the largest decode count of the bucket: 1, 2, 4, 8, ...
            measured = self.token_cost(top)
            if measured is not None and (found is None or measured > found[0]):
                found = (measured, top)
        return found

    def token_cost(self, num_decodes: int) -> float | None:
        """The measured c of num_decodes' bucket; None until both sides have min_samples samples."""
        if any(self.lacking(num_decodes)):
            return None
        plain, drafts, per_decode = self.periods(num_decodes)
        if plain <= 0.0 or per_decode <= 0.0:
            return None
        return max(0.0, (drafts / plain - 1.0) / per_decode)
