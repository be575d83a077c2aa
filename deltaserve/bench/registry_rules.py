"""The rules of vLLM's production configuration for the oracle registry, and the checkpoint facts they depend on.

vLLM on a multimodal Qwen3.5/3.6 checkpoint served as a text model (vLLM's `--language-model-only`, vllm-project/vllm
PR #34120; the vllm-project/recipes Qwen3.5 recipe; the vllm-oracle README):
- `--language-model-only`: no vision tower, and it unlocks the fused QK-norm + RoPE + gate attention path.
- never `--enforce-eager` (compile and CUDA graphs on), async scheduling left at its default (on).
- `--mamba-ssm-cache-dtype` as the checkpoint says (float32 for Qwen3.5's text_config.mamba_ssm_dtype).
- `--max-num-batched-tokens` at least 2 x ISL (and 8192 for the MoE shape, as measured on the H200); on an 80 GB
  card's site, where 2 x ISL is past what vLLM's memory profile holds, one whole prompt or 65,536 (the
  batched-tokens-80gb deviation, noted on the records it applies to).
- `--no-enable-prefix-caching` for random data (it shares no prefix; caching would only add overhead).
  Data whose prompts share prefixes (`is_random_data=False`, the grid's prefix_repetition dataset) leaves prefix
  caching at vLLM's choice or turns it on (`enable_prefix_caching`: vLLM's prefix-caching arm, issue 36), never
  off; `prefix_match_unit` adds vLLM 0.26's `--prefix-match-unit N` (the finest token boundary a hit can land on;
  CacheConfig.prefix_match_unit) to that arm, the tuned second peer.
- no speculative decoding, except in vLLM's MTP arm (`speculative_config`, issue 41): `--speculative-config` with
  method "mtp" (the checkpoint must declare its MTP layer, `mtp_num_hidden_layers` >= 1, which vLLM reads to build
  the draft) and, on dummy weights, vLLM 0.26's synthetic acceptance ("rejection_sample_method": "synthetic" with
  "synthetic_acceptance_rates" or "synthetic_acceptance_length"), so that both engines do the full draft and
  verify work and only the accept decision is pinned.
- no `--quantization`: a block-FP8 checkpoint (Qwen's -FP8 releases and the FP8 dummies, issue 37) declares
  `quantization_config` and vLLM's ModelConfig takes the method from it; a `--quantization` that disagrees with the
  checkpoint (or asks vLLM to quantize an unquantized one online) is not its production configuration.
- every kernel backend at vLLM's own choice. A site that cannot run the default backend forces another one only
  as a named `Deviation` with its reason, direction and magnitude (the offline H200 runs GDN prefill on Triton:
  FlashInfer, vLLM's SM90 default, is not in the bundle); every record of such a launch carries the
  deviation as its denominator note, and `bench report` marks the ratios it can move.

`inspect_checkpoint` reads the facts from config.json; `min_batched_tokens` is the step-budget floor;
`check_vllm_argv` lists every way an argv departs from the configuration above (the registry refuses to build such
a launch, and `deltaserve check oracle-flags` checks hand-written launches against `REQUIRED_FLAGS` /
`FORBIDDEN_FLAGS`); `check_speculative_config` does the same for the MTP arm's `--speculative-config`. The launches
themselves are built in registry.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Flags every hand-written vLLM launch must spell out (the static gate checks these textually).
REQUIRED_FLAGS: tuple[str, ...] = ("--language-model-only",)
# Flags no production launch may carry, with the reason the gate prints.
FORBIDDEN_FLAGS: dict[str, str] = {
    "--enforce-eager": "turns off torch.compile and CUDA graphs: not vLLM's production configuration",
    "--no-async-scheduling": "turns off async scheduling, which is on by default in production",
}
DEFAULT_MAMBA_SSM_DTYPE = "float32"  # vLLM hardcodes float32 for Qwen3.5 when the config is silent
MIN_BATCHED_TOKENS_MOE = 8192


@dataclass(frozen=True)
class CheckpointFacts:
    """What the production configuration depends on, read from a checkpoint's config.json."""

    is_multimodal: bool
    is_moe: bool
    mamba_ssm_dtype: str
    has_weights: bool
    num_mtp_layers: int = 0  # mtp_num_hidden_layers (Qwen3.5/3.6) or num_nextn_predict_layers (Qwen3-Next)
    quantization: str | None = None  # quantization_config.quant_method ("fp8" for the -FP8 releases), else None


