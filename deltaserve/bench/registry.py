"""The oracle registry: the one module that says how each peer engine runs in its production configuration.

Every harness path builds peer server commands here (the grid calls `oracle_launch`; shell scripts call
`python -m deltaserve.bench.registry --model DIR --input-len N -- EXTRA`), every in-process oracle is built
here (`vllm_engine` + `build_vllm_llm`, used by `deltaserve gate tokens --reference vllm`), and the static gate
`deltaserve check oracle-flags` checks hand-written launches against `REQUIRED_FLAGS` / `FORBIDDEN_FLAGS` /
`BACKEND_FLAGS` (deviations.py) and in-process constructions against the registry, so no two harnesses can
disagree about the denominator. Where the oracle runs (SITES) and what each site forces (DEVIATIONS) live in
deviations.py.

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
A launch may leave out a required flag, or override a backend, only with an exemption that carries its reason
(a text-only checkpoint, where --language-model-only decides nothing, is exempted here automatically).

Image traffic (`serves_media=True`, the grid's random-mm dataset) is not text serving: vLLM's production
configuration for it keeps the vision tower, so the launch carries no --language-model-only (the flag would drop
the tower and refuse every image) and `check_vllm_argv` refuses one; the record's denominator note says what that
costs vLLM (MEDIA_TRAFFIC_NOTE).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deltaserve.bench.deviations import (
    BATCHED_TOKENS_80GB,
    DEFAULT_SITE,
    DEVIATIONS,
    GATE_SITE,
    SITES,
    backend_overrides,
    denominator_note,
    site_deviations,
    site_env,
    site_flags,
    site_max_batched_tokens,
)

VLLM = "vllm"
ORACLES = (VLLM,)

# Flags every hand-written vLLM launch must spell out (the static gate checks these textually).
REQUIRED_FLAGS: tuple[str, ...] = ("--language-model-only",)
# Flags no production launch may carry, with the reason the gate prints.
FORBIDDEN_FLAGS: dict[str, str] = {
    "--enforce-eager": "turns off torch.compile and CUDA graphs: not vLLM's production configuration",
    "--no-async-scheduling": "turns off async scheduling, which is on by default in production",
}
TEXT_ONLY_EXEMPTION = "text-only checkpoint: --language-model-only decides nothing"
DEFAULT_MAMBA_SSM_DTYPE = "float32"  # vLLM hardcodes float32 for Qwen3.5 when the config is silent
MIN_BATCHED_TOKENS_MOE = 8192
MEDIA_REASON = (
    "no --language-model-only: image traffic needs the vision tower, which vLLM's production configuration for "
    "media keeps (hence no fused QK-norm + RoPE + gate attention path)"
)
# The denominator note of every image-traffic launch: not a deviation (this is vLLM's production configuration for
# media) but a difference from its text-serving configuration that can move the ratios.
MEDIA_TRAFFIC_NOTE = (
    "vision-tower-kept: image traffic, so vLLM serves in its production configuration for media, without "
    "--language-model-only (that flag drops the vision tower and would refuse every image). Its vision tower is "
    "built (0.84 GiB more weights and 1.0 GiB less KV cache on the 35B-A3B shape, measured on one H200 on "
    "2026-11-29), and its decoder attention runs without the fused QK-norm + RoPE + gate kernel, which vLLM 0.26 "
    "uses only when serving text only (Qwen3NextAttention's text_only); deltaserve's fused preamble applies the "
    "3-D MRoPE positions itself. On text traffic the two vLLM configurations ran at the same speed within noise "
    "(35B-A3B, c1 185.6 vs 184.0 and c32 1507.4 vs 1505.7 output tok/s), so the missing fusion is not expected "
    "to move these ratios much; the vision encoder's own kernels (ViT attention backend at vLLM's choice) are "
    "vLLM's production ones."
)


@dataclass(frozen=True)
class CheckpointFacts:
    """What the production configuration depends on, read from a checkpoint's config.json."""

    is_multimodal: bool
    is_moe: bool
    mamba_ssm_dtype: str
    has_weights: bool
    num_mtp_layers: int = 0  # mtp_num_hidden_layers (Qwen3.5/3.6) or num_nextn_predict_layers (Qwen3-Next)
    quantization: str | None = None  # quantization_config.quant_method ("fp8" for the -FP8 releases), else None


