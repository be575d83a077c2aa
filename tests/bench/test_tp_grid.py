"""The TP=2 grid (issue 19, benchmarks/grids/h200_tp2.toml) resolves to deltaserve at --tensor-parallel-size 2
against vLLM's production command (from the oracle registry) at --tensor-parallel-size 2, with NVLink multicast off
in both arms' environments."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deltaserve import env
from deltaserve.bench import grid as grid_module
from deltaserve.bench.grid_config import load_config, resolve
from deltaserve.bench.registry_rules import check_vllm_argv


def _value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_both_arms_run_at_two_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, arch, experts in (("q35-35b-a3b", "Qwen3_5MoeForConditionalGeneration", 256),
                                ("q35-27b", "Qwen3_5ForConditionalGeneration", 0)):  # fmt: skip
        (tmp_path / name).mkdir()
        config = {"architectures": [arch], "vision_config": {},
                  "text_config": {"num_experts": experts, "mamba_ssm_dtype": "float32"}}  # fmt: skip
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    monkeypatch.setenv("DELTASERVE_MODELS", str(tmp_path))
    config = load_config(grid_module.REPO_ROOT / "benchmarks/grids/h200_tp2.toml")
    arms = {arm.role: arm for arm in config.arms}
    for model in config.models:
        ours, peer = resolve(arms["subject"], model, config), resolve(arms["peer"], model, config)
        assert ours.argv[1:4] == ["-m", "deltaserve.cli", "serve"]
        assert _value(ours.argv, "--tensor-parallel-size") == _value(peer.argv, "--tensor-parallel-size") == "2"
        # the peer is the registry's production command, with nothing dropped
        assert peer.argv[1:4] == ["-m", "vllm.entrypoints.cli.main", "serve"] and peer.exemption is None
        assert check_vllm_argv(peer.argv, input_len=1024, is_random_data=True) == []
        for launch in (ours, peer):
            assert {k: launch.env_overrides.get(k) for k in env.NVLINK_MULTICAST_OFF} == env.NVLINK_MULTICAST_OFF
