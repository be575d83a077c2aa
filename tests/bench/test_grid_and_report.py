"""The grid (config, registry-built arms, launch/health/client/stop, schedules, record) and the report."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import textwrap
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from deltaserve.bench import grid as grid_module
from deltaserve.bench import grid_cli, grid_launch, report, report_cells, report_record, report_standing
from deltaserve.bench.grid import Grid
from deltaserve.bench.grid_config import load_config, resolve
from deltaserve.bench.grid_ratios import compute_ratios
from tests.support.ports import free_port

from .bench_helpers import WordTokenizer

FAKE_SERVER = Path(__file__).parent / "fake_server.py"


def fake_grid_toml(path: Path, model: Path, port: int, is_restart_cheap: bool) -> Path:
    text = f"""
    [grid]
    name = "fake"
    title = "fake servers"
    concurrencies = [1, 2]
    lengths = [[16, 4]]
    prompts_per_concurrency = 2
    min_prompts = 3
    num_warmups = 1
    port = {port}
    is_restart_cheap = {str(is_restart_cheap).lower()}
    drift_concurrency = 2
    client_args = ["--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99"]

    [[models]]
    name = "word"
    path = "{model}"

    [[arms]]
    name = "fast"
    role = "subject"
    command = ["{{python}}", "{FAKE_SERVER}", "{{model}}", "--port", "{{port}}", "--itl-ms", "1"]
    # Generous: on a loaded 2-core CI machine the fake server's imports alone can take tens of seconds.
    startup_timeout_s = 180

    [[arms]]
    name = "slow"
    role = "peer"
    command = ["{{python}}", "{FAKE_SERVER}", "{{model}}", "--port", "{{port}}", "--itl-ms", "10"]
    denominator_note = "repaired: now runs with the production flags"
    startup_timeout_s = 180
    """
    path.write_text(textwrap.dedent(text))
    return path


def test_config_validation(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[[models]]\nname="m"\npath="p"\n[[arms]]\nname="a"\noracle="vllm"\ncommand=["x"]\n')
    with pytest.raises(ValueError, match="exactly one"):
        load_config(bad)
    bad.write_text('[[models]]\nname="m"\npath="p"\n[[arms]]\nname="a"\noracle="vllm"\ndrop_flags=["--x"]\n')
    with pytest.raises(ValueError, match="exemption"):
        load_config(bad)
    bad.write_text('[grid]\ncolour="red"\n[[models]]\nname="m"\npath="p"\n[[arms]]\nname="a"\ncommand=["x"]\n')
    with pytest.raises(ValueError, match="unknown keys"):
        load_config(bad)


def test_h200_grid_resolves_peers_through_the_registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, arch, experts in (("q35-35b-a3b", "Qwen3_5MoeForConditionalGeneration", 256),
                                ("q35-27b", "Qwen3_5ForConditionalGeneration", 0)):  # fmt: skip
        (tmp_path / name).mkdir()
        text = {"num_experts": experts, "mamba_ssm_dtype": "float32"}
        config = {"architectures": [arch], "text_config": text, "vision_config": {}}
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    monkeypatch.setenv("DELTASERVE_MODELS", str(tmp_path))
    config = load_config(grid_module.REPO_ROOT / "benchmarks/grids/h200_first.toml")
    assert [a.name for a in config.arms] == ["deltaserve", "vllm", "vllm-no-lmo", "deltaserve-2048"]
    assert config.num_prompts(1) == 10 and config.num_prompts(32) == 160
    moe, dense = config.models
    vllm = resolve(config.arms[1], moe, config)
    assert "--language-model-only" in vllm.argv and vllm.exemption is None
    assert vllm.argv[vllm.argv.index("--max-num-batched-tokens") + 1] == "8192"
    assert vllm.env_overrides["PYTHONPATH"].endswith(":/tmp/vllm_site")  # production: FlashInfer's bundle first
    assert "/tmp/flashinfer_site" in vllm.env_overrides["PYTHONPATH"] and "--gdn-prefill-backend" not in vllm.argv
    dense_vllm = resolve(config.arms[1], dense, config)
    assert dense_vllm.argv[dense_vllm.argv.index("--max-num-batched-tokens") + 1] == "2048"
    no_lmo = resolve(config.arms[2], moe, config)
    assert "--language-model-only" not in no_lmo.argv and "vision tower" in no_lmo.exemption
    ours = resolve(config.arms[0], moe, config)
    assert ours.argv[:4] == [sys.executable, "-m", "deltaserve.cli", "serve"]
    assert ours.argv[4] == str(tmp_path / "q35-35b-a3b")
    assert ours.env_overrides["PYTHONPATH"] == f"{grid_module.REPO_ROOT}:/tmp/vllm_site"
    budget = resolve(config.arms[3], dense, config)
    assert config.arms[3].role == "subject" and budget.argv[-2:] == ["--max-num-batched-tokens", "2048"]
    assert "--max-num-seqs" not in vllm.argv and vllm.deviations == ["flashinfer-sampler-off"]
    # an 80 GB card (`bench grid --card h100`): the peer at the h100 twin of its site, with vLLM's own limit
    config.arms[1].site = grid_cli.site_for_card(config.arms[1].site, "h100")
    on_h100 = resolve(config.arms[1], dense, config)
    assert config.arms[1].site == "h100-offline" and on_h100.env_overrides == vllm.env_overrides
    assert on_h100.argv[on_h100.argv.index("--max-num-seqs") + 1] == "256"
    assert on_h100.deviations == ["flashinfer-sampler-off", "max-num-seqs-256"]
    assert grid_cli.site_for_card("h200-offline-triton-gdn", "h100") == "h100-offline-triton-gdn"
    assert grid_cli.site_for_card("h100-offline", "h200") == "h200-offline"
    assert grid_cli.site_for_card("online", "h100") == "online"
    # `bench grid --no-flashinfer` (the vLLM bundle without FlashInfer's): the Triton/FLA GDN prefill twin, noted
    config.arms[1].site = grid_cli.site_without_flashinfer(config.arms[1].site)
    triton = resolve(config.arms[1], dense, config)
    assert config.arms[1].site == "h100-offline-triton-gdn" and "gdn-prefill-triton" in triton.deviations
    assert triton.argv[triton.argv.index("--gdn-prefill-backend") + 1] == "triton"
    assert "/tmp/flashinfer_site" not in triton.env_overrides["PYTHONPATH"]
    assert grid_cli.site_without_flashinfer("h200-offline") == "h200-offline-triton-gdn"
    assert grid_cli.site_without_flashinfer("h200-offline-triton-gdn") == "h200-offline-triton-gdn"
    assert grid_cli.site_without_flashinfer("online") == "online"
    # `bench grid --gpu-memory-utilization 0.92`: every arm the same, in its command or the peer's extra args
    for arm in config.arms:
        grid_cli.set_utilization(arm, "0.92")
    for arm in config.arms:
        argv = resolve(arm, dense, config).argv
        assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.92"
        assert argv.count("--gpu-memory-utilization") == 1
    with pytest.raises(ValueError, match="must be in"):
        grid_cli.set_utilization(config.arms[0], "1.5")


def test_each_point_draws_its_own_prompts_and_every_arm_the_same(tmp_path: Path) -> None:
    """A caching server must not find one run's prompts in an earlier run's (the prefix_random record's hits): the
    client's --seed differs between points and is the same for every arm of a point."""
    config = load_config(grid_module.REPO_ROOT / "benchmarks/grids/h200_prefix_random.toml")
    model = SimpleNamespace(path=str(tmp_path / "m"))  # what client_argv reads of a launch: its URL and model
    launches = [SimpleNamespace(base_url=f"http://127.0.0.1:{port}", model=model) for port in (8000, 8001)]

    def seed(launch: object, isl: int, osl: int, c: int) -> str:
        argv = grid_launch.client_argv(launch, config, isl, osl, c, "x")
        return argv[argv.index("--seed") + 1]

    points = [(isl, osl, c) for isl, osl in [(1024, 128), (16384, 128)] for c in (1, 8, 32, 64)]
    seeds = [seed(launches[0], *point) for point in points]
    assert len(set(seeds)) == len(points), seeds
    # a launch's warm-up point draws apart from every measured point (h100_long-27b-20261206-s31: 99.6 % hits)
    warm = grid_launch.client_argv(launches[0], config, 1024, 128, 1, "x", is_warmup=True)
    assert warm[warm.index("--seed") + 1] not in seeds
    assert "--warmup-distinct" in warm and "--warmup-distinct" in grid_launch.client_argv(
        launches[0], config, 1, 1, 1, "x"
    )
    for launch in launches[1:]:
        assert [seed(launch, *point) for point in points] == seeds


def test_ratios_pair_subject_and_peer_points() -> None:
    metrics = {"output_throughput": 200.0, "median_ttft_ms": 10.0, "p99_ttft_ms": 20.0, "median_tpot_ms": 2.0}
    peer = {"output_throughput": 100.0, "median_ttft_ms": 20.0, "p99_ttft_ms": 20.0, "median_tpot_ms": 4.0}
    record = {
        "arms": {"ds": {"role": "subject"}, "v": {"role": "peer"}},
        "runs": [
            {
                "arm": "ds",
                "model": "m",
                "isl": 8,
                "osl": 2,
                "concurrency": 1,
                "is_drift_check": False,
                "metrics": metrics,
            },
            {"arm": "v", "model": "m", "isl": 8, "osl": 2, "concurrency": 1, "is_drift_check": False, "metrics": peer},
            {
                "arm": "ds",
                "model": "m",
                "isl": 8,
                "osl": 2,
                "concurrency": 4,
                "is_drift_check": False,
                "metrics": metrics,
            },
        ],
    }
    (entry,) = compute_ratios(record)
    assert entry["output_throughput"] == 2.0 and entry["median_ttft_ms"] == 0.5 and entry["p99_ttft_ms"] == 1.0
    assert entry["median_tpot_ms"] == 0.5 and entry["peak_gpu_memory_gib"] is None


def test_a_grid_without_its_drift_re_run_says_so_in_its_schedule(tmp_path: Path, word_model: Path) -> None:
    config = load_config(fake_grid_toml(tmp_path / "fake.toml", word_model, free_port(), False))
    assert Grid(config, tmp_path, record_name="a").record["schedule"] == "sequential+drift"
    no_drift = Grid(config, tmp_path, record_name="b", is_drift_enabled=False).record
    assert no_drift["schedule"] == "sequential (no drift re-run: --no-drift)"


@pytest.mark.parametrize("is_restart_cheap", [False, True])
def test_grid_end_to_end_with_fake_servers_then_report(
    tmp_path: Path, word_model: Path, patch_tokenizer: WordTokenizer, is_restart_cheap: bool
) -> None:
    port = free_port()
    config = load_config(fake_grid_toml(tmp_path / "fake.toml", word_model, port, is_restart_cheap))
    results = tmp_path / "results"
    record = Grid(config, results, record_name="fake-run").run()
    path = results / "fake-run.json"
    assert json.loads(path.read_text()) == json.loads(json.dumps(record, default=str))
    assert record["is_complete"] and record["schedule"] == ("alternating" if is_restart_cheap else "sequential+drift")
    order = [(e["arm"], e["is_drift_check"]) for e in record["launches"]]
    if is_restart_cheap:
        assert order == [("fast", False), ("slow", False), ("fast", False), ("slow", False)]  # A B A B
        assert record["drift"] == []
    else:
        assert order == [("fast", False), ("slow", False), ("fast", True)]
        (drift,) = record["drift"]
        assert drift["arm"] == "fast" and drift["concurrency"] == 2 and drift["output_throughput_change"] is not None
    for launch in record["launches"]:
        assert launch["error"] is None and launch["engine_version"] == "fake-0.0.1" and launch["is_port_freed"]
        assert str(FAKE_SERVER) in launch["command_line"]
    assert not _port_is_open(port)
    runs = [r for r in record["runs"] if not r["is_drift_check"]]
    assert {(r["arm"], r["concurrency"]) for r in runs} == {("fast", 1), ("fast", 2), ("slow", 1), ("slow", 2)}
    assert all(r["metrics"]["completed"] == r["metrics"]["num_prompts"] for r in record["runs"])
    assert all(r["metrics"]["num_prompts"] == max(3, 2 * r["concurrency"]) for r in runs)
    assert len(record["ratios"]) == 2
    for entry in record["ratios"]:
        assert entry["subject"] == "fast" and entry["peer"] == "slow"
        # 1 ms vs 10 ms between tokens: far apart enough that a loaded machine's timer jitter (several ms) cannot
        # invert the ratio (1 ms vs 3 ms gave 1.73 under load 5)
        assert entry["median_tpot_ms"] < 0.9
    assert record["arms"]["slow"]["denominator_note"].startswith("repaired")
    assert (results / "raw/fake-run/fast-word-16x4-c1.json").exists()

    docs = tmp_path / "docs"
    args = report.argparse.Namespace(results_dir=results, output=docs / "BENCHMARKS.md", check=False)
    assert report.run(args) == 0
    text = (docs / "BENCHMARKS.md").read_text()
    assert (docs / "plots/bench-fake-run.png").stat().st_size > 1000
    assert str(FAKE_SERVER) in text and "--itl-ms 10" in text  # every arm's exact command line
    # the denominator note is printed once, under its own heading, and every pair it concerns links to it
    assert text.count("repaired: now runs with the production flags") == 1 and "### Note 1" in text
    assert "fast / slow [*1](#note-1)" in text and "![fake-run](plots/bench-fake-run.png)" in text
    assert text.index("## Current standing") < text.index("## Notes") < text.index("Ratio history")
    assert "### fake: word" in text and "deltaserve bench serve --base-url" in text
    args.check = True
    assert report.run(args) == 0
    (docs / "BENCHMARKS.md").write_text(text + "edit\n")
    assert report.run(args) == 1


def test_a_dead_arm_is_recorded_and_the_grid_goes_on(
    tmp_path: Path, word_model: Path, patch_tokenizer: WordTokenizer
) -> None:
    toml = tmp_path / "dead.toml"
    toml.write_text(
        f'[grid]\nname="dead"\nconcurrencies=[1]\nlengths=[[8,2]]\nport={free_port()}\n'
        f'[[models]]\nname="w"\npath="{word_model}"\n'
        f'[[arms]]\nname="dies"\nrole="subject"\ncommand=["{sys.executable}", "-c", "raise SystemExit(3)"]\n'
    )
    record = Grid(load_config(toml), tmp_path / "r", record_name="dead").run()
    (launch,) = record["launches"]
    assert "exited with 3" in launch["error"] and record["runs"] == [] and record["is_complete"]


def test_report_without_records(tmp_path: Path) -> None:
    args = report.argparse.Namespace(results_dir=tmp_path, output=tmp_path / "B.md", check=False)
    assert report.run(args) == 0 and "No grid records yet" in (tmp_path / "B.md").read_text()


def _port_is_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_deadline_skips_launches_that_would_not_finish(
    tmp_path: Path, word_model: Path, patch_tokenizer: WordTokenizer
) -> None:
    toml = tmp_path / "late.toml"
    toml.write_text(
        f'[grid]\nname="late"\nconcurrencies=[1, 2]\nlengths=[[8,2]]\nport={free_port()}\n'
        f'[[models]]\nname="w"\npath="{word_model}"\n'
        f'[[arms]]\nname="slow-start"\nrole="subject"\ncommand=["{sys.executable}", "-c", "pass"]\n'
        "expected_startup_s = 80\nexpected_run_s = 30\n"  # its start and first point alone pass the deadline
    )
    record = Grid(load_config(toml), tmp_path / "r", record_name="late", deadline_s=100).run()
    assert record["launches"] == [] and record["skipped"] == [{"arm": "slow-start", "model": "w", "reason": "deadline"}]


def test_deadline_leaves_the_points_that_would_not_finish_for_a_resumed_call(
    tmp_path: Path, word_model: Path, patch_tokenizer: WordTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An arm whose start and first point fit runs; the points after the deadline are named, and a resumed call
    runs only those."""
    config = load_config(fake_grid_toml(tmp_path / "fake.toml", word_model, free_port(), is_restart_cheap=False))
    config.arms = config.arms[:1]
    config.concurrencies = [1, 2]
    results = tmp_path / "results"
    grid = Grid(config, results, record_name="cut", deadline_s=3600, is_drift_enabled=False)
    checks: list[float] = []

    def one_point_fits(expected_s: float) -> bool:
        checks.append(expected_s)
        return len(checks) > 1  # the launch's check passes, the one before the second point does not

    monkeypatch.setattr(grid, "_is_past_deadline", one_point_fits)
    record = grid.run()
    assert [r["concurrency"] for r in record["runs"]] == [1] and len(record["launches"]) == 1
    assert record["skipped"] == [{"arm": "fast", "model": "word", "reason": "deadline", "points": ["16x4-c2"]}]
    resumed = Grid(config, results, record_name="cut", is_drift_enabled=False, resume_path=results / "cut.json").run()
    assert sorted(r["concurrency"] for r in resumed["runs"]) == [1, 2] and resumed["skipped"] == []
    assert len(resumed["launches"]) == 2


def test_sigterm_stops_the_server_and_keeps_the_record(
    tmp_path: Path, word_model: Path, patch_tokenizer: WordTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DELTASERVE_GRID_PIDFILE", str(tmp_path / "server.pgid"))
    port = free_port()
    toml = tmp_path / "long.toml"
    toml.write_text(
        f'[grid]\nname="long"\nconcurrencies=[1]\nlengths=[[8,200]]\nmin_prompts=50\nport={port}\n'
        f'[[models]]\nname="w"\npath="{word_model}"\n'
        f'[[arms]]\nname="slow"\nrole="subject"\n'
        f'command=["{{python}}", "{FAKE_SERVER}", "{{model}}", "--port", "{{port}}", "--itl-ms", "20"]\n'
    )
    grid = Grid(load_config(toml), tmp_path / "r", record_name="long")
    timer = threading.Timer(3.0, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    with pytest.raises(grid_module.GridInterrupted):
        grid.run()
    timer.cancel()
    saved = json.loads((tmp_path / "r/long.json").read_text())
    assert saved["interrupted"] == f"signal {int(signal.SIGTERM)}" and not saved["is_complete"]
    assert saved["launches"][0]["is_port_freed"] and not _port_is_open(port)
    assert not (tmp_path / "server.pgid").exists()
    assert signal.getsignal(signal.SIGTERM) is not grid_module._interrupt  # handler restored


def test_an_interrupt_raised_in_an_event_loop_callback_leaves_the_loop() -> None:
    """The signal may land while the client's event loop runs a transport callback: the interrupt must leave the
    loop, not become a failed request (asyncio hands any other BaseException raised there to its error handler)."""
    import asyncio

    async def client() -> None:
        asyncio.get_running_loop().call_soon(grid_module._interrupt, int(signal.SIGTERM), None)
        await asyncio.sleep(0.5)

    with pytest.raises(grid_module.GridInterrupted, match="signal 15"):
        asyncio.run(client())


def test_arms_run_in_the_order_asked_and_the_drift_relaunches_the_subject(
    tmp_path: Path, word_model: Path, patch_tokenizer: WordTokenizer
) -> None:
    """`--arms slow,fast` runs the peer first (so a deadline cannot skip it after the subject), and the drift re-run
    still relaunches the subject arm, compared with its own first run."""
    toml = fake_grid_toml(tmp_path / "fake.toml", word_model, free_port(), is_restart_cheap=False)
    config = load_config(toml)
    config.arms = grid_cli._select(config.arms, "slow,fast,slow", None, "arms")
    assert [arm.name for arm in config.arms] == ["slow", "fast"]
    record = Grid(config, tmp_path / "results", record_name="order").run()
    order = [(e["arm"], e["is_drift_check"]) for e in record["launches"]]
    assert order == [("slow", False), ("fast", False), ("fast", True)]
    assert record["drift"][0]["arm"] == "fast" and record["drift"][0]["first"]["output_throughput"] is not None
    with pytest.raises(ValueError, match="unknown arms"):
        grid_cli._select(config.arms, "fast,nope", None, "arms")


def test_the_deadline_expects_a_measured_start_up_over_the_files_guess(
    tmp_path: Path, word_model: Path, patch_tokenizer: WordTokenizer
) -> None:
    """An arm's expected start-up is the grid file's guess until a launch of it on that model has been measured, in
    this record or the adapted one (same GPUs only); then the slowest measured, with a fifth and 15 s to spare."""
    toml = fake_grid_toml(tmp_path / "fake.toml", word_model, free_port(), is_restart_cheap=False)
    config = load_config(toml)
    arm, model = config.arms[1], config.models[0]
    grid = Grid(config, tmp_path / "results", record_name="deadline")
    assert grid.expected_startup_s(arm, model) == arm.expected_startup_s
    gpus = (grid.record.get("host") or {}).get("gpus") or []
    launches = [
        {"arm": arm.name, "model": model.name, "startup_s": 100.0},
        {"arm": arm.name, "model": model.name, "startup_s": None, "error": "refused"},
        {"arm": arm.name, "model": "another", "startup_s": 900.0},
    ]
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"host": {"gpus": gpus}, "launches": launches, "arms": {}}))
    adapted = Grid(config, tmp_path / "results", record_name="deadline2", adapt_from=earlier)
    assert adapted.expected_startup_s(arm, model) == 1.2 * 100.0 + 15.0
    adapted.record["launches"].append({"arm": arm.name, "model": model.name, "startup_s": 200.0})
    assert adapted.expected_startup_s(arm, model) == 1.2 * 200.0 + 15.0
    earlier.write_text(json.dumps({"host": {"gpus": [*gpus, "another GPU"]}, "launches": launches, "arms": {}}))
    other_card = Grid(config, tmp_path / "results", record_name="deadline3", adapt_from=earlier)
    assert other_card.expected_startup_s(arm, model) == arm.expected_startup_s


def test_resume_runs_only_what_the_record_lacks_then_the_drift(
    tmp_path: Path, word_model: Path, patch_tokenizer: WordTokenizer
) -> None:
    toml = fake_grid_toml(tmp_path / "fake.toml", word_model, free_port(), is_restart_cheap=False)
    first_call = load_config(toml)
    first_call.arms = first_call.arms[:1]  # as `--arms fast`
    results = tmp_path / "results"
    first = Grid(first_call, results, record_name="split", is_drift_enabled=False).run()
    assert [e["arm"] for e in first["launches"]] == ["fast"] and first["ratios"] == [] and "resumed" not in first

    second = Grid(load_config(toml), results, resume_path=results / "split.json").run()
    order = [(e["arm"], e["is_drift_check"]) for e in second["launches"]]
    assert order == [("fast", False), ("slow", False), ("fast", True)]  # fast is not launched again
    assert len(second["resumed"]) == 1 and second["is_complete"] and set(second["arms"]) == {"fast", "slow"}
    assert len(second["ratios"]) == 2 and len(second["drift"]) == 1
    assert second["drift"][0]["first"]["output_throughput"] is not None  # compared with the first call's run
    assert json.loads((results / "split.json").read_text())["launches"] == second["launches"]

    third = Grid(load_config(toml), results, resume_path=results / "split.json").run()
    assert len(third["launches"]) == 3 and len(third["resumed"]) == 2  # nothing left to run

    other = tmp_path / "other.toml"
    other.write_text(toml.read_text().replace('name = "fake"', 'name = "other"'))
    with pytest.raises(ValueError, match="not a deltaserve-grid-record/1 record of grid 'other'"):
        Grid(load_config(other), results, resume_path=results / "split.json")


def test_resume_redoes_a_drift_rerun_the_deadline_skipped(
    tmp_path: Path, word_model: Path, patch_tokenizer: WordTokenizer
) -> None:
    toml = fake_grid_toml(tmp_path / "fake.toml", word_model, free_port(), is_restart_cheap=False)
    results = tmp_path / "results"
    first_call = load_config(toml)
    for arm in first_call.arms:
        arm.expected_startup_s, arm.expected_run_s = 0.0, 0.0
    grid = Grid(first_call, results, record_name="late-drift", deadline_s=3600)
    original_drift = grid._drift

    def drift_past_the_deadline(arm, model, first_runs):  # type: ignore[no-untyped-def]
        grid.deadline_s = 0.0  # what a slow first call looks like by the time the drift re-run comes up
        original_drift(arm, model, first_runs)

    grid._drift = drift_past_the_deadline  # type: ignore[method-assign]
    record = grid.run()
    assert record["drift"][0]["rerun"]["output_throughput"] is None and record["skipped"][0]["reason"] == "deadline"

    resumed = Grid(load_config(toml), results, resume_path=results / "late-drift.json").run()
    (drift,) = resumed["drift"]
    assert drift["rerun"]["output_throughput"] is not None and resumed["skipped"] == []
    assert [(e["arm"], e["is_drift_check"]) for e in resumed["launches"]][-1] == ("fast", True)


def test_ratio_history_keeps_every_subject_apart() -> None:
    """A grid may hold two configurations of deltaserve against one peer: neither row may hide the other."""
    ratios = [
        {"subject": s, "peer": "vllm", "model": "m", "isl": 8, "osl": 2, "concurrency": 1, "output_throughput": r}
        for s, r in (("deltaserve", 0.5), ("deltaserve-2048", 0.75))
    ]
    record = {"grid": "g", "arms": {}, "ratios": ratios}
    text = "\n".join(report_standing.render_history([("rec", record)]))
    assert "| deltaserve / vllm | 0.500 |" in text and "| deltaserve-2048 / vllm | 0.750 |" in text


def _run(arm: str, concurrency: int, metrics: dict) -> dict:
    return {"arm": arm, "model": "m", "isl": 8, "osl": 2, "concurrency": concurrency, "is_drift_check": False,
            "metrics": metrics}  # fmt: skip


def test_baseline_arm_gets_its_own_ratio() -> None:
    """vLLM at a forced backend against vLLM at its own choice: the handicap itself, beside subject / peer."""
    fast = {"output_throughput": 100.0, "median_ttft_ms": 10.0}
    slow = {"output_throughput": 90.0, "median_ttft_ms": 15.0}
    record = {
        "arms": {
            "ds": {"role": "subject"},
            "vllm": {"role": "peer", "baseline": "vllm-default"},
            "vllm-default": {"role": "peer"},
        },
        "runs": [_run("ds", 1, fast), _run("vllm", 1, slow), _run("vllm-default", 1, fast)],
    }
    pairs = {(e["subject"], e["peer"]): e for e in compute_ratios(record)}
    assert set(pairs) == {("ds", "vllm"), ("ds", "vllm-default"), ("vllm", "vllm-default")}
    assert pairs[("vllm", "vllm-default")]["median_ttft_ms"] == 1.5


def test_gdn_backend_grid_resolves_both_oracle_sites(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, experts in (("q35-35b-a3b", 256), ("q35-27b", 0)):
        (tmp_path / name).mkdir()
        text = {"num_experts": experts, "mamba_ssm_dtype": "float32"}
        config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": text, "vision_config": {}}
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    monkeypatch.setenv("DELTASERVE_MODELS", str(tmp_path))
    config = load_config(grid_module.REPO_ROOT / "benchmarks/grids/h200_gdn_backend.toml")
    arms = {arm.name: arm for arm in config.arms}
    assert config.concurrencies == [1, 8, 32] and config.lengths == [(1024, 128), (16384, 128)]
    assert arms["vllm"].baseline == "vllm-gdn-default"
    assert (arms["vllm"].site, arms["vllm-gdn-default"].site) == ("h200-offline-triton-gdn", "h200-offline")
    forced = resolve(arms["vllm"], config.models[0], config)
    default = resolve(arms["vllm-gdn-default"], config.models[0], config)
    assert "--gdn-prefill-backend" in forced.argv and "--gdn-prefill-backend" not in default.argv
    assert forced.denominator_note and default.denominator_note is None
    assert forced.argv[: forced.argv.index("--gdn-prefill-backend")] == default.argv[: len(default.argv) - 4]
    entry = {"denominator_note": None}
    grid_launch._note_deviations(entry, forced)
    assert entry["deviations"] == ["flashinfer-sampler-off", "gdn-prefill-triton"]
    assert entry["denominator_note"] == forced.denominator_note
    bad = tmp_path / "bad.toml"
    bad.write_text('[[models]]\nname="m"\npath="p"\n[[arms]]\nname="a"\ncommand=["x"]\nbaseline="nope"\n')
    with pytest.raises(ValueError, match="baseline"):
        load_config(bad)


def test_report_marks_ratios_a_peer_deviation_can_move() -> None:
    """A record whose peer ran with --gdn-prefill-backend triton gets daggers on TTFT and throughput ratios (read
    from the launch argv even when the record predates the registry's deviations), with the note."""
    ratio = {"subject": "ds", "peer": "vllm", "model": "m", "isl": 8, "osl": 2, "concurrency": 1,
             "output_throughput": 0.5, "median_ttft_ms": 0.8, "p99_ttft_ms": 0.9, "median_tpot_ms": 1.2,
             "peak_gpu_memory_gib": 1.0}  # fmt: skip
    launch = {"arm": "vllm", "model": "m", "argv": ["vllm", "serve", "m", "--gdn-prefill-backend", "triton"],
              "env": {}, "command_line": "vllm serve m --gdn-prefill-backend triton"}  # fmt: skip
    record = {"grid": "g", "arms": {"ds": {"role": "subject"}, "vllm": {"role": "peer"}}, "launches": [launch],
              "runs": [], "ratios": [ratio]}  # fmt: skip
    notes = report_cells.Notes()
    text = "\n".join(report_record.render_record("rec", record, None, notes) + notes.render())
    dagger = "[†1](#note-1)"
    assert f"| ds / vllm | m | 8/2 | 1 | 0.500 {dagger} | 0.800 {dagger} | 0.900 {dagger} | 1.200 | 1.000 |" in text
    assert "gdn-prefill-triton" in text and "(the record itself lacks this note)" in text
    assert text.count("gdn-prefill-triton:") == 1  # the note once, however many cells it marks
    history = "\n".join(report_standing.render_history([("rec", record)]))
    assert f"0.500 {dagger}" in history
    clean = dict(record, launches=[dict(launch, argv=["vllm", "serve", "m"])])
    assert "†" not in "\n".join(report_record.render_record("rec", clean, None))


def test_committed_records_carry_the_gdn_deviation_note() -> None:
    for path in sorted((grid_module.REPO_ROOT / "benchmarks/results/grids").glob("h200_first-*.json")):
        record = json.loads(path.read_text())
        for name, arm in record["arms"].items():
            if arm.get("oracle") != "vllm":
                continue
            assert "gdn-prefill-triton" in arm["deviations"], (path.name, name)
            assert "favours deltaserve on TTFT" in arm["denominator_note"]
        assert "added on 2026-12-01 (issue 17)" in record["provenance_note"]


def test_a_point_with_failed_requests_gets_no_ratio() -> None:
    """vLLM failed 73 of 160 requests at c32 (benchmarks/results/grids/h200_structured-35b-a3b-20261201-s4.json);
    its throughput counts their time and not their tokens, so subject / peer there compares different work."""
    ours = {"output_throughput": 1491.5, "median_tpot_ms": 18.15, "completed": 160, "failed": 0}
    peer = {"output_throughput": 1056.5, "median_tpot_ms": 20.70, "completed": 87, "failed": 73}
    run = {"model": "m", "isl": 1024, "osl": 128, "concurrency": 32, "is_drift_check": False}
    record = {
        "arms": {"ds": {"role": "subject"}, "v": {"role": "peer"}},
        "runs": [run | {"arm": "ds", "metrics": ours}, run | {"arm": "v", "metrics": peer}],
    }
    (entry,) = compute_ratios(record)
    assert entry["output_throughput"] is None and entry["median_tpot_ms"] is None
    assert entry["excluded"] == "v failed 73 of 160 requests"
    peer_ok = peer | {"completed": 160, "failed": 0}
    record["runs"][1]["metrics"] = peer_ok
    (entry,) = compute_ratios(record)
    assert abs(entry["output_throughput"] - 1491.5 / 1056.5) < 1e-9 and "excluded" not in entry


def test_a_point_whose_arms_emit_unlike_outputs_is_flagged() -> None:
    """vLLM's dummy weights decode one text for every chat prompt (benchmarks/dummy_routing.py): a point where one
    arm's outputs are all alike and the other's all distinct keeps its ratio, flagged, and the report marks it."""
    ours = {"output_throughput": 896.0, "completed": 160, "failed": 0, "num_distinct_generated_texts": 160}
    peer = {"output_throughput": 2045.9, "completed": 160, "failed": 0, "num_distinct_generated_texts": 1}
    run = {"model": "m", "isl": 1024, "osl": 128, "concurrency": 32, "is_drift_check": False}
    record = {
        "grid": "g",
        "arms": {"ds": {"role": "subject"}, "v": {"role": "peer"}},
        "runs": [run | {"arm": "ds", "metrics": ours}, run | {"arm": "v", "metrics": peer}],
    }
    (entry,) = compute_ratios(record)
    assert abs(entry["output_throughput"] - 896.0 / 2045.9) < 1e-9
    assert entry["unequal_outputs"] == (
        "unequal outputs: ds 160 distinct of 160, v 1 of 160: the arms may have done different expert work"
    )
    record["ratios"] = [entry]
    assert "‡" in "\n".join(report_standing.render_history([("r", record)]))
    # alike enough (within a factor 2), or a record from before the count: no flag
    for distinct in (100, None):
        record["runs"][1]["metrics"] = peer | {"num_distinct_generated_texts": distinct}
        (entry,) = compute_ratios(record)
        assert "unequal_outputs" not in entry


def test_plots_without_matplotlib_name_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """matplotlib is only in the `bench` extra: a report that must draw without it says how to install it."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    record = {
        "grid": "g",
        "title": "t",
        "models": [{"name": "m"}],
        "arms": {"ds": {}},
        "launches": [],
        "runs": [_run("ds", 1, {"output_throughput": 1.0}) | {"client_command_line": "deltaserve bench serve"}],
    }
    with pytest.raises(SystemExit, match=r"pip install 'deltaserve\[bench\]'"):
        report.plot_record("rec", record, tmp_path)
    assert report.render([("rec", record)], {}).startswith("# Benchmarks")  # the Markdown itself needs no plots


def test_a_newer_grid_of_other_subjects_leaves_the_standing_grid_standing() -> None:
    """A grid that compares two peers (the GDN-backend handicap: vllm / vllm-gdn-default) on the same workload does
    not push deltaserve's core grid into the history; a newer grid with the same subject does."""

    def record(grid: str, date: str, subject: str, peer: str) -> dict:
        ratio = {"subject": subject, "peer": peer, "model": "m", "isl": 8, "osl": 2, "concurrency": 1}
        run = _run(subject, 1, {"output_throughput": 1.0}) | {"client_command_line": "bench serve --x"}
        return {"grid": grid, "host": {"date": date}, "models": [{"name": "m"}], "runs": [run], "ratios": [ratio]}

    core = ("core-1", record("core", "2026-12-03", "deltaserve", "vllm"))
    handicap = ("handicap-1", record("handicap", "2026-12-04", "vllm", "vllm-gdn-default"))
    stands, superseded = report_standing.standing([core, handicap])
    assert {grid for grid, _, _, _ in stands} == {"core", "handicap"} and superseded == []
    rerun = ("core2-1", record("core2", "2026-12-05", "deltaserve", "vllm"))
    stands, superseded = report_standing.standing([core, handicap, rerun])
    assert superseded == [("core", "m", "core2")]
    # a run of the same grid on another card stands beside it, never in its place
    h100 = ("core2-h100", record("core2", "2026-12-06", "deltaserve", "vllm"))
    h100[1]["host"]["gpus"] = ["NVIDIA H100 80GB HBM3"]
    stands, superseded = report_standing.standing([core, handicap, rerun, h100])
    assert sorted((grid, card, [stem for stem, _ in members]) for grid, _, card, members in stands) == [
        ("core2", "NVIDIA H100 80GB HBM3", ["core2-h100"]),
        ("core2", "no GPU", ["core2-1"]),
        ("handicap", "no GPU", ["handicap-1"]),
    ]
    text = report.render([core, handicap, rerun, h100], {})
    assert "### core2: m, NVIDIA H100 80GB HBM3" in text and "### core2: m, no GPU" in text
    # nor does a newer grid of the same subjects and workload on another card push it into the history
    other_card = ("core3-h100", record("core3", "2026-12-07", "deltaserve", "vllm"))
    other_card[1]["host"]["gpus"] = ["NVIDIA H100 80GB HBM3"]
    stands, superseded = report_standing.standing([core, handicap, rerun, other_card])
    assert ("core2", "no GPU") in {(grid, card) for grid, _, card, _ in stands}
    assert superseded == [("core", "m", "core2")]


def test_a_warmup_point_runs_first_and_stays_out_of_the_runs(
    tmp_path: Path, word_model: Path, patch_tokenizer: WordTokenizer
) -> None:
    toml = fake_grid_toml(tmp_path / "fake.toml", word_model, free_port(), False)
    toml.write_text(toml.read_text().replace("drift_concurrency = 2", "drift_concurrency = 2\nwarmup_point = true"))
    config = load_config(toml)
    assert config.warmup_point
    config.arms = config.arms[:1]
    record = Grid(config, tmp_path / "results", record_name="warm", is_drift_enabled=False).run()
    (launch,) = record["launches"]
    warmup = launch["warmup_run"]
    assert warmup["point"] == "16x4-c1" and warmup["error"] is None and warmup["output_throughput"] > 0
    # the measured runs are the grid's points, each once; the warm-up's client JSON is not among the raw runs
    assert sorted(r["concurrency"] for r in record["runs"]) == [1, 2]
    assert not any("warmup" in p.name for p in (tmp_path / "results/raw").rglob("*.json"))
    assert launch["warmup_compiles"] == [] and launch["late_compiles"] == []
    # a warm-up costs a run of time, and the deadline counts it: a start and one run fit 100 s, a start and two not
    config.arms[0].expected_startup_s, config.arms[0].expected_run_s = 30.0, 40.0
    late = Grid(config, tmp_path / "late", record_name="late", deadline_s=100).run()
    assert late["launches"] == [] and late["skipped"][0]["reason"] == "deadline"
    config.warmup_point = False
    assert not Grid(config, tmp_path / "late", record_name="late", deadline_s=100)._is_past_deadline(30.0 + 40.0)


def test_a_grid_without_a_peer_shows_the_servers_hit_rate() -> None:
    """A run that a server answered from its prefix cache shows it in the standing table, peer or none: random data
    shares nothing, so a hit there is a prompt the server saw before (h100_long-27b-20261206-s31: 99.6 % at c1)."""
    run = _run("ds", 1, {"output_throughput": 1.0, "server_prefix_cache_hit_rate": 0.996}) | {
        "client_command_line": "x"
    }
    record = {"grid": "long", "host": {"date": "2026-12-06"}, "models": [{"name": "m"}], "runs": [run], "ratios": []}
    assert "| 99.6 % |" in report.render([("rec", record)], {})
    del run["metrics"]["server_prefix_cache_hit_rate"]  # a server that reports none: no column
    assert "prefix cache hit rate" not in report.render([("rec", record)], {})


def test_lengths_picks_the_grids_own_pairs_and_the_peers_budget_follows() -> None:
    """`--lengths` runs a subset of the grid's pairs (an 80 GB card cannot profile vLLM's 2 x 65,536-token budget on
    the 27B: h100_long-27b-20261206-s31); a pair the grid lacks, or a malformed one, is refused."""
    config = load_config(grid_module.REPO_ROOT / "benchmarks/grids/h200_long.toml")
    assert config.max_input_len() == 65536
    config.lengths = grid_cli.select_lengths(config.lengths, "16384x128")
    assert config.lengths == [(16384, 128)] and config.max_input_len() == 16384
    for bad in ("1024x128", "16384", "16384x128x1", "abc"):
        with pytest.raises(ValueError, match="--lengths"):
            grid_cli.select_lengths([(16384, 128), (65536, 128)], bad)
    assert grid_cli.select_lengths([(1, 2), (3, 4)], "3x4,1x2") == [(1, 2), (3, 4)]  # the grid's order


@pytest.mark.parametrize("is_warming", [True, False])
def test_a_launch_records_the_kernels_its_server_compiled_while_serving(
    tmp_path: Path, word_model: Path, patch_tokenizer: WordTokenizer, is_warming: bool
) -> None:
    """The JIT monitor's lines in a server's log (both engines log vLLM's words; vLLM's CuTeDSL line too) land in the
    record: per launch, those after the warm-up as `late_compiles` and those during it as `warmup_compiles`; per
    run, those logged while its measured requests ran as `runs[].compiles` (not its client warm-up request's), and
    the ratio at that point carries the flag the report marks. The warm-up is the first point (c1: its client
    warm-up and 3 prompts, requests 1-4) and one wave at c2 (its client warm-up and 2 prompts, 5-7); then c1 (8 is
    its client warm-up, 9-11 measured) and c2 (12, then 13-16). Without the warm-up, c1 is 1 and 2-4, c2 5 and 6-9."""
    toml = fake_grid_toml(tmp_path / "fake.toml", word_model, free_port(), False)
    lines = "1:_warm_kernel,8:_client_warmup_kernel,13:_late_kernel@CuTeDSL"
    text = toml.read_text().replace('"--itl-ms", "1"]', f'"--itl-ms", "1", "--jit-lines", "{lines}"]')
    toml.write_text(
        text.replace("drift_concurrency = 2", f"drift_concurrency = 2\nwarmup_point = {str(is_warming).lower()}")
    )
    config = load_config(toml)
    record = Grid(config, tmp_path / "results", record_name="jit", is_drift_enabled=False).run()
    launch = record["launches"][0]
    compiles = {r["concurrency"]: r["compiles"] for r in record["runs"] if r["arm"] == "fast"}
    if is_warming:
        assert launch["warmup_wave"]["point"] == "16x4-c2" and launch["warmup_wave"]["num_prompts"] == 2
        assert launch["warmup_compiles"] == ["_warm_kernel"]
        assert launch["late_compiles"] == ["_client_warmup_kernel", "_late_kernel (CuTeDSL)"]
        assert compiles == {1: [], 2: ["_late_kernel (CuTeDSL)"]}
        (flagged,) = [e for e in record["ratios"] if e.get("compiles_while_measured")]
        assert flagged["concurrency"] == 2
        assert flagged["compiles_while_measured"].startswith("fast compiled _late_kernel (CuTeDSL) while measured")
        rendered = "\n".join(report_record.render_record("jit", record, None))
        assert "compiled while measured: _client_warmup_kernel, _late_kernel (CuTeDSL)" in rendered
        assert "§" in report.render([("jit", record)], {})
    else:
        assert "warmup_compiles" not in launch and "warmup_wave" not in launch
        assert launch["late_compiles"] == ["_warm_kernel", "_client_warmup_kernel"]
        assert compiles == {1: [], 2: ["_client_warmup_kernel"]}
    assert "prefill_kernels" not in launch  # the stand-in logs no start-up line


def test_a_launch_records_the_prefill_kernels_its_deltaserve_server_picked(
    tmp_path: Path, word_model: Path, patch_tokenizer: WordTokenizer
) -> None:
    """deltaserve's start-up line naming its resolved attention and GDN prefill kernels lands in the launch's record
    and the report's launch line."""
    toml = fake_grid_toml(tmp_path / "fake.toml", word_model, free_port(), False)
    line = "INFO deltaserve.runner.model_runner: prefill kernels: attention=FLASH_ATTN gdn=flashinfer-large"
    toml.write_text(toml.read_text().replace('"--itl-ms", "1"]', f'"--itl-ms", "1", "--start-line", "{line}"]'))
    config = load_config(toml)
    config.arms = config.arms[:1]
    record = Grid(config, tmp_path / "results", record_name="kernels", is_drift_enabled=False).run()
    (launch,) = record["launches"]
    assert launch["prefill_kernels"] == {"attention": "FLASH_ATTN", "gdn": "flashinfer-large"}
    rendered = "\n".join(report_record.render_record("kernels", record, None))
    assert "prefill kernels: attention FLASH_ATTN, GDN flashinfer-large" in rendered