@dataclass
class OracleLaunch:
    """A peer server launch: argv, environment, and why it looks the way it does."""

    oracle: str
    argv: list[str]
    env: dict[str, str]
    exemption: str | None = None
    reasons: list[str] = field(default_factory=list)
    version_probe: list[str] = field(default_factory=list)
    deviations: list[str] = field(default_factory=list)  # names in DEVIATIONS
    denominator_note: str | None = None

    @property
    def command_line(self) -> str:
        return shlex.join(self.argv)


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


def vllm_launch(
    model: str,
    input_len: int,
    port: int = 8000,
    site: str = DEFAULT_SITE,
    is_random_data: bool = True,
    python: str = "python3",
    extra_args: list[str] | tuple[str, ...] = (),
    drop_flags: list[str] | tuple[str, ...] = (),
    exemption: str | None = None,
    facts: CheckpointFacts | None = None,
    serves_media: bool = False,
    enable_prefix_caching: bool = False,
    prefix_match_unit: int | None = None,
    speculative_config: dict[str, Any] | None = None,
) -> OracleLaunch:
    """vLLM's production server command for `model` at input length `input_len`.

    `drop_flags` removes required flags and needs `exemption` (the reason); `extra_args` may add flags but
    not forbidden ones, and may not weaken a required one (checked by `check_vllm_argv`). `serves_media` names
    the traffic (images): the launch keeps the vision tower (no --language-model-only) and carries
    MEDIA_TRAFFIC_NOTE as its denominator note. `enable_prefix_caching` (data that shares prefixes only) and
    `prefix_match_unit` (with it) build vLLM's prefix-caching arm; `speculative_config` builds its MTP arm.
    """
    if enable_prefix_caching and is_random_data:
        raise ValueError("--enable-prefix-caching is for data that shares prefixes: random data needs it off")
    if prefix_match_unit is not None and (not enable_prefix_caching or prefix_match_unit <= 0):
        raise ValueError("--prefix-match-unit needs --enable-prefix-caching and a positive number of tokens")
    if site not in SITES:
        raise ValueError(f"unknown site {site!r}; known: {', '.join(SITES)}")
    facts = facts or inspect_checkpoint(model)
    if serves_media and not facts.is_multimodal:
        raise ValueError(f"{model} has no vision tower (no vision_config): it cannot serve image traffic")
    if serves_media and "--language-model-only" in drop_flags:
        raise ValueError("image traffic already runs without --language-model-only: there is nothing to drop")
    dtype = facts.mamba_ssm_dtype
    card_max = site_max_batched_tokens(site)
    num_batched = min_batched_tokens(input_len, facts.is_moe, card_max)
    is_budget_capped = num_batched < min_batched_tokens(input_len, facts.is_moe)
    # A backend override needs the caller's own reason (the automatic text-only exemption does not cover it).
    overrides = backend_overrides(list(extra_args))
    if overrides and not exemption:
        raise ValueError(f"{', '.join(overrides)} overrides a backend vLLM would choose itself: needs an exemption")
    # oracle-registry: the one spelled-out vLLM launch; every harness builds its peer command from here.
    argv = [
        python, "-m", "vllm.entrypoints.cli.main", "serve", model,
        "--language-model-only",
        "--mamba-ssm-cache-dtype", dtype,
        "--max-num-batched-tokens", str(num_batched),
        "--no-enable-prefix-caching",
        "--port", str(port),
    ]  # fmt: skip
    reasons = [
        "--language-model-only: text serving of a multimodal checkpoint; enables the fused attention preamble",
        f"--mamba-ssm-cache-dtype {dtype}: the checkpoint's SSM state dtype",
        f"--max-num-batched-tokens {num_batched}: at least 2 x ISL ({input_len})"
        if not is_budget_capped
        else f"--max-num-batched-tokens {num_batched}: one whole prompt ({input_len}), the card's profile limit",
        "--no-enable-prefix-caching: random prompts share no prefix",
        "compile and CUDA graphs on (no --enforce-eager), async scheduling at its default",
    ]
    if not facts.is_multimodal:
        drop_flags = [*drop_flags, "--language-model-only"]
        exemption = exemption or TEXT_ONLY_EXEMPTION
    if serves_media:
        argv.remove("--language-model-only")
        reasons[0] = MEDIA_REASON
    if not is_random_data:
        index = argv.index("--no-enable-prefix-caching")
        argv.remove("--no-enable-prefix-caching")
        reasons.remove("--no-enable-prefix-caching: random prompts share no prefix")
        if enable_prefix_caching:
            argv.insert(index, "--enable-prefix-caching")
            reasons.append("--enable-prefix-caching: vLLM's prefix-caching arm for prompts that share prefixes")
        if prefix_match_unit is not None:
            argv[index + 1 : index + 1] = ["--prefix-match-unit", str(prefix_match_unit)]
            reasons.append(f"--prefix-match-unit {prefix_match_unit}: hits may land every {prefix_match_unit} tokens")
    if speculative_config is not None:
        problems = check_speculative_config(speculative_config, facts)
        if problems:
            raise ValueError("not vLLM's MTP arm: " + "; ".join(problems))
        argv += ["--speculative-config", json.dumps(speculative_config, separators=(",", ":"))]
        reasons.append(f"--speculative-config: vLLM's MTP arm ({speculative_config})")
    if facts.quantization is not None:
        reasons.append(
            f"no --quantization: the checkpoint's quantization_config declares {facts.quantization!r}, which vLLM "
            "reads itself (block FP8: DeepGEMM / CUTLASS block GEMMs and its Triton fused MoE at its own choice)"
        )
    if not facts.has_weights:
        argv += ["--load-format", "dummy"]
        reasons.append("--load-format dummy: config-only checkpoint")
    deviations = site_deviations(site) + ([DEVIATIONS[BATCHED_TOKENS_80GB]] if is_budget_capped else [])
    argv += site_flags(site)
    reasons += [f"deviation {d.name} (site {site}): {d.reason}" for d in deviations]
    for flag in drop_flags:
        if flag not in REQUIRED_FLAGS:
            raise ValueError(f"{flag} is not a required flag; nothing to drop")
        if not exemption:
            raise ValueError(f"dropping {flag} needs an exemption reason")
        if flag in argv:
            argv.remove(flag)
    argv += list(extra_args)
    launch = OracleLaunch(
        oracle=VLLM,
        argv=argv,
        env=site_env(site),
        exemption=exemption if drop_flags or overrides else None,
        reasons=reasons,
        deviations=[d.name for d in deviations],
        denominator_note=" ".join(
            note for note in (MEDIA_TRAFFIC_NOTE if serves_media else None, denominator_note(deviations)) if note
        )
        or None,
        version_probe=[python, "-c", "import vllm; print(vllm.__version__)"],
    )
    problems = check_vllm_argv(
        argv, input_len=input_len, is_random_data=is_random_data, facts=facts, serves_media=serves_media,
        card_max=card_max,
    )  # fmt: skip
    if launch.exemption:
        problems = [p for p in problems if not any(f in p for f in drop_flags)]
    if problems:
        raise ValueError("not vLLM's production configuration: " + "; ".join(problems))
    return launch


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


