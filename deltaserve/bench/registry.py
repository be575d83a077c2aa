"""The oracle registry: the one module that says how each peer engine runs in its production configuration.

Every harness path builds peer server commands here (the grid calls `oracle_launch`; shell scripts call
`python -m deltaserve.bench.registry --model DIR --input-len N -- EXTRA`), every in-process oracle is built
here (`vllm_engine` + `build_vllm_llm`, used by `deltaserve gate tokens --reference vllm`), and the static gate
`deltaserve check oracle-flags` checks hand-written launches against `REQUIRED_FLAGS` / `FORBIDDEN_FLAGS`
(registry_rules.py) / `BACKEND_FLAGS` (deviations.py) and in-process constructions against the registry, so no two
harnesses can disagree about the denominator. Where the oracle runs (SITES) and what each site forces (DEVIATIONS)
live in deviations.py. What the production configuration is, flag by flag and why, and the checks that hold a
launch to it (`check_vllm_argv`, `check_speculative_config`) are in registry_rules.py; the launch and engine
records this module returns, with their fixed reasons and notes, in registry_types.py.

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
from deltaserve.bench.registry_rules import (
    REQUIRED_FLAGS,
    CheckpointFacts,
    check_speculative_config,
    check_vllm_argv,
    inspect_checkpoint,
    min_batched_tokens,
)
from deltaserve.bench.registry_types import (
    HARNESS_ENGINE_KWARGS,
    IN_PROCESS_ENV,
    MEDIA_REASON,
    MEDIA_TRAFFIC_NOTE,
    SHARED_GPU_ENGINE_KWARGS,
    TEXT_ONLY_EXEMPTION,
    OracleEngine,
    OracleLaunch,
)

VLLM = "vllm"
ORACLES = (VLLM,)


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


def oracle_launch(oracle: str, model: str, input_len: int, **kwargs: Any) -> OracleLaunch:
    """Dispatch by oracle name (only vLLM today)."""
    if oracle == VLLM:
        return vllm_launch(model, input_len, **kwargs)
    raise ValueError(f"unknown oracle {oracle!r}; known: {', '.join(ORACLES)}")


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
