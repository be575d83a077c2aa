"""SpeculativeConfig: vLLM's `--speculative-config` JSON / `LLM(speculative_config=dict)`, parsed and validated as
vLLM 0.26 does for the one method deltaserve serves, the checkpoint's own MTP layer
(docs/compatibility.md#speculative-decoding).

Plain frozen data (no torch), importable by every stage. `parse_speculative_config` takes the JSON text, a dict or
an already parsed SpeculativeConfig and returns a SpeculativeConfig or None (none given); every refusal is a
SpeculativeConfigError naming the key or the method:
- method: "mtp", or one of vLLM's MTP aliases for this model family ("qwen3_next_mtp", "qwen3_5_mtp"), which vLLM
  rewrites to "mtp" with a deprecation warning (so does deltaserve). Every other method vLLM knows (eagle, eagle3,
  ngram, medusa, mlp_speculator, draft_model, suffix, ...) is refused as not supported, and a name vLLM does not
  know is refused as unknown. A method is required: without one vLLM would take a draft model, which deltaserve
  does not serve.
- num_speculative_tokens: an integer > 0; absent, vLLM takes the draft config's n_predict, which for these
  checkpoints is mtp_num_hidden_layers = 1.
- rejection_sample_method: "standard" (default) or "synthetic"; with "synthetic" exactly one of
  synthetic_acceptance_rates (length num_speculative_tokens, each in [0, 1], non-increasing: position i's entry is
  the unconditional probability that the first i + 1 drafts are accepted) or synthetic_acceptance_length (in
  [1, k + 1], resolved to rates by vLLM's minimum-variance schedule); either key without "synthetic" is refused.
- draft_sample_method: "greedy" (vLLM's default; "probabilistic" is refused as not supported).
- num_speculative_tokens_per_batch_size: vLLM's batch-size schedule of k, a list of [first, last, k] entries
  (inclusive batch-size ranges, sorted, not overlapping, the first starting at 1, k >= 0); a batch size in a gap
  takes the k of the range before it, one past the last range the last k, and k is never above
  num_speculative_tokens. The scheduler applies it per step (scheduler/spec_policy.py).
- k_policy (deltaserve only): the per-step k policy (docs/speculative-decoding.md#the-k-policy): true for its
  defaults, an object of its parameters (KPolicyConfig's fields: integers, token_cost a number >= 0, measure_cost
  a bool), false or absent for vLLM's fixed k.
- async_verify (deltaserve only, default false): under async scheduling, a speculating sequence's next step is
  planned while its verify step still runs, its start corrected on the device by the drafts that verify rejected
  (docs/speculative-decoding.md#async-verify); a boolean.
- disable_by_batch_size: vLLM removed it from its SpeculativeConfig (unused since its V1 engine); refused naming
  num_speculative_tokens_per_batch_size.
- moe_backend, disable_padded_drafter_batch: how vLLM's drafter runs (its MoE kernel, its batch padding), accepted
  and logged as ignored (LOGGED_KEYS).
- any other key is refused by name: a key vLLM knows as not supported here, any other as unknown.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

MTP_METHOD = "mtp"
# vLLM's per-model MTP method names for this family; vLLM rewrites every MTP name to "mtp" with a warning
MTP_ALIASES = ("qwen3_next_mtp", "qwen3_5_mtp")
# vLLM's MTP method names for other model families: vLLM rewrites them to "mtp" too, but a user who wrote one
# meant another model's MTP module; deltaserve names the mismatch rather than guess
OTHER_MTP_METHODS = (
    "deepseek_mtp",
    "mimo_mtp",
    "glm4_moe_mtp",
    "ernie_mtp",
    "longcat_flash_mtp",
    "pangu_ultra_moe_mtp",
)
# speculative methods vLLM knows that deltaserve does not serve
UNSUPPORTED_METHODS = (
    "ngram", "[ngram]", "ngram_gpu", "medusa", "mlp_speculator", "draft_model", "suffix", "custom_class", "eagle",
    "eagle3", "extract_hidden_states", "dflash",
)  # fmt: skip
REJECTION_SAMPLE_METHODS = ("standard", "synthetic")
DEFAULT_NUM_SPECULATIVE_TOKENS = 1  # vLLM's default: the draft config's n_predict (mtp_num_hidden_layers: 1)
SUPPORTED_KEYS = (
    "method", "num_speculative_tokens", "rejection_sample_method", "synthetic_acceptance_rates",
    "synthetic_acceptance_length", "draft_sample_method", "num_speculative_tokens_per_batch_size", "k_policy",
    "async_verify",
)  # fmt: skip
# SpeculativeConfig fields of vLLM's that pick how its drafter runs, not what it drafts (vllm/config/speculative.py:
# moe_backend, the draft model's MoE kernel; disable_padded_drafter_batch, the layout of an EAGLE drafter's batch):
# accepted and logged, as the table of vllm_flags.py logs --moe-backend (deltaserve's MTP drafter runs its own
# kernels on its own batch layout). Both are in launch lines users copy (docs/compatibility.md#launch-commands).
LOGGED_KEYS = {
    "moe_backend": "the MTP drafter runs deltaserve's own MoE kernels",
    "disable_padded_drafter_batch": "the MTP drafter's batch layout is deltaserve's own",
}
# SpeculativeConfig fields vLLM accepts that deltaserve does not implement (refused by name as not supported)
VLLM_ONLY_KEYS = (
    "model", "draft_tensor_parallel_size", "tensor_parallel_size", "quantization", "max_model_len", "revision",
    "code_revision", "prompt_lookup_max", "prompt_lookup_min", "parallel_drafting",
    "enforce_eager", "attention_backend", "kv_cache_dtype", "use_local_argmax_reduction",
    "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests", "suffix_decoding_max_spec_factor",
    "suffix_decoding_min_token_prob", "speculative_token_tree", "draft_load_config",
)  # fmt: skip


class SpeculativeConfigError(ValueError):
    """A --speculative-config / speculative_config deltaserve refuses; the message names the key or the method."""


# First guesses, not yet measured (docs/speculative-decoding.md#the-k-policy names the H200 arms that will pick them)
DEFAULT_MAX_BATCH_TOKENS = 64
DEFAULT_TOKEN_COST = 0.15
DEFAULT_PROBE_INTERVAL = 50
DEFAULT_WINDOW = 64
DEFAULT_MIN_SAMPLES = 8


@dataclass(frozen=True)
class KPolicyConfig:
    """The per-step k policy's parameters (deltaserve-only `k_policy` key; scheduler/spec_policy.py)."""

    # a step whose decodes x (1 + k) exceed this drafts fewer tokens a decode (none when even k = 1 exceeds it);
    # 0: no batch rule
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS
    # c: one more draft position costs c plain decode steps (a verify of 1 + k tokens plus its drafting costs
    # 1 + c k); 0: no acceptance rule
    token_cost: float = DEFAULT_TOKEN_COST
    probe_interval: int = DEFAULT_PROBE_INTERVAL  # every this many steps one step drafts the batch rule's k in full
    window: int = DEFAULT_WINDOW  # observations a position's acceptance estimate averages over (exponentially)
    min_samples: int = DEFAULT_MIN_SAMPLES  # below this many (weighted) observations a position counts as accepted
    # the policy times its own steps and uses the measured c per batch bucket (scheduler/step_cost.py); token_cost
    # is then the prior until a bucket is measured. False: token_cost is c everywhere
    measure_cost: bool = True

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # every field, under its own name


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = MTP_METHOD  # always "mtp" after parsing (aliases resolved)
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS  # k drafts per decode step
    rejection_sample_method: str = "standard"  # "standard" or "synthetic" (benchmarks on dummy weights)
    # per draft position i, the unconditional probability that drafts 0..i are all accepted; set only with
    # rejection_sample_method "synthetic" (synthetic_acceptance_length is resolved into it, as vLLM does)
    synthetic_acceptance_rates: tuple[float, ...] | None = None
    draft_sample_method: str = "greedy"
    # vLLM's batch-size schedule: ((first, last, k), ...) inclusive ranges, validated; None: fixed k
    num_speculative_tokens_per_batch_size: tuple[tuple[int, int, int], ...] | None = None
    k_policy: KPolicyConfig | None = None  # deltaserve only: the per-step k policy; None: off
    # deltaserve only: plan a speculating sequence's next step before its verify result is back (async scheduling
    # for verify steps, scheduler/spec.py)
    async_verify: bool = False

    @property
    def is_synthetic(self) -> bool:
        return self.rejection_sample_method == "synthetic"

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (the keys vLLM reads), for sending to another process or logging."""
        out: dict[str, Any] = {
            "method": self.method,
            "num_speculative_tokens": self.num_speculative_tokens,
            "rejection_sample_method": self.rejection_sample_method,
            "draft_sample_method": self.draft_sample_method,
        }
        if self.synthetic_acceptance_rates is not None:
            out["synthetic_acceptance_rates"] = list(self.synthetic_acceptance_rates)
        if self.num_speculative_tokens_per_batch_size is not None:
            out["num_speculative_tokens_per_batch_size"] = [list(e) for e in self.num_speculative_tokens_per_batch_size]
        if self.k_policy is not None:
            out["k_policy"] = self.k_policy.to_dict()
        if self.async_verify:
            out["async_verify"] = True
        return out


def acceptance_length_to_rates(length: float, num_tokens: int) -> tuple[float, ...]:
    """vLLM's minimum-variance schedule: a mean acceptance length L (drafts accepted + the bonus token) as
    unconditional per-position rates: the first floor(L - 1) drafts always accepted, the next with the fraction
    left, the rest never."""
    expected = length - 1.0  # drafts accepted on average
    num_full = int(expected)
    rates = [1.0] * num_full + [expected - num_full] + [0.0] * (num_tokens - num_full - 1)
    return tuple(rates[:num_tokens])


def _number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SpeculativeConfigError(f"speculative_config `{key}` must be a number, got {value!r}")
    return float(value)


def _synthetic_rates(num_tokens: int, rates: Any, length: Any, has_rates: bool, has_length: bool) -> tuple[float, ...]:
    if has_rates == has_length:
        raise SpeculativeConfigError(
            "speculative_config `rejection_sample_method` 'synthetic' requires exactly one of "
            "`synthetic_acceptance_rates` or `synthetic_acceptance_length`"
        )
    if has_rates:
        if not isinstance(rates, list | tuple):
            raise SpeculativeConfigError(
                f"speculative_config `synthetic_acceptance_rates` must be a list of numbers, got {rates!r}"
            )
        values = [_number("synthetic_acceptance_rates", r) for r in rates]
        if len(values) != num_tokens:
            raise SpeculativeConfigError(
                f"speculative_config `synthetic_acceptance_rates` must have length {num_tokens} "
                f"(num_speculative_tokens), got {values}"
            )
        if not all(0.0 <= r <= 1.0 for r in values):
            raise SpeculativeConfigError(
                f"speculative_config `synthetic_acceptance_rates` entries must be in [0, 1], got {values}"
            )
        if any(values[i] > values[i - 1] for i in range(1, len(values))):
            raise SpeculativeConfigError(
                f"speculative_config `synthetic_acceptance_rates` must be non-increasing, got {values}"
            )
        return tuple(values)
    value = _number("synthetic_acceptance_length", length)
    if not 1.0 <= value <= num_tokens + 1:
        raise SpeculativeConfigError(
            f"speculative_config `synthetic_acceptance_length` must be in [1, {num_tokens + 1}], got {value}"
        )
    return acceptance_length_to_rates(value, num_tokens)


def _batch_schedule(value: Any) -> tuple[tuple[int, int, int], ...]:
    """vLLM's num_speculative_tokens_per_batch_size, checked as vLLM checks its [first, last, k] form."""
    key = "num_speculative_tokens_per_batch_size"
    if not isinstance(value, list | tuple) or not value:
        raise SpeculativeConfigError(
            f"speculative_config `{key}` must be a non-empty list of [first, last, k] entries, got {value!r}"
        )
    entries = []
    for entry in value:
        is_ints = isinstance(entry, list | tuple) and all(isinstance(v, int) and not isinstance(v, bool) for v in entry)
        if not is_ints or len(entry) != 3:
            raise SpeculativeConfigError(
                f"speculative_config `{key}` entries must be [first batch size, last batch size, k], got {entry!r}"
            )
        first, last, k = entry
        if first <= 0 or last < first or k < 0:
            raise SpeculativeConfigError(
                f"speculative_config `{key}` entry {list(entry)}: batch sizes must be positive with first <= last, "
                "and k >= 0"
            )
        entries.append((first, last, k))
    entries.sort()
    if entries[0][0] != 1:
        raise SpeculativeConfigError(f"speculative_config `{key}`: the first batch-size range must start at 1")
    for before, after in zip(entries, entries[1:], strict=False):
        if after[0] <= before[1]:
            raise SpeculativeConfigError(f"speculative_config `{key}`: batch-size ranges must not overlap")
    return tuple(entries)