def oracle_launch(oracle: str, model: str, input_len: int, **kwargs: Any) -> OracleLaunch:
    """Dispatch by oracle name (only vLLM today)."""
    if oracle == VLLM:
        return vllm_launch(model, input_len, **kwargs)
    raise ValueError(f"unknown oracle {oracle!r}; known: {', '.join(ORACLES)}")


# Engine arguments that change what an in-process oracle reports, never what it computes.
HARNESS_ENGINE_KWARGS: dict[str, tuple[Any, str]] = {
    "logprobs_mode": ("raw_logits", "per-step logits come back as raw logits (bf16 values), not logprobs"),
}
# An in-process oracle that shares its GPU with other gates (`gate tokens --share-gpu`): cache sizes only. A fixed
# KV cache makes vLLM skip its start-up memory profiling (gpu_worker.determine_available_memory), whose assertion
# fails when another process frees memory meanwhile; the small utilization only passes request_memory's start-up
# check (free >= utilization x total) beside the other gates.
SHARED_GPU_ENGINE_KWARGS: dict[str, tuple[Any, str]] = {
    "gpu_memory_utilization": (0.05, "shares the GPU with other token gates; start-up check only"),
    "kv_cache_memory_bytes": (
        2**30,
        "a fixed 1 GiB KV cache (the gate's 32 prompts of <= 200 tokens need a few MB): no memory profiling beside "
        "other processes; no preemption either way, so no computation changes",
    ),
}
# Environment an in-process oracle needs besides the site's.
IN_PROCESS_ENV: dict[str, tuple[str, str]] = {
    "VLLM_ALLOW_INSECURE_SERIALIZATION": (
        "1",
        "LLM.apply_model pickles the gate's inspection function into the engine process; changes no computation",
    ),
}


