"""`deltaserve bench kernels`: time every Triton kernel at the Qwen3.5-27B and 35B-A3B shapes on one GPU.

For each model and token count it builds the op's real-shape inputs (bf16 activations, fp32 GDN states and
routing weights), times the public dispatcher (which routes to Triton on CUDA), counts the bytes the op
must move at least (inputs read once, outputs written once; weights of the experts actually routed to),
and reports the achieved bandwidth as a share of the device's copy bandwidth, measured in the same run
with a large device-to-device copy (bytes read + written). Token counts up to --decode-up-to run the
decode forms (paged attention over --context cached tokens per sequence, conv update, GDN decode, one
sequence per token); larger counts run the prefill forms on one sequence. `moe_block` times the whole MoE
block op (router, routing, routed and shared experts) beside `fused_moe`, `gdn_verify_conv`, `gdn_verify` and
`spec_commit` the speculative verify step's conv, delta rule and commit (at decode token counts: that many sequences
of 1 + k = 4 tokens; the commit of one layer, every token accepted), and `linear`
kernels.linear on the GDN input projection (the register GEMV at one row, cuBLAS beyond); `fp8_linear` and
`fp8_fused_moe` the same projection and the routed experts with block-FP8 weights (docs/fp8.md). The decode
step as a whole, per batch size, is benchmarks/decode_step.py.

Timing: the op's inputs are replicated until the sets together exceed three times the L2 cache and used in
rotation, so no call finds its inputs in L2. The primary number is GPU time per call from replaying a CUDA
graph of one pass over the sets (no launch overhead); `eager_us` is triton.testing.do_bench's median of
plain calls, which includes Python launch overhead where an op is launch-bound (the four-op preamble).
A table goes to stdout, then one JSON line last. On a machine without CUDA it exits 2: nothing to measure.

`--tp N` times the shapes one rank of an N-way tensor-parallel engine runs (model/parallel.py's split: query, KV,
GDN key and value heads, the dense / shared-expert width and each expert's width divided by N; KV heads replicated
below N; with --expert-parallel whole experts divided instead), so the fused preamble and every kernel are covered
at their per-rank shapes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from deltaserve.bench.provenance import git_state
from deltaserve.model.parallel import kv_head_shard, split_evenly

EPS = 1e-6
ROPE_POSITIONS = 65536
DEFAULT_TOKENS = "1,8,64,512,2048,8192"
# Where the cases build their inputs; the CPU test of the case builders points it at "cpu".
DEVICE = "cuda"


@dataclass(frozen=True)
class ModelShapes:
    """Per-layer kernel shapes of one checkpoint (docs/ARCHITECTURE.md#configs-and-checkpoint-layout)."""

    name: str
    hidden: int
    num_q_heads: int
    num_kv_heads: int
    num_v_heads: int
    mlp_inter: int  # dense SwiGLU width (27B) or the shared expert's (35B-A3B)
    head_dim: int = 256
    rotary_dim: int = 64
    num_k_heads: int = 16
    head_k_dim: int = 128
    head_v_dim: int = 128
    conv_kernel: int = 4
    num_experts: int = 0
    top_k: int = 0
    moe_inter: int = 0

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim


def per_rank(m: ModelShapes, tp: int, expert_parallel: bool = False) -> ModelShapes:
    """The kernel shapes of one rank of a tp-way tensor-parallel engine (every rank's are the same); refuses a
    size that does not divide a sharded dimension, as the engine does."""
    if tp == 1:
        return m
    num_q_heads = split_evenly(m.num_q_heads, tp, 0, "num_attention_heads").size
    num_kv_heads = kv_head_shard(m.num_kv_heads, tp, 0).size
    num_k_heads = split_evenly(m.num_k_heads, tp, 0, "linear_num_key_heads").size
    num_v_heads = split_evenly(m.num_v_heads, tp, 0, "linear_num_value_heads").size
    inter_field = "shared_expert_intermediate_size" if m.num_experts else "intermediate_size"
    mlp_inter = split_evenly(m.mlp_inter, tp, 0, inter_field).size
    experts, moe_inter = m.num_experts, m.moe_inter
    if m.num_experts and expert_parallel:
        experts = split_evenly(m.num_experts, tp, 0, "num_experts").size
    elif m.num_experts:
        moe_inter = split_evenly(m.moe_inter, tp, 0, "moe_intermediate_size").size
    return dataclasses.replace(
        m,
        name=f"{m.name}/tp{tp}" + ("-ep" if expert_parallel and m.num_experts else ""),
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        num_k_heads=num_k_heads,
        num_v_heads=num_v_heads,
        mlp_inter=mlp_inter,
        num_experts=experts,
        moe_inter=moe_inter,
    )


MODELS: dict[str, ModelShapes] = {
    "27b": ModelShapes("Qwen3.5-27B", hidden=5120, num_q_heads=24, num_kv_heads=4, num_v_heads=48, mlp_inter=17408),
    "35b-a3b": ModelShapes(
        "Qwen3.5-35B-A3B",
        hidden=2048,
        num_q_heads=16,
        num_kv_heads=2,
        num_v_heads=32,
        mlp_inter=512,
        num_experts=256,
        top_k=8,
        moe_inter=512,
    ),
}
OPS = (
    "preamble_fused",
    "preamble_unfused",
    "rotary_embedding",
    "rms_norm_residual",
    "gated_rms_norm",
    "silu_and_mul",
    "store_kv",
    "paged_attention",
    "causal_conv1d",
    "gdn",
    "gdn_verify_conv",
    "gdn_verify",
    "spec_commit",
    "fused_moe",
    "moe_block",
    "linear",
    "fp8_linear",
    "fp8_fused_moe",
)


@dataclass
class Case:
    """One op at one shape: `make` builds a fresh input set, `call` runs the op on one."""

    op: str
    mode: str
    make: Callable[[], tuple[Any, ...]]
    call: Callable[[tuple[Any, ...]], object]
    bytes: int
    flops: int = 0
    note: str = ""


def _randn(*shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=DEVICE) * scale).to(dtype)