def inspect_checkpoint(model_dir: str | Path) -> CheckpointFacts:
    """Read config.json: multimodal (vision_config or *ForConditionalGeneration), MoE, SSM dtype, weights, MTP
    layers and the quantization method (quantization_config at the top level or in text_config)."""
    path = Path(model_dir)
    config = json.loads((path / "config.json").read_text())
    text = config.get("text_config") or config
    architectures = config.get("architectures") or []
    is_multimodal = "vision_config" in config or any(a.endswith("ForConditionalGeneration") for a in architectures)
    is_moe = int(text.get("num_experts") or 0) > 0
    dtype = text.get("mamba_ssm_dtype") or config.get("mamba_ssm_dtype") or DEFAULT_MAMBA_SSM_DTYPE
    has_weights = any(path.glob("*.safetensors")) or any(path.glob("*.bin"))
    # Qwen3-Next's MTP layer count may be absent: vLLM then builds its one MTP layer (Qwen3NextMTP reads
    # num_nextn_predict_layers with a default of 1), as deltaserve's config does (config.py)
    is_next = (text.get("model_type") or config.get("model_type")) == "qwen3_next"
    mtp = next(
        (c[k] for c in (text, config) for k in ("mtp_num_hidden_layers", "num_nextn_predict_layers") if k in c),
        1 if is_next else 0,
    )
    quants = [c["quantization_config"] for c in (config, text) if isinstance(c.get("quantization_config"), dict)]
    method = quants[0].get("quant_method") if quants else None
    return CheckpointFacts(is_multimodal, is_moe, str(dtype), has_weights, int(mtp or 0), method and str(method))


# vLLM 0.26's speculative-config keys the MTP arm may set, and the methods it accepts for this family.
SPECULATIVE_KEYS = (
    "method",
    "num_speculative_tokens",
    "rejection_sample_method",
    "synthetic_acceptance_rates",
    "synthetic_acceptance_length",
)
MTP_METHODS = ("mtp",)


def check_speculative_config(config: dict[str, Any], facts: CheckpointFacts) -> list[str]:
    """Every way `config` is not vLLM's MTP arm on this checkpoint (empty list: it is)."""
    problems = [f"unknown key {key!r}" for key in config if key not in SPECULATIVE_KEYS]
    if config.get("method") not in MTP_METHODS:
        problems.append(f"method {config.get('method')!r}: the MTP arm runs method 'mtp'")
    k = config.get("num_speculative_tokens")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        problems.append(f"num_speculative_tokens must be a positive integer, got {k!r}")
    rates = config.get("synthetic_acceptance_rates")
    if rates is not None:
        if not isinstance(rates, list) or (isinstance(k, int) and len(rates) != k):
            problems.append(f"synthetic_acceptance_rates must list one rate per draft position ({k}), got {rates!r}")
        elif any(not 0.0 <= float(r) <= 1.0 for r in rates) or rates != sorted(rates, reverse=True):
            problems.append(f"synthetic_acceptance_rates must be non-increasing rates in [0, 1], got {rates}")
    is_synthetic = config.get("rejection_sample_method") == "synthetic"
    if is_synthetic != (rates is not None or "synthetic_acceptance_length" in config):
        problems.append("rejection_sample_method 'synthetic' goes with synthetic_acceptance_rates / _length")
    if facts.num_mtp_layers < 1:
        problems.append("the checkpoint declares no MTP layer (mtp_num_hidden_layers): vLLM cannot build the draft")
    if not facts.has_weights and not is_synthetic:
        problems.append("dummy weights draft nothing useful: pin the acceptance (rejection_sample_method synthetic)")
    return problems


