"""benchmarks/fp8_ab.py on the CPU, with the field's libraries absent: the shapes it times are the FP8 projections
deltaserve builds, every library arm is recorded as missing by name with its import error, ours is checked against
its twin and timed at a tiny shape, an arm that disagrees with the twin is reported and never wins, the verdict rule
adopts a library only past the margin, the record is indexed as a kernel record, and scripts/h200.sh's fp8-ab step
builds its command (dry run)."""

from __future__ import annotations

import importlib.util
import json
import tempfile
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

from deltaserve.bench import records_index
from deltaserve.config import ModelConfig
from deltaserve.kernels.fp8 import Fp8Weight, fp8_linear_ref
from deltaserve.model.qwen3_5 import Qwen35Model
from tests.support.scripts import absent as absent_importer
from tests.support.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
LIBRARIES = ("vllm", "flashinfer", "deep_gemm")
TINY = ["--device", "cpu", "--dense-shape", "256x384", "--moe-shape", "4,128,256,2", "--tokens", "1,3"]
TINY += ["--moe-tokens", "2", "--check-tokens", "3", "--check-moe-tokens", "5", "--reps", "2"]


@pytest.fixture(scope="module")
def fp8_ab() -> ModuleType:
    return load_script("fp8_ab")


absent = absent_importer(*LIBRARIES)  # none of the field's libraries installed, whatever this machine has


def test_shapes_are_the_fp8_projections_deltaserve_builds(fp8_ab: ModuleType) -> None:
    """Every [N, K] the benchmark times is an FP8 projection deltaserve builds for that model, and every FP8
    projection it builds is timed (the routed experts by the MoE case)."""
    dummies = fp8_ab._make_dummy_models()
    for model, folder in fp8_ab.MODELS.items():
        with tempfile.TemporaryDirectory() as path:
            dummies.write_config(path, folder)
            built = Qwen35Model(ModelConfig.from_pretrained(Path(path)), torch.bfloat16, "meta", build_vision=False)
        weights = [m for m in built.modules() if isinstance(m, Fp8Weight)]
        dense = {tuple(w.weight.shape) for w in weights if w.weight.dim() == 2}
        experts = {tuple(w.weight.shape) for w in weights if w.weight.dim() == 3}
        text = fp8_ab.text_config(model)
        timed = fp8_ab.dense_shapes(text)
        assert {(rows, cols) for _, rows, cols in timed} == dense, model
        assert len(timed) == len(dense)  # one case a shape
        moe = fp8_ab.moe_shape(text)
        if moe is None:
            assert not experts, model
        else:
            e, inter, hidden, top_k = moe
            assert experts == {(e, 2 * inter, hidden), (e, hidden, inter)} and top_k == 8, model
    assert ("o_proj+out_proj", 2048, 4096) in fp8_ab.dense_shapes(fp8_ab.text_config("35b-a3b"))