def _preamble_cases(m: ModelShapes, tokens: int, dtype: torch.dtype) -> list[Case]:
    from deltaserve.kernels import attn_preamble, attn_preamble_unfused, rope_cos_sin_cache, rotary_embedding

    nq, nkv, d, r = m.num_q_heads, m.num_kv_heads, m.head_dim, m.rotary_dim
    width = nq * 2 * d + 2 * nkv * d
    cache = rope_cos_sin_cache(r, ROPE_POSITIONS, 1e7, dtype, DEVICE)
    q_w, k_w = _randn(d, dtype=dtype, scale=0.1), _randn(d, dtype=dtype, scale=0.1)
    size = dtype.itemsize
    # Compulsory traffic: q|gate and k read, cos/sin rows read, q, k, gate written (v is not touched).
    moved = tokens * ((nq * 2 * d + nkv * d) + r + (2 * nq * d + nkv * d)) * size

    def make() -> tuple[Any, ...]:
        positions = torch.randint(0, ROPE_POSITIONS, (tokens,), device=DEVICE)
        return _randn(tokens, width, dtype=dtype), positions, cache[positions]

    def fused(s: tuple[Any, ...]) -> object:
        return attn_preamble(s[0], q_w, k_w, s[2], nq, nkv, d, r, EPS)

    def unfused(s: tuple[Any, ...]) -> object:
        return attn_preamble_unfused(s[0], q_w, k_w, s[1], cache, nq, nkv, d, r, EPS)

    def make_rope() -> tuple[Any, ...]:
        positions = torch.randint(0, ROPE_POSITIONS, (tokens,), device=DEVICE)
        return positions, _randn(tokens, nq * d, dtype=dtype), _randn(tokens, nkv * d, dtype=dtype)

    def rope(s: tuple[Any, ...]) -> object:
        return rotary_embedding(s[0], s[1], s[2], cache, d, r)

    rope_moved = tokens * (2 * (nq + nkv) * d + r) * size
    return [
        Case("preamble_fused", "-", make, fused, moved, note="1 launch"),
        Case("preamble_unfused", "-", make, unfused, moved, note="4 ops; bytes = fused's compulsory bytes"),
        Case("rotary_embedding", "-", make_rope, rope, rope_moved, note="out of place, as the ref"),
    ]


