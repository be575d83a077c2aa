"""benchmarks/profile_prefill.py on the CPU: one chunked prefill at a time through the engine on the trained tiny
checkpoints, its record (timings per chunk as the scheduler split the prompt, the op table from the model's labels),
the FLOP and byte model against hand counts, and where the record is filed. The GPU numbers need the H200
(`bash scripts/h200.sh profile-prefill`)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRAINED = ROOT / "deltaserve" / "tiny" / "trained"


def _load(name: str) -> Any:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


profile_prefill = _load("profile_prefill")
prefill_costs = sys.modules["prefill_costs"]


@pytest.fixture(scope="module", params=["dense", "moe"])
def cpu_record(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A CPU run on a trained tiny checkpoint: a 70-token prompt at 32 tokens a step (3 chunks), profiled, and a
    40-token one, timed only."""
    out = tmp_path_factory.mktemp("profile") / "profile-prefill-cpu-test.json"
    argv = ["--device", "cpu", "--model", str(TRAINED / request.param), "--load-format", "auto",
            "--prompt-lens", "70,40", "--profile-lens", "70", "--max-num-batched-tokens", "32", "--reps", "2",
            "--out", str(out)]  # fmt: skip
    assert profile_prefill.main(argv) == 0
    record = json.loads(out.read_text())
    record["path"] = out
    record["variant"] = request.param
    return record


def test_timings_follow_the_chunks_the_scheduler_made(cpu_record: dict[str, Any]) -> None:
    assert cpu_record["kind"] == "profile_prefill" and not cpu_record["errors"]
    assert cpu_record["max_num_batched_tokens"] == 32 and cpu_record["timer"] == "host"
    runs = {run["prompt_len"]: run for run in cpu_record["runs"]}
    assert set(runs) == {70, 40}
    assert [(c["start"], c["tokens"]) for c in runs[70]["chunks"]] == [(0, 32), (32, 32), (64, 6)]
    assert [(c["start"], c["tokens"]) for c in runs[40]["chunks"]] == [(0, 32), (32, 8)]
    assert "profile" in runs[70] and "profile" not in runs[40]  # --profile-lens 70
    for run in runs.values():
        assert len(run["ttft_ms"]) == len(run["gpu_ms"]) == 2
        # the steps' time lies inside the request's wall time, and the steps' own spans inside their first-to-last
        for wall, steps in zip(run["ttft_ms"], run["gpu_ms"], strict=True):
            assert 0 < steps <= wall
        assert 0 < run["steps_gpu_ms_median"] <= run["gpu_ms_median"] * 1.001
        assert all(c["gpu_ms_median"] > 0 for c in run["chunks"])


def test_the_op_table_splits_the_prefill_by_label(cpu_record: dict[str, Any]) -> None:
    config = json.loads((TRAINED / cpu_record["variant"] / "config.json").read_text())["text_config"]
    num_gdn = config["layer_types"].count("linear_attention")
    num_attn = config["layer_types"].count("full_attention")
    profile = next(run for run in cpu_record["runs"] if run["prompt_len"] == 70)["profile"]
    ops = {op["op"]: op for op in profile["ops"]}
    assert {"gdn.gdn_prefill", "gdn.causal_conv1d_prefill", "attn.paged_attention", "attn.attn_preamble"} <= set(ops)
    assert {"gdn.in_proj_qkvzba", "gdn.out_proj", "attn.qkv_proj", "attn.o_proj", "lm.lm_head"} <= set(ops)
    moe_or_dense = {"mlp.fused_moe_block"} if cpu_record["variant"] == "moe" else {"mlp.gate_up", "mlp.down"}
    assert moe_or_dense <= set(ops), sorted(ops)
    assert not {"unlabelled", "gdn.gdn_decode", "gdn.causal_conv1d_update"} & set(ops), sorted(ops)
    assert sum(op["share_pct"] for op in ops.values()) == pytest.approx(100, abs=0.2)
    # time goes to the innermost label: a layer's own range keeps only what runs between its ops
    assert all(op["ms"] > 0 for op in ops.values()), ops
    assert ops["gdn.gdn_prefill"]["ms"] > ops["gdn.other"]["ms"] and ops["attn.o_proj"]["ms"] > 0
    # each op's own time, nothing counted twice: the ops add up to the steps' time under the profiler (the marks
    # around each step hold its range)
    steps_ms = sum(c["step_ms"] for c in profile["chunks"])
    assert 0.8 * steps_ms <= profile["ops_ms"] <= 1.01 * steps_ms, (profile["ops_ms"], steps_ms)
    # a range per layer per chunk; lm_head on the one row the last chunk samples
    assert ops["gdn.gdn_prefill"]["calls"] == num_gdn * 3 and ops["attn.paged_attention"]["calls"] == num_attn * 3
    assert ops["lm.lm_head"]["calls"] == 1 and ops[profile_prefill.RUNNER_OP]["calls"] == 3
    for name, op in ops.items():
        if not name.endswith(".other"):
            assert op["bytes"] > 0 and op["floor_ms"] > 0 and op["bound"] in ("memory", "compute"), op
    assert ops["gdn.gdn_prefill"]["flops"] > 0 and ops["attn.qkv_proj"]["flops"] > 0
    assert [(c["start"], c["tokens"]) for c in profile["chunks"]] == [(0, 32), (32, 32), (64, 6)]
    # the chunks' op tables split the same time
    by_chunk = sum(op["ms"] for chunk in profile["chunks"] for op in chunk["ops"])
    assert by_chunk == pytest.approx(profile["ops_ms"], rel=0.01)
    assert "lm.lm_head" in {op["op"] for op in profile["chunks"][-1]["ops"]}
    assert "lm.lm_head" not in {op["op"] for op in profile["chunks"][0]["ops"]}
    assert "gdn.gdn_prefill" in profile_prefill.table(profile)


