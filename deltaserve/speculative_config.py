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
- any other key is refused by name: a key vLLM knows as not supported here, any other as unknown.
"""

from __future__ import annotations

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
    "synthetic_acceptance_length", "draft_sample_method",
)  # fmt: skip
# SpeculativeConfig fields vLLM accepts that deltaserve does not implement (refused by name as not supported)
VLLM_ONLY_KEYS = (
    "model", "draft_tensor_parallel_size", "tensor_parallel_size", "quantization", "max_model_len", "revision",
    "code_revision", "disable_padded_drafter_batch", "prompt_lookup_max", "prompt_lookup_min", "parallel_drafting",
    "enforce_eager", "moe_backend", "attention_backend", "kv_cache_dtype", "use_local_argmax_reduction",
    "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests", "suffix_decoding_max_spec_factor",
    "suffix_decoding_min_token_prob", "speculative_token_tree", "disable_by_batch_size", "draft_load_config",
)  # fmt: skip


class SpeculativeConfigError(ValueError):
    """A --speculative-config / speculative_config deltaserve refuses; the message names the key or the method."""


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = MTP_METHOD  # always "mtp" after parsing (aliases resolved)
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS  # k drafts per decode step
    rejection_sample_method: str = "standard"  # "standard" or "synthetic" (benchmarks on dummy weights)
    # per draft position i, the unconditional probability that drafts 0..i are all accepted; set only with
    # rejection_sample_method "synthetic" (synthetic_acceptance_length is resolved into it, as vLLM does)
    synthetic_acceptance_rates: tuple[float, ...] | None = None
    draft_sample_method: str = "greedy"

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
    return SpeculativeConfig(method, k, rejection, rates, draft_sample)


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
