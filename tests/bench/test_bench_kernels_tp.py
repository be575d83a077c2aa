"""`deltaserve bench kernels --tp N`: the per-rank shapes of an N-way tensor-parallel engine, and every case builder
running at them (through the refs, on the CPU)."""

from __future__ import annotations

import argparse

import pytest
import torch

from deltaserve.bench import kernel_cases, kernel_shapes
from deltaserve.bench import kernels as bench
from deltaserve.model.parallel import ShardingError


def test_per_rank_shapes_of_the_two_benchmarked_models() -> None:
    dense = kernel_shapes.per_rank(kernel_shapes.MODELS["27b"], 2)
    assert (dense.num_q_heads, dense.num_kv_heads, dense.num_k_heads, dense.num_v_heads) == (12, 2, 8, 24)
    assert dense.mlp_inter == 8704 and dense.conv_dim == 2 * 8 * 128 + 24 * 128 and dense.name.endswith("/tp2")
    moe = kernel_shapes.per_rank(kernel_shapes.MODELS["35b-a3b"], 2)
    # two KV heads over two ranks: one each; each expert's width halves, every expert stays
    assert (moe.num_q_heads, moe.num_kv_heads, moe.num_v_heads, moe.mlp_inter) == (8, 1, 16, 256)
    assert (moe.num_experts, moe.moe_inter, moe.top_k) == (256, 256, 8)
    expert_parallel = kernel_shapes.per_rank(kernel_shapes.MODELS["35b-a3b"], 4, expert_parallel=True)
    assert (expert_parallel.num_kv_heads, expert_parallel.num_experts, expert_parallel.moe_inter) == (1, 64, 512)
    assert kernel_shapes.per_rank(kernel_shapes.MODELS["27b"], 1) is kernel_shapes.MODELS["27b"]
    with pytest.raises(ShardingError, match="`num_attention_heads` \\(16\\)"):
        kernel_shapes.per_rank(kernel_shapes.MODELS["35b-a3b"], 3)


def test_case_builders_at_per_rank_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel_cases, "DEVICE", "cpu")
    tiny = kernel_shapes.ModelShapes(
        "tiny", hidden=64, num_q_heads=4, num_kv_heads=2, num_v_heads=4, mlp_inter=32, head_dim=32, rotary_dim=16,
        num_k_heads=2, head_k_dim=16, head_v_dim=16, num_experts=8, top_k=2, moe_inter=16,
    )  # fmt: skip
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--decode-up-to", "4", "--context", "20", "--page-size", "8", "--tp", "2"])
    args.ops = set(kernel_shapes.OPS)
    shard = kernel_shapes.per_rank(tiny, args.tp)
    assert (shard.num_q_heads, shard.num_kv_heads, shard.num_v_heads, shard.moe_inter) == (2, 1, 2, 8)
    cases = [*bench.build_cases(shard, 2, args, torch.float32), *bench.build_cases(shard, 9, args, torch.float32)]
    assert {c.op for c in cases} == set(kernel_shapes.OPS)
    for case in cases:
        case.call(case.make())