def _k_policy(value: Any) -> KPolicyConfig | None:
    """The deltaserve-only `k_policy` key: true (defaults), false / null (off) or an object of parameters."""
    if value is None or value is False:
        return None
    if value is True:
        return KPolicyConfig()
    if not isinstance(value, Mapping):
        raise SpeculativeConfigError(f"speculative_config `k_policy` must be true, false or an object, got {value!r}")
    fields = KPolicyConfig().to_dict()
    for key, given in value.items():
        if key not in fields:
            raise SpeculativeConfigError(f"speculative_config `k_policy` key `{key}` is not one of {sorted(fields)}")
        if key == "measure_cost":
            if not isinstance(given, bool):
                raise SpeculativeConfigError(
                    f"speculative_config `k_policy.measure_cost` must be true or false, got {given!r}"
                )
            continue
        if key == "token_cost":
            if _number("k_policy.token_cost", given) < 0:
                raise SpeculativeConfigError(f"speculative_config `k_policy.token_cost` must be >= 0, got {given!r}")
            continue
        minimum = 0 if key in ("max_batch_tokens", "min_samples") else 1
        if isinstance(given, bool) or not isinstance(given, int) or given < minimum:
            raise SpeculativeConfigError(
                f"speculative_config `k_policy.{key}` must be an integer >= {minimum}, got {given!r}"
            )
    return KPolicyConfig(**{**fields, **value, "token_cost": float(value.get("token_cost", fields["token_cost"]))})


