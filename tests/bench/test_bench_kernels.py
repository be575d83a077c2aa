"""`deltaserve bench kernels`: exits 2 without CUDA; every case builder runs (through the refs) on tiny shapes."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from deltaserve.bench import kernel_cases, kernel_shapes
from deltaserve.bench import kernels as bench


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA exit path")
def test_exits_2_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.run(_args([])) == 2
    assert "nothing to measure" in capsys.readouterr().err


def test_case_builders(monkeypatch: pytest.MonkeyPatch) -> None:
    """Builds and calls every case at a tiny model shape on the CPU, where the dispatchers take the refs."""
    monkeypatch.setattr(kernel_cases, "DEVICE", "cpu")
    tiny = kernel_shapes.ModelShapes(
        "tiny",
        hidden=64,
        num_q_heads=4,
        num_kv_heads=2,
        num_v_heads=4,
        mlp_inter=32,
        head_dim=32,
        rotary_dim=16,
        num_k_heads=2,
        head_k_dim=16,
        head_v_dim=16,
        num_experts=8,
        top_k=2,
        moe_inter=16,
    )
    args = _args(["--decode-up-to", "4", "--context", "20", "--page-size", "8"])
    args.ops = set(kernel_shapes.OPS)
    # 2 tokens take the decode forms, 9 the prefill forms.
    cases = [*bench.build_cases(tiny, 2, args, torch.float32), *bench.build_cases(tiny, 9, args, torch.float32)]
    assert {c.op for c in cases} == set(kernel_shapes.OPS)
    assert {c.mode for c in cases if c.op == "gdn"} == {"decode", "prefill"}
    for case in cases:
        case.call(case.make())
        assert case.bytes > 0


@pytest.mark.gpu
def test_bench_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--models", "35b-a3b", "--tokens", "1,64", "--ops", "preamble_fused,preamble_unfused,rms_norm_residual"]
    assert bench.run(_args(argv)) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["kind"] == "kernel_bench" and len(record["results"]) == 6
    assert all(r["graph_us"] is not None and r["graph_us"] > 0 for r in record["results"])