@dataclass
class OracleEngine:
    """An in-process oracle: the `vllm.LLM` keyword arguments, the environment, and why they look so."""

    oracle: str
    kwargs: dict[str, Any]
    env: dict[str, str]
    reasons: list[str] = field(default_factory=list)
    deviations: list[str] = field(default_factory=list)
    denominator_note: str | None = None


def vllm_engine(
    model: str,
    max_prompt_len: int,
    dtype: str = "auto",
    site: str = GATE_SITE,
    seed: int = 0,
    facts: CheckpointFacts | None = None,
    serves_media: bool = False,
    shares_gpu: bool = False,
    speculative_config: dict[str, Any] | None = None,
) -> OracleEngine:
    """vLLM's production configuration as `vllm.LLM(**kwargs)` for `model` (the in-process twin of vllm_launch).

    Nothing here is a knob: a harness that needs another configuration adds a named Deviation. `serves_media`
    names the traffic, not a setting: image and video prompts need the vision tower, so vLLM's production
    configuration for them keeps it (no language_model_only, hence no fused QK-norm + RoPE + gate path).
    `shares_gpu` (gates run side by side on one GPU) adds SHARED_GPU_ENGINE_KWARGS, each with its reason.
    `speculative_config` makes it vLLM's MTP arm (checked as `vllm_launch` checks it), for the MTP gates.
    """
    facts = facts or inspect_checkpoint(model)
    if serves_media and not facts.is_multimodal:
        raise ValueError(f"{model} has no vision tower (no vision_config): it cannot serve image or video prompts")
    is_text_only = facts.is_multimodal and not serves_media
    num_batched = min_batched_tokens(max_prompt_len, facts.is_moe)
    kwargs: dict[str, Any] = {
        "model": model,
        "dtype": dtype,
        "seed": seed,
        # A multimodal checkpoint served as text: no vision tower, and vLLM's fused QK-norm + RoPE + gate path.
        "language_model_only": is_text_only,
        "mamba_ssm_cache_dtype": facts.mamba_ssm_dtype,
        "max_num_batched_tokens": num_batched,
        "enable_prefix_caching": False,
        "enforce_eager": False,
    }
    lmo_reason = "text serving of a multimodal checkpoint" if facts.is_multimodal else "text-only checkpoint"
    if serves_media:
        lmo_reason = "image and video prompts: the production configuration keeps the vision tower"
    reasons = [
        f"language_model_only={is_text_only}: {lmo_reason}",
        f"mamba_ssm_cache_dtype={facts.mamba_ssm_dtype}: the checkpoint's SSM state dtype",
        f"max_num_batched_tokens={num_batched}: at least 2 x the longest prompt ({max_prompt_len})",
        "enable_prefix_caching=False: the gate's prompts share no prefix",
        "enforce_eager=False: compile and CUDA graphs on; async scheduling at its default",
    ]
    if not facts.has_weights:
        kwargs["load_format"] = "dummy"
        reasons.append("load_format=dummy: config-only checkpoint")
    if speculative_config is not None:
        problems = check_speculative_config(speculative_config, facts)
        if problems:
            raise ValueError("not vLLM's MTP arm: " + "; ".join(problems))
        kwargs["speculative_config"] = dict(speculative_config)
        reasons.append(f"speculative_config={speculative_config}: vLLM's MTP arm")
        # vLLM's offline LLM keeps stat logging off by default, and LLM.get_metrics() (the MTP gate's source of the
        # vllm:spec_decode_* counters) asserts it is on; it changes what the engine reports, not what it computes
        kwargs["disable_log_stats"] = False
        reasons.append("disable_log_stats=False: the spec-decode counters are read through LLM.get_metrics()")
    for name, (value, why) in (HARNESS_ENGINE_KWARGS | (SHARED_GPU_ENGINE_KWARGS if shares_gpu else {})).items():
        kwargs[name] = value
        reasons.append(f"{name}={value}: {why}")
    deviations = site_deviations(site)
    for deviation in deviations:
        kwargs.update(dict(deviation.engine_kwargs))
        reasons.append(f"deviation {deviation.name} (site {site}): {deviation.reason}")
    env = site_env(site)
    for name, (value, why) in IN_PROCESS_ENV.items():
        env[name] = value
        reasons.append(f"{name}={value}: {why}")
    return OracleEngine(VLLM, kwargs, env, reasons, [d.name for d in deviations], denominator_note(deviations))


