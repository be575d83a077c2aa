"""The oracle registry: vLLM's production command per kind of checkpoint, exemptions, and refusals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from deltaserve.bench import deviations, registry, registry_rules, registry_types

REPO = Path(__file__).resolve().parents[2]


def write_config(
    path: Path, *, is_multimodal: bool = True, num_experts: int = 0, dtype: str | None = "float32"
) -> Path:
    text = {"hidden_size": 64, "num_experts": num_experts}
    if dtype:
        text["mamba_ssm_dtype"] = dtype
    config = {"architectures": ["Qwen3_5ForCausalLM"], **text}
    if is_multimodal:
        config = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "text_config": text, "vision_config": {}}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_multimodal_moe_checkpoint_gets_the_production_flags(tmp_path: Path) -> None:
    model = write_config(tmp_path / "moe", num_experts=256)
    launch = registry.vllm_launch(str(model), 1024, port=8123)
    argv = launch.argv
    assert argv[1:5] == ["-m", "vllm.entrypoints.cli.main", "serve", str(model)]
    assert "--language-model-only" in argv and "--enforce-eager" not in argv
    assert argv[argv.index("--mamba-ssm-cache-dtype") + 1] == "float32"
    assert argv[argv.index("--max-num-batched-tokens") + 1] == "8192"  # MoE floor above 2 x 1024
    assert "--no-enable-prefix-caching" in argv
    assert "--gdn-prefill-backend" not in argv  # production: vLLM picks FlashInfer's GDN prefill itself
    assert argv[argv.index("--load-format") + 1] == "dummy"  # no weight files in the folder
    assert launch.env["PYTHONPATH"].split(":")[0] == "/tmp/flashinfer_site" and launch.exemption is None
    assert registry_rules.check_vllm_argv(argv, input_len=1024, is_random_data=True) == []


def test_dense_shape_scales_batched_tokens_with_isl_and_follows_the_ssm_dtype(tmp_path: Path) -> None:
    model = write_config(tmp_path / "dense", dtype="bfloat16")
    argv = registry.vllm_launch(str(model), 3000, site="online").argv
    assert argv[argv.index("--max-num-batched-tokens") + 1] == "6000"
    assert argv[argv.index("--mamba-ssm-cache-dtype") + 1] == "bfloat16"
    assert "--gdn-prefill-backend" not in argv
    silent = write_config(tmp_path / "silent", dtype=None)
    argv = registry.vllm_launch(str(silent), 1024).argv
    assert argv[argv.index("--mamba-ssm-cache-dtype") + 1] == "float32"


def test_an_80gb_card_caps_the_step_budget_where_2x_isl_does_not_fit(tmp_path: Path) -> None:
    """On an h100-* site the budget is max(ISL, 65536) where 2 x ISL is more (vLLM's memory profile of a 131,072-token
    step ran out of memory on an H100: h100_long-27b-20261206-s31), and the launch carries the batched-tokens-80gb
    deviation with its note; shorter prompts, and the H200 sites, keep 2 x ISL and no such deviation."""
    model = str(write_config(tmp_path / "dense"))

    def budget(launch: registry_types.OracleLaunch) -> int:
        return int(launch.argv[launch.argv.index("--max-num-batched-tokens") + 1])

    capped = registry.vllm_launch(model, 65536, site="h100-offline")
    assert budget(capped) == 65536 and deviations.BATCHED_TOKENS_80GB in capped.deviations
    assert "batched-tokens-80gb" in (capped.denominator_note or "")
    assert any("one whole prompt (65536)" in reason for reason in capped.reasons)
    assert budget(registry.vllm_launch(model, 100000, site="h100-offline")) == 100000  # one whole prompt at least
    short = registry.vllm_launch(model, 16384, site="h100-offline")
    assert budget(short) == 32768 and deviations.BATCHED_TOKENS_80GB not in short.deviations
    on_h200 = registry.vllm_launch(model, 65536, site="h200-offline")
    assert budget(on_h200) == 131072 and deviations.BATCHED_TOKENS_80GB not in on_h200.deviations
    # the floor check: the capped budget passes on the 80 GB site's limit, not without it
    assert registry_rules.check_vllm_argv(capped.argv, input_len=65536, is_random_data=True, card_max=65536) == []
    assert registry_rules.check_vllm_argv(capped.argv, input_len=65536, is_random_data=True)


def test_text_only_checkpoint_is_exempt_with_its_reason(tmp_path: Path) -> None:
    model = write_config(tmp_path / "text", is_multimodal=False)
    launch = registry.vllm_launch(str(model), 1024)
    assert "--language-model-only" not in launch.argv
    assert launch.exemption == registry_types.TEXT_ONLY_EXEMPTION


def test_drop_needs_a_reason_and_weakening_extras_are_refused(tmp_path: Path) -> None:
    model = str(write_config(tmp_path / "m"))
    with pytest.raises(ValueError, match="exemption"):
        registry.vllm_launch(model, 1024, drop_flags=["--language-model-only"])
    launch = registry.vllm_launch(model, 1024, drop_flags=["--language-model-only"], exemption="shows the flag")
    assert "--language-model-only" not in launch.argv and launch.exemption == "shows the flag"
    for extra in (["--enforce-eager"], ["--no-async-scheduling"], ["--enable-prefix-caching"]):
        with pytest.raises(ValueError, match="production"):
            registry.vllm_launch(model, 1024, extra_args=extra)
    with pytest.raises(ValueError, match="max-num-batched-tokens"):
        registry.vllm_launch(model, 1024, extra_args=["--max-num-batched-tokens", "1024"])
    with pytest.raises(ValueError, match="mamba"):
        registry.vllm_launch(model, 1024, extra_args=["--mamba-ssm-cache-dtype", "bfloat16"])
    with pytest.raises(ValueError, match="not a required flag"):
        registry.vllm_launch(model, 1024, drop_flags=["--port"], exemption="x")
    argv = registry.vllm_launch(model, 1024, is_random_data=False).argv
    assert "--no-enable-prefix-caching" not in argv


def test_cli_prints_the_same_command_the_grid_uses(tmp_path: Path) -> None:
    model = str(write_config(tmp_path / "m", num_experts=8))
    done = subprocess.run(
        [sys.executable, "-m", "deltaserve.bench.registry", "--model", model, "--input-len", "1024", "--port", "9000"]
        + ["--", "--max-model-len", "4096"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    expected = registry.vllm_launch(model, 1024, port=9000, extra_args=["--max-model-len", "4096"]).command_line
    assert done.stdout.strip() == expected
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "deltaserve.bench.registry",
            "--model",
            model,
            "--input-len",
            "8",
            "--",
            "--enforce-eager",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert refused.returncode == 1 and "enforce-eager" in refused.stderr


def test_site_deviations_are_named_with_reasons_and_a_denominator_note(tmp_path: Path) -> None:
    model = str(write_config(tmp_path / "m"))
    launch = registry.vllm_launch(model, 1024, site="h200-offline-triton-gdn")
    assert launch.deviations == ["gdn-prefill-triton", "flashinfer-sampler-off"]
    assert launch.argv[-2:] == ["--gdn-prefill-backend", "triton"] and launch.env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    note = launch.denominator_note
    assert note and "gdn-prefill-triton" in note and "favours deltaserve on TTFT" in note
    # the measured size, with the record that measured it
    assert "h200_gdn_backend-35b-a3b-20261204.json" in note and "unmeasured (" not in note
    # the sampler deviation moves nothing at temperature 0, so it is named but not in the denominator note
    assert "flashinfer-sampler-off" not in note
    assert any(reason.startswith("deviation gdn-prefill-triton") for reason in launch.reasons)
    for deviation in deviations.DEVIATIONS.values():
        assert deviation.reason and deviation.direction and deviation.magnitude
    production = registry.vllm_launch(model, 1024)  # the default site
    assert production.deviations == ["flashinfer-sampler-off"]
    assert "--gdn-prefill-backend" not in production.argv and production.denominator_note is None
    assert "/tmp/flashinfer_site" in production.env["PYTHONPATH"]
    assert registry.vllm_launch(model, 1024, site="online").deviations == []


def test_recorded_launches_are_recognised_and_backend_overrides_need_a_reason(tmp_path: Path) -> None:
    argv = ["vllm", "serve", "m", "--gdn-prefill-backend=triton"]
    assert [d.name for d in deviations.deviations_in(argv, {})] == ["gdn-prefill-triton"]
    assert [d.name for d in deviations.deviations_in(["vllm"], {"VLLM_USE_FLASHINFER_SAMPLER": "0"})] == [
        "flashinfer-sampler-off"
    ]
    assert deviations.deviations_in(["vllm", "serve", "m", "--gdn-prefill-backend", "flashinfer"]) == []
    assert registry.backend_overrides(["--moe-backend", "triton"], {"VLLM_ATTENTION_BACKEND": "X"}) == [
        "--moe-backend triton",
        "VLLM_ATTENTION_BACKEND=X",
    ]
    model = str(write_config(tmp_path / "m"))
    with pytest.raises(ValueError, match="overrides a backend"):
        registry.vllm_launch(model, 1024, site="online", extra_args=["--attention-backend", "FLASHINFER"])
    text_only = str(write_config(tmp_path / "text", is_multimodal=False))
    with pytest.raises(ValueError, match="overrides a backend"):
        # the automatic text-only exemption does not cover a backend override
        registry.vllm_launch(text_only, 1024, site="online", extra_args=["--moe-backend", "triton"])
    launch = registry.vllm_launch(model, 1024, site="online", extra_args=["--moe-backend", "triton"], exemption="why")
    assert launch.exemption == "why"


def test_in_process_engine_follows_the_production_configuration(tmp_path: Path) -> None:
    moe = write_config(tmp_path / "moe", num_experts=8)
    engine = registry.vllm_engine(str(moe), 160, dtype="bfloat16", seed=3)
    kwargs = engine.kwargs
    assert kwargs["language_model_only"] is True and kwargs["enforce_eager"] is False
    assert kwargs["mamba_ssm_cache_dtype"] == "float32" and kwargs["max_num_batched_tokens"] == 8192
    assert kwargs["enable_prefix_caching"] is False and kwargs["dtype"] == "bfloat16" and kwargs["seed"] == 3
    assert kwargs["gdn_prefill_backend"] == "triton" and kwargs["load_format"] == "dummy"
    assert kwargs["logprobs_mode"] == "raw_logits"
    assert engine.env["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1" and engine.env["PYTHONPATH"] == "/tmp/vllm_site"
    assert engine.deviations == ["gdn-prefill-triton", "flashinfer-sampler-off"]
    text_only = write_config(tmp_path / "text", is_multimodal=False, dtype="bfloat16")
    kwargs = registry.vllm_engine(str(text_only), 100, site="online").kwargs
    assert kwargs["language_model_only"] is False and kwargs["mamba_ssm_cache_dtype"] == "bfloat16"
    assert kwargs["max_num_batched_tokens"] == 200 and "gdn_prefill_backend" not in kwargs


def test_apply_environment_refuses_a_conflicting_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_USE_FLASHINFER_SAMPLER", "1")
    with pytest.raises(ValueError, match="VLLM_USE_FLASHINFER_SAMPLER=1"):
        registry.apply_environment({"VLLM_USE_FLASHINFER_SAMPLER": "0"})
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delenv("DELTASERVE_TEST_ORACLE_VAR", raising=False)
    registry.apply_environment({"PYTHONPATH": "/tmp/a:/tmp/b", "DELTASERVE_TEST_ORACLE_VAR": "x"})
    assert sys.path[:2] == ["/tmp/a", "/tmp/b"]
    import os

    assert os.environ["DELTASERVE_TEST_ORACLE_VAR"] == "x"
    monkeypatch.delenv("DELTASERVE_TEST_ORACLE_VAR")
