"""vLLM's MTP arm in the oracle registry (issue 41), the MTP grid resolved through it, and the dummy checkpoints that
declare the MTP layer vLLM builds its draft from."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from deltaserve.bench import registry
from deltaserve.bench.grid import load_config, resolve

from .test_registry import write_config

REPO = Path(__file__).resolve().parents[2]
GRID = REPO / "benchmarks/grids/h200_mtp.toml"
K3 = {
    "method": "mtp",
    "num_speculative_tokens": 3,
    "rejection_sample_method": "synthetic",
    "synthetic_acceptance_rates": [0.917, 0.837, 0.648],
}


def _with_mtp(path: Path, layers: int = 1) -> Path:
    config = json.loads((path / "config.json").read_text())
    config["text_config"]["mtp_num_hidden_layers"] = layers
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_mtp_arm_adds_the_speculative_config_and_checks_it(tmp_path: Path) -> None:
    model = str(_with_mtp(write_config(tmp_path / "m", num_experts=8)))
    launch = registry.vllm_launch(model, 1024, speculative_config=K3)
    index = launch.argv.index("--speculative-config")
    assert json.loads(launch.argv[index + 1]) == K3
    assert any("MTP arm" in reason for reason in launch.reasons)
    assert "--speculative-config" not in registry.vllm_launch(model, 1024).argv
    refusals = {
        "method 'eagle'": {**K3, "method": "eagle"},
        "positive integer": {**K3, "num_speculative_tokens": 0},
        "one rate per draft position": {**K3, "synthetic_acceptance_rates": [0.9, 0.8]},
        "non-increasing": {**K3, "synthetic_acceptance_rates": [0.5, 0.9, 0.4]},
        "unknown key 'draft_tensor_parallel_size'": {**K3, "draft_tensor_parallel_size": 1},
        "pin the acceptance": {"method": "mtp", "num_speculative_tokens": 3},
    }
    for message, config in refusals.items():
        with pytest.raises(ValueError, match=message):
            registry.vllm_launch(model, 1024, speculative_config=config)
    no_layer = str(write_config(tmp_path / "plain", num_experts=8))
    with pytest.raises(ValueError, match="declares no MTP layer"):
        registry.vllm_launch(no_layer, 1024, speculative_config=K3)


def test_mtp_grid_resolves_through_the_registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, experts in (("q35-35b-a3b", 256), ("q35-27b", 0)):
        _with_mtp(write_config(tmp_path / name, num_experts=experts))
    monkeypatch.setenv("DELTASERVE_MODELS", str(tmp_path))
    config = load_config(GRID)
    assert [a.name for a in config.arms] == ["deltaserve", "vllm", "vllm-mtp3", "vllm-mtp1"]
    assert config.concurrencies == [1, 8, 32, 64] and config.lengths == [(1024, 128)]
    for model in config.models:
        ours, plain, mtp3, mtp1 = (resolve(arm, model, config) for arm in config.arms)
        assert "--speculative-config" not in ours.argv and "--speculative-config" not in plain.argv
        for launch, k, rates in ((mtp3, 3, [0.917, 0.837, 0.648]), (mtp1, 1, [0.917])):
            spec = json.loads(launch.argv[launch.argv.index("--speculative-config") + 1])
            assert spec["num_speculative_tokens"] == k and spec["synthetic_acceptance_rates"] == rates
            assert "--no-enable-prefix-caching" in launch.argv and launch.exemption is None


def test_dummy_checkpoints_declare_their_mtp_layer(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("make_dummy_models", REPO / "benchmarks/oracle/make_dummy_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.write_config(str(tmp_path / "moe"), "q35-35b-a3b")
    module.write_multimodal(str(tmp_path / "mm"), scaled=True)
    for folder in ("moe", "mm"):
        config = json.loads((tmp_path / folder / "config.json").read_text())
        assert config["mtp_num_hidden_layers"] == 1 and config["text_config"]["mtp_num_hidden_layers"] == 1
        assert registry.inspect_checkpoint(tmp_path / folder).num_mtp_layers == 1


def test_in_process_oracle_becomes_the_mtp_arm_only_when_asked(tmp_path: Path) -> None:
    model = str(_with_mtp(write_config(tmp_path / "m", num_experts=8)))
    (tmp_path / "m" / "model.safetensors").write_bytes(b"")  # real weights: drafts are real, no pinned acceptance
    greedy = {"method": "mtp", "num_speculative_tokens": 2}
    engine = registry.vllm_engine(model, 160, speculative_config=greedy)
    assert engine.kwargs["speculative_config"] == greedy and any("MTP arm" in r for r in engine.reasons)
    assert "speculative_config" not in registry.vllm_engine(model, 160).kwargs
    with pytest.raises(ValueError, match="method 'ngram'"):
        registry.vllm_engine(model, 160, speculative_config={**greedy, "method": "ngram"})
