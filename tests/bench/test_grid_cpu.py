"""The CI grid: two real `deltaserve serve` arms on the CPU (fused vs unfused attention preamble) through launch,
health, the client, the record and the report, into a temporary folder.

This is the harness's end-to-end test on the real server and real tokenizer path (transformers), so it is the
slow one (two server starts on the CPU); every other tests/bench test uses stand-ins and stays fast.
"""

from __future__ import annotations

import importlib.util
import json
import textwrap
from pathlib import Path

import pytest

from deltaserve.bench import report
from deltaserve.bench.grid import Grid
from deltaserve.bench.grid_config import load_config
from tests.support.ports import free_port

pytestmark = pytest.mark.slow


def test_fused_vs_unfused_preamble_grid_on_the_cpu(tmp_path: Path) -> None:
    if importlib.util.find_spec("deltaserve.api.cli") is None:
        pytest.skip("deltaserve serve (deltaserve.api.cli) is not there yet")
    from deltaserve.tiny import make_tiny

    model = make_tiny(tmp_path / "tiny-dense", "dense")
    config_path = tmp_path / "cpu.toml"
    config_path.write_text(
        textwrap.dedent(
            f"""
            [grid]
            name = "cpu_preamble"
            title = "deltaserve fused vs unfused attention preamble, tiny dense, CPU"
            concurrencies = [1, 2]
            lengths = [[32, 32]]
            prompts_per_concurrency = 2
            min_prompts = 3
            num_warmups = 1
            port = {free_port()}
            is_restart_cheap = false
            client_args = ["--temperature", "0", "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl,e2el"]

            [[models]]
            name = "tiny-dense"
            path = "{model}"

            [[arms]]
            name = "fused"
            role = "subject"
            command = ["{{python}}", "-m", "deltaserve.cli", "serve", "{{model}}", "--port", "{{port}}"]
            env = {{ DELTASERVE_FUSE_ATTN_PREAMBLE = "1" }}
            startup_timeout_s = 120

            [[arms]]
            name = "unfused"
            role = "peer"
            command = ["{{python}}", "-m", "deltaserve.cli", "serve", "{{model}}", "--port", "{{port}}"]
            env = {{ DELTASERVE_FUSE_ATTN_PREAMBLE = "0" }}
            startup_timeout_s = 120
            denominator_note = "the same engine with the four-op preamble"
            """
        )
    )
    results = tmp_path / "results"
    record = Grid(load_config(config_path), results, record_name="cpu-run", is_drift_enabled=False).run()

    assert record["is_complete"] and json.loads((results / "cpu-run.json").read_text())["is_complete"]
    assert [(e["arm"], e["error"], e["is_port_freed"]) for e in record["launches"]] == [
        ("fused", None, True),
        ("unfused", None, True),
    ]
    assert [e["env"]["DELTASERVE_FUSE_ATTN_PREAMBLE"] for e in record["launches"]] == ["1", "0"]
    assert all(e["engine_version"] for e in record["launches"])
    for run in record["runs"]:
        metrics = run["metrics"]
        assert run["error"] is None and metrics["failed"] == 0, run
        assert metrics["completed"] == max(3, 2 * run["concurrency"])
        # ignore_eos, usage from the server; 32 tokens a request, so a stream spans many reads of the client even on
        # a fast CPU step (with 8, one run once read every event of most streams at once: TPOT median 0)
        assert metrics["total_output_tokens"] == 32 * metrics["completed"]
        assert metrics["is_server_tokenize_aligned"] and metrics["median_tpot_ms"] > 0
    assert len(record["ratios"]) == 2 and all(r["output_throughput"] > 0 for r in record["ratios"])

    output = tmp_path / "docs" / "BENCHMARKS.md"
    assert report.run(report.argparse.Namespace(results_dir=results, output=output, check=False)) == 0
    text = output.read_text()
    assert "DELTASERVE_FUSE_ATTN_PREAMBLE=0" in text and "the same engine with the four-op preamble" in text
    assert (output.parent / "plots/bench-cpu-run.png").exists()


def test_multi_turn_grid_records_both_arms_hit_rates_on_the_cpu(tmp_path: Path) -> None:
    """The multi-turn dataset through the grid on two real servers, deltaserve's prefix cache on (subject) and off
    (peer): one conversation per client, and each ratio carries both servers' hit rates from their /metrics."""
    from deltaserve.tiny import make_tiny

    model = make_tiny(tmp_path / "tiny-dense", "dense")
    serve = '["{python}", "-m", "deltaserve.cli", "serve", "{model}", "--port", "{port}"'
    config_path = tmp_path / "cpu-mt.toml"
    config_path.write_text(
        textwrap.dedent(
            f"""
            [grid]
            name = "cpu_multi_turn"
            title = "deltaserve prefix cache on vs off, multi-turn, tiny dense, CPU"
            concurrencies = [2]
            lengths = [[130, 8]]
            num_warmups = 1
            port = {free_port()}
            client_args = ["--temperature", "0", "--ignore-eos"]

            [dataset]
            name = "multi-turn"
            multi_turn_turns = 3
            multi_turn_user_len = 20

            [[models]]
            name = "tiny-dense"
            path = "{model}"

            [[arms]]
            name = "cache-on"
            role = "subject"
            command = {serve}]
            startup_timeout_s = 120

            [[arms]]
            name = "cache-off"
            role = "peer"
            command = {serve}, "--no-enable-prefix-caching"]
            startup_timeout_s = 120
            """
        )
    )
    record = Grid(load_config(config_path), tmp_path / "results", record_name="mt", is_drift_enabled=False).run()
    assert record["is_complete"] and [e["error"] for e in record["launches"]] == [None, None]
    by_arm = {run["arm"]: run["metrics"] for run in record["runs"]}
    for metrics in by_arm.values():
        assert metrics["failed"] == 0 and metrics["completed"] == 2 * 3 and metrics["multi_turn_num_clients"] == 2
    on, off = by_arm["cache-on"], by_arm["cache-off"]
    # turns 2 and 3 re-send the earlier turn's whole prompt: the cache serves part of it
    assert on["server_prefix_cache_queries"] > 0 and 0 < on["server_prefix_cache_hit_rate"] < 1
    # the cache off: nothing is looked up, so there is no rate (not a 0 %)
    assert off["server_prefix_cache_queries"] == 0 and off["server_prefix_cache_hit_rate"] is None
    (entry,) = record["ratios"]
    assert entry["subject_prefix_cache_hit_rate"] == on["server_prefix_cache_hit_rate"]
    assert entry["peer_prefix_cache_hit_rate"] is None
