"""benchmarks/attention_ab.py on the CPU, with the field's libraries absent: the library arms are recorded as missing
by name with their import errors, ours is checked against its twin and timed at tiny cases, stand-ins for FA3 and
FlashInfer called exactly as the arms call the real ones agree with the twin (so the metadata each arm builds from
deltaserve's cache is right), an arm that disagrees is reported and never wins, the range rule adopts a library only
past the margin, the record is indexed as a kernel record, and scripts/h200.sh's attention-ab step builds its
command (dry run)."""

from __future__ import annotations

import importlib
import importlib.util
import json
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

from deltaserve.bench import records_index
from deltaserve.kernels.attention import paged_attention_ref
from tests.support.scripts import absent as absent_importer
from tests.support.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
LIBRARIES = ("vllm", "flashinfer")
TINY = ["--device", "cpu", "--shapes", "27b", "--cases", "24@40,2x8@0,3x2@20", "--check-cases", "small,16@33"]
TINY += ["--reps", "2"]


@pytest.fixture(scope="module")
def attention_ab() -> ModuleType:
    return load_script("attention_ab")


absent = absent_importer(*LIBRARIES)  # none of the field's libraries installed, whatever this machine has


def fake_fa3(wrong: str = "") -> SimpleNamespace:
    """vllm.vllm_flash_attn with FA3's varlen signature, computed by the twin from exactly the arguments the arm
    passes (query offsets, seqused_k, the block table, the scale); `wrong`: zeros, or the block table ignored."""

    def varlen(q: Any, k: Any, v: Any, max_q: int, cu_q: Any, max_k: int, **kw: Any) -> torch.Tensor:
        assert kw["causal"] is True and kw["fa_version"] == 3 and kw.get("cu_seqlens_k") is None
        table = kw["block_table"]
        if wrong == "zeros":
            return torch.zeros_like(q)
        if wrong == "table":  # the pages read in order, as if each sequence owned contiguous blocks
            table = torch.arange(table.numel(), dtype=table.dtype).view(table.shape) % k.shape[0]
        return paged_attention_ref(q, k, v, cu_q, kw["seqused_k"], table, kw["softmax_scale"], max_q, max_k)

    return SimpleNamespace(flash_attn_varlen_func=varlen, fa_version_unsupported_reason=lambda version: None)


