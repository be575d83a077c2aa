"""scripts/h200.sh, the one H200 runner: it parses, documents every step it runs, builds each step's commands from
its arguments (checked under DRY_RUN on the CPU), and no script is named for a run, a date or a session."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUNNER = ROOT / "scripts" / "h200.sh"


def runner(
    tmp_path: Path, *args: str, path: str | None = None, extra_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OUT": str(tmp_path / "out"), "DS_WORK": str(tmp_path / "work"), "DRY_RUN": "1"}
    env.update(extra_env or {})
    if path is not None:
        env["PATH"] = f"{path}:{env['PATH']}"
    env.update(DS_MODELS=str(tmp_path / "models"), DS_W128=str(tmp_path / "w128"), RECORD_TAG="h200-test", PY="python3")
    return subprocess.run(["bash", str(RUNNER), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def test_the_runner_parses_and_documents_every_step(tmp_path: Path) -> None:
    assert subprocess.run(["bash", "-n", str(RUNNER)], capture_output=True).returncode == 0
    text = RUNNER.read_text()
    steps = re.findall(r"^  ([a-z][a-z0-9-]*)(?: \| [a-z-]+)*\)", text, flags=re.M)
    assert {"setup", "tests", "gates", "decode-step", "kernel-ab", "grid", "tp"} <= set(steps)
    usage = subprocess.run(["bash", str(RUNNER), "--help"], capture_output=True, text=True)
    assert usage.returncode == 0
    for step in steps:
        assert re.search(rf"^  {step}\b", usage.stdout, flags=re.M), step
    assert runner(tmp_path).returncode == 2 and runner(tmp_path, "bogus").returncode == 2


def test_steps_build_their_commands(tmp_path: Path) -> None:
    done = runner(tmp_path, "decode-step", "--batches", "1,32,128", "--shapes", "27b,35b-a3b")
    assert done.returncode == 0, done.stdout + done.stderr
    out = tmp_path / "out"
    assert (
        f"benchmarks/decode_step.py --models {tmp_path}/models --label after --out {out}/decode-step-h200-test.json "
        "--batches 1,32,128 --shapes 27b,35b-a3b" in done.stdout
    )
    assert f"scripts/decode_step_compare.py {out}/decode-step-h200-test.json" in done.stdout
    assert (out / "summary.txt").is_file() and (out / "logs-decode-step.tgz").is_file()

    grid = runner(tmp_path, "grid", "core2", "--models", "q35-27b", "--record-name", "r1", "--no-drift").stdout
    assert "bench grid benchmarks/grids/h200_core2.toml --result-dir /tmp/ds_grid" in grid
    assert re.search(r"--record-name r1 --no-drift --deadline-s \d+ ", grid) and "--card" not in grid
    gates = runner(tmp_path, "gates").stdout
    for variant in ("dense", "moe", "next"):
        assert f"--dtype float32 --device cuda --record {out}/gate-fp32-tiny-{variant}-cuda-h200-test.json" in gates
    assert "env OUT=" in runner(tmp_path, "gates", "bf16", "vllm").stdout
    cached = runner(tmp_path, "gates", "prefix-cache", "--max-tokens", "16").stdout
    for variant in ("dense", "moe", "next"):
        assert (
            f"gate prefix-cache --model deltaserve/tiny/trained/{variant} --dtype bfloat16 --device cuda --record "
            f"{out}/gate-prefix-cache-{variant}-bf16-h200-test.json --max-tokens 16" in cached
        )
    mtp = runner(tmp_path, "gates", "mtp", "-k", "1").stdout
    for variant in ("dense", "moe", "next"):
        assert (
            f"deltaserve.cli gate mtp --model deltaserve/tiny/trained/{variant} --dtype bfloat16 --device cuda "
            f"--reference vllm --share-gpu --record {out}/gate-mtp-{variant}-bf16-h200-test.json -k 1" in mtp
        )
        assert f"gate mtp {variant} rc 0" in mtp
    fp8 = runner(tmp_path, "gates", "fp8", "--num-prompts", "8").stdout
    w128 = tmp_path / "w128"
    for variant in ("dense", "moe", "next"):  # trained on the GPU first (not shipped), written as FP8, vs vLLM
        train = f"-m deltaserve.tiny.train {w128}/{variant}-w128 --variant {variant}-w128 --device cuda > "
        assert train in fp8 and fp8.index(train) < fp8.index("gate fp8 --model")
        assert (
            f"gate fp8 --model {w128}/{variant}-w128 --fp8-dir /tmp/ds_fp8/{variant}-w128"
            f" --dtype bfloat16 --device cuda --share-gpu --record {out}/gate-fp8-{variant}-w128-h200-test.json "
            "--num-prompts 8" in fp8
        )
        assert f"train {variant}-w128 on cuda rc 0" in fp8 and f"gate fp8 {variant}-w128 rc 0" in fp8
    (w128 / "moe-w128").mkdir(parents=True)
    (w128 / "moe-w128" / "training.json").write_text("{}")  # a warm machine's earlier call trained it
    again = runner(tmp_path, "gates", "fp8").stdout
    assert f"train moe-w128: reusing {w128}/moe-w128" in again and "--variant moe-w128" not in again
    assert "--variant dense-w128 --device cuda" in again and f"gate fp8 --model {w128}/moe-w128 " in again
    rows = runner(tmp_path, "verify-rows", "--num-prompts", "4").stdout
    for variant in ("dense", "moe", "next"):
        assert (
            f"benchmarks/verify_rows.py --model deltaserve/tiny/trained/{variant} --dtype bfloat16 --device cuda "
            f"--out {out}/verify-rows-{variant}-h200-test.json --num-prompts 4" in rows
        )
    vision = runner(tmp_path, "vision-encode", "--images", "1,6").stdout  # writes the image dummy first
    assert f"benchmarks/oracle/make_dummy_models.py {tmp_path}/models --only q35-35b-a3b-mm" in vision
    record = f"{out}/vision-encode-h200-test.json"
    assert f"vision_encode.py --model {tmp_path}/models/q35-35b-a3b-mm --out {record} --images 1,6" in vision
    tp_gate = runner(tmp_path, "tp", "gate").stdout
    for variant in ("dense", "moe", "next"):  # speculative decoding at two ranks, with MTP vs without
        assert f"gate mtp --model deltaserve/tiny/trained/{variant} --dtype bfloat16 --device cuda -tp 2" in tp_gate
    tp_tests = runner(tmp_path, "tp", "tests").stdout
    assert "--import-mode=importlib tests/runner/test_gpu_tensor_parallel.py" in tp_tests  # where the file lives


def test_decode_step_writes_the_fp8_dummies_its_shapes_name(tmp_path: Path) -> None:
    """FP8 shapes (decode_step.py's keys or their folder names) get their block-FP8 dummies first, by the grid step's
    call; bf16 shapes and folders make_dummy_models.py does not write get none."""
    models = tmp_path / "models"
    done = runner(tmp_path, "decode-step", "--batches", "1,2", "--shapes", "35b-a3b-fp8,27b,q35-122b-a10b-fp8")
    assert done.returncode == 0, done.stdout + done.stderr
    write = f"benchmarks/oracle/make_dummy_models.py {models} --only q35-35b-a3b-fp8,q35-122b-a10b-fp8 > "
    assert write in done.stdout and "dummy-fp8.log" in done.stdout
    assert done.stdout.index(write) < done.stdout.index("benchmarks/decode_step.py")
    assert "--shapes 35b-a3b-fp8,27b,q35-122b-a10b-fp8 >" in done.stdout
    equals = runner(tmp_path, "decode-step", "--shapes=27b-fp8,moe-fp8").stdout
    assert f"make_dummy_models.py {models} --only q35-27b-fp8 > " in equals
    bf16 = runner(tmp_path, "decode-step", "--shapes", "27b,35b-a3b").stdout
    assert "dummy-fp8.log" not in bf16


def test_profile_prefill_runs_one_process_per_shape_within_the_call(tmp_path: Path) -> None:
    """Both shapes by default, each its own record at the long grid's max_model_len, the call's time shared between
    them; one named shape gets all of it, and FLAGS come last (a --max-model-len there wins)."""
    done = runner(tmp_path, "profile-prefill")
    assert done.returncode == 0, done.stdout + done.stderr
    out, models = tmp_path / "out", tmp_path / "models"
    limits = []
    for shape in ("27b", "35b-a3b"):
        line = next(x for x in done.stdout.splitlines() if f"--out {out}/profile-prefill-{shape}-h200-test.json" in x)
        assert f"benchmarks/profile_prefill.py --model {models}/q35-{shape} --max-model-len 66560 --out" in line
        limits.append(int(re.search(r"timeout (\d+) ", line).group(1)))
    assert limits[0] <= 300 and limits[1] > limits[0], limits
    one = runner(tmp_path, "profile-prefill", "27b", "--prompt-lens", "65536", "--max-model-len", "70000").stdout
    line = next(x for x in one.splitlines() if "profile_prefill.py" in x)
    assert int(re.search(r"timeout (\d+) ", line).group(1)) > 500
    assert f"--out {out}/profile-prefill-27b-h200-test.json --prompt-lens 65536 --max-model-len 70000 >" in line
    assert sum("profile_prefill.py" in x for x in one.splitlines()) == 1


def test_kernel_ab_builds_a_baseline_tree_from_one_kernel_file(tmp_path: Path) -> None:
    baseline = tmp_path / "moe_decode_triton.py"
    baseline.write_text("# an earlier kernel\n")
    done = runner(tmp_path, "kernel-ab", str(baseline), "--batches", "1,2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "with deltaserve/kernels/moe_decode_triton.py from" in done.stdout
    tree = re.search(r"baseline tree (\S+):", done.stdout).group(1)
    assert (Path(tree) / "deltaserve/kernels/moe_decode_triton.py").read_text() == "# an earlier kernel\n"
    assert (Path(tree) / "deltaserve/kernels/__init__.py").is_file()  # the rest is this tree's package
    assert f"--baseline {tree} --batches 1,2" in done.stdout
    assert runner(tmp_path, "kernel-ab", str(tmp_path / "missing.py")).returncode == 2


@pytest.mark.parametrize("path", sorted((ROOT / "scripts").iterdir()), ids=lambda p: p.name)
def test_no_script_is_named_for_a_run(path: Path) -> None:
    assert not re.search(r"_s\d+|session|call\d|\d{6,}|short_", path.name), path.name


@pytest.mark.parametrize("step, flags", [("fp8-ab", "--models 27b --ops dense"), ("attention-ab", "--shapes 27b")])
def test_library_ab_steps_put_both_bundles_on_the_path_and_keep_to_the_budget(
    tmp_path: Path, step: str, flags: str
) -> None:  # fmt: skip
    script = step.replace("-", "_") + ".py"
    done = runner(tmp_path, step, *flags.split())
    assert done.returncode == 0, done.stdout + done.stderr
    out = tmp_path / "out"
    line = next(line for line in done.stdout.splitlines() if f"benchmarks/{script}" in line)
    site = "/tmp/ds_site:/tmp/flashinfer_site:/tmp/flashinfer_site/nvidia_cutlass_dsl/dsl_packages:/tmp/vllm_site"
    assert f"PYTHONPATH={ROOT}:{site} FLASHINFER_WORKSPACE_BASE=/tmp/fi_jit" in line
    match = re.search(rf"{script} --out {out}/{step}-h200-test.json --deadline-s (\d+) {flags} ", line)
    assert match and 400 < int(match.group(1)) < 570, line
    own = next(line for line in runner(tmp_path, step, "--deadline-s", "120").stdout.splitlines() if script in line)
    assert own.count("--deadline-s") == 1 and "--deadline-s 120 >" in own  # a given deadline is the one it runs


def test_the_grid_moves_the_peers_to_their_h100_sites_on_an_h100(tmp_path: Path) -> None:
    """On an 80 GB card the grid step adds --card h100 (vLLM's --max-num-seqs 256), unless the call names a card."""
    fake = tmp_path / "bin"
    fake.mkdir()
    smi = fake / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3'\n")
    smi.chmod(0o755)
    grid = runner(tmp_path, "grid", "prefix", "--models", "q35-27b", path=str(fake)).stdout
    assert re.search(r"bench grid benchmarks/grids/h200_prefix.toml .*--card h100", grid)
    named = runner(tmp_path, "grid", "prefix", "--card", "h200", path=str(fake)).stdout
    assert "--card h200" in named and "--card h100" not in named


def test_records_are_named_by_the_card_the_call_got(tmp_path: Path) -> None:
    """A call that asked for an H200 and got an H100 names its records h100: the default tag, and a grid's
    --record-name that names a card (twice in one session a record was filed under the other card's name)."""
    fake = tmp_path / "bin"
    fake.mkdir()
    smi = fake / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3'\n")
    smi.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "RECORD_TAG"}
    out = runner(tmp_path, "grid", "mtp", "--record-name", "h200_mtp-27b-X", path=str(fake)).stdout
    command = next(line for line in out.splitlines() if "bench grid" in line)
    assert "--record-name h100_mtp-27b-X" in command and "h200_mtp-27b-X" not in command
    assert "names another card: h100_mtp-27b-X" in out
    kept = runner(tmp_path, "grid", "mtp", "--record-name", "mtp-27b-X", path=str(fake)).stdout
    assert "--record-name mtp-27b-X" in next(line for line in kept.splitlines() if "bench grid" in line)
    env.update(OUT=str(tmp_path / "out2"), DS_WORK=str(tmp_path / "work2"), DRY_RUN="1", PATH=f"{fake}:{env['PATH']}",
               DS_MODELS=str(tmp_path / "models"), PY="python3")  # fmt: skip
    profile = subprocess.run(["bash", str(RUNNER), "profile-prefill", "27b"], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=60).stdout  # fmt: skip
    assert re.search(r"profile-prefill-27b-h100-\d{8}\.json", profile), profile[-2000:]


def test_the_grid_forces_the_triton_gdn_prefill_while_flashinfer_is_missing(tmp_path: Path) -> None:
    """With the vLLM bundle unpacked and not FlashInfer's, the grid step adds --no-flashinfer (the peers at their
    Triton/FLA GDN prefill twins), unless the call says it; with both, or without vLLM, it adds nothing."""
    vllm_site, fi_site = tmp_path / "vllm_site", tmp_path / "fi_site"
    (vllm_site / "vllm").mkdir(parents=True)
    env = {"VLLM_SITE": str(vllm_site), "FI_SITE": str(fi_site)}
    forced = runner(tmp_path, "grid", "mtp", "--models", "q35-27b", extra_env=env).stdout
    assert re.search(r"bench grid benchmarks/grids/h200_mtp.toml .*--no-flashinfer", forced), forced
    named = runner(tmp_path, "grid", "mtp", "--no-flashinfer", extra_env=env).stdout
    command = next(line for line in named.splitlines() if "bench grid" in line)
    assert command.count("--no-flashinfer") == 1
    (fi_site / "flashinfer").mkdir(parents=True)
    both = runner(tmp_path, "grid", "mtp", extra_env=env).stdout
    assert "bench grid" in both and "--no-flashinfer" not in both


def test_the_gdn_prefill_ab_step_times_ours_beside_both_of_vllms_kernels(tmp_path: Path) -> None:
    done = runner(tmp_path, "gdn-prefill-ab", "--iters", "5")
    assert done.returncode == 0, done.stdout + done.stderr
    line = next(line for line in done.stdout.splitlines() if "gdn_prefill_kernels.py" in line)
    assert "/tmp/flashinfer_site:/tmp/flashinfer_site/nvidia_cutlass_dsl/dsl_packages:/tmp/vllm_site" in line
    flags = r"gdn-prefill-ab-h200-test.json --deadline-s \d+ --backends ours,triton,flashinfer --commit \S+ --iters 5"
    assert re.search(flags, line)
    # unbuffered: a call cut by its budget still returns the cases it printed (a cut run once came back empty)
    assert "PYTHONUNBUFFERED=1" in line


def test_the_tests_step_puts_flashinfer_on_the_path_only_when_asked(tmp_path: Path) -> None:
    args = ("tests", "tests/kernels/test_gdn_flashinfer.py")
    plain = runner(tmp_path, *args)
    asked = runner(tmp_path, *args, extra_env={"WITH_FLASHINFER": "1"})
    for done in (plain, asked):
        assert done.returncode == 0, done.stdout + done.stderr
        assert re.search(r"-m pytest -v -m gpu .*tests/kernels/test_gdn_flashinfer.py", done.stdout)
    assert "FlashInfer bundle on the path" in asked.stdout and "FlashInfer bundle on the path" not in plain.stdout


def test_a_dry_run_stops_no_server_a_pidfile_names(tmp_path: Path) -> None:
    # a grid's pidfile names a live process group (here a sleeping child of this test): a dry run says so and
    # leaves it running
    sleeper = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        pidfile = tmp_path / "grid.pgid"
        pidfile.write_text(f"{sleeper.pid}\n")
        done = runner(tmp_path, "grid", "mtp", extra_env={"DELTASERVE_GRID_PIDFILE": str(pidfile)})
        assert "stopping the server a killed grid left behind" in done.stdout
        assert sleeper.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait()
