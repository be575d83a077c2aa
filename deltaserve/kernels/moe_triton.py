"""Triton fused MoE: routed-expert SwiGLU over tokens sorted by expert, as grouped GEMMs.

Each call takes its launch configuration from the committed tuning table (moe_configs: one config per
power-of-two token bucket, picked on the device by benchmarks/tune_moe.py; never autotuned while serving).
A bucket whose path is "decode" runs moe_decode_triton's gate/up and down+sum kernels on the given routing
(two launches, no alignment). The "grouped" path, all sized from shapes (no host sync, CUDA-graph safe):
1. Align (`align_experts`: one Triton launch up to ALIGN_DISPATCH_MAX_ENTRIES entries, three up to
   ALIGN_CHUNKED_MAX_ENTRIES, torch ops beyond; see moe_routing_triton): the T·k (token, choice) entries are
   sorted stably by expert and each expert's run is padded to a multiple of BLOCK_M, so every BLOCK_M-row
   block of `sorted_ids` belongs to one expert (`block_expert`, -1 past the end). The block count is
   bounded by cdiv(T·k, BLOCK_M) + min(E, T·k).
2. GEMM 1 + SiLU-and-mul: each block gathers its tokens' rows of x and multiplies them by the expert's gate
   and up rows of w13 (two fp32 accumulators); the epilogue rounds both (the ref's bf16 GEMM output),
   takes SiLU(gate)·up in fp32 and stores one rounded row per entry: act [T·k, I].
3. GEMM 2: act rows times the expert's w2, rounded to the input dtype per entry: y [T·k, H]. A last small
   kernel sums each token's k rows scaled by its fp32 routing weights, in fp32, and rounds once.
Routing weights stay fp32 and multiply the rounded expert output, as the ref. The three launches are plain (no
programmatic dependent launch): with it the 35B-A3B decode steps that take this path (B = 32, 64) ran 1-1.3 %
slower, while the decode path's kernels gained (docs/kernels.md#programmatic-dependent-launch).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from deltaserve.kernels import moe_configs
from deltaserve.kernels._triton import dot_precision, i64, next_pow2, silu_f32
from deltaserve.kernels.fp8 import Fp8Rows
from deltaserve.kernels.moe_align import moe_align_ref
from deltaserve.kernels.moe_configs import MoEConfig
from deltaserve.kernels.moe_routing_triton import (
    ALIGN_CHUNKED_MAX_ENTRIES,
    ALIGN_DISPATCH_MAX_ENTRIES,
    moe_align_chunked_triton,
    moe_align_triton,
)

# Token chunk per pass: bounds the act / y scratch (35B-A3B at 8192 tokens: y is 256 MiB in bf16).
CHUNK_TOKENS = 8192
# The bucket whose default config a grouped call falls back to when its own config is a decode one.
DEFAULT_GROUPED_TOKENS = 128


@triton.jit(do_not_specialize=["num_entries"])
def _moe_gemm1_kernel(
    x_ptr,
    w13_ptr,
    act_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    num_entries,
    stride_x,
    stride_w_e,
    stride_w_n,
    TOP_K: tl.constexpr,
    I: tl.constexpr,
    H: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    i_m = tl.program_id(0)
    i_n = tl.program_id(1)
    i_e = i64(tl.load(block_expert_ptr + i_m))
    if i_e < 0:
        return
    b_entry = tl.load(sorted_ids_ptr + i_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    m_m = b_entry < num_entries
    b_token = i64(b_entry // TOP_K)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] rows of the gate half; up rows are I further
    m_n = o_n < I
    o_k = tl.arange(0, BLOCK_K)
    p_x = x_ptr + b_token[:, None] * stride_x + o_k[None, :]  # [BLOCK_M, BLOCK_K]
    p_wg = w13_ptr + i_e * stride_w_e + i64(o_n)[None, :] * stride_w_n + o_k[:, None]  # [BLOCK_K, BLOCK_N]
    p_wu = p_wg + I * stride_w_n
    b_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    b_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        m_k = (k0 + o_k) < H
        b_x = tl.load(p_x, mask=m_m[:, None] & m_k[None, :], other=0.0)
        b_wg = tl.load(p_wg, mask=m_k[:, None] & m_n[None, :], other=0.0)
        b_wu = tl.load(p_wu, mask=m_k[:, None] & m_n[None, :], other=0.0)
        b_gate = tl.dot(b_x, b_wg, b_gate, input_precision=DOT_PRECISION)
        b_up = tl.dot(b_x, b_wu, b_up, input_precision=DOT_PRECISION)
        p_x += BLOCK_K
        p_wg += BLOCK_K
        p_wu += BLOCK_K
    # The ref rounds the GEMM output, then takes SiLU-and-mul in fp32 and rounds again.
    b_gate = b_gate.to(act_ptr.dtype.element_ty).to(tl.float32)
    b_up = b_up.to(act_ptr.dtype.element_ty).to(tl.float32)
    b_act = silu_f32(b_gate) * b_up
    p_act = act_ptr + i64(b_entry)[:, None] * I + o_n[None, :]
    tl.store(p_act, b_act, mask=m_m[:, None] & m_n[None, :])


@triton.jit(do_not_specialize=["num_entries"])
def _moe_gemm2_kernel(
    act_ptr,
    w2_ptr,
    y_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    num_entries,
    stride_w_e,
    stride_w_n,
    I: tl.constexpr,
    H: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    i_m = tl.program_id(0)
    i_n = tl.program_id(1)
    i_e = i64(tl.load(block_expert_ptr + i_m))
    if i_e < 0:
        return
    b_entry = i64(tl.load(sorted_ids_ptr + i_m * BLOCK_M + tl.arange(0, BLOCK_M)))  # [BLOCK_M]
    m_m = b_entry < num_entries
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output columns (hidden)
    m_n = o_n < H
    o_k = tl.arange(0, BLOCK_K)
    p_a = act_ptr + b_entry[:, None] * I + o_k[None, :]  # [BLOCK_M, BLOCK_K]
    p_w = w2_ptr + i_e * stride_w_e + i64(o_n)[None, :] * stride_w_n + o_k[:, None]  # [BLOCK_K, BLOCK_N]
    b_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        m_k = (k0 + o_k) < I
        b_a = tl.load(p_a, mask=m_m[:, None] & m_k[None, :], other=0.0)
        b_w = tl.load(p_w, mask=m_k[:, None] & m_n[None, :], other=0.0)
        b_acc = tl.dot(b_a, b_w, b_acc, input_precision=DOT_PRECISION)
        p_a += BLOCK_K
        p_w += BLOCK_K
    tl.store(y_ptr + b_entry[:, None] * H + o_n[None, :], b_acc, mask=m_m[:, None] & m_n[None, :])


@triton.jit
def _moe_sum_kernel(
    y_ptr,
    topk_weights_ptr,
    shared_ptr,
    gate_ptr,
    out_ptr,
    stride_w,
    stride_sh,
    stride_g,
    stride_o,
    TOP_K: tl.constexpr,
    H: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    i_t = i64(tl.program_id(0))
    o_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < H
    b_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        b_w = tl.load(topk_weights_ptr + i_t * stride_w + j).to(tl.float32)
        b_y = tl.load(y_ptr + (i_t * TOP_K + j) * H + o_h, mask=m_h, other=0.0).to(tl.float32)
        b_sum += b_w * b_y
    if HAS_SHARED:
        # The block's epilogue, as the ref: routed output rounded, then routed + sigmoid(gate)·shared in fp32,
        # rounded once (launched without FMA contraction, so the product is rounded before the add, as torch).
        b_routed = b_sum.to(out_ptr.dtype.element_ty).to(tl.float32)
        b_gate = tl.load(gate_ptr + i_t * stride_g).to(tl.float32)
        b_sig = 1.0 / (1.0 + tl.exp(-b_gate))
        b_shared = tl.load(shared_ptr + i_t * stride_sh + o_h, mask=m_h, other=0.0).to(tl.float32)
        b_sum = b_routed + b_sig * b_shared
    tl.store(out_ptr + i_t * stride_o + o_h, b_sum, mask=m_h)


def grouped_block_m(num_entries: int, num_experts: int) -> int:
    """The default grouped-path BLOCK_M (tables set their own): about the mean rows per expert, 16-64."""
    return moe_configs.default_config(max(1, num_entries), num_experts, 1).block_m


def align_experts(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The grouped path's alignment (all three equal moe_align_ref): one program up to ALIGN_DISPATCH_MAX_ENTRIES
    (decode buckets up to 128 tokens at top-8), the three-launch chunked kernels up to ALIGN_CHUNKED_MAX_ENTRIES
    (the larger decode buckets, and the prefill steps, eager and host-bound on the 35B-A3B shape, where the torch
    ops cost ~15 launches and ~0.4 ms of host a layer), the torch ops beyond."""
    num_entries = topk_ids.numel()
    if num_entries <= ALIGN_DISPATCH_MAX_ENTRIES:
        return moe_align_triton(topk_ids, num_experts, block_m)
    if num_entries <= ALIGN_CHUNKED_MAX_ENTRIES:
        return moe_align_chunked_triton(topk_ids, num_experts, block_m)
    return moe_align_ref(topk_ids, num_experts, block_m)