def _method(data: Mapping[str, Any]) -> str:
    if "method" not in data or data["method"] is None:
        raise SpeculativeConfigError(
            "speculative_config has no `method`: deltaserve serves the checkpoint's own MTP layer, "
            '\'{"method": "mtp", "num_speculative_tokens": k}\''
        )
    method = data["method"]
    if not isinstance(method, str):
        raise SpeculativeConfigError(f"speculative_config `method` must be a string, got {method!r}")
    if method == MTP_METHOD:
        return method
    if method in MTP_ALIASES:
        logger.warning("speculative_config method `%s` is deprecated and replaced with mtp.", method)
        return MTP_METHOD
    if method in OTHER_MTP_METHODS:
        raise SpeculativeConfigError(
            f"speculative_config `method` {method!r} names another model family's MTP module; for this "
            "checkpoint's MTP layer use 'mtp'"
        )
    if method in UNSUPPORTED_METHODS:
        raise SpeculativeConfigError(
            f"speculative_config `method` {method!r} is not supported by deltaserve: only 'mtp' (the checkpoint's "
            "own multi-token-prediction layer) is"
        )
    raise SpeculativeConfigError(f"speculative_config `method` {method!r} is not a speculative decoding method")


def speculative_config_from_dict(data: Mapping[str, Any]) -> SpeculativeConfig:
    """A validated SpeculativeConfig from vLLM's keys (module docstring)."""
    for key in data:
        if key in SUPPORTED_KEYS:
            continue
        if key in LOGGED_KEYS:
            logger.info("ignoring speculative_config key `%s`: %s", key, LOGGED_KEYS[key])
            continue
        if key == "disable_by_batch_size":
            raise SpeculativeConfigError(
                "speculative_config key `disable_by_batch_size` was removed from vLLM's SpeculativeConfig (unused "
                "since its V1 engine): use `num_speculative_tokens_per_batch_size`, e.g. [[1, 32, 3], [33, 1024, 0]]"
            )
        if key in VLLM_ONLY_KEYS:
            raise SpeculativeConfigError(f"speculative_config key `{key}` is not supported by deltaserve")
        raise SpeculativeConfigError(f"speculative_config key `{key}` is not a speculative_config field")
    method = _method(data)
    k = data.get("num_speculative_tokens")
    if k is None:
        k = DEFAULT_NUM_SPECULATIVE_TOKENS
    if isinstance(k, bool) or not isinstance(k, int):
        raise SpeculativeConfigError(f"speculative_config `num_speculative_tokens` must be an integer, got {k!r}")
    if k <= 0:
        raise SpeculativeConfigError(f"speculative_config `num_speculative_tokens` must be greater than 0, got {k}")
    rejection = data.get("rejection_sample_method", "standard")
    if rejection not in REJECTION_SAMPLE_METHODS:
        raise SpeculativeConfigError(
            f"speculative_config `rejection_sample_method` {rejection!r} is not supported: 'standard' or 'synthetic'"
        )
    draft_sample = data.get("draft_sample_method", "greedy")
    if draft_sample != "greedy":
        raise SpeculativeConfigError(
            f"speculative_config `draft_sample_method` {draft_sample!r} is not supported: deltaserve drafts greedily "
            "('greedy', vLLM's default)"
        )
    has_rates = data.get("synthetic_acceptance_rates") is not None
    has_length = data.get("synthetic_acceptance_length") is not None
    rates = None
    if rejection == "synthetic":
        rates = _synthetic_rates(
            k, data.get("synthetic_acceptance_rates"), data.get("synthetic_acceptance_length"), has_rates, has_length
        )
    elif has_rates or has_length:
        key = "synthetic_acceptance_rates" if has_rates else "synthetic_acceptance_length"
        raise SpeculativeConfigError(
            f"speculative_config `{key}` is only valid with `rejection_sample_method` 'synthetic'"
        )
    schedule = data.get("num_speculative_tokens_per_batch_size")
    schedule = None if schedule is None else _batch_schedule(schedule)
    async_verify = data.get("async_verify", False)
    if not isinstance(async_verify, bool):
        raise SpeculativeConfigError(f"speculative_config `async_verify` must be true or false, got {async_verify!r}")
    return SpeculativeConfig(
        method, k, rejection, rates, draft_sample, schedule, _k_policy(data.get("k_policy")), async_verify
    )


def parse_speculative_config(value: str | Mapping[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
    """--speculative-config's JSON text, LLM(speculative_config=dict) or a parsed config -> SpeculativeConfig;
    None -> None (no speculative decoding)."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise SpeculativeConfigError(f"--speculative-config is not valid JSON ({exc}): {value!r}") from exc
    if not isinstance(value, Mapping):
        raise SpeculativeConfigError(f"speculative_config must be a JSON object, got {value!r}")
    return speculative_config_from_dict(value)
