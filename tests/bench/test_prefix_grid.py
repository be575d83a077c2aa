"""vLLM's prefix-caching arm in the oracle registry, the prefix-caching grids (issue 36: prefix_repetition,
multi-turn, and random traffic with the cache on and off) resolved through it, and the hit rates a grid records
from each server's /metrics and prints beside every ratio."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from deltaserve.bench import registry, registry_rules, report
from deltaserve.bench.grid import Grid
from deltaserve.bench.grid_config import load_config, resolve
from deltaserve.bench.grid_launch import client_argv
from deltaserve.bench.grid_ratios import compute_ratios
from deltaserve.bench.serve_args import prefix_options
from deltaserve.bench.serve_cli import parse_bench_args
from deltaserve.bench.server_counters import parse_prefix_counters, prefix_cache_fields
from deltaserve.gates import oracle_flags

from .test_registry import write_config

REPO = Path(__file__).resolve().parents[2]
GRID = REPO / "benchmarks/grids/h200_prefix.toml"


def test_prefix_caching_arm_is_on_only_for_data_that_shares_prefixes(tmp_path: Path) -> None:
    model = str(write_config(tmp_path / "m", num_experts=8))
    launch = registry.vllm_launch(model, 5500, is_random_data=False, enable_prefix_caching=True)
    assert "--enable-prefix-caching" in launch.argv and "--no-enable-prefix-caching" not in launch.argv
    assert "--prefix-match-unit" not in launch.argv and any("prefix-caching arm" in r for r in launch.reasons)
    tuned = registry.vllm_launch(model, 5500, is_random_data=False, enable_prefix_caching=True, prefix_match_unit=16)
    index = tuned.argv.index("--prefix-match-unit")
    assert tuned.argv[index + 1] == "16" and tuned.argv[:index] == launch.argv[:index]
    assert registry_rules.check_vllm_argv(tuned.argv, input_len=5500, is_random_data=False) == []
    with pytest.raises(ValueError, match="random data needs it off"):
        registry.vllm_launch(model, 1024, enable_prefix_caching=True)
    with pytest.raises(ValueError, match="needs --enable-prefix-caching"):
        registry.vllm_launch(model, 1024, is_random_data=False, prefix_match_unit=16)
    with pytest.raises(ValueError, match="never off"):
        registry.vllm_launch(model, 1024, is_random_data=False, extra_args=["--no-enable-prefix-caching"])


def test_prefix_grid_resolves_through_the_registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, experts in (("q35-35b-a3b", 256), ("q35-27b", 0)):
        write_config(tmp_path / name, num_experts=experts)
    monkeypatch.setenv("DELTASERVE_MODELS", str(tmp_path))
    config = load_config(GRID)
    assert [a.name for a in config.arms] == ["deltaserve", "vllm-pc", "vllm-pc-unit16"]
    assert config.concurrencies == [1, 8, 32, 64] and config.lengths == [(4736, 128), (5500, 128)]
    assert [m.name for m in config.models] == ["q35-35b-a3b", "q35-27b"]
    for model in config.models:
        ours, pc, unit16 = (resolve(arm, model, config) for arm in config.arms)
        assert ours.argv[:4] == [sys.executable, "-m", "deltaserve.cli", "serve"]
        for peer in (pc, unit16):
            assert "--enable-prefix-caching" in peer.argv and "--no-enable-prefix-caching" not in peer.argv
            assert peer.argv[peer.argv.index("--max-num-batched-tokens") + 1] == "11000"  # 2 x the longest ISL
            assert "--language-model-only" in peer.argv and peer.exemption is None
        assert "--prefix-match-unit" not in pc.argv
        assert unit16.argv[unit16.argv.index("--prefix-match-unit") + 1] == "16"
    launch = resolve(config.arms[0], config.models[0], config)
    for (isl, osl), (prefix_len, suffix_len) in zip(config.lengths, ((4224, 512), (4000, 1500)), strict=True):
        args = parse_bench_args(client_argv(launch, config, isl, osl, 8, "x"))
        assert args.dataset_name == "prefix_repetition" and args.ignore_eos is True and args.num_prompts == 40
        options = prefix_options(args)
        assert (options.prefix_len, options.suffix_len, options.num_prefixes, options.output_len) == (
            prefix_len, suffix_len, 4, 128,
        )  # fmt: skip


def test_oracle_flags_passes_the_prefix_grid() -> None:
    code, launches, num_files = oracle_flags.check([GRID])
    assert code == 0 and num_files == 1
    assert {(launch.spelling, launch.status) for launch in launches} == {
        ("registry:vllm (vllm-pc)", "ok"),
        ("registry:vllm (vllm-pc-unit16)", "ok"),
    }


@pytest.mark.parametrize(
    ("lengths", "table", "message"),
    [
        ("[[16, 2], [32, 2]]", 'name="prefix_repetition"\n', "needs prefix_repetition_prefix_len"),
        ("[[16, 2], [32, 2]]", 'name="random"\nprefix_repetition_prefix_len=4\n', "apply to prefix_repetition only"),
        ("[[16, 2], [32, 2]]", 'name="prefix_repetition"\nprefix_repetition_prefix_len=[4, 5, 6]\n',
         "3 prefix_repetition_prefix_len"),
        ("[[16, 2], [32, 2]]", 'name="prefix_repetition"\nprefix_repetition_prefix_len=16\n', "must be in"),
        ("[[16, 2]]", 'name="multi-turn"\nmulti_turn_turns=3\n', "needs multi_turn_user_len"),
        ("[[16, 2]]", 'name="multi-turn"\nmulti_turn_turns=0\nmulti_turn_user_len=5\n', "needs multi_turn_turns"),
        ("[[16, 2]]", 'name="random"\nmulti_turn_turns=3\n', "apply to multi-turn only"),
    ],
)  # fmt: skip
def test_prefix_and_multi_turn_dataset_tables_are_validated(
    tmp_path: Path, lengths: str, table: str, message: str
) -> None:
    path = tmp_path / "g.toml"
    grid = f"[grid]\nlengths={lengths}\n"
    path.write_text(grid + '[[models]]\nname="m"\npath="p"\n[[arms]]\nname="a"\ncommand=["x"]\n[dataset]\n' + table)
    with pytest.raises(ValueError, match=message):
        load_config(path)


def test_grid_record_states_the_prefix_dataset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("q35-35b-a3b", "q35-27b"):
        write_config(tmp_path / name, num_experts=8)
    monkeypatch.setenv("DELTASERVE_MODELS", str(tmp_path))
    record = Grid(load_config(GRID), tmp_path / "r", record_name="p")._new_record()
    assert record["dataset"] == {
        "name": "prefix_repetition",
        "prefix_repetition_prefix_len": [4224, 4000],
        "prefix_repetition_num_prefixes": 4,
    }


@pytest.mark.parametrize(
    ("dataset", "arm", "problem"),
    [
        ('name="prefix_repetition"', 'extra_args=["--no-enable-prefix-caching"]', "or on"),
        ('name="random"', "enable_prefix_caching=true", "shares no prefix"),
        ('name="random"', 'extra_args=["--enable-prefix-caching"]', "shares no prefix"),
    ],
)
def test_oracle_flags_refuses_prefix_caching_against_the_data(
    tmp_path: Path, dataset: str, arm: str, problem: str
) -> None:
    path = tmp_path / "g.toml"
    path.write_text(f'[dataset]\n{dataset}\n[[arms]]\nname="v"\noracle="vllm"\n{arm}\n')
    code, (launch,), _ = oracle_flags.check([path])
    assert code == 1 and launch.status == "violation" and problem in " ".join(launch.problems)


def test_registry_cli_prints_the_prefix_caching_arm(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = str(write_config(tmp_path / "m", num_experts=8))
    parser = argparse.ArgumentParser()
    registry.add_arguments(parser)
    argv = ["--model", model, "--input-len", "5500", "--enable-prefix-caching", "--prefix-match-unit", "16"]
    assert registry.run(parser.parse_args(argv)) == 0
    expected = registry.vllm_launch(
        model, 5500, is_random_data=False, enable_prefix_caching=True, prefix_match_unit=16
    ).command_line
    assert capsys.readouterr().out.strip() == expected
    assert registry.run(parser.parse_args(["--model", model, "--input-len", "64", "--prefix-match-unit", "16"])) == 1


MULTI_TURN_GRID = REPO / "benchmarks/grids/h200_prefix_multi_turn.toml"
RANDOM_GRID = REPO / "benchmarks/grids/h200_prefix_random.toml"


def test_multi_turn_grid_runs_one_conversation_per_client(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, experts in (("q35-35b-a3b", 256), ("q35-27b", 0)):
        write_config(tmp_path / name, num_experts=experts)
    monkeypatch.setenv("DELTASERVE_MODELS", str(tmp_path))
    config = load_config(MULTI_TURN_GRID)
    assert config.dataset.is_multi_turn and config.dataset.shares_prefixes
    assert config.concurrencies == [16, 64] and config.lengths == [(2000, 256)]
    assert [a.name for a in config.arms] == ["deltaserve", "vllm-pc", "vllm-pc-unit16"]
    # the last turn: system + 12 x (user + answer)
    assert config.max_input_len() == 2000 + 12 * (200 + 256)
    model = config.models[0]
    ours, pc, unit16 = (resolve(arm, model, config) for arm in config.arms)
    assert ours.argv[ours.argv.index("--max-model-len") + 1] == "16384"
    for peer in (pc, unit16):
        assert "--enable-prefix-caching" in peer.argv and "--no-enable-prefix-caching" not in peer.argv
        assert peer.argv[peer.argv.index("--max-num-batched-tokens") + 1] == str(2 * config.max_input_len())
    for clients in config.concurrencies:
        args = parse_bench_args(client_argv(ours, config, 2000, 256, clients, "x"))
        assert (args.dataset_name, args.backend, args.endpoint) == ("multi-turn", "openai-chat", "/v1/chat/completions")
        assert (args.multi_turn_num_clients, args.multi_turn_turns, args.multi_turn_system_len) == (clients, 12, 2000)
        assert (args.multi_turn_user_len, args.multi_turn_output_len, args.max_concurrency) == (200, 256, clients)
    record = Grid(config, tmp_path / "r", record_name="m")._new_record()
    assert record["dataset"] == {"name": "multi-turn", "multi_turn_turns": 12, "multi_turn_user_len": 200}
    code, launches, _ = oracle_flags.check([MULTI_TURN_GRID])
    assert code == 0 and {launch.status for launch in launches} == {"ok"}


def test_random_grid_compares_the_cache_on_and_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, experts in (("q35-35b-a3b", 256), ("q35-27b", 0)):
        write_config(tmp_path / name, num_experts=experts)
    monkeypatch.setenv("DELTASERVE_MODELS", str(tmp_path))
    config = load_config(RANDOM_GRID)
    assert config.dataset.name == "random" and config.lengths == [(1024, 128)]
    assert [(a.name, a.role) for a in config.arms] == [("deltaserve", "subject"), ("deltaserve-no-pc", "peer"),
                                                       ("vllm", "peer")]  # fmt: skip
    on, off, vllm = (resolve(arm, config.models[0], config) for arm in config.arms)
    assert "--no-enable-prefix-caching" not in on.argv and off.argv == [*on.argv, "--no-enable-prefix-caching"]
    assert "--no-enable-prefix-caching" in vllm.argv
    assert "cost" in (config.arms[1].denominator_note or "")
    code, launches, _ = oracle_flags.check([RANDOM_GRID])
    assert code == 0 and {launch.status for launch in launches} == {"ok"}


def test_server_counters_are_summed_over_engines_and_give_the_runs_rate() -> None:
    text = "\n".join([
        "# HELP vllm:prefix_cache_queries Prefix cache queries, in terms of number of queried tokens.",
        "# TYPE vllm:prefix_cache_queries counter",
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0',
        'vllm:prefix_cache_queries_total{engine="1",model_name="m"} 500.0',
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 300.0',
        'vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e9',
        "vllm:prefix_cache_hits_total 100.0",
    ])  # fmt: skip
    assert parse_prefix_counters(text) == (1500.0, 400.0)
    assert parse_prefix_counters("vllm:num_requests_running 0.0\n") is None
    fields = prefix_cache_fields((1500.0, 400.0), (2500.0, 1150.0))
    assert fields == {"server_prefix_cache_queries": 1000, "server_prefix_cache_hits": 750,
                      "server_prefix_cache_hit_rate": 0.75}  # fmt: skip
    assert prefix_cache_fields((10.0, 0.0), (10.0, 0.0))["server_prefix_cache_hit_rate"] is None  # nothing queried
    assert set(prefix_cache_fields(None, (1.0, 1.0)).values()) == {None}


def test_ratios_and_report_carry_both_engines_hit_rates() -> None:
    def run(arm: str, rate: float | None) -> dict[str, object]:
        metrics = {"output_throughput": 100.0 if arm == "ds" else 50.0, "server_prefix_cache_hit_rate": rate}
        return {"arm": arm, "model": "m", "isl": 2000, "osl": 256, "concurrency": 16, "is_drift_check": False,
                "metrics": metrics, "error": None,
                "client_command_line": "deltaserve bench serve --dataset-name multi-turn"}  # fmt: skip

    record: dict[str, object] = {
        "grid": "g", "title": "t", "arms": {"ds": {"role": "subject"}, "v": {"role": "peer"}},
        "models": [{"name": "m"}], "runs": [run("ds", 0.8125), run("v", None)], "lengths": [[2000, 256]],
        "concurrencies": [16], "launches": [], "drift": [],
    }  # fmt: skip
    (entry,) = compute_ratios(record)
    assert entry["output_throughput"] == 2.0
    assert (entry["subject_prefix_cache_hit_rate"], entry["peer_prefix_cache_hit_rate"]) == (0.8125, None)
    record["ratios"] = [entry]
    text = report.render([("g-1", record)], {})
    assert "prefix cache hit rate (subject / peer)" in text and "81.2 % / n/a" in text
    # records from before the field: no column
    record["ratios"] = [{k: v for k, v in entry.items() if "hit_rate" not in k}]
    assert "prefix cache hit rate" not in report.render([("g-1", record)], {})