def _norm_cases(m: ModelShapes, tokens: int, dtype: torch.dtype) -> list[Case]:
    from deltaserve.kernels import gated_rms_norm, rms_norm, silu_and_mul

    size = dtype.itemsize
    w_h = _randn(m.hidden, dtype=dtype, scale=0.1)
    w_v = _randn(m.head_v_dim, dtype=dtype)
    return [
        Case(
            "rms_norm_residual",
            "-",
            lambda: (_randn(tokens, m.hidden, dtype=dtype), _randn(tokens, m.hidden, dtype=dtype)),
            lambda s: rms_norm(s[0], w_h, EPS, s[1]),
            4 * tokens * m.hidden * size,
        ),
        Case(
            "gated_rms_norm",
            "-",
            lambda: tuple(_randn(tokens, m.num_v_heads, m.head_v_dim, dtype=dtype) for _ in range(2)),
            lambda s: gated_rms_norm(s[0], s[1], w_v, EPS),
            3 * tokens * m.num_v_heads * m.head_v_dim * size,
        ),
        Case(
            "silu_and_mul",
            "-",
            lambda: (_randn(tokens, 2 * m.mlp_inter, dtype=dtype),),
            lambda s: silu_and_mul(s[0]),
            3 * tokens * m.mlp_inter * size,
            note=f"I = {m.mlp_inter}",
        ),
    ]