def min_batched_tokens(input_len: int, is_moe: bool, card_max: int | None = None) -> int:
    """At least 2 x ISL, so one step can prefill two whole prompts; 8192 floor for the MoE shape. On a card whose
    memory profile holds no more than `card_max` tokens a step (site_max_batched_tokens), at least one whole prompt
    and card_max (the batched-tokens-80gb deviation where that is below 2 x ISL)."""
    floor = MIN_BATCHED_TOKENS_MOE if is_moe else 0
    wanted = max(2 * input_len, floor)
    if card_max is not None and wanted > card_max:
        return max(input_len, card_max, floor)
    return wanted


def _flag_value(argv: list[str], flag: str) -> str | None:
    """The value of `flag` in argv (`--f v` or `--f=v`); the last one wins, as in argparse."""
    value = None
    for i, word in enumerate(argv):
        if word == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif word.startswith(flag + "="):
            value = word.split("=", 1)[1]
    return value


def _has_flag(argv: list[str], flag: str) -> bool:
    return any(word == flag or word.startswith(flag + "=") for word in argv)


def check_vllm_argv(
    argv: list[str],
    input_len: int | None = None,
    is_random_data: bool | None = None,
    facts: CheckpointFacts | None = None,
    serves_media: bool = False,
    card_max: int | None = None,
) -> list[str]:
    """Every way `argv` departs from the production configuration (empty list: it is the real thing); for image
    traffic (`serves_media`) --language-model-only is a departure instead of a requirement. `card_max`: the site's
    step-budget limit (site_max_batched_tokens), which lowers the --max-num-batched-tokens floor."""
    required = [flag for flag in REQUIRED_FLAGS if not (serves_media and flag == "--language-model-only")]
    problems = [f"missing {flag}" for flag in required if not _has_flag(argv, flag)]
    if serves_media and _has_flag(argv, "--language-model-only"):
        problems.append("--language-model-only: drops the vision tower, which image traffic needs")
    problems += [f"{flag}: {why}" for flag, why in FORBIDDEN_FLAGS.items() if _has_flag(argv, flag)]
    if input_len is not None:
        value = _flag_value(argv, "--max-num-batched-tokens")
        floor = min_batched_tokens(input_len, facts.is_moe if facts else False, card_max)
        if value is None or not value.isdigit() or int(value) < floor:
            problems.append(f"--max-num-batched-tokens must be at least {floor} for ISL {input_len}, got {value}")
    # argparse's last-one-wins: the final prefix-caching flag decides.
    last = [w for w in argv if w in ("--enable-prefix-caching", "--no-enable-prefix-caching")]
    if is_random_data and (not last or last[-1] != "--no-enable-prefix-caching"):
        problems.append("random data needs --no-enable-prefix-caching")
    if is_random_data is False and last and last[-1] == "--no-enable-prefix-caching":
        problems.append("prompts that share prefixes leave prefix caching at vLLM's choice or on, never off")
    if facts is not None:
        value = _flag_value(argv, "--mamba-ssm-cache-dtype")
        if value is not None and value != facts.mamba_ssm_dtype:
            problems.append(f"--mamba-ssm-cache-dtype {value} differs from the checkpoint's {facts.mamba_ssm_dtype}")
        method = _flag_value(argv, "--quantization") or _flag_value(argv, "-q")
        if method is not None and method != "None" and method != facts.quantization:
            declared = f"declares {facts.quantization!r}" if facts.quantization else "is unquantized (online)"
            problems.append(f"--quantization {method}: the checkpoint {declared}; vLLM takes the method from it")
    return problems