def test_the_record_is_filed_and_indexed_with_the_kernel_records(cpu_record: dict[str, Any]) -> None:
    from deltaserve.bench import records_index

    assert records_index.kind_of("profile-prefill-27b-h200-20261206.json") == "kernels"
    what, date, commit, gpu = records_index.describe(cpu_record["path"])
    assert what.startswith("one prefill at a time in the engine") and "prompts 70,40" in what, what
    assert date != "-" and gpu == "-"
    default = profile_prefill.ds.default_out("profile-prefill")
    assert default.parent == ROOT / "benchmarks" / "results" / "kernels"


def test_chunk_costs_against_hand_counts() -> None:
    from deltaserve.config import ModelConfig
    from deltaserve.kernels.gdn_triton import CHUNK

    config = ModelConfig.from_pretrained(TRAINED / "dense")
    h, nq, nkv, d = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    num_attn, num_gdn = len(config.full_attention_layers), len(config.linear_attention_layers)
    costs = prefill_costs.chunk_costs(config, 32, 64, samples=False)
    n = 2 * nq * d + 2 * nkv * d
    assert costs["attn.qkv_proj"] == ((n * h + 32 * h + 32 * n) * 2 * num_attn, 2.0 * 32 * n * h * num_attn)
    pairs = 32 * 64 + 32 * 33 // 2
    assert costs["attn.paged_attention"][1] == 4.0 * nq * d * pairs * num_attn
    assert "lm.lm_head" not in costs and "lm.lm_head" in prefill_costs.chunk_costs(config, 4, 96, samples=True)
    # a prompt's chunks score exactly the causal pairs of the whole prompt
    split = [(0, 32), (32, 32), (64, 32), (96, 4)]
    assert sum(prefill_costs.attention_pairs(t, p) for p, t in split) == 100 * 101 // 2
    # the chunked GDN at the served heads (dk = dv = 128) and C = 64, per token and value head
    assert prefill_costs.GDN_CHUNK == CHUNK
    assert prefill_costs.gdn_prefill_flops_per_token(128, 128) == pytest.approx(98304 + 81920 + 4096 / 3)
    gdn = costs["gdn.gdn_prefill"][1]
    per_token = prefill_costs.gdn_prefill_flops_per_token(config.linear_key_head_dim, config.linear_value_head_dim)
    assert gdn == pytest.approx(32 * config.linear_num_value_heads * per_token * num_gdn)
    # the floor takes the larger of the two ceilings' times
    assert prefill_costs.floor_us(4e9, 1e12, {"copy_gbps": 4000.0, "bf16_tflops": 800.0}) == (1250.0, "compute")
    assert prefill_costs.floor_us(4e9, 1e9, {"copy_gbps": 4000.0, "bf16_tflops": 800.0}) == (1000.0, "memory")


