"""vLLM's MTP arm in the oracle registry (issue 41), the MTP grid resolved through it (deltaserve's MTP arms with the
same --speculative-config as vLLM's), the dummy checkpoints that declare the MTP layer vLLM builds its draft from, and
each run's mean acceptance length from the server's /metrics, carried into the ratios and the report; a CPU grid
point on the trained tiny checkpoint records it from a real speculating server."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from deltaserve.bench import registry, registry_rules, report
from deltaserve.bench.grid import Grid
from deltaserve.bench.grid_config import load_config, resolve
from deltaserve.bench.grid_ratios import compute_ratios
from deltaserve.bench.server_counters import parse_spec_counters, spec_decode_fields
from deltaserve.speculative_config import KPolicyConfig, parse_speculative_config
from deltaserve.tiny.trained import trained_model_dir
from tests.support.ports import free_port

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
    names = [
        "deltaserve", "deltaserve-mtp3", "deltaserve-mtp1", "deltaserve-mtp3-kpolicy", "deltaserve-mtp3-kpolicy-low",
        "deltaserve-mtp3-async", "vllm", "vllm-mtp3", "vllm-mtp1",
    ]  # fmt: skip
    assert [a.name for a in config.arms] == names
    assert {a.name: a.baseline for a in config.arms if a.baseline} == {
        "deltaserve-mtp3": "deltaserve", "deltaserve-mtp1": "deltaserve", "deltaserve-mtp3-kpolicy": "deltaserve",
        "deltaserve-mtp3-kpolicy-low": "deltaserve", "deltaserve-mtp3-async": "deltaserve", "vllm-mtp3": "vllm",
        "vllm-mtp1": "vllm",
    }  # fmt: skip
    assert config.concurrencies == [1, 8, 32, 64] and config.lengths == [(1024, 128)]
    for model in config.models:
        ours, ours3, ours1, policy, policy_low, chained, plain, mtp3, mtp1 = (
            resolve(a, model, config) for a in config.arms
        )
        # async verify: deltaserve-mtp3's configuration plus the deltaserve-only key
        parsed = parse_speculative_config(chained.argv[chained.argv.index("--speculative-config") + 1])
        assert parsed.async_verify and parsed.k_policy is None and parsed.num_speculative_tokens == 3
        assert chained.argv[: len(ours.argv)] == ours.argv
        for launch, rates in ((policy, [0.917, 0.837, 0.648]), (policy_low, [0.1, 0.02, 0.0])):
            # the k policy's arms: k = 3 with the policy at its defaults (deltaserve only: no vLLM twin)
            parsed = parse_speculative_config(launch.argv[launch.argv.index("--speculative-config") + 1])
            assert parsed.k_policy == KPolicyConfig() and parsed.num_speculative_tokens == 3
            assert list(parsed.synthetic_acceptance_rates) == rates
            assert launch.argv[: len(ours.argv)] == ours.argv
        assert "--speculative-config" not in ours.argv and "--speculative-config" not in plain.argv
        for launch, k, rates in ((mtp3, 3, [0.917, 0.837, 0.648]), (mtp1, 1, [0.917])):
            spec = json.loads(launch.argv[launch.argv.index("--speculative-config") + 1])
            assert spec["num_speculative_tokens"] == k and spec["synthetic_acceptance_rates"] == rates
            assert "--no-enable-prefix-caching" in launch.argv and launch.exemption is None
        for subject, peer in ((ours3, mtp3), (ours1, mtp1)):
            # deltaserve's MTP arm: its plain launch plus vLLM's --speculative-config, word for word
            spec = subject.argv[subject.argv.index("--speculative-config") + 1]
            assert json.loads(spec) == json.loads(peer.argv[peer.argv.index("--speculative-config") + 1])
            assert subject.argv[: len(ours.argv)] == ours.argv and subject.argv[len(ours.argv) :] == [
                "--speculative-config", spec
            ]  # fmt: skip
            parsed = parse_speculative_config(spec)  # deltaserve serve accepts it as written
            assert parsed.rejection_sample_method == "synthetic" and parsed.num_speculative_tokens in (1, 3)


def test_server_spec_counters_give_the_runs_mean_acceptance_length() -> None:
    text = "\n".join([
        "# TYPE vllm:spec_decode_num_drafts counter",
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 100.0',
        'vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 20.0',
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 360.0',
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 240.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 110.0',
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 5.0',
    ])  # fmt: skip
    assert parse_spec_counters(text) == (120.0, 360.0, 240.0)
    assert parse_spec_counters('vllm:prefix_cache_queries_total{engine="0"} 5.0') is None  # not speculating
    fields = spec_decode_fields((120.0, 360.0, 240.0), (220.0, 660.0, 480.0))
    assert fields["server_spec_decode_num_drafts"] == 100 and fields["server_spec_decode_num_accepted_tokens"] == 240
    assert fields["server_mean_acceptance_length"] == 3.4 and fields["server_draft_acceptance_rate"] == 0.8
    assert spec_decode_fields((5.0, 15.0, 3.0), (5.0, 15.0, 3.0))["server_mean_acceptance_length"] is None
    assert set(spec_decode_fields(None, (1.0, 1.0, 1.0)).values()) == {None}


def test_ratios_and_report_carry_the_mean_acceptance_length() -> None:
    def run(arm: str, length: float | None) -> dict[str, object]:
        metrics = {"output_throughput": 150.0 if arm == "ds-mtp3" else 100.0, "server_mean_acceptance_length": length}
        return {"arm": arm, "model": "m", "isl": 1024, "osl": 128, "concurrency": 1, "is_drift_check": False,
                "metrics": metrics, "error": None,
                "client_command_line": "deltaserve bench serve --dataset-name random"}  # fmt: skip

    record: dict[str, object] = {
        "grid": "g", "title": "t", "models": [{"name": "m"}], "lengths": [[1024, 128]], "concurrencies": [1],
        "arms": {"ds": {"role": "subject"}, "ds-mtp3": {"role": "subject", "baseline": "ds"},
                 "v": {"role": "peer"}, "v-mtp3": {"role": "peer", "baseline": "v"}},
        "runs": [run("ds", None), run("ds-mtp3", 3.375), run("v", None), run("v-mtp3", 3.4)],
        "launches": [], "drift": [],
    }  # fmt: skip
    ratios = {(e["subject"], e["peer"]): e for e in compute_ratios(record)}
    assert "subject_mean_acceptance_length" not in ratios[("ds", "v")]  # neither speculates: no field
    both = ratios[("ds-mtp3", "v-mtp3")]
    assert both["output_throughput"] == 1.5
    assert (both["subject_mean_acceptance_length"], both["peer_mean_acceptance_length"]) == (3.375, 3.4)
    assert (
        ratios[("ds-mtp3", "ds")]["subject_mean_acceptance_length"],
        ratios[("ds-mtp3", "ds")]["peer_mean_acceptance_length"],
    ) == (3.375, None)
    record["ratios"] = list(ratios.values())
    text = report.render([("g-1", record)], {})
    assert "mean acceptance length (subject / peer)" in text and "3.38 / 3.40" in text and "3.38 / –" in text
    # records from before the field: no column
    record["ratios"] = [{k: v for k, v in e.items() if "acceptance" not in k} for e in ratios.values()]
    assert "mean acceptance length" not in report.render([("g-1", record)], {})


def test_dummy_checkpoints_declare_their_mtp_layer(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("make_dummy_models", REPO / "benchmarks/oracle/make_dummy_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.write_config(str(tmp_path / "moe"), "q35-35b-a3b")
    module.write_multimodal(str(tmp_path / "mm"), scaled=True)
    for folder in ("moe", "mm"):
        config = json.loads((tmp_path / folder / "config.json").read_text())
        assert config["mtp_num_hidden_layers"] == 1 and config["text_config"]["mtp_num_hidden_layers"] == 1
        assert registry_rules.inspect_checkpoint(tmp_path / folder).num_mtp_layers == 1


def test_the_trained_checkpoints_declare_their_mtp_layer_as_vllm_reads_it(tmp_path: Path) -> None:
    # Qwen3-Next without num_nextn_predict_layers: vLLM builds one MTP layer, so the MTP gate's oracle can run there
    for variant in ("dense", "moe", "next"):
        assert registry_rules.inspect_checkpoint(trained_model_dir(variant)).num_mtp_layers == 1, variant
    config = json.loads((trained_model_dir("next") / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    assert registry_rules.inspect_checkpoint(tmp_path).num_mtp_layers == 0


def test_in_process_oracle_becomes_the_mtp_arm_only_when_asked(tmp_path: Path) -> None:
    model = str(_with_mtp(write_config(tmp_path / "m", num_experts=8)))
    (tmp_path / "m" / "model.safetensors").write_bytes(b"")  # real weights: drafts are real, no pinned acceptance
    greedy = {"method": "mtp", "num_speculative_tokens": 2}
    engine = registry.vllm_engine(model, 160, speculative_config=greedy)
    assert engine.kwargs["speculative_config"] == greedy and any("MTP arm" in r for r in engine.reasons)
    assert "speculative_config" not in registry.vllm_engine(model, 160).kwargs
    with pytest.raises(ValueError, match="method 'ngram'"):
        registry.vllm_engine(model, 160, speculative_config={**greedy, "method": "ngram"})


@pytest.mark.slow
def test_cpu_grid_point_records_the_speculating_servers_acceptance(tmp_path: Path) -> None:
    """Two real `deltaserve serve` arms on the trained tiny dense checkpoint, without and with MTP (k = 2, its trained
    head drafting: the standard accept rule), one point: the MTP run's mean acceptance length comes from its
    /metrics, the plain run has none, and the MTP / plain ratio carries both."""
    model = trained_model_dir("dense")
    spec = json.dumps({"method": "mtp", "num_speculative_tokens": 2})
    serve = ["{python}", "-m", "deltaserve.cli", "serve", "{model}", "--port", "{port}"]
    config_path = tmp_path / "cpu_mtp.toml"
    config_path.write_text(
        "\n".join(
            [
                "[grid]",
                'name = "cpu_mtp"',
                'title = "deltaserve with and without MTP, trained tiny dense, CPU"',
                "concurrencies = [2]",
                "lengths = [[32, 24]]",
                "prompts_per_concurrency = 2",
                "min_prompts = 4",
                "num_warmups = 1",
                f"port = {free_port()}",
                "is_restart_cheap = false",
                'client_args = ["--temperature", "0", "--ignore-eos"]',
                "[[models]]",
                'name = "tiny-dense"',
                f'path = "{model}"',
                "[[arms]]",
                'name = "ds"',
                'role = "peer"',
                f"command = {json.dumps(serve)}",
                "startup_timeout_s = 120",
                "[[arms]]",
                'name = "ds-mtp2"',
                'role = "subject"',
                f"command = {json.dumps([*serve, '--speculative-config', spec])}",
                "startup_timeout_s = 120",
            ]
        )  # fmt: skip
    )
    record = Grid(load_config(config_path), tmp_path / "results", record_name="r", is_drift_enabled=False).run()
    runs = {r["arm"]: r["metrics"] for r in record["runs"]}
    assert all(r["error"] is None for r in record["runs"]) and runs["ds-mtp2"]["failed"] == 0
    assert runs["ds"]["server_mean_acceptance_length"] is None and runs["ds"]["server_spec_decode_num_drafts"] is None
    mtp = runs["ds-mtp2"]
    assert mtp["server_spec_decode_num_drafts"] > 0 and mtp["server_spec_decode_num_draft_tokens"] > 0
    assert mtp["server_mean_acceptance_length"] == 1 + mtp["server_spec_decode_num_accepted_tokens"] / mtp[
        "server_spec_decode_num_drafts"
    ]  # fmt: skip
    (entry,) = [e for e in record["ratios"] if (e["subject"], e["peer"]) == ("ds-mtp2", "ds")]
    assert entry["subject_mean_acceptance_length"] == mtp["server_mean_acceptance_length"]
    assert entry["peer_mean_acceptance_length"] is None