def weighted_sum_triton(
    y: torch.Tensor,
    topk_weights: torch.Tensor,
    shared: torch.Tensor | None,
    shared_gate_logits: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    """out [T, H] = the top-k rows of y [T * k, H] weighted by topk_weights [T, k] (fp32), plus, with the shared
    expert's output [T, H] and gate logits [T, 1], its sigmoid-gated output: the last launch of every grouped MoE."""
    num_tokens, hidden = out.shape
    block_h = min(1024, next_pow2(hidden))
    has_shared = shared is not None and shared_gate_logits is not None
    _moe_sum_kernel[(num_tokens, triton.cdiv(hidden, block_h))](
        y,
        topk_weights,
        shared if has_shared else out,
        shared_gate_logits if has_shared else out,
        out,
        topk_weights.stride(0),
        shared.stride(0) if has_shared else 0,
        shared_gate_logits.stride(0) if has_shared else 0,
        out.stride(0),
        TOP_K=topk_weights.shape[1],
        H=hidden,
        HAS_SHARED=has_shared,
        BLOCK_H=block_h,
        enable_fp_fusion=False,
    )


def over_token_chunks(
    chunk: Callable[..., None],
    x: torch.Tensor | Fp8Rows,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    shared: torch.Tensor | None,
    shared_gate_logits: torch.Tensor | None,
) -> torch.Tensor:
    """Runs a grouped MoE `chunk(x, topk_weights, topk_ids, out, shared, gate_logits)` over CHUNK_TOKENS-row slices
    of the tokens (its buffers stay bounded), each writing its rows of the returned out [T, H]. Fp8Rows are sliced
    with their quantization."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    for start in range(0, x.shape[0], CHUNK_TOKENS):
        rows = slice(start, min(start + CHUNK_TOKENS, x.shape[0]))
        chunk(
            x[rows],
            topk_weights[rows],
            topk_ids[rows],
            out[rows],
            None if shared is None else shared[rows],
            None if shared_gate_logits is None else shared_gate_logits[rows],
        )
    return out


def _fused_moe_chunk(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    out: torch.Tensor,
    shared: torch.Tensor | None,
    shared_gate_logits: torch.Tensor | None,
    w13: torch.Tensor,
    w2: torch.Tensor,
    config: MoEConfig,
) -> None:
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    num_entries = num_tokens * top_k
    block_m = config.block_m
    sorted_ids, block_expert = align_experts(topk_ids, num_experts, block_m)
    num_blocks = block_expert.shape[0]
    act = torch.empty(num_entries, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(num_entries, hidden, dtype=x.dtype, device=x.device)
    precision = dot_precision(x.dtype)
    g1, g2 = config.gemm1, config.gemm2
    _moe_gemm1_kernel[(num_blocks, triton.cdiv(inter, g1.BLOCK_N))](
        x, w13, act, sorted_ids, block_expert, num_entries, x.stride(0), w13.stride(0), w13.stride(1),
        TOP_K=top_k, I=inter, H=hidden, DOT_PRECISION=precision, BLOCK_M=block_m, **g1.launch(),
    )  # fmt: skip
    _moe_gemm2_kernel[(num_blocks, triton.cdiv(hidden, g2.BLOCK_N))](
        act, w2, y, sorted_ids, block_expert, num_entries, w2.stride(0), w2.stride(1),
        I=inter, H=hidden, DOT_PRECISION=precision, BLOCK_M=block_m, **g2.launch(),
    )  # fmt: skip
    weighted_sum_triton(y, topk_weights, shared, shared_gate_logits, out)


def fused_moe_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    shared: torch.Tensor | None = None,
    shared_gate_logits: torch.Tensor | None = None,
    config: MoEConfig | None = None,
) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; topk_weights [T, k] fp32; topk_ids [T, k] -> [T, H]. With the
    shared expert's output [T, H] and its gate logits [T, 1], the sigmoid-gated sum of both, as fused_moe_ref.
    `config` overrides the tuning table's choice (the tuner's candidates; tests)."""
    assert x.stride(-1) == 1 and w13.stride(-1) == 1 and w2.stride(-1) == 1
    assert w13.dtype == x.dtype and w2.dtype == x.dtype
    assert (shared is None) == (shared_gate_logits is None), "the shared expert needs both its output and its gate"
    if shared is not None:
        assert shared.shape == x.shape and shared.stride(-1) == 1
    num_tokens, hidden = x.shape
    num_experts, inter, top_k = w13.shape[0], w13.shape[1] // 2, topk_ids.shape[1]
    if config is None:
        config = moe_configs.config_for(num_tokens, num_experts, inter, hidden, top_k, x.dtype, x.device)
    if config.path == "decode" and 0 < num_tokens <= moe_configs.DECODE_MAX_TOKENS:
        from deltaserve.kernels.moe_decode_triton import decode_gemms

        return decode_gemms(
            x, w13, w2, config.gemm1, config.gemm2, top_k=top_k, topk_weights=topk_weights, topk_ids=topk_ids,
            shared_out=shared, shared_gate_logits=shared_gate_logits,
        )  # fmt: skip
    if config.path == "decode":  # a chunk past the decode path's limit (tests force tiny chunks)
        config = moe_configs.default_config(DEFAULT_GROUPED_TOKENS, num_experts, top_k)
    return over_token_chunks(
        lambda *rows: _fused_moe_chunk(*rows, w13, w2, config), x, topk_weights, topk_ids, shared, shared_gate_logits
    )