def test_cpu_run_names_the_missing_libraries_checks_ours_and_writes_an_indexed_record(
    fp8_ab: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "fp8-ab-cpu-test.json"
    assert fp8_ab.main([*TINY, "--out", str(out)], importer=absent) == 0
    printed = capsys.readouterr().out
    record = json.loads(out.read_text())
    assert record["kind"] == "fp8_ab" and record["device"] == "cpu" and record["git_commit"]
    missing = {
        "dense/vllm-cutlass": "vllm",
        "dense/vllm-triton": "vllm",
        "dense/flashinfer": "flashinfer",
        "dense/deepgemm": "deep_gemm",
        "moe/vllm-triton": "vllm",
    }
    assert set(record["missing"]) == set(missing)
    for arm, library in missing.items():
        assert record["missing"][arm] == f"not installed: ModuleNotFoundError: No module named '{library}'"
        assert not record["arms"][arm]["available"] and f"arm {arm} " in printed
    assert record["arms"]["dense/deltaserve"]["available"] and record["arms"]["moe/deltaserve"]["available"]
    assert all(arm["includes_activation_quant"] for arm in record["arms"].values())
    checks = {(c["op"], c["arm"]): c for c in record["checks"]}
    assert set(checks) == {("dense", "deltaserve"), ("moe", "deltaserve")}
    assert checks["dense", "deltaserve"]["agrees"] and 0 < checks["dense", "deltaserve"]["max_rel"] < 4e-3
    timed = [(r["op"], r["M"], r["arm"]) for r in record["results"]]
    assert timed == [("dense", 1, "deltaserve"), ("dense", 3, "deltaserve"), ("moe", 2, "deltaserve")]
    assert all(r["us"] > 0 and r["tflops"] > 0 and r["copy_share"] is None for r in record["results"])
    assert [w["adopt"] for w in record["winners"]] == ["deltaserve"] * 3 and not record["skipped"]
    assert [(v["op"], v["range"], v["cases"], v["serve"], v["libraries"]) for v in record["ranges"]] == [
        ("dense", "decode", 2, "deltaserve", {}), ("moe", "decode", 1, "deltaserve", {})
    ]  # fmt: skip
    assert records_index.kind_of(out.name) == "kernels"
    what = records_index.describe(out)[0]
    assert what.startswith("block-FP8 GEMM / MoE vs libraries (fp8_ab.py): custom dense,moe")
    assert "missing dense/vllm-cutlass, dense/vllm-triton, dense/flashinfer, dense/deepgemm, moe/vllm-triton" in what


def test_an_arm_that_disagrees_with_the_twin_is_reported_and_never_wins(
    fp8_ab: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A FlashInfer stand-in that returns zeros at once (faster than ours, wrong), or one that reads each 128-row
    block's scale from another block: printed as DISAGREES, recorded with agrees false, timed, and the case is still
    deltaserve's. A library whose entry point raises is recorded with its error and not timed."""

    def zeros(x: torch.Tensor, weight: torch.Tensor, _: None, scale: torch.Tensor, out_dtype: torch.dtype) -> Any:
        return torch.zeros(x.shape[0], weight.shape[0], dtype=out_dtype)

    def wrong_blocks(x: torch.Tensor, weight: torch.Tensor, _: None, scale: torch.Tensor, out_dtype: Any) -> Any:
        return fp8_linear_ref(x, Fp8Weight.of(weight, scale.flip(0), 128))  # each row block given another's scale

    def broken(*_: Any, **__: Any) -> Any:
        raise RuntimeError("fp8_blockscale_gemm_sm90 is only supported on SM90")

    for fake, status in ((zeros, "DISAGREES"), (wrong_blocks, "DISAGREES"), (broken, "ERROR")):
        fake_flashinfer = SimpleNamespace(__version__="0.6.14", fp8_blockscale_gemm_sm90=fake)

        def importer(name: str, fake_flashinfer: Any = fake_flashinfer) -> Any:
            return fake_flashinfer if name.startswith("flashinfer") else absent(name)

        out = tmp_path / f"fp8-ab-{fake.__name__}.json"
        assert fp8_ab.main([*TINY, "--ops", "dense", "--out", str(out)], importer=importer) == 0
        record = json.loads(out.read_text())
        assert record["arms"]["dense/flashinfer"]["available"] and "dense/flashinfer" not in record["missing"]
        check = next(c for c in record["checks"] if c["arm"] == "flashinfer")
        assert check["agrees"] is False and f"flashinfer: {status}" in capsys.readouterr().out
        rows = [r for r in record["results"] if r["arm"] == "flashinfer"]
        if fake is zeros:
            assert check["max_rel"] == pytest.approx(1.0)
        if status == "DISAGREES":
            assert check["max_rel"] > 0.1 and len(rows) == 2
            assert all(r["agrees"] is False for r in rows)
        else:
            assert "only supported on SM90" in check["error"] and not rows
        assert [(w["winner"], w["adopt"], w["best_library"]) for w in record["winners"]] == [
            ("deltaserve", "deltaserve", None)
        ] * 2


def test_verdict_adopts_a_library_only_past_the_margin(fp8_ab: ModuleType) -> None:
    case = {"op": "dense", "model": "27b", "shape": "qkv_proj", "M": 1}

    def rows(**us: float) -> list[dict[str, Any]]:
        return [{"arm": arm.replace("_", "-"), "us": t, "agrees": True} for arm, t in us.items()]

    by_far = fp8_ab.verdict(case, rows(deltaserve=100.0, vllm_cutlass=85.0, vllm_triton=120.0), 0.10)
    assert (by_far["winner"], by_far["adopt"], by_far["best_library"]) == (
        "vllm-cutlass",
        "vllm-cutlass",
        "vllm-cutlass",
    )
    assert by_far["library_gain"] == pytest.approx(100 / 85 - 1)
    narrow = fp8_ab.verdict(case, rows(deltaserve=100.0, vllm_cutlass=95.0), 0.10)
    assert (narrow["winner"], narrow["adopt"]) == ("vllm-cutlass", "deltaserve")
    wrong = rows(deltaserve=100.0, flashinfer=10.0)
    wrong[1]["agrees"] = False
    assert fp8_ab.verdict(case, wrong, 0.10)["adopt"] == "deltaserve"


def test_a_range_is_served_by_a_library_only_if_it_ran_everywhere_and_wins_the_sum(
    fp8_ab: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def row(model: str, m: int, arm: str, us: float, agrees: bool = True) -> dict[str, Any]:
        return {"op": "dense", "model": model, "shape": "qkv_proj", "M": m, "arm": arm, "us": us, "agrees": agrees}

    decode = [row("27b", 1, "deltaserve", 100), row("27b", 1, "vllm-cutlass", 50), row("27b", 1, "flashinfer", 80)]
    decode += [row("35b-a3b", 8, "deltaserve", 10), row("35b-a3b", 8, "vllm-cutlass", 12)]
    decode += [row("35b-a3b", 8, "flashinfer", 9, agrees=False)]  # flashinfer disagrees at one decode case
    prefill = [row("27b", 2048, "deltaserve", 1000), row("27b", 2048, "vllm-cutlass", 950)]
    verdicts = {v["range"]: v for v in fp8_ab.range_verdicts(decode + prefill, 0.10)}
    assert verdicts["decode"]["serve"] == "vllm-cutlass" and verdicts["decode"]["cases"] == 2
    assert verdicts["decode"]["libraries"]["vllm-cutlass"]["gain"] == pytest.approx(110 / 62 - 1)
    assert verdicts["decode"]["libraries"]["flashinfer"]["eligible"] is False  # 80 us alone would not count
    assert verdicts["prefill"]["serve"] == "deltaserve"  # 5 % is inside the margin
    records = []
    for model, rows in (("27b", decode[:3] + prefill), ("35b-a3b", decode[3:])):
        records.append(tmp_path / f"fp8-ab-{model}.json")
        records[-1].write_text(json.dumps({"kind": "fp8_ab", "results": rows}))
    assert fp8_ab.main(["--summarize", *map(str, records)]) == 0
    printed = capsys.readouterr().out
    assert "dense decode: 2 cases; serve vllm-cutlass (libraries over deltaserve: flashinfer" in printed
    assert "dense prefill: 1 cases; serve deltaserve" in printed


def test_check_only_checks_every_arm_and_times_nothing(fp8_ab: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "fp8-ab-check.json"
    assert fp8_ab.main([*TINY, "--check-only", "--out", str(out)], importer=absent) == 0
    record = json.loads(out.read_text())
    assert [(c["op"], c["arm"], c["agrees"]) for c in record["checks"]] == [
        ("dense", "deltaserve", True), ("moe", "deltaserve", True)
    ]  # fmt: skip
    assert not record["results"] and not record["winners"] and not record["skipped"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA refusal")
def test_cuda_on_a_machine_without_it_is_refused_by_name(fp8_ab: ModuleType, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as refused:
        fp8_ab.main(["--device", "cuda", "--ops", "dense"])
    assert refused.value.code == 2 and "--device cuda: this machine has no CUDA device" in capsys.readouterr().err


def test_the_deadline_records_the_cases_it_cut(fp8_ab: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "fp8-ab-cut.json"
    assert fp8_ab.main([*TINY, "--deadline-s", "0", "--out", str(out)], importer=absent) == 0
    record = json.loads(out.read_text())
    assert not record["results"] and not record["checks"]
    assert [(s["op"], s["M"], s["why"]) for s in record["skipped"]] == [
        ("dense", 1, "deadline"), ("dense", 3, "deadline"), ("moe", 2, "deadline")
    ]  # fmt: skip
    assert "3 cut at the deadline" in records_index.describe(out)[0]


@pytest.mark.gpu
def test_on_the_gpu_every_arm_that_imports_is_checked_and_ours_agrees(fp8_ab: ModuleType, tmp_path: Path) -> None:
    """On the H200 (`bash scripts/h200.sh tests tests/bench/test_fp8_ab.py`, the vLLM bundle on the path): a small
    dense shape and a small MoE through the whole tool on CUDA; ours agrees with its twin and is timed by CUDA
    graph at every M, every library arm that imports has its check recorded (agreeing, or with its error), and
    each case names an arm to serve."""
    out = tmp_path / "fp8-ab-gpu.json"
    args = ["--dense-shape", "1024x2048", "--moe-shape", "8,256,512,2", "--tokens", "1,64", "--moe-tokens", "4"]
    assert fp8_ab.main([*args, "--reps", "3", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    ours = [c for c in record["checks"] if c["arm"] == "deltaserve"]
    assert len(ours) == 3 and all(c["agrees"] for c in ours)  # dense at M = 8 and 256, MoE at T = 32
    rows = [r for r in record["results"] if r["arm"] == "deltaserve"]
    assert len(rows) == 3 and all(r["mode"] == "graph" and r["us"] > 0 and r["copy_share"] > 0 for r in rows)
    checked = {f"{c['op']}/{c['arm']}" for c in record["checks"]}
    assert {name for name, arm in record["arms"].items() if arm["available"]} == checked
    assert all(w["adopt"] for w in record["winners"])


def test_deepgemm_arm_takes_the_copy_vllm_vendors_when_no_package_is_installed(fp8_ab: ModuleType) -> None:
    """vLLM 0.26 imports DeepGEMM from an installed deep_gemm package, else from the copy its wheel vendors
    (vllm.third_party.deep_gemm): the arm does the same and names the vendored copy; with neither it is missing,
    named by the package."""
    stand_in = SimpleNamespace(__version__="0.26.0", fp8_gemm_nt=None)

    def vendored_only(name: str) -> Any:
        if name.split(".")[0] in ("deep_gemm", "flashinfer"):
            raise ModuleNotFoundError(f"No module named '{name.split('.')[0]}'")
        if name.startswith("vllm"):
            return stand_in  # the vLLM modules the arm reads, stood in: only the import order is under test
        return importlib.import_module(name)

    arms = {arm.name: arm for arm in fp8_ab.dense_arms(vendored_only)}
    assert arms["deepgemm"].error is None, arms["deepgemm"].error
    assert arms["deepgemm"].library == "deep_gemm vendored in vllm 0.26.0"
    arms = {arm.name: arm for arm in fp8_ab.dense_arms(absent)}
    assert arms["deepgemm"].error == "not installed: ModuleNotFoundError: No module named 'deep_gemm'"
