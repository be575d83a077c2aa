"""The cases `deltaserve bench kernels` times for the matrix products: the MoE block, the linear layer, block FP8.

fused_moe and the whole MoE block op (router, routing, routed and shared experts), counting the weights of the experts
actually routed to; kernels.linear on the GDN input projection's shape (the register GEMV at one row, cuBLAS beyond);
and the same projection and the routed experts with block-FP8 weights (docs/fp8.md), whose bytes count one a value
plus an fp32 scale per 128 x 128 block. Their inputs come from kernel_cases.py's builders.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from deltaserve.bench.kernel_cases import Case, device_randn, fp8_weight
from deltaserve.bench.kernel_shapes import ModelShapes


def moe_cases(m: ModelShapes, tokens: int, dtype: torch.dtype) -> list[Case]:
    if not m.num_experts:
        return []
    from deltaserve.kernels import fused_moe, fused_moe_block, moe_route

    hidden, inter, experts = m.hidden, m.moe_inter, m.num_experts
    w13 = device_randn(experts, 2 * inter, hidden, dtype=dtype, scale=hidden**-0.5)
    w2 = device_randn(experts, hidden, inter, dtype=dtype, scale=inter**-0.5)
    router = device_randn(experts, hidden, dtype=dtype, scale=hidden**-0.5)
    shared = (
        device_randn(2 * m.mlp_inter, hidden, dtype=dtype, scale=hidden**-0.5),
        device_randn(hidden, m.mlp_inter, dtype=dtype, scale=m.mlp_inter**-0.5),
        device_randn(1, hidden, dtype=dtype, scale=hidden**-0.5),
    )

    def make() -> tuple[Any, ...]:
        weights, ids = moe_route(device_randn(tokens, experts, dtype=dtype), m.top_k, True)
        return device_randn(tokens, hidden, dtype=dtype), weights, ids

    probe = make()
    active = int(torch.unique(probe[2]).numel())
    size = dtype.itemsize
    moved = active * 3 * inter * hidden * size + 2 * tokens * hidden * size
    flops = 2 * tokens * m.top_k * 3 * inter * hidden
    note = f"{active}/{experts} experts hit, top-{m.top_k}"
    # The whole block: router + routing + routed experts + the sigmoid-gated shared expert (one op).
    block_moved = moved + (3 * m.mlp_inter + experts + 1) * hidden * size
    block_flops = flops + 2 * tokens * (3 * m.mlp_inter + experts + 1) * hidden

    def block(s: tuple[Any, ...]) -> object:
        return fused_moe_block(s[0], router, w13, w2, m.top_k, True, *shared)

    return [
        Case("fused_moe", "-", make, lambda s: fused_moe(s[0], w13, w2, s[1], s[2]), moved, flops, note),
        Case("moe_block", "-", make, block, block_moved, block_flops, f"{note}, with router and shared expert"),
    ]


def linear_cases(m: ModelShapes, tokens: int, dtype: torch.dtype) -> list[Case]:
    """kernels.linear on the GDN input projection's shape (the register GEMV at one row, cuBLAS beyond)."""
    from deltaserve.kernels import linear

    out_features, in_features = m.conv_dim + m.num_v_heads * m.head_v_dim, m.hidden
    weight = device_randn(out_features, in_features, dtype=dtype, scale=in_features**-0.5)
    size = dtype.itemsize
    moved = (out_features * in_features + tokens * (in_features + out_features)) * size
    flops = 2 * tokens * out_features * in_features
    note = f"[{out_features} x {in_features}] (in_proj_qkvz)"
    make = lambda: (device_randn(tokens, in_features, dtype=dtype),)  # noqa: E731
    return [Case("linear", "-", make, lambda s: linear(s[0], weight), moved, flops, note)]


def _fp8_bytes(*shape: int) -> int:
    """Bytes of a block-FP8 weight: one a value, plus an fp32 scale per 128 x 128 block."""
    lead = math.prod(shape[:-2])
    return lead * (shape[-2] * shape[-1] + 4 * math.ceil(shape[-2] / 128) * math.ceil(shape[-1] / 128))


def fp8_cases(m: ModelShapes, tokens: int, dtype: torch.dtype) -> list[Case]:
    """Block FP8 (docs/fp8.md): kernels.linear with an Fp8Weight on the GDN input projection's shape (activation
    quantization + GEMM), and fused_moe with FP8 experts (quantization, two grouped GEMMs, the weighted sum)."""
    from deltaserve.kernels import fused_moe, linear, moe_route

    size = dtype.itemsize
    out_features, in_features = m.conv_dim + m.num_v_heads * m.head_v_dim, m.hidden
    weight = fp8_weight(out_features, in_features)
    moved = _fp8_bytes(out_features, in_features) + tokens * (in_features + out_features) * size
    flops = 2 * tokens * out_features * in_features
    make = lambda: (device_randn(tokens, in_features, dtype=dtype),)  # noqa: E731
    note = f"[{out_features} x {in_features}] e4m3 (in_proj_qkvz)"
    cases = [Case("fp8_linear", "-", make, lambda s: linear(s[0], weight), moved, flops, note)]
    if not m.num_experts:
        return cases
    hidden, inter, experts = m.hidden, m.moe_inter, m.num_experts
    w13, w2 = fp8_weight(experts, 2 * inter, hidden), fp8_weight(experts, hidden, inter)

    def make_moe() -> tuple[Any, ...]:
        weights, ids = moe_route(device_randn(tokens, experts, dtype=dtype), m.top_k, True)
        return device_randn(tokens, hidden, dtype=dtype), weights, ids

    active = int(torch.unique(make_moe()[2]).numel())
    moe_moved = active * (_fp8_bytes(2 * inter, hidden) + _fp8_bytes(hidden, inter)) + 2 * tokens * hidden * size
    moe_flops = 2 * tokens * m.top_k * 3 * inter * hidden
    moe_note = f"{active}/{experts} e4m3 experts hit, top-{m.top_k}"
    moe_call = lambda s: fused_moe(s[0], w13, w2, s[1], s[2])  # noqa: E731
    return [*cases, Case("fp8_fused_moe", "-", make_moe, moe_call, moe_moved, moe_flops, moe_note)]