def apply_environment(env: dict[str, str]) -> None:
    """Make this process fit for an in-process oracle: PYTHONPATH entries go on sys.path, the rest into
    os.environ (before vLLM is first imported; a value already set differently is an error)."""
    for name, value in env.items():
        if name == "PYTHONPATH":
            for entry in reversed(value.split(":")):
                if entry and entry not in sys.path:
                    sys.path.insert(0, entry)
            continue
        current = os.environ.get(name)
        if current is not None and current != value:
            raise ValueError(f"{name}={current} in the environment, but the oracle registry needs {name}={value}")
        os.environ[name] = value


def build_vllm_llm(engine: OracleEngine) -> Any:
    """The in-process vLLM oracle; the only `vllm.LLM(...)` construction in the repository."""
    apply_environment(engine.env)
    import vllm

    # oracle-registry: in-process construction; every harness builds its vllm.LLM here.
    return vllm.LLM(**engine.kwargs)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """CLI: print the production command for a checkpoint (for shell harnesses)."""
    parser.add_argument("--model", required=True, help="checkpoint folder (config.json is read)")
    parser.add_argument("--oracle", default=VLLM, choices=ORACLES)
    parser.add_argument("--input-len", type=int, required=True, help="the benchmark's ISL")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--site", default=DEFAULT_SITE, choices=sorted(SITES))
    parser.add_argument("--python", default="python3", help="the interpreter that has vLLM")
    parser.add_argument("--not-random-data", action="store_true", help="leave prefix caching at vLLM's default")
    parser.add_argument(
        "--enable-prefix-caching", action="store_true", help="vLLM's prefix-caching arm (implies --not-random-data)"
    )
    parser.add_argument("--prefix-match-unit", type=int, default=None, help="with --enable-prefix-caching")
    parser.add_argument("--serves-media", action="store_true", help="image traffic: keep the vision tower")
    parser.add_argument(
        "--speculative-config", type=json.loads, default=None, help="vLLM's MTP arm: its --speculative-config JSON"
    )
    parser.add_argument("--drop-flag", action="append", default=[], help="required flag to leave out")
    parser.add_argument("--exempt", default=None, help="the reason for --drop-flag")
    parser.add_argument("--format", default="shell", choices=["shell", "json", "env"])
    parser.add_argument("extra", nargs="*", help="after --: extra serve flags (checked, not trusted)")


def run(args: argparse.Namespace) -> int:
    """Print the launch as a shell line, as JSON, or as `export` lines for its environment."""
    extra = list(args.extra)
    try:
        launch = oracle_launch(
            args.oracle,
            args.model,
            args.input_len,
            port=args.port,
            site=args.site,
            is_random_data=not (args.not_random_data or args.enable_prefix_caching),
            python=args.python,
            extra_args=extra,
            drop_flags=args.drop_flag,
            exemption=args.exempt,
            serves_media=args.serves_media,
            enable_prefix_caching=args.enable_prefix_caching,
            prefix_match_unit=args.prefix_match_unit,
            speculative_config=args.speculative_config,
        )
    except (ValueError, OSError) as exc:
        print(f"registry: {exc}", file=sys.stderr)
        return 1
    if args.format == "json":
        print(json.dumps(launch.__dict__ | {"command_line": launch.command_line}, indent=2))
    elif args.format == "env":
        print("\n".join(f"export {k}={shlex.quote(v)}" for k, v in launch.env.items()))
    else:
        print(launch.command_line)
    return 0


if __name__ == "__main__":
    main_parser = argparse.ArgumentParser(prog="python -m deltaserve.bench.registry", description=__doc__)
    add_arguments(main_parser)
    sys.exit(run(main_parser.parse_args()))
