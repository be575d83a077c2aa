"""The oracle registry: vLLM's production command per kind of checkpoint, exemptions, and refusals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from deltaserve.bench import registry

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
    assert argv[argv.index("--gdn-prefill-backend") + 1] == "triton"
    assert argv[argv.index("--load-format") + 1] == "dummy"  # no weight files in the folder
    assert launch.env["PYTHONPATH"] == "/tmp/vllm_site" and launch.exemption is None
    assert registry.check_vllm_argv(argv, input_len=1024, is_random_data=True) == []


def test_dense_shape_scales_batched_tokens_with_isl_and_follows_the_ssm_dtype(tmp_path: Path) -> None:
    model = write_config(tmp_path / "dense", dtype="bfloat16")
    argv = registry.vllm_launch(str(model), 3000, site="online").argv
    assert argv[argv.index("--max-num-batched-tokens") + 1] == "6000"
    assert argv[argv.index("--mamba-ssm-cache-dtype") + 1] == "bfloat16"
    assert "--gdn-prefill-backend" not in argv
    silent = write_config(tmp_path / "silent", dtype=None)
    argv = registry.vllm_launch(str(silent), 1024).argv
    assert argv[argv.index("--mamba-ssm-cache-dtype") + 1] == "float32"


def test_text_only_checkpoint_is_exempt_with_its_reason(tmp_path: Path) -> None:
    model = write_config(tmp_path / "text", is_multimodal=False)
    launch = registry.vllm_launch(str(model), 1024)
    assert "--language-model-only" not in launch.argv
    assert launch.exemption == registry.TEXT_ONLY_EXEMPTION


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