def test_bad_arguments_and_a_missing_gpu_measure_nothing(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    assert profile_prefill.main(["--model", str(TRAINED / "dense"), "--prompt-lens", "0", "--out", str(out)]) == 2
    unmeasured = ["--device", "cpu", "--model", str(TRAINED / "dense"), "--prompt-lens", "64", "--profile-lens", "32"]
    assert profile_prefill.main([*unmeasured, "--out", str(out)]) == 2
    if not profile_prefill.torch.cuda.is_available():
        assert profile_prefill.main(["--model", str(TRAINED / "dense"), "--out", str(out)]) == 2
    assert not out.exists()


class _Kernel:
    def __init__(self, name: str, duration: float) -> None:
        self.name, self.duration = name, duration


class _Span:
    def __init__(self, us: float, start: float = 0.0) -> None:
        self.us, self.start = us, start

    def elapsed_us(self) -> float:
        return self.us


class _Event:
    """What attribute() reads of a torch.profiler FunctionEvent."""

    def __init__(
        self, name: str, parent: _Event | None = None, kernels: tuple = (), cuda_us: float | None = None,
        start: float = 0.0, is_user_annotation: bool = False,
    ) -> None:  # fmt: skip
        from torch.autograd import DeviceType

        self.name, self.cpu_parent, self.kernels = name, parent, list(kernels)
        self.is_user_annotation = is_user_annotation
        self.device_type = DeviceType.CPU if cuda_us is None else DeviceType.CUDA
        self.time_range = _Span(cuda_us or 0.0, start)
        self.self_cpu_time_total = 1.0


def test_gpu_kernels_go_to_the_innermost_label_of_their_launch() -> None:
    """The GPU half of the attribution, on events shaped as the profiler gives them: a kernel goes to the innermost
    model label above its launch, within its step's range; a layer's own range folds into `gdn.other`; a kernel
    launched in a step outside every label is the runner's; one outside every step, or linked to no launch, is
    `unlabelled`."""
    import torch

    label = profile_prefill.ds.LABEL
    step0, step1 = _Event("prefill_chunk:0"), _Event("prefill_chunk:1")
    layer = _Event(f"{label}layer.0.linear_attention", step0)
    core, core1 = _Event(f"{label}gdn.gdn_prefill", layer), _Event(f"{label}gdn.gdn_prefill", step1)
    scan, out = _Kernel("_gdn_chunk_scan_kernel", 40.0), _Kernel("_gdn_chunk_out_kernel", 8.0)
    events = [
        step0, step1, layer, core, core1,
        _Event("cuLaunchKernel", core, [scan, out]),
        _Event("aten::copy_", layer, [_Kernel("copy_kernel", 3.0)]),  # in the layer, outside its ops
        _Event("cuLaunchKernel", core1, [_Kernel("_gdn_chunk_scan_kernel", 50.0)]),
        _Event("cudaMemcpyAsync", step1, [_Kernel("Memcpy HtoD", 2.0)]),  # the step's inputs
        _Event("aten::argmax", None, [_Kernel("reduce_kernel", 1.0)]),  # outside every step
        _Event("_gdn_chunk_scan_kernel", cuda_us=90.0),
        _Event("_gdn_chunk_out_kernel", cuda_us=8.0),
        _Event("copy_kernel", cuda_us=3.0),
        _Event("Memcpy HtoD", cuda_us=2.0),
        _Event("reduce_kernel", cuda_us=1.0),
        _Event("orphan_kernel", cuda_us=5.0),  # the profiler linked it to no launch
        # the ranges' GPU spans (gpu_user_annotation): time the kernels above already hold, never a kernel (the
        # 2026-12-05 H200 run counted them, and two thirds of a prefill showed as unclaimed)
        _Event("prefill_chunk:0", cuda_us=60.0, is_user_annotation=True),
        _Event(f"{label}gdn.gdn_prefill", cuda_us=48.0, is_user_annotation=True),
        _Event("prefill_chunk:1", cuda_us=50.0),  # a torch that does not flag it: known by its name
    ]  # fmt: skip
    cells, kernels = profile_prefill.attribute(events, torch.device("cuda"))
    assert cells[("gdn.gdn_prefill", 0)] == [48.0, 2, 1] and cells[("gdn.gdn_prefill", 1)] == [50.0, 1, 1]
    assert cells[("gdn.other", 0)] == [3.0, 1, 1]
    assert cells[(profile_prefill.RUNNER_OP, 1)] == [2.0, 1, 1] and cells[(profile_prefill.RUNNER_OP, 0)][2] == 1
    assert cells[("unlabelled", None)][0] == 1.0 + 5.0
    assert kernels["total_us"] == 109.0 and kernels["unclaimed_us"] == 5.0
    assert kernels["by_op"]["gdn.gdn_prefill"][0] == {"name": "_gdn_chunk_scan_kernel", "us": 90.0, "calls": 2}
    assert sum(v[0] for v in cells.values()) == kernels["total_us"]  # every kernel counted once


def test_triton_kernels_go_to_their_launch_label_by_launch_order() -> None:
    """Triton's driver launches, which the profiler links to no host op, go to the label that was open at their
    launch (triton_launches' log), matched to the GPU's kernels by order; a log that does not match what ran leaves
    them unclaimed and says so; a Triton kernel the profiler did link is not counted twice."""
    import torch

    label = profile_prefill.ds.LABEL
    step0 = _Event("prefill_chunk:0")
    norm = _Event(f"{label}layer.rms_norm", step0)
    launches = [("_gdn_chunk_scan_kernel", "gdn.gdn_prefill", 0), ("_conv_kernel", "gdn.causal_conv1d_prefill", 0),
                ("_gdn_chunk_scan_kernel", "layer.1.linear_attention", 0), ("_rms_kernel", None, 0),
                ("_rms_kernel", None, None)]  # fmt: skip
    ran = [
        _Event("_conv_kernel", cuda_us=4.0, start=20.0),
        _Event("_gdn_chunk_scan_kernel", cuda_us=30.0, start=10.0),
        _Event("_gdn_chunk_scan_kernel", cuda_us=7.0, start=30.0),
        _Event("_rms_kernel", cuda_us=2.0, start=40.0),
        _Event("_rms_kernel", cuda_us=1.0, start=50.0),
    ]
    linked = _Event("cuLaunchKernelEx", norm, [_Kernel("_rms_kernel", 2.0)])  # a link the profiler did make
    events = [step0, norm, linked, _Event("aten::mul", norm, [_Kernel("mul_kernel", 3.0)]), *ran,
              _Event("mul_kernel", cuda_us=3.0, start=60.0)]  # fmt: skip
    cells, kernels = profile_prefill.attribute(events, torch.device("cuda"), launches)
    assert cells[("gdn.gdn_prefill", 0)][:2] == [30.0, 1] and cells[("gdn.causal_conv1d_prefill", 0)][:2] == [4.0, 1]
    assert cells[("gdn.other", 0)][:2] == [7.0, 1]  # a layer's own range folds into gdn.other
    assert cells[(profile_prefill.RUNNER_OP, 0)][:2] == [2.0, 1] and cells[("unlabelled", None)][:2] == [1.0, 1]
    assert cells[("layer.rms_norm", 0)][:2] == [3.0, 1]  # the linked torch kernel alone, the Triton one not twice
    assert kernels["unclaimed_us"] == 0.0 and kernels["launch_order"].startswith("5 Triton kernels")
    assert sum(v[0] for v in cells.values()) == kernels["total_us"] == 47.0
    cells, kernels = profile_prefill.attribute(events, torch.device("cuda"), launches[:-1])
    assert kernels["launch_order"].startswith("mismatch: 5 Triton kernels ran, 4 launched")
    assert kernels["unclaimed_us"] == 44.0 and cells[("unlabelled", None)][0] == 44.0


def test_labels_keep_the_innermost_open_label() -> None:
    from deltaserve.model import labels

    with labels.enabled():
        assert labels.current() is None
        with labels.label("layer.0.linear_attention"):
            with labels.label("gdn.gdn_prefill"):
                assert labels.current() == "gdn.gdn_prefill"
            assert labels.current() == "layer.0.linear_attention"
        assert labels.current() is None
    with labels.label("gdn.gdn_prefill"):  # off again: the shared no-op, nothing kept
        assert labels.current() is None


@pytest.mark.gpu
def test_gpu_run_attributes_every_kernel_and_no_op_beats_its_floor(tmp_path: Path) -> None:
    """On the GPU (bf16, the Triton kernels, CUDA events, kernels under the profiler): the prefill kernels sit under
    their labels, almost nothing is unclaimed, the kernels fit inside the steps' event spans, and no op runs faster
    than the floor its byte and FLOP counts give (one that did would mean a wrong count)."""
    out = tmp_path / "profile-prefill-gpu-test.json"
    argv = ["--device", "cuda", "--model", str(TRAINED / "moe"), "--load-format", "auto", "--prompt-lens", "300",
            "--max-num-batched-tokens", "128", "--reps", "2", "--out", str(out)]  # fmt: skip
    assert profile_prefill.main(argv) == 0
    record = json.loads(out.read_text())
    assert record["timer"] == "cuda-events" and record["ceilings"]["copy_gbps"] > 1000
    run = record["runs"][0]
    assert [(c["start"], c["tokens"]) for c in run["chunks"]] == [(0, 128), (128, 128), (256, 44)]
    assert (
        0 < run["steps_gpu_ms_median"] <= run["gpu_ms_median"] * 1.001 and run["gpu_ms_median"] < run["ttft_ms_median"]
    )
    profile = run["profile"]
    ops = {op["op"]: op for op in profile["ops"]}
    assert ops["gdn.gdn_prefill"]["kernels"] >= 4 * 3 * 6  # four launches a layer a chunk, 6 GDN layers
    assert profile["kernels"]["launch_order"].endswith("attributed by launch order")
    assert any("gdn_chunk" in k["name"] for k in profile["kernels"]["by_op"]["gdn.gdn_prefill"])
    assert profile["kernels"]["unclaimed_us"] <= 0.02 * profile["kernels"]["total_us"]
    assert ops.get("unlabelled", {"share_pct": 0})["share_pct"] < 5
    for chunk in profile["chunks"]:
        assert chunk["ops_ms"] <= chunk["step_ms"] * 1.01, chunk
    assert profile["beats_floor"] == [], profile["beats_floor"]