class FakeWrapper:
    """flashinfer.BatchPrefillWithPagedKVCacheWrapper: plan takes FlashInfer's CSR page list; run rebuilds a block
    table from it and calls the twin, so it agrees only if the arm's conversion is right."""

    def __init__(self, workspace: torch.Tensor, layout: str) -> None:
        assert layout == "NHD" and workspace.dtype == torch.uint8

    def plan(self, qo: Any, indptr: Any, indices: Any, last: Any, nq: int, nkv: int, d: int, page: int, **kw: Any):
        assert kw["causal"] is True
        pages = (indptr[1:] - indptr[:-1]).tolist()
        self.table = torch.zeros(len(pages), max(pages), dtype=torch.int32)
        for b, n in enumerate(pages):
            self.table[b, :n] = indices[indptr[b] : indptr[b] + n]
        self.seq_lens = ((indptr[1:] - indptr[:-1] - 1) * page + last).to(torch.int32)
        self.qo, self.scale = qo, kw["sm_scale"]

    def run(self, q: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return paged_attention_ref(q, *cache, self.qo, self.seq_lens, self.table, self.scale)


def with_fakes(fa3: Any = None, flashinfer: Any = None) -> Any:
    def importer(name: str) -> Any:
        if name.startswith("vllm.vllm_flash_attn") and fa3 is not None:
            return fa3
        if name == "flashinfer" and flashinfer is not None:
            return flashinfer
        return absent(name)

    return importer


@pytest.fixture(scope="module")
def cpu_record(attention_ab: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    out = tmp_path_factory.mktemp("attention-ab") / "attention-ab-cpu-test.json"
    return out, attention_ab.main([*TINY, "--out", str(out)], importer=absent)


def test_cases_flops_and_head_shapes(attention_ab: ModuleType) -> None:
    assert attention_ab.head_shape("35b-a3b") == (16, 2, 256) and attention_ab.head_shape("27b") == (24, 4, 256)
    assert attention_ab.parse_case("8192@57344") == [(8192, 57344)]
    assert attention_ab.parse_case("64x4@4096") == [(4, 4096)] * 64
    for bad in ("2048", "0@5", "x3@4", "2048@-1"):
        with pytest.raises(ValueError, match="C@P or BxC@P"):
            attention_ab.parse_case(bad)
    # the chunk sees the P cached tokens and itself causally: C·P + C(C+1)/2 scores a head, 4·d FLOPs each
    assert attention_ab.case_flops([(2048, 8192)], 24, 256) == 4 * 24 * 256 * (2048 * 8192 + 2048 * 2049 // 2)
    assert "57344" in " ".join(attention_ab.CASES) and "8192@57344" in attention_ab.CASES  # up to a 64K prompt
    assert {"8x1024@0", "64x4@4096"} <= set(attention_ab.CASES)


def test_cpu_run_names_the_missing_libraries_checks_ours_and_writes_an_indexed_record(
    cpu_record: tuple[Path, int],
) -> None:
    out, code = cpu_record
    assert code == 0
    record = json.loads(out.read_text())
    assert record["kind"] == "attention_ab" and record["device"] == "cpu" and record["git_commit"]
    vllm, flashinfer = (f"not installed: ModuleNotFoundError: No module named '{name}'" for name in LIBRARIES)
    assert record["missing"] == {
        "vllm-fa3": vllm, "vllm-fa3@vllm": vllm, "flashinfer": flashinfer, "flashinfer@vllm": flashinfer
    }  # fmt: skip
    assert record["library_block_sizes"] == {"27b": {"16": 16, "vllm": 784}}
    assert record["arms"]["deltaserve"]["available"] and record["heads"] == {"27b": [24, 4, 256]}
    checks = [(c["case"], c["arm"], c["agrees"]) for c in record["checks"]]
    assert checks == [("small", "deltaserve", True), ("16@33", "deltaserve", True)]
    assert all(0 < c["max_rel"] < 4e-3 for c in record["checks"])  # one bf16 rounding of the output, not zero
    timed = [(r["case"], r["B"], r["C"], r["P"], r["arm"]) for r in record["results"]]
    assert timed == [("24@40", 1, 24, 40, "deltaserve"), ("2x8@0", 2, 8, 0, "deltaserve"),
                     ("3x2@20", 3, 2, 20, "deltaserve")]  # fmt: skip
    assert all(r["us"] > 0 and r["tflops"] > 0 and r["bf16_share"] is None for r in record["results"])
    assert [w["adopt"] for w in record["winners"]] == ["deltaserve"] * 3 and not record["skipped"]
    assert [(v["range"], v["cases"], v["serve"]) for v in record["ranges"]] == [
        ("verify", 2, "deltaserve"), ("short", 1, "deltaserve")
    ]  # fmt: skip
    assert records_index.kind_of(out.name) == "kernels"
    what = records_index.describe(out)[0]
    assert what.startswith("paged attention prefill vs libraries (attention_ab.py): 27b; arms deltaserve; ")
    assert (
        "missing vllm-fa3, vllm-fa3@vllm, flashinfer, flashinfer@vllm; kernel per range verify deltaserve, short"
        in what
    )


def test_library_arms_build_their_metadata_from_our_cache_and_agree(attention_ab: ModuleType, tmp_path: Path) -> None:
    """FA3 and FlashInfer stand-ins that compute the twin from only what each arm hands them: both agree at the
    small mixed batch (shuffled pages, a decode, odd lengths), on our cache and on its copy repaged to vLLM's block
    size (784 tokens on the 27B) and to 32, and are timed at every case."""
    out = tmp_path / "attention-ab-fakes.json"
    fakes = with_fakes(
        fake_fa3(), SimpleNamespace(__version__="0.6.14", BatchPrefillWithPagedKVCacheWrapper=FakeWrapper)
    )
    args = [*TINY, "--check-cases", "small", "--library-block-sizes", "16,vllm,32", "--out", str(out)]
    assert attention_ab.main(args, importer=fakes) == 0
    record = json.loads(out.read_text())
    assert not record["missing"] and record["arms"]["flashinfer"]["library"] == "flashinfer 0.6.14"
    names = {"deltaserve", "vllm-fa3", "vllm-fa3@vllm", "vllm-fa3@32", "flashinfer", "flashinfer@vllm", "flashinfer@32"}
    assert {c["arm"]: c["agrees"] for c in record["checks"]} == dict.fromkeys(names, True)
    assert {r["arm"] for r in record["results"]} == names
    assert len(record["results"]) == 3 * 7 and all(r["agrees"] for r in record["results"])


def test_vllm_block_size_and_the_repaged_copy(attention_ab: ModuleType) -> None:
    """vLLM's page for these hybrid models holds one GDN layer's state: 35B-A3B conv (2·16·128 + 32·128)·3·2 B and
    fp32 state 32·128·128·4 B over 2·2·256·2 B a token -> 66 blocks of 16; 27B (2·16·128 + 48·128)·3·2 and
    48·128·128·4 over 2·4·256·2 -> 49 blocks of 16. The repaged copy holds every token where its table says."""
    assert attention_ab.vllm_block_size("35b-a3b") == 16 * -(-(8192 * 6 + 32 * 128 * 128 * 4) // (16 * 2048)) == 1056
    assert attention_ab.vllm_block_size("27b") == 16 * -(-(10240 * 6 + 48 * 128 * 128 * 4) // (16 * 4096)) == 784
    b = attention_ab.make_batch([(5, 30), (1, 0)], (4, 2, 8), "cpu", torch.float32)
    copy = attention_ab.repage(b, 7)
    assert copy.k_cache.shape[1:] == (7, 2, 8) and copy.block_tables.shape == (2, 5)
    for s, length in enumerate(b.seq_lens.tolist()):
        for pos in range(length):
            old = b.k_cache[b.block_tables[s, pos // 16], pos % 16]
            assert torch.equal(copy.k_cache[copy.block_tables[s, pos // 7], pos % 7], old)
            assert torch.equal(
                copy.v_cache[copy.block_tables[s, pos // 7], pos % 7], b.v_cache[b.block_tables[s, pos // 16], pos % 16]
            )


def test_an_arm_that_disagrees_with_the_twin_is_reported_and_never_wins(
    attention_ab: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An FA3 stand-in that returns zeros at once (faster than ours, wrong), or one that reads the pages in order
    instead of through the block table: DISAGREES, timed, and every case is still deltaserve's. One whose entry
    point raises is recorded with its error and not timed."""

    def broken(*_: Any, **__: Any) -> Any:
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer")

    raising = SimpleNamespace(flash_attn_varlen_func=broken, fa_version_unsupported_reason=lambda version: None)
    for fa3, status in ((fake_fa3("zeros"), "DISAGREES"), (fake_fa3("table"), "DISAGREES"), (raising, "ERROR")):
        out = tmp_path / "attention-ab-wrong.json"
        args = [
            *TINY,
            "--check-cases",
            "small",
            "--cases",
            "24@40",
            "--library-block-sizes",
            "16,32",
            "--out",
            str(out),
        ]
        assert attention_ab.main(args, importer=with_fakes(fa3)) == 0
        record = json.loads(out.read_text())
        check = next(c for c in record["checks"] if c["arm"] == "vllm-fa3")
        assert check["agrees"] is False and f"vllm-fa3: {status}" in capsys.readouterr().out
        rows = [r for r in record["results"] if r["arm"] == "vllm-fa3"]
        if status == "DISAGREES":
            assert check["max_rel"] > 0.1 and len(rows) == 1 and rows[0]["agrees"] is False
        else:
            assert "Ampere" in check["error"] and not rows
        assert [(w["winner"], w["adopt"], w["best_library"]) for w in record["winners"]] == [
            ("deltaserve", "deltaserve", None)
        ]
        assert record["ranges"][0]["serve"] == "deltaserve" and not record["ranges"][0]["libraries"]


def test_fa3_not_built_for_the_device_is_recorded_with_vllms_reason(attention_ab: ModuleType, tmp_path: Path) -> None:
    fa = SimpleNamespace(flash_attn_varlen_func=None, fa_version_unsupported_reason=lambda v: "FA3 needs sm90")
    arms = {arm.name: arm for arm in importlib.import_module("attention_ab_arms").attention_arms(with_fakes(fa))}
    assert arms["vllm-fa3"].error == "vLLM reports FlashAttention 3 unsupported here: FA3 needs sm90"


def test_a_range_is_served_by_a_library_only_if_it_ran_everywhere_and_wins_the_sum(attention_ab: ModuleType) -> None:
    def row(case: str, arm: str, us: float, agrees: bool = True) -> dict[str, Any]:
        seqs = attention_ab.parse_case(case)
        return {"model": "27b", "case": case, "C": seqs[0][0], "P": seqs[0][1], "arm": arm, "us": us, "agrees": agrees}

    long = [row("8192@57344", "deltaserve", 100e3), row("8192@57344", "vllm-fa3", 60e3)]
    long += [row("2048@32768", "deltaserve", 10e3), row("2048@32768", "vllm-fa3", 12e3)]
    long += [row("8192@57344", "flashinfer", 50e3), row("2048@32768", "flashinfer", 5e3, agrees=False)]
    short = [row("2048@0", "deltaserve", 1000), row("2048@0", "vllm-fa3", 950)]  # 5 %: inside the margin
    verify = [row("64x4@4096", "deltaserve", 100), row("64x4@4096", "flashinfer", 80)]
    verdicts = {v["range"]: v for v in attention_ab.range_verdicts(long + short + verify, 0.10)}
    assert verdicts["long"]["serve"] == "vllm-fa3" and verdicts["long"]["cases"] == 2
    assert verdicts["long"]["libraries"]["vllm-fa3"]["gain"] == pytest.approx(110 / 72 - 1)
    assert verdicts["long"]["libraries"]["flashinfer"]["eligible"] is False  # disagreed at one long case
    assert verdicts["short"]["serve"] == "deltaserve" and verdicts["verify"]["serve"] == "flashinfer"


def test_check_only_checks_every_arm_and_times_nothing(attention_ab: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "attention-ab-check.json"
    assert attention_ab.main([*TINY, "--check-only", "--check-cases", "small", "--out", str(out)], absent) == 0
    record = json.loads(out.read_text())
    assert [(c["case"], c["arm"], c["agrees"]) for c in record["checks"]] == [("small", "deltaserve", True)]
    assert not record["results"] and not record["winners"] and not record["skipped"]


def test_the_deadline_records_what_it_cut(attention_ab: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "attention-ab-cut.json"
    assert attention_ab.main([*TINY, "--deadline-s", "0", "--out", str(out)], importer=absent) == 0
    record = json.loads(out.read_text())
    assert not record["results"] and not record["checks"]
    assert [(s["case"], s["why"]) for s in record["skipped"]] == [
        ("small", "deadline"), ("16@33", "deadline"), ("24@40", "deadline"), ("2x8@0", "deadline"),
        ("3x2@20", "deadline")
    ]  # fmt: skip
    assert "5 cut at the deadline" in records_index.describe(out)[0]


def test_bad_flags_are_refused_by_name(attention_ab: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    for flags, said in (
        (["--shapes", "70b"], "--shapes: unknown ['70b']"),
        (["--cases", "4096"], "C@P or BxC@P"),
        (["--library-block-sizes", "16,big"], "--library-block-sizes: block sizes in tokens or `vllm`, not ['big']"),
    ):
        with pytest.raises(SystemExit) as refused:
            attention_ab.main(["--device", "cpu", *flags])
        assert refused.value.code == 2 and said in capsys.readouterr().err


@pytest.mark.gpu
def test_on_the_gpu_every_arm_that_imports_is_checked_and_ours_agrees(attention_ab: ModuleType, tmp_path: Path) -> None:
    """On the H200 (`bash scripts/h200.sh tests tests/bench/test_attention_ab.py`, the bundles on the path): the
    small check and one real chunk through the whole tool on CUDA; ours agrees with its twin and is timed at both
    cases, every library arm that imports has its checks recorded (agreeing, or with its error), each case names
    an arm to serve."""
    out = tmp_path / "attention-ab-gpu.json"
    args = ["--shapes", "27b", "--check-cases", "small,2048@4096", "--cases", "2048@4096,64x4@4096", "--reps", "3"]
    assert attention_ab.main([*args, "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    ours = [c for c in record["checks"] if c["arm"] == "deltaserve"]
    assert len(ours) == 2 and all(c["agrees"] for c in ours)
    rows = [r for r in record["results"] if r["arm"] == "deltaserve"]
    assert len(rows) == 2 and all(r["us"] > 0 and 0 < r["bf16_share"] < 1 for r in rows)
    checked = {c["arm"] for c in record["checks"]}
    assert {name for name, arm in record["arms"].items() if arm["available"]} == checked
    assert all(w["adopt"] for w in record["winners"])