def _attention_cases(
    m: ModelShapes, tokens: int, dtype: torch.dtype, is_decode: bool, context: int, page: int
) -> list[Case]:
    from deltaserve.kernels import paged_attention, store_kv

    nq, nkv, d = m.num_q_heads, m.num_kv_heads, m.head_dim
    size = dtype.itemsize
    batch, seq_len = (tokens, context) if is_decode else (1, tokens)
    pages_per_seq = math.ceil(seq_len / page)
    scale = d**-0.5

    def make_attn() -> tuple[Any, ...]:
        num_blocks = batch * pages_per_seq
        k_cache = _randn(num_blocks, page, nkv, d, dtype=dtype)
        v_cache = _randn(num_blocks, page, nkv, d, dtype=dtype)
        block_tables = torch.randperm(num_blocks, device=DEVICE).int().view(batch, pages_per_seq)
        q = _randn(tokens, nq, d, dtype=dtype)
        q_lens = torch.full((batch,), tokens // batch, dtype=torch.int32, device=DEVICE)
        qsl = torch.zeros(batch + 1, dtype=torch.int32, device=DEVICE)
        qsl[1:] = q_lens.cumsum(0)
        seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device=DEVICE)
        return q, k_cache, v_cache, qsl, seq_lens, block_tables

    def attn(s: tuple[Any, ...]) -> object:
        return paged_attention(*s, scale, tokens // batch, seq_len)

    kv_read = batch * seq_len * nkv * d * 2 * size
    flops = 4 * nq * d * (tokens * seq_len if is_decode else tokens * (tokens + 1) // 2)

    def make_store() -> tuple[Any, ...]:
        num_blocks = math.ceil(tokens / page)
        k, v = (_randn(tokens, nkv, d, dtype=dtype) for _ in range(2))
        caches = [_randn(num_blocks, page, nkv, d, dtype=dtype) for _ in range(2)]
        return k, v, caches[0], caches[1], torch.arange(tokens, dtype=torch.int64, device=DEVICE)

    mode = "decode" if is_decode else "prefill"
    note = f"{batch} seq x {seq_len} ctx, page {page}"
    return [
        Case("store_kv", "-", make_store, lambda s: store_kv(*s), 4 * tokens * nkv * d * size),
        Case("paged_attention", mode, make_attn, attn, kv_read + 2 * tokens * nq * d * size, flops, note),
    ]


def _gdn_inputs(m: ModelShapes, tokens: int, num_seqs: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """q, k, v (views of one conv output, as served), a, b [tokens, ...] and num_seqs fp32 states."""
    hk, hv, dk, dv = m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim
    mixed = _randn(tokens, 2 * hk * dk + hv * dv, dtype=dtype)
    q = mixed[:, : hk * dk].view(tokens, hk, dk)
    k = mixed[:, hk * dk : 2 * hk * dk].view(tokens, hk, dk)
    v = mixed[:, 2 * hk * dk :].view(tokens, hv, dv)
    a, b = _randn(tokens, hv, dtype=dtype), _randn(tokens, hv, dtype=dtype)
    return q, k, v, a, b, _randn(num_seqs, hv, dk, dv, dtype=torch.float32, scale=0.1)


def _gdn_cases(m: ModelShapes, tokens: int, dtype: torch.dtype, is_decode: bool) -> list[Case]:
    from deltaserve.kernels import causal_conv1d_prefill, causal_conv1d_update, gdn_decode, gdn_prefill

    size = dtype.itemsize
    channels, width = m.conv_dim, m.conv_kernel
    hk, hv, dk, dv = m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim
    conv_w = _randn(channels, width, dtype=dtype, scale=0.5)
    A_log = torch.log(torch.empty(hv, device=DEVICE).uniform_(1, 16))
    dt_bias = _randn(hv, dtype=torch.float32, scale=0.5)
    num_seqs = tokens if is_decode else 1
    state_bytes = num_seqs * hv * dk * dv * 4

    def make_conv() -> tuple[Any, ...]:
        x = _randn(tokens, channels, dtype=dtype)
        states = _randn(num_seqs, width - 1, channels, dtype=dtype)
        slots = torch.arange(num_seqs, dtype=torch.int32, device=DEVICE)
        qsl = torch.tensor([0, tokens], dtype=torch.int32, device=DEVICE)
        return x, states, slots, qsl, torch.ones(num_seqs, dtype=torch.bool, device=DEVICE)

    def conv(s: tuple[Any, ...]) -> object:
        if is_decode:
            return causal_conv1d_update(s[0], conv_w, s[1], s[2])
        return causal_conv1d_prefill(s[0], conv_w, s[1], s[3], s[2], s[4])

    def make_gdn() -> tuple[Any, ...]:
        q, k, v, a, b, states = _gdn_inputs(m, tokens, num_seqs, dtype)
        slots = torch.arange(num_seqs, dtype=torch.int32, device=DEVICE)
        qsl = torch.tensor([0, tokens], dtype=torch.int32, device=DEVICE)
        return q, k, v, a, b, states, slots, qsl, torch.ones(num_seqs, dtype=torch.bool, device=DEVICE)

    def gdn(s: tuple[Any, ...]) -> object:
        q, k, v, a, b, states, slots, qsl, has_init = s
        if is_decode:
            return gdn_decode(q, k, v, a, b, A_log, dt_bias, states, slots)
        return gdn_prefill(q, k, v, a, b, A_log, dt_bias, states, qsl, slots, has_init)

    mode = "decode" if is_decode else "prefill"
    conv_bytes = 2 * tokens * channels * size + 2 * num_seqs * (width - 1) * channels * size
    gdn_bytes = tokens * (2 * hk * dk + 2 * hv * dv + 2 * hv) * size + 2 * state_bytes
    gdn_flops = 8 * tokens * hv * dk * dv  # decay, Sᵀk, rank-1 update, Sᵀq (recurrent form)
    return [
        Case("causal_conv1d", mode, make_conv, conv, conv_bytes),
        Case(
            "gdn",
            mode,
            make_gdn,
            gdn,
            gdn_bytes,
            gdn_flops,
            f"{num_seqs} seq, fp32 state" + ", chunked" * (not is_decode),
        ),
    ]


VERIFY_WIDTH = 4  # 1 + k tokens a verify chunk at k = 3, issue 41's grids


def _verify_cases(m: ModelShapes, tokens: int, dtype: torch.dtype, is_decode: bool) -> list[Case]:
    """The speculative verify step's conv at decode token counts: `tokens` sequences of 1 + k = 4 tokens each."""
    if not is_decode:
        return []
    from deltaserve.kernels import causal_conv1d_verify

    size = dtype.itemsize
    channels, width, num_seqs = m.conv_dim, m.conv_kernel, tokens
    rows = num_seqs * VERIFY_WIDTH
    conv_w = _randn(channels, width, dtype=dtype, scale=0.5)
    index = torch.arange(rows, device=DEVICE).view(num_seqs, VERIFY_WIDTH)
    slots = torch.arange(num_seqs, dtype=torch.int32, device=DEVICE)

    def make() -> tuple[Any, ...]:
        scratch = torch.empty(num_seqs, VERIFY_WIDTH, width - 1, channels, dtype=dtype, device=DEVICE)
        return _randn(rows, channels, dtype=dtype), _randn(num_seqs, width - 1, channels, dtype=dtype), scratch

    def call(s: tuple[Any, ...]) -> object:
        return causal_conv1d_verify(s[0], conv_w, s[1], slots, index, s[2])

    # x read and y written, the slot's rows read, a window written after every token
    moved = (2 * rows * channels + num_seqs * (width - 1) * channels + rows * (width - 1) * channels) * size
    return [
        Case("gdn_verify_conv", "verify", make, call, moved, note=f"{num_seqs} seq x {VERIFY_WIDTH} tokens"),
        *_verify_gdn_cases(m, num_seqs, dtype),
    ]


def _verify_gdn_cases(m: ModelShapes, num_seqs: int, dtype: torch.dtype) -> list[Case]:
    """The verify step's delta rule (reads the live state, stores each token's k, v, a, b) and its commit (one layer:
    the conv window copied, all 1 + k tokens replayed on the live state, the whole chunk accepted): num_seqs
    sequences of 1 + k = 4 tokens (docs/speculative-decoding.md#the-commit-one-launch)."""
    from deltaserve.kernels import gdn_verify, spec_state_commit_layers
    from deltaserve.kernels.gdn_spec import verify_row_width

    size = dtype.itemsize
    hk, hv, dk, dv = m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim
    channels, width = m.conv_dim, m.conv_kernel
    rows = num_seqs * VERIFY_WIDTH
    row = verify_row_width(hk, dk, hv, dv)
    A_log = torch.log(torch.empty(hv, device=DEVICE).uniform_(1, 16))
    dt_bias = _randn(hv, dtype=dtype, scale=0.5)
    index = torch.arange(rows, device=DEVICE).view(num_seqs, VERIFY_WIDTH)
    slots = torch.arange(num_seqs, dtype=torch.int32, device=DEVICE)
    accepted = torch.full((num_seqs,), VERIFY_WIDTH - 1, dtype=torch.int64, device=DEVICE)
    state_bytes = num_seqs * hv * dk * dv * 4

    def make_verify() -> tuple[Any, ...]:
        scratch_rows = torch.empty(num_seqs, VERIFY_WIDTH, row, dtype=dtype, device=DEVICE)
        return *_gdn_inputs(m, rows, num_seqs, dtype), scratch_rows

    def verify(s: tuple[Any, ...]) -> object:
        return gdn_verify(*s[:5], A_log, dt_bias, s[5], slots, index, s[6])

    def make_commit() -> tuple[Any, ...]:
        conv = _randn(1, num_seqs, width - 1, channels, dtype=dtype)
        states = _randn(1, num_seqs, hv, dk, dv, dtype=torch.float32, scale=0.1)
        scratch_conv = _randn(1, num_seqs, VERIFY_WIDTH, width - 1, channels, dtype=dtype)
        scratch_rows = _randn(1, num_seqs, VERIFY_WIDTH, row, dtype=dtype, scale=0.5)
        return conv, states, scratch_conv, scratch_rows

    def commit(s: tuple[Any, ...]) -> object:
        spec_state_commit_layers(*s, A_log[None], dt_bias[None], slots, accepted, VERIFY_WIDTH)
        return None

    # verify: q, k, v, a, b read, o written, the state read, a row stored a token
    verify_bytes = rows * (2 * hk * dk + 2 * hv * dv + 2 * hv + row) * size + state_bytes
    # commit: the state read and written, the tokens' rows read, a conv window copied
    commit_bytes = 2 * state_bytes + rows * row * size + 2 * num_seqs * (width - 1) * channels * size
    flops = 8 * rows * hv * dk * dv
    note = f"{num_seqs} seq x {VERIFY_WIDTH} tokens, fp32 state"
    return [
        Case("gdn_verify", "verify", make_verify, verify, verify_bytes, flops, note),
        Case("spec_commit", "verify", make_commit, commit, commit_bytes, flops, note + ", all accepted"),
    ]


def _moe_cases(m: ModelShapes, tokens: int, dtype: torch.dtype) -> list[Case]:
    if not m.num_experts:
        return []
    from deltaserve.kernels import fused_moe, fused_moe_block, moe_route

    hidden, inter, experts = m.hidden, m.moe_inter, m.num_experts
    w13 = _randn(experts, 2 * inter, hidden, dtype=dtype, scale=hidden**-0.5)
    w2 = _randn(experts, hidden, inter, dtype=dtype, scale=inter**-0.5)
    router = _randn(experts, hidden, dtype=dtype, scale=hidden**-0.5)
    shared = (
        _randn(2 * m.mlp_inter, hidden, dtype=dtype, scale=hidden**-0.5),
        _randn(hidden, m.mlp_inter, dtype=dtype, scale=m.mlp_inter**-0.5),
        _randn(1, hidden, dtype=dtype, scale=hidden**-0.5),
    )

    def make() -> tuple[Any, ...]:
        weights, ids = moe_route(_randn(tokens, experts, dtype=dtype), m.top_k, True)
        return _randn(tokens, hidden, dtype=dtype), weights, ids

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


def _linear_cases(m: ModelShapes, tokens: int, dtype: torch.dtype) -> list[Case]:
    """kernels.linear on the GDN input projection's shape (the register GEMV at one row, cuBLAS beyond)."""
    from deltaserve.kernels import linear

    out_features, in_features = m.conv_dim + m.num_v_heads * m.head_v_dim, m.hidden
    weight = _randn(out_features, in_features, dtype=dtype, scale=in_features**-0.5)
    size = dtype.itemsize
    moved = (out_features * in_features + tokens * (in_features + out_features)) * size
    flops = 2 * tokens * out_features * in_features
    note = f"[{out_features} x {in_features}] (in_proj_qkvz)"
    make = lambda: (_randn(tokens, in_features, dtype=dtype),)  # noqa: E731
    return [Case("linear", "-", make, lambda s: linear(s[0], weight), moved, flops, note)]


def _fp8_weight(*shape: int) -> Any:
    """A block-FP8 weight [..., N, K] (docs/fp8.md): N(0, 1) values cast to e4m3, every block scale K^-0.5."""
    from deltaserve.kernels import Fp8Weight

    weight = Fp8Weight(*shape, device=DEVICE)
    weight.weight.copy_(torch.randn(*shape, device=DEVICE).to(weight.weight.dtype))
    weight.scale.fill_(shape[-1] ** -0.5)
    return weight


def _fp8_bytes(*shape: int) -> int:
    """Bytes of a block-FP8 weight: one a value, plus an fp32 scale per 128 x 128 block."""
    lead = math.prod(shape[:-2])
    return lead * (shape[-2] * shape[-1] + 4 * math.ceil(shape[-2] / 128) * math.ceil(shape[-1] / 128))


def _fp8_cases(m: ModelShapes, tokens: int, dtype: torch.dtype) -> list[Case]:
    """Block FP8 (docs/fp8.md): kernels.linear with an Fp8Weight on the GDN input projection's shape (activation
    quantization + GEMM), and fused_moe with FP8 experts (quantization, two grouped GEMMs, the weighted sum)."""
    from deltaserve.kernels import fused_moe, linear, moe_route

    size = dtype.itemsize
    out_features, in_features = m.conv_dim + m.num_v_heads * m.head_v_dim, m.hidden
    weight = _fp8_weight(out_features, in_features)
    moved = _fp8_bytes(out_features, in_features) + tokens * (in_features + out_features) * size
    flops = 2 * tokens * out_features * in_features
    make = lambda: (_randn(tokens, in_features, dtype=dtype),)  # noqa: E731
    note = f"[{out_features} x {in_features}] e4m3 (in_proj_qkvz)"
    cases = [Case("fp8_linear", "-", make, lambda s: linear(s[0], weight), moved, flops, note)]
    if not m.num_experts:
        return cases
    hidden, inter, experts = m.hidden, m.moe_inter, m.num_experts
    w13, w2 = _fp8_weight(experts, 2 * inter, hidden), _fp8_weight(experts, hidden, inter)

    def make_moe() -> tuple[Any, ...]:
        weights, ids = moe_route(_randn(tokens, experts, dtype=dtype), m.top_k, True)
        return _randn(tokens, hidden, dtype=dtype), weights, ids

    active = int(torch.unique(make_moe()[2]).numel())
    moe_moved = active * (_fp8_bytes(2 * inter, hidden) + _fp8_bytes(hidden, inter)) + 2 * tokens * hidden * size
    moe_flops = 2 * tokens * m.top_k * 3 * inter * hidden
    moe_note = f"{active}/{experts} e4m3 experts hit, top-{m.top_k}"
    moe_call = lambda s: fused_moe(s[0], w13, w2, s[1], s[2])  # noqa: E731
    return [*cases, Case("fp8_fused_moe", "-", make_moe, moe_call, moe_moved, moe_flops, moe_note)]


def build_cases(m: ModelShapes, tokens: int, args: argparse.Namespace, dtype: torch.dtype) -> list[Case]:
    is_decode = tokens <= args.decode_up_to
    cases = [
        *_preamble_cases(m, tokens, dtype),
        *_norm_cases(m, tokens, dtype),
        *_attention_cases(m, tokens, dtype, is_decode, args.context, args.page_size),
        *_gdn_cases(m, tokens, dtype, is_decode),
        *_verify_cases(m, tokens, dtype, is_decode),
        *_moe_cases(m, tokens, dtype),
        *_linear_cases(m, tokens, dtype),
        *_fp8_cases(m, tokens, dtype),
    ]
    return [c for c in cases if c.op in args.ops]


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def event_times_ms(fn: Callable[[], object], repeats: int) -> list[float]:
    """GPU ms of each of `repeats` calls of fn (a graph replay, a pass of eager calls), between two CUDA events,
    each call waited for."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def time_case(case: Case, l2_bytes: int, replays: int) -> dict[str, Any]:
    """GPU µs per call from CUDA-graph replays over rotating input sets, plus do_bench's eager median."""
    import triton.testing

    num_sets = int(min(4096, max(1, math.ceil(3 * l2_bytes / max(case.bytes, 1)))))
    sets = [case.make() for _ in range(num_sets)]
    for s in sets[: min(3, num_sets)]:
        case.call(s)  # compiles, autotunes (never inside capture) and warms up
    torch.cuda.synchronize()
    cursor = [0]

    def eager_call() -> None:
        cursor[0] = (cursor[0] + 1) % num_sets
        case.call(sets[cursor[0]])

    eager_us = 1e3 * triton.testing.do_bench(eager_call, warmup=10, rep=50, return_mode="median")
    graph_us, note = None, case.note
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            case.call(sets[0])
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for s in sets:
                case.call(s)
        graph.replay()
        torch.cuda.synchronize()
        graph_us = _median([ms * 1e3 / num_sets for ms in event_times_ms(graph.replay, replays)])
    except Exception as exc:  # a capture failure is a finding, not a crash of the whole bench
        torch.cuda.synchronize()
        note = f"{note}; no graph: {type(exc).__name__}: {exc}".strip("; ")[:160]
    return {"graph_us": graph_us, "eager_us": eager_us, "rotations": num_sets, "note": note}


def copy_bandwidth_gbps(num_bytes: int = 2 << 30) -> float:
    """Device copy bandwidth: bytes read + written by a large D2D copy, per second (do_bench median)."""
    import triton.testing

    src = torch.empty(num_bytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * num_bytes / (ms * 1e-3) / 1e9


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default="27b,35b-a3b", help=f"comma list of {', '.join(MODELS)}")
    parser.add_argument("--tokens", default=DEFAULT_TOKENS, help="comma list of token counts per step")
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma list of {', '.join(OPS)}")
    parser.add_argument("--decode-up-to", type=int, default=64, help="token counts up to this run decode forms")
    parser.add_argument("--context", type=int, default=4096, help="cached tokens per sequence for decode attention")
    parser.add_argument("--page-size", type=int, default=64, help="KV cache block size in tokens")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--replays", type=int, default=10, help="CUDA-graph replays per measurement (median)")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON record here")
    parser.add_argument("--tp", type=int, default=1, help="time one rank's shapes of an N-way tensor-parallel engine")
    parser.add_argument("--expert-parallel", action="store_true", help="with --tp: whole experts per rank")


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print(
            "deltaserve bench kernels: no CUDA device (or TRITON_INTERPRET is set): nothing to measure. "
            "It times the Triton kernels on a GPU; on a CPU run `pytest tests/kernels` for correctness.",
            file=sys.stderr,
        )
        return 2
    import triton

    if args.tp < 1:
        print(f"deltaserve bench kernels: --tp must be at least 1, got {args.tp}", file=sys.stderr)
        return 2
    try:
        models = [
            per_rank(MODELS[name.strip().lower()], args.tp, args.expert_parallel)
            for name in args.models.split(",")
            if name.strip()
        ]
    except ValueError as exc:
        print(f"deltaserve bench kernels: {exc}", file=sys.stderr)
        return 2
    token_counts = [int(t) for t in args.tokens.split(",") if t.strip()]
    args.ops = {op.strip() for op in args.ops.split(",") if op.strip()}
    unknown = args.ops - set(OPS)
    if unknown:
        print(f"deltaserve bench kernels: unknown ops {sorted(unknown)}; choose from {', '.join(OPS)}", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    l2_bytes = int(getattr(props, "L2_cache_size", 50 << 20))
    copy_gbps = copy_bandwidth_gbps()
    torch.cuda.empty_cache()
    print(f"{props.name}: copy bandwidth {copy_gbps:.0f} GB/s (read + write), L2 {l2_bytes >> 20} MiB")
    header = f"{'model':<16} {'op':<18} {'mode':<8} {'T':>6} {'graph_us':>10} {'eager_us':>10} "
    header += f"{'MB':>9} {'GB/s':>8} {'%copy':>6} {'TFLOP/s':>8}  note"
    print(header)
    results = []
    for model in models:
        for tokens in token_counts:
            for case in build_cases(model, tokens, args, dtype):
                timing = time_case(case, l2_bytes, args.replays)
                torch.cuda.empty_cache()
                best_us = timing["graph_us"] if timing["graph_us"] is not None else timing["eager_us"]
                gbps = case.bytes / (best_us * 1e-6) / 1e9
                tflops = case.flops / (best_us * 1e-6) / 1e12 if case.flops else None
                row = {
                    "model": model.name,
                    "op": case.op,
                    "mode": case.mode,
                    "tokens": tokens,
                    "graph_us": timing["graph_us"],
                    "eager_us": timing["eager_us"],
                    "bytes": case.bytes,
                    "gbps": gbps,
                    "copy_share": gbps / copy_gbps,
                    "tflops": tflops,
                    "rotations": timing["rotations"],
                    "note": timing["note"],
                }
                results.append(row)
                print(
                    f"{model.name:<16} {case.op:<18} {case.mode:<8} {tokens:>6} {_fmt(timing['graph_us'], '10.2f')} "
                    f"{timing['eager_us']:>10.2f} {case.bytes / 1e6:>9.2f} {gbps:>8.0f} "
                    f"{100 * gbps / copy_gbps:>5.0f}% {_fmt(tflops, '8.1f')}  {timing['note']}",
                    flush=True,
                )
    record = {
        "kind": "kernel_bench",
        "gpu": props.name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "git_commit": git_state(Path(__file__).resolve().parents[2])["commit"],
        "command": shlex.join(["deltaserve", *sys.argv[1:]]) if sys.argv else "deltaserve bench kernels",
        "dtype": args.dtype,
        "tensor_parallel_size": args.tp,
        "expert_parallel": args.expert_parallel,
        "copy_bandwidth_gbps": copy_gbps,
        "l2_bytes": l2_bytes,
        "results": results,
    }
    line = json.dumps(record)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(line)
    return 0
