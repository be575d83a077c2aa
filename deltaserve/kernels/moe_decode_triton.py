"""Triton MoE block for small batches: router, routed experts and shared expert of one layer in three launches.

For T ≤ DECODE_MAX_TOKENS tokens (a decode step), with no expert alignment, no sort and no [T·k, H] buffer:

1. Router: logits = x·W_rᵀ [T, E] and the shared-expert gate logit x·w_gᵀ [T, 1] in one pass over the
   router rows (the gate row is row E), fp32 sums, stored in the model dtype (the bf16 F.linear outputs the
   ref rounds to). Up to ROUTER_GEMV_MAX_TOKENS tokens the GEMV kernel (`_moe_router_gemv_kernel`, no tensor
   cores): up to 4 tokens one program per (row pair, token); above, 8 tokens per program
   and 2-8 rows, so the 1 MB router of the 35B-A3B shape streams through ≥ 128 programs at every T, each
   weight tile loaded once per program and multiplied by all its tokens. Above, `_moe_router_kernel`
   (tl.dot tiles of 16 rows × 16 tokens; its 16-row minimum left 16-64 programs at ≤ 64 tokens, 14 µs for
   1 MB). The switch points and block shapes are the ROUTER_* module constants (router_gemv_config); their
   measurements: docs/kernels.md#moe-decode.
2. Gate/up (`_moe_decode_gemm1_kernel`): one program per (entry, column block), an entry being a (token,
   choice) pair or the shared expert. Each program first routes every token of the batch from the logits
   (softmax → top-k by repeated argmax, lowest expert id first on ties → renormalise, all fp32, as
   moe_route_triton; on max(gemm1.ROUTE_ROWS, next_pow2(T)) token rows, at most the dot tile's, mapped onto
   the dot tile's rows afterwards: ROUTE_ROWS 16, the default, is one tile for both);
   program 0 stores the routing for step 3 (above ROUTE_IN_GEMM1_MAX_TOKENS tokens the
   [tokens, E] tile no longer fits in registers, and moe_route_triton routes in a launch of its own, four
   launches in all). An entry whose expert an earlier entry
   already chose exits; the first one (the "leader") gathers every token that chose the expert as the rows of
   one tile, so each expert's w13 rows are read once per step whatever the batch. Epilogue as moe_triton:
   gate and up rounded, SiLU(gate)·up in fp32, rounded: act [T·k + T, I] (routed rows, then shared rows).
3. Down + sum (`_moe_decode_gemm2_kernel`): one program per (token, column block): for each of the token's
   k entries y = round(act·W2_eᵀ), acc += w·y in fp32 in choice order; routed = round(acc); with the shared
   expert out = round(routed + sigmoid(gate)·round(act_sh·W2_shᵀ)), else routed. No FMA contraction, so each
   product rounds before its add as in the ref. The token's k weight slices are read by its program; a slice
   two tokens share is read twice (from L2 in practice), which is why the tuning table moves larger batches
   to the grouped path. With gemm2.CHOICES_PER_PROGRAM = c > 0 (a tuned choice) step 3 is two launches
   instead: `_moe_decode_gemm2_split_kernel`, one program per (token, group of c choices or the shared
   expert, column block), writes each y_j (rounded, as above) to a [T, k (+1), H] scratch, so a program's
   serial chain is c GEMVs instead of k + 1; `_moe_decode_combine_kernel` then sums w·y in fp32 in choice
   order and adds the gated shared expert exactly as above: the same operations in the same order, so the
   same bits as the one-program kernel at the same BLOCK_N / BLOCK_K / num_warps.

Parallelism at small batches comes from narrow column blocks (split-N): at T = 1 on the 35B-A3B shape,
9 experts × 512/16 columns = 288 programs for gate/up and 2048/8 = 256 for down, two per SM on 132 SMs,
with the whole reduction in each program, so no split-K partials or second pass are needed.
Numerics equal fused_moe_ref's rounding points; the fp32 sums run in a different order (fp32-level noise).
All grids come from shapes (no host sync): CUDA-graph safe.

Block-FP8 experts (`moe_block_fp8_triton`, up to FP8_DECODE_MAX_TOKENS tokens; docs/fp8.md#decode) take the same
launches with FP8 constexprs: gate/up reads x's per-token-group quantization and walks K a group (128) at a time,
(q_x . q_w) · s_x · s_w added in fp32 per group; the split down quantizes each act row per group in registers
(fp8_triton.quantized_row_dot), so the rounding points are fused_moe_block_fp8_ref's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.kernels._triton import dot_precision, i64, next_pow2, pdl_launch, pdl_wait, silu_f32
from deltaserve.kernels.activation_triton import silu_and_mul_fp8_triton
from deltaserve.kernels.fp8 import Fp8Rows, Fp8Weight, plain, quantized
from deltaserve.kernels.fp8_triton import (
    GROUP_SIZE,
    fp8_linear_triton,
    fused_moe_fp8_triton,
    quantize_activation_triton,
    quantized_row_dot,
)
from deltaserve.kernels.moe import FP8_BLOCK_MAX_TOKENS
from deltaserve.kernels.moe_configs import DECODE_MAX_TOKENS, GemmConfig, MoEConfig
from deltaserve.kernels.moe_routing_triton import NAN_KEY, moe_route_triton

# Router launch: rows of W_r per program, reduction step, token rows per program (tl.dot needs 16).
ROUTER_BLOCK_R = 16
ROUTER_BLOCK_K = 256
ROUTER_BLOCK_T = 16
# The GEMV router (T <= ROUTER_GEMV_MAX_TOKENS; docs/kernels.md#moe-decode): up to ROUTER_GEMV_SINGLE_MAX_TOKENS
# tokens one program per (row pair, token); above, ROUTER_GEMV_BLOCK_T tokens per program, the rows per
# program the largest power of two up to ROUTER_GEMV_MAX_BLOCK_R that still launches ROUTER_GEMV_MIN_PROGRAMS
# programs at the smallest token count of the power-of-two bucket (so the variant follows the bucket alone).
# Above ROUTER_GEMV_MAX_TOKENS the tl.dot kernel (its 16-row tiles reach 128 programs from ~113 tokens on).
ROUTER_GEMV_MAX_TOKENS = 64
ROUTER_GEMV_SINGLE_MAX_TOKENS = 4
ROUTER_GEMV_BLOCK_T = 8
ROUTER_GEMV_BLOCK_R = 2
ROUTER_GEMV_MAX_BLOCK_R = 8
ROUTER_GEMV_MIN_PROGRAMS = 128
ROUTER_GEMV_VEC = 8
ROUTER_GEMV_WARPS = 4
# Up to ROUTER_GEMV_SINGLE_MAX_TOKENS tokens the GEMV router takes the whole hidden size in one K step (VEC = H /
# threads) and loads its W rows (and the gate row) before the PDL wait, as kernels.linear's GEMV does: the 1 MB router
# streams while the norm before it finishes (35B-A3B B = 1 2.52 -> 2.41 ms on the H200, docs/kernels.md#moe-decode).
# The one-step tile's limit: 2048 (the 35B-A3B hidden) at 4 warps is 16 elements, two 16-byte loads, a thread;
# deeper routers take 1024-column steps after the wait.
ROUTER_W_BEFORE_WAIT_MAX_HIDDEN = 4096
# Gate/up programs route the whole batch in registers ([tokens, E] fp32) up to this many tokens; at 32 tokens
# and E = 256 that tile took every register (and spilled at 64, benchmarks/kernel_resources.py), so larger
# decode batches route in moe_route_triton's own launch first.
ROUTE_IN_GEMM1_MAX_TOKENS = 16
# The combine launch of the choice-split down GEMM (gemm2 with CHOICES_PER_PROGRAM): output columns per program
# and warps. It moves
# T·(k+1)·H·2 + T·H·2 bytes (45 KB at T = 1), so its cost is the launch; 128 columns give 16 programs a token.
COMBINE_BLOCK_N = 128
COMBINE_WARPS = 4


@triton.jit(do_not_specialize=["num_tokens"])
def _moe_router_kernel(
    x_ptr,
    w_ptr,
    gate_w_ptr,
    logits_ptr,
    num_tokens,
    stride_x,
    stride_w,
    stride_l,
    E: tl.constexpr,
    H: tl.constexpr,
    HAS_GATE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)
    i_r = tl.program_id(0)
    i_tb = tl.program_id(1)
    o_t = i_tb * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    m_t = o_t < num_tokens
    o_r = i_r * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R] router rows (experts)
    m_r = o_r < E
    o_k = tl.arange(0, BLOCK_K)
    p_x = x_ptr + i64(o_t)[:, None] * stride_x + o_k[None, :]  # [BLOCK_T, BLOCK_K]
    p_w = w_ptr + i64(o_r)[None, :] * stride_w + o_k[:, None]  # [BLOCK_K, BLOCK_R]
    b_acc = tl.zeros([BLOCK_T, BLOCK_R], dtype=tl.float32)
    b_gate = tl.zeros([BLOCK_T], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        m_k = (k0 + o_k) < H
        b_x = tl.load(p_x, mask=m_t[:, None] & m_k[None, :], other=0.0)
        b_w = tl.load(p_w, mask=m_k[:, None] & m_r[None, :], other=0.0)
        b_acc = tl.dot(b_x, b_w, b_acc, input_precision=DOT_PRECISION)
        if HAS_GATE:
            # Every row block computes the gate logit (a 4 KiB L2-resident row); row block 0 stores it.
            b_g = tl.load(gate_w_ptr + k0 + o_k, mask=m_k, other=0.0).to(tl.float32)  # [BLOCK_K]
            b_gate += tl.sum(b_x.to(tl.float32) * b_g[None, :], axis=1)
        p_x += BLOCK_K
        p_w += BLOCK_K
    p_l = logits_ptr + i64(o_t)[:, None] * stride_l + o_r[None, :]
    tl.store(p_l, b_acc, mask=m_t[:, None] & m_r[None, :])
    if HAS_GATE:
        tl.store(logits_ptr + i64(o_t) * stride_l + E, b_gate, mask=m_t & (i_r == 0))


@triton.jit(do_not_specialize=["num_tokens"])
def _moe_router_gemv_kernel(
    x_ptr,
    w_ptr,
    gate_w_ptr,
    logits_ptr,
    num_tokens,
    stride_x,
    stride_w,
    stride_l,
    E: tl.constexpr,
    H: tl.constexpr,
    HAS_GATE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    VEC: tl.constexpr,
    USE_PDL: tl.constexpr = False,
    W_BEFORE_WAIT: tl.constexpr = False,
):
    """BLOCK_T tokens' logits for BLOCK_R rows: rows < E of W_r, row E the shared-expert gate (HAS_GATE). Each
    weight tile is loaded once and multiplied by every token of the block (x rows come from L2).
    W_BEFORE_WAIT (the launcher sets it only when BLOCK_K covers H, one K step): the weight tile is loaded
    before the PDL wait (weights never depend on the launch before), x after.

    x and W tiles are loaded as [BLOCK_T, 1, BLOCK_K] and [1, BLOCK_R, BLOCK_K] with BLOCK_K = VEC lanes per
    thread times every thread, so both land in the same layout (no shared-memory conversion) and each thread
    multiplies its own VEC columns of every (token, row) pair; the VEC products are summed in the thread, the
    partial sums across threads once at the end."""
    i_r = tl.program_id(0)
    i_tb = tl.program_id(1)
    o_t = i_tb * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T] tokens
    m_t = o_t < num_tokens
    o_r = i_r * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R] rows: experts, then the gate
    o_k = tl.arange(0, BLOCK_K)[None, None, :]  # [1, 1, BLOCK_K]
    p_x = x_ptr + i64(o_t)[:, None, None] * stride_x + o_k  # [BLOCK_T, 1, BLOCK_K]
    p_w = w_ptr + i64(o_r)[None, :, None] * stride_w + o_k  # [1, BLOCK_R, BLOCK_K]
    if W_BEFORE_WAIT:  # one K step: the whole weight tile ahead of the wait
        b_w0 = _router_w_tile(p_w, gate_w_ptr, o_r, o_k, 0, E, H, HAS_GATE)
    pdl_wait(USE_PDL)
    b_acc = tl.zeros([BLOCK_T, BLOCK_R, BLOCK_K // VEC], dtype=tl.float32)
    # Unrolled so that the loads of later steps are issued before the products of earlier ones.
    for k0 in tl.static_range(0, H, BLOCK_K):
        m_k = (k0 + o_k) < H
        if W_BEFORE_WAIT:
            b_w = b_w0
        else:
            b_w = _router_w_tile(p_w, gate_w_ptr, o_r, o_k, k0, E, H, HAS_GATE)
        b_x = tl.load(p_x + k0, mask=m_t[:, None, None] & m_k, other=0.0).to(tl.float32)
        b_prod = tl.reshape(b_x * b_w, [BLOCK_T, BLOCK_R, BLOCK_K // VEC, VEC])
        b_acc += tl.sum(b_prod, axis=3)
    b_l = tl.sum(b_acc, axis=2)  # [BLOCK_T, BLOCK_R] fp32
    num_rows = E + 1 if HAS_GATE else E
    p_l = logits_ptr + i64(o_t)[:, None] * stride_l + o_r[None, :]
    tl.store(p_l, b_l, mask=m_t[:, None] & (o_r < num_rows)[None, :])


@triton.jit
def _router_w_tile(p_w, gate_w_ptr, o_r, o_k, k0, E: tl.constexpr, H: tl.constexpr, HAS_GATE: tl.constexpr):
    """The router GEMV's [1, BLOCK_R, BLOCK_K] weight tile at K offset k0, fp32: rows < E of W_r and, with HAS_GATE,
    the gate row as row E (a 4 KiB row beside W_r, loaded only by the lane whose row is E; others masked)."""
    m_w = o_r < E
    m_k = (k0 + o_k) < H
    b_w = tl.load(p_w + k0, mask=m_w[None, :, None] & m_k, other=0.0).to(tl.float32)
    if HAS_GATE:
        p_g = gate_w_ptr + k0 + o_k + 0 * o_r[None, :, None]
        b_w += tl.load(p_g, mask=(o_r == E)[None, :, None] & m_k, other=0.0).to(tl.float32)
    return b_w


@triton.jit
def _route_tile(
    logits_ptr,
    stride_l,
    o_t,
    m_t,
    E: tl.constexpr,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_KK: tl.constexpr,
):
    """Routing of a tile of tokens: (ids [BLOCK_T, BLOCK_KK] int32, weights fp32), as moe_route_triton."""
    o_e = tl.arange(0, BLOCK_E)
    m_e = o_e < E
    o_j = tl.arange(0, BLOCK_KK)
    p_l = logits_ptr + i64(o_t)[:, None] * stride_l + o_e[None, :]
    b_l = tl.load(p_l, mask=m_t[:, None] & m_e[None, :], other=-float("inf")).to(tl.float32)  # [BLOCK_T, BLOCK_E]
    b_max = tl.max(b_l, axis=1)
    b_max = tl.where(b_max == -float("inf"), 0.0, b_max)  # rows past the batch: all -inf
    b_p = tl.exp(b_l - b_max[:, None])
    b_sum = tl.sum(b_p, axis=1)
    b_p = b_p / tl.where(b_sum == 0.0, 1.0, b_sum)[:, None]
    b_p = tl.where(m_e[None, :], b_p, -1.0)  # padding experts never win
    b_p = tl.where(b_p != b_p, NAN_KEY, b_p)  # NaN first and ids in [0, E), as moe_route_triton
    b_ids = tl.zeros([BLOCK_T, BLOCK_KK], dtype=tl.int32)
    b_w = tl.zeros([BLOCK_T, BLOCK_KK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        p_max = tl.max(b_p, axis=1)  # [BLOCK_T]
        i_max = tl.min(tl.where(b_p == p_max[:, None], o_e[None, :], BLOCK_E), axis=1)  # lowest id among ties
        b_ids = tl.where(o_j[None, :] == j, i_max[:, None], b_ids)
        b_w = tl.where(o_j[None, :] == j, tl.where(p_max == NAN_KEY, float("nan"), p_max)[:, None], b_w)
        b_p = tl.where(o_e[None, :] == i_max[:, None], -1.0, b_p)
    if RENORMALIZE:
        b_norm = tl.sum(tl.where(o_j[None, :] < TOP_K, b_w, 0.0), axis=1)
        b_w = b_w / tl.where(b_norm == 0.0, 1.0, b_norm)[:, None]
    return b_ids, b_w


@triton.jit
def _gate_up_tile(
    x_ptr,
    p_w_base,
    act_ptr,
    stride_x,
    stride_n,
    n_limit,
    i_n,
    o_t,
    m_row,
    o_row,
    I_MAX: tl.constexpr,
    H: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One gate/up program's GEMMs and epilogue: rows o_t [BLOCK_T] of x (m_row: those that take part) times the
    BLOCK_N gate rows of column block i_n (and the up rows n_limit further) of the weights at p_w_base; act rows
    o_row get SiLU(round(gate))·round(up), rounded."""
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] gate rows; the up rows are n_limit further
    m_n = o_n < n_limit
    o_k = tl.arange(0, BLOCK_K)
    p_x = x_ptr + i64(o_t)[:, None] * stride_x + o_k[None, :]  # [BLOCK_T, BLOCK_K]
    p_wg = p_w_base + i64(o_n)[None, :] * stride_n + o_k[:, None]  # [BLOCK_K, BLOCK_N]
    p_wu = p_wg + i64(n_limit) * stride_n
    b_gate = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    b_up = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        m_k = (k0 + o_k) < H
        b_x = tl.load(p_x, mask=m_row[:, None] & m_k[None, :], other=0.0)
        b_wg = tl.load(p_wg, mask=m_k[:, None] & m_n[None, :], other=0.0)
        b_wu = tl.load(p_wu, mask=m_k[:, None] & m_n[None, :], other=0.0)
        b_gate = tl.dot(b_x, b_wg, b_gate, input_precision=DOT_PRECISION)
        b_up = tl.dot(b_x, b_wu, b_up, input_precision=DOT_PRECISION)
        p_x += BLOCK_K
        p_wg += BLOCK_K
        p_wu += BLOCK_K
    _gate_up_store(b_gate, b_up, act_ptr, o_row, m_row, o_n, m_n, I_MAX)


@triton.jit
def _gate_up_store(b_gate, b_up, act_ptr, o_row, m_row, o_n, m_n, I_MAX: tl.constexpr):
    """As the grouped GEMM's epilogue (the ref): the GEMM outputs [BLOCK_T, BLOCK_N] rounded, SiLU-and-mul in
    fp32, rounded again into act rows o_row."""
    b_gate = b_gate.to(act_ptr.dtype.element_ty).to(tl.float32)
    b_up = b_up.to(act_ptr.dtype.element_ty).to(tl.float32)
    b_act = silu_f32(b_gate) * b_up
    p_act = act_ptr + i64(o_row)[:, None] * I_MAX + o_n[None, :]
    tl.store(p_act, b_act, mask=m_row[:, None] & m_n[None, :])


@triton.jit
def _gate_up_fp8_tile(
    q_ptr,
    sx_ptr,
    p_w_base,
    p_s_base,
    act_ptr,
    stride_q,
    stride_sx,
    stride_n,
    stride_s_n,
    scale_rows,
    n_limit,
    i_n,
    o_t,
    m_row,
    o_row,
    I_MAX: tl.constexpr,
    H: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """_gate_up_tile with block-FP8 weights: rows o_t of the quantized x (q e4m3 [T, H], its per-group scales
    sx [T, ceil(H/128)]) times the BLOCK_N gate rows of column block i_n (and the up rows n_limit further) of the
    e4m3 weights at p_w_base, whose block scales start at p_s_base (row r's scale row r // scale_rows). Per group
    of 128 columns, as the FP8 GEMMs (kernels/fp8_triton.py): acc += (q_x . q_w) · s_x · s_w in fp32; then
    _gate_up_tile's epilogue."""
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] gate rows; the up rows are n_limit further
    m_n = o_n < n_limit
    o_k = tl.arange(0, GROUP_SIZE)
    p_x = q_ptr + i64(o_t)[:, None] * stride_q + o_k[None, :]  # [BLOCK_T, 128]
    p_wg = p_w_base + i64(o_n)[None, :] * stride_n + o_k[:, None]  # [128, BLOCK_N]
    p_wu = p_wg + i64(n_limit) * stride_n
    p_sg = p_s_base + i64(o_n // scale_rows) * stride_s_n  # [BLOCK_N]
    p_su = p_s_base + i64((n_limit + o_n) // scale_rows) * stride_s_n
    p_sx = sx_ptr + i64(o_t) * stride_sx  # [BLOCK_T]
    b_gate = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    b_up = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    for g in range(0, tl.cdiv(H, GROUP_SIZE)):
        m_k = (g * GROUP_SIZE + o_k) < H
        b_x = tl.load(p_x + g * GROUP_SIZE, mask=m_row[:, None] & m_k[None, :], other=0.0)
        b_sx = tl.load(p_sx + g, mask=m_row, other=0.0)[:, None]
        b_wg = tl.load(p_wg + g * GROUP_SIZE, mask=m_k[:, None] & m_n[None, :], other=0.0)
        b_wu = tl.load(p_wu + g * GROUP_SIZE, mask=m_k[:, None] & m_n[None, :], other=0.0)
        b_gate += tl.dot(b_x, b_wg) * b_sx * tl.load(p_sg + g, mask=m_n, other=0.0)[None, :]
        b_up += tl.dot(b_x, b_wu) * b_sx * tl.load(p_su + g, mask=m_n, other=0.0)[None, :]
    _gate_up_store(b_gate, b_up, act_ptr, o_row, m_row, o_n, m_n, I_MAX)


@triton.jit(do_not_specialize=["num_tokens"])
def _moe_decode_gemm1_kernel(
    x_ptr,
    w13_ptr,
    shared_w13_ptr,
    logits_ptr,
    ids_ptr,
    weights_ptr,
    act_ptr,
    num_tokens,
    stride_x,
    stride_w_e,
    stride_w_n,
    stride_sw_n,
    stride_l,
    stride_ids,
    sx_ptr,  # FP8 only (else any tensor): x's per-group scales; x_ptr is then its e4m3 quantization
    s13_ptr,  # FP8 only: the block scales of w13 and of the shared expert's [gate | up] rows
    shared_s13_ptr,
    stride_sx,
    stride_s_e,
    stride_s_n,
    stride_ssh_n,
    E: tl.constexpr,
    TOP_K: tl.constexpr,
    I: tl.constexpr,
    I_SH: tl.constexpr,
    I_MAX: tl.constexpr,
    H: tl.constexpr,
    ROUTE: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_TR: tl.constexpr,
    BLOCK_KK: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,
    FP8: tl.constexpr = False,  # block-FP8 weights (BLOCK_K is then the group, 128)
    SCALE_ROWS: tl.constexpr = 1,  # the routed and the shared weights' block_n (FP8)
    SH_SCALE_ROWS: tl.constexpr = 1,
):
    i_p = tl.program_id(0)  # entry (token, choice) in flat order; i_p == T·k is the shared expert
    i_n = tl.program_id(1)
    num_entries = num_tokens * TOP_K
    o_t = tl.arange(0, BLOCK_T)
    m_t = o_t < num_tokens
    pdl_wait(USE_PDL)
    # The routing runs on BLOCK_TR token rows, the dot tile has BLOCK_T ≥ 16 (tl.dot's minimum): at T = 1 a
    # 16-row routing tile did 16 times the softmax and top-k work the batch needs.
    o_r = tl.arange(0, BLOCK_TR)  # [BLOCK_TR]
    m_r = o_r < num_tokens
    o_j = tl.arange(0, BLOCK_KK)
    m_rj = m_r[:, None] & (o_j < TOP_K)[None, :]  # [BLOCK_TR, BLOCK_KK]
    if ROUTE:
        b_ids, b_w = _route_tile(logits_ptr, stride_l, o_r, m_r, E, TOP_K, RENORMALIZE, BLOCK_TR, BLOCK_E, BLOCK_KK)
        if (i_p == 0) & (i_n == 0):
            p_route = o_r[:, None] * stride_ids + o_j[None, :]
            tl.store(ids_ptr + p_route, b_ids, mask=m_rj)
            tl.store(weights_ptr + p_route, b_w, mask=m_rj)
    else:
        b_ids = tl.load(ids_ptr + o_r[:, None] * stride_ids + o_j[None, :], mask=m_rj, other=-1).to(tl.int32)
    is_shared = i_p >= num_entries
    i_tok = i_p // TOP_K
    i_choice = i_p % TOP_K
    i_e = tl.sum(tl.sum(tl.where((o_r[:, None] == i_tok) & (o_j[None, :] == i_choice), b_ids, 0), axis=1), axis=0)
    b_hit = (b_ids == i_e) & m_rj  # [BLOCK_TR, BLOCK_KK]: which tokens chose this entry's expert, at which choice
    b_flat = o_r[:, None] * TOP_K + o_j[None, :]
    num_earlier = tl.sum(tl.sum((b_hit & (b_flat < i_p)).to(tl.int32), axis=1), axis=0)
    n_limit = tl.where(is_shared, I_SH, I)
    # Only the first entry of each expert (and the shared program) computes; column blocks past its width exit.
    if ((num_earlier > 0) & (i_p < num_entries)) | (i_n * BLOCK_N >= n_limit):
        return
    if is_shared:
        p_w_base = shared_w13_ptr
        stride_n = stride_sw_n
        if FP8:
            p_s_base = shared_s13_ptr
            stride_s = stride_ssh_n
    else:
        p_w_base = w13_ptr + i64(i_e) * stride_w_e
        stride_n = stride_w_n
        if FP8:
            p_s_base = s13_ptr + i64(i_e) * stride_s_e
            stride_s = stride_s_n
    b_used = tl.max(b_hit.to(tl.int32), axis=1)  # [BLOCK_TR] 1 where the token chose the expert
    o_row_r = o_r * TOP_K + tl.sum(tl.where(b_hit, o_j[None, :], 0), axis=1)  # [BLOCK_TR] its act row
    if BLOCK_TR == BLOCK_T:
        m_used = b_used > 0
        o_row_t = o_row_r
    else:  # the routing rows onto the dot tile's (rows past BLOCK_TR are past the batch)
        b_sel = o_t[:, None] == o_r[None, :]  # [BLOCK_T, BLOCK_TR]
        m_used = tl.max(tl.where(b_sel, b_used[None, :], 0), axis=1) > 0
        o_row_t = tl.sum(tl.where(b_sel, o_row_r[None, :], 0), axis=1)
    m_row = tl.where(is_shared, m_t, m_used)  # [BLOCK_T]
    o_row = tl.where(is_shared, num_entries + o_t, o_row_t)  # act row of each token
    if FP8:
        scale_rows = tl.where(is_shared, SH_SCALE_ROWS, SCALE_ROWS)
        _gate_up_fp8_tile(x_ptr, sx_ptr, p_w_base, p_s_base, act_ptr, stride_x, stride_sx, stride_n, stride_s,
                          scale_rows, n_limit, i_n, o_t, m_row, o_row, I_MAX, H, BLOCK_T, BLOCK_N)  # fmt: skip
    else:
        _gate_up_tile(x_ptr, p_w_base, act_ptr, stride_x, stride_n, n_limit, i_n, o_t, m_row, o_row, I_MAX, H,
                      DOT_PRECISION, BLOCK_T, BLOCK_N, BLOCK_K)  # fmt: skip


@triton.jit
def _gemv(a_ptr, w_ptr, o_n, m_n, stride_n, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Σ_k a[k]·w[n, k] for the BLOCK_N rows o_n of w: [BLOCK_N] fp32 (one activation row, no tensor cores)."""
    b_acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < K
        b_a = tl.load(a_ptr + o_k, mask=m_k, other=0.0).to(tl.float32)  # [BLOCK_K]
        b_w = tl.load(w_ptr + i64(o_n)[:, None] * stride_n + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0)
        b_acc += b_w.to(tl.float32) * b_a[None, :]
    return tl.sum(b_acc, axis=1)


@triton.jit(do_not_specialize=["num_tokens"])
def _moe_decode_gemm2_kernel(
    act_ptr,
    w2_ptr,
    shared_w2_ptr,
    ids_ptr,
    weights_ptr,
    shared_ptr,
    gate_ptr,
    out_ptr,
    num_tokens,
    stride_w_e,
    stride_w_n,
    stride_sw_n,
    stride_ids,
    stride_wt,
    stride_sh,
    stride_g,
    stride_o,
    TOP_K: tl.constexpr,
    I: tl.constexpr,
    I_SH: tl.constexpr,
    I_MAX: tl.constexpr,
    H: tl.constexpr,
    SHARED_MODE: tl.constexpr,  # 0: none; 1: shared output given [T, H]; 2: shared act rows in act, W2_sh given
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)
    i_t = i64(tl.program_id(0))
    i_n = tl.program_id(1)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output columns (hidden)
    m_n = o_n < H
    out_ty = out_ptr.dtype.element_ty
    b_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        i_e = i64(tl.load(ids_ptr + i_t * stride_ids + j))
        b_wt = tl.load(weights_ptr + i_t * stride_wt + j).to(tl.float32)
        p_a = act_ptr + (i_t * TOP_K + j) * I_MAX
        b_y = _gemv(p_a, w2_ptr + i_e * stride_w_e, o_n, m_n, stride_w_n, I, BLOCK_N, BLOCK_K)
        b_acc += b_wt * b_y.to(out_ty).to(tl.float32)
    if SHARED_MODE != 0:
        b_routed = b_acc.to(out_ty).to(tl.float32)
        if SHARED_MODE == 1:
            b_shared = tl.load(shared_ptr + i_t * stride_sh + o_n, mask=m_n, other=0.0).to(tl.float32)
        else:
            p_a = act_ptr + (num_tokens * TOP_K + i_t) * I_MAX
            b_shared = _gemv(p_a, shared_w2_ptr, o_n, m_n, stride_sw_n, I_SH, BLOCK_N, BLOCK_K)
            b_shared = b_shared.to(out_ty).to(tl.float32)
        b_gate = tl.load(gate_ptr + i_t * stride_g).to(tl.float32)
        b_acc = b_routed + b_shared / (1.0 + tl.exp(-b_gate))
    tl.store(out_ptr + i_t * stride_o + o_n, b_acc, mask=m_n)


@triton.jit(do_not_specialize=["num_tokens"])
def _moe_decode_gemm2_split_kernel(
    act_ptr,
    w2_ptr,
    shared_w2_ptr,
    ids_ptr,
    y_ptr,
    num_tokens,
    stride_w_e,
    stride_w_n,
    stride_sw_n,
    stride_ids,
    s2_ptr,  # FP8 only (else any tensor): the block scales of w2 and of the shared expert's down rows
    shared_s2_ptr,
    stride_s_e,
    stride_s_n,
    stride_ssh_n,
    TOP_K: tl.constexpr,
    I: tl.constexpr,
    I_SH: tl.constexpr,
    I_MAX: tl.constexpr,
    H: tl.constexpr,
    NUM_SLOTS: tl.constexpr,  # y rows per token: TOP_K, plus the shared expert's when it is computed here
    CHOICES_PER_PROGRAM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,
    FP8: tl.constexpr = False,  # block-FP8 weights: each act row quantized here (quantized_row_dot)
    SCALE_ROWS: tl.constexpr = 1,
    SH_SCALE_ROWS: tl.constexpr = 1,
):
    """The down GEMM split over the choices: program (token, group, column block) writes y_j =
    round(act_j·W2_eᵀ) [BLOCK_N] for the CHOICES_PER_PROGRAM choices of its group into y [T, NUM_SLOTS, H]; the
    group past the last routed one (launched when NUM_SLOTS > TOP_K) writes round(act_sh·W2_shᵀ) into slot
    TOP_K. The same GEMV (same blocks, no FMA) as _moe_decode_gemm2_kernel, so y_j is bit-for-bit its b_y."""
    pdl_wait(USE_PDL)
    i_t = i64(tl.program_id(0))
    i_g = tl.program_id(1)
    i_n = tl.program_id(2)
    num_groups: tl.constexpr = (TOP_K + CHOICES_PER_PROGRAM - 1) // CHOICES_PER_PROGRAM
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output columns (hidden)
    m_n = o_n < H
    y_ty = y_ptr.dtype.element_ty
    p_y = y_ptr + i_t * NUM_SLOTS * H + o_n  # [BLOCK_N] slot 0 of the token
    if i_g < num_groups:
        for jj in tl.static_range(CHOICES_PER_PROGRAM):
            j = i_g * CHOICES_PER_PROGRAM + jj
            if j < TOP_K:  # the last group of a k that CHOICES_PER_PROGRAM does not divide is partial
                i_e = i64(tl.load(ids_ptr + i_t * stride_ids + j))
                p_a = act_ptr + (i_t * TOP_K + j) * I_MAX
                if FP8:
                    b_y = quantized_row_dot(p_a, w2_ptr + i_e * stride_w_e, s2_ptr + i_e * stride_s_e, o_n, m_n,
                                            stride_w_n, stride_s_n, I, SCALE_ROWS, BLOCK_N)  # fmt: skip
                else:
                    b_y = _gemv(p_a, w2_ptr + i_e * stride_w_e, o_n, m_n, stride_w_n, I, BLOCK_N, BLOCK_K)
                tl.store(p_y + j * H, b_y.to(y_ty), mask=m_n)
    else:
        p_a = act_ptr + (num_tokens * TOP_K + i_t) * I_MAX
        if FP8:
            b_sh = quantized_row_dot(p_a, shared_w2_ptr, shared_s2_ptr, o_n, m_n, stride_sw_n, stride_ssh_n, I_SH,
                                     SH_SCALE_ROWS, BLOCK_N)  # fmt: skip
        else:
            b_sh = _gemv(p_a, shared_w2_ptr, o_n, m_n, stride_sw_n, I_SH, BLOCK_N, BLOCK_K)
        tl.store(p_y + TOP_K * H, b_sh.to(y_ty), mask=m_n)


@triton.jit
def _moe_decode_combine_kernel(
    y_ptr,
    weights_ptr,
    shared_ptr,
    gate_ptr,
    out_ptr,
    stride_wt,
    stride_sh,
    stride_g,
    stride_o,
    TOP_K: tl.constexpr,
    H: tl.constexpr,
    NUM_SLOTS: tl.constexpr,
    SHARED_MODE: tl.constexpr,  # as _moe_decode_gemm2_kernel's; mode 2 reads the shared output from slot TOP_K
    BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """The choice split's second launch, _moe_decode_gemm2_kernel's epilogue on the split kernel's y [T, NUM_SLOTS, H]:
    acc += w_j·y_j in fp32 in choice order (y_j already rounded), routed = round(acc), out = round(routed +
    sigmoid(gate)·shared) — the same operations in the same order, so the same bits."""
    pdl_wait(USE_PDL)
    i_t = i64(tl.program_id(0))
    i_n = tl.program_id(1)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    m_n = o_n < H
    out_ty = out_ptr.dtype.element_ty
    p_y = y_ptr + i_t * NUM_SLOTS * H + o_n
    b_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        b_wt = tl.load(weights_ptr + i_t * stride_wt + j).to(tl.float32)
        b_y = tl.load(p_y + j * H, mask=m_n, other=0.0).to(tl.float32)
        b_acc += b_wt * b_y
    if SHARED_MODE != 0:
        b_routed = b_acc.to(out_ty).to(tl.float32)
        if SHARED_MODE == 1:
            b_shared = tl.load(shared_ptr + i_t * stride_sh + o_n, mask=m_n, other=0.0).to(tl.float32)
        else:
            b_shared = tl.load(p_y + TOP_K * H, mask=m_n, other=0.0).to(tl.float32)
        b_gate = tl.load(gate_ptr + i_t * stride_g).to(tl.float32)
        b_acc = b_routed + b_shared / (1.0 + tl.exp(-b_gate))
    tl.store(out_ptr + i_t * stride_o + o_n, b_acc, mask=m_n)


def _block_t(num_tokens: int) -> int:
    """Token rows of the gate/up tile: the power-of-two bucket, at least 16 (tl.dot's minimum)."""
    return max(16, next_pow2(num_tokens))


def router_gemv_config(num_tokens: int, num_rows: int, hidden: int) -> dict[str, int]:
    """BLOCK_T / BLOCK_R / BLOCK_K of the GEMV router for num_tokens ≤ ROUTER_GEMV_MAX_TOKENS tokens and num_rows
    rows (E, plus the gate row): a function of the token count's power-of-two bucket only (module constants)."""
    if num_tokens <= ROUTER_GEMV_SINGLE_MAX_TOKENS:
        block_t, block_r = 1, ROUTER_GEMV_BLOCK_R
    else:
        block_t = ROUTER_GEMV_BLOCK_T
        # the fewest token blocks any count of this bucket launches
        min_blocks = triton.cdiv(next_pow2(num_tokens) // 2 + 1, block_t)
        block_r = ROUTER_GEMV_BLOCK_R
        while (
            block_r < ROUTER_GEMV_MAX_BLOCK_R
            and triton.cdiv(num_rows, 2 * block_r) * min_blocks >= ROUTER_GEMV_MIN_PROGRAMS
        ):
            block_r *= 2
    if router_w_before_wait(num_tokens, hidden):
        # one K step, VEC = the hidden size over the program's threads
        block_k = next_pow2(hidden)
        vec = max(1, block_k // (32 * ROUTER_GEMV_WARPS))
        return {"BLOCK_T": block_t, "BLOCK_R": block_r, "BLOCK_K": block_k, "VEC": vec, "W_BEFORE_WAIT": True}
    # VEC 16-byte columns a thread, every thread of the program along the reduction
    block_k = min(ROUTER_GEMV_VEC * 32 * ROUTER_GEMV_WARPS, next_pow2(hidden))
    return {"BLOCK_T": block_t, "BLOCK_R": block_r, "BLOCK_K": block_k, "VEC": min(ROUTER_GEMV_VEC, block_k)}


def router_w_before_wait(num_tokens: int, hidden: int) -> bool:
    """The weights load before the wait: a one-token-a-program launch and a hidden size the one-step tile holds."""
    is_single = num_tokens <= ROUTER_GEMV_SINGLE_MAX_TOKENS
    return is_single and next_pow2(hidden) <= ROUTER_W_BEFORE_WAIT_MAX_HIDDEN


def router_logits_triton(
    x: torch.Tensor, router_weight: torch.Tensor, gate_weight: torch.Tensor | None
) -> torch.Tensor:
    """x [T, H], W_r [E, H], w_g [1, H] or None -> logits [T, E (+1)] in x's dtype: the router logits and, as
    column E, the shared-expert gate logit (both as F.linear would round them). Twin: moe.router_logits_ref."""
    num_experts = router_weight.shape[0]
    logits = torch.empty(x.shape[0], num_experts + int(gate_weight is not None), dtype=x.dtype, device=x.device)
    router_logits_into(x, router_weight, gate_weight, logits)
    return logits


def router_logits_into(
    x: torch.Tensor, router_weight: torch.Tensor, gate_weight: torch.Tensor | None, logits: torch.Tensor
) -> None:
    """router_logits_triton's launches into a given logits [T, E (+1)] (row stride free, last dim contiguous):
    the GEMV kernel up to ROUTER_GEMV_MAX_TOKENS tokens, the tl.dot kernel above."""
    num_tokens, hidden = x.shape
    num_experts = router_weight.shape[0]
    has_gate = gate_weight is not None
    assert logits.shape == (num_tokens, num_experts + int(has_gate)) and logits.stride(-1) == 1
    assert x.stride(-1) == 1 and router_weight.stride(-1) == 1 and (gate_weight is None or gate_weight.stride(-1) == 1)
    if num_tokens == 0:
        return
    if num_tokens <= ROUTER_GEMV_MAX_TOKENS:
        config = router_gemv_config(num_tokens, num_experts + int(has_gate), hidden)
        grid = (triton.cdiv(num_experts + int(has_gate), config["BLOCK_R"]), triton.cdiv(num_tokens, config["BLOCK_T"]))
        _moe_router_gemv_kernel[grid](
            x,
            router_weight,
            gate_weight if has_gate else router_weight,
            logits,
            num_tokens,
            x.stride(0),
            router_weight.stride(0),
            logits.stride(0),
            E=num_experts,
            H=hidden,
            HAS_GATE=has_gate,
            **config,
            num_warps=ROUTER_GEMV_WARPS,
            **pdl_launch(x),
        )
        return
    grid = (triton.cdiv(num_experts, ROUTER_BLOCK_R), triton.cdiv(num_tokens, ROUTER_BLOCK_T))
    _moe_router_kernel[grid](
        x,
        router_weight,
        gate_weight if has_gate else router_weight,
        logits,
        num_tokens,
        x.stride(0),
        router_weight.stride(0),
        logits.stride(0),
        E=num_experts,
        H=hidden,
        HAS_GATE=has_gate,
        DOT_PRECISION=dot_precision(x.dtype),
        BLOCK_T=ROUTER_BLOCK_T,
        BLOCK_R=ROUTER_BLOCK_R,
        BLOCK_K=min(ROUTER_BLOCK_K, next_pow2(hidden)),
        num_warps=4,
        num_stages=3,
        **pdl_launch(x),
    )


def _fp8_parts(weight: torch.Tensor | Fp8Weight) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """(values, block scales or None, block_n) of a plain or block-FP8 weight."""
    if isinstance(weight, Fp8Weight):
        return weight.weight, weight.scale, weight.block_n
    return weight, None, 1


def _down_split(
    act: torch.Tensor,
    w2: torch.Tensor | Fp8Weight,
    shared_w2: torch.Tensor | Fp8Weight,
    ids: torch.Tensor,
    weights: torch.Tensor,
    shared_out: torch.Tensor | None,
    gate: torch.Tensor | None,
    out: torch.Tensor,
    gemm2: GemmConfig,
    *,
    top_k: int,
    inter: int,
    inter_sh: int,
    shared_mode: int,
) -> None:
    """Step 3 as two launches: the choice-split down GEMVs into y [T, k (+1 shared), H] in out's dtype
    (each y_j is rounded there in the one-program kernel too), then the combine into out [T, H]. Block-FP8 down
    weights (both or neither) quantize each act row in the split kernel."""
    num_tokens, hidden = out.shape
    num_slots = top_k + int(shared_mode == 2)
    num_groups = triton.cdiv(top_k, gemm2.CHOICES_PER_PROGRAM)
    y = torch.empty(num_tokens, num_slots, hidden, dtype=out.dtype, device=out.device)
    grid = (num_tokens, num_groups + int(shared_mode == 2), triton.cdiv(hidden, gemm2.BLOCK_N))
    w2, s2, rows = _fp8_parts(w2)
    shared_w2, shared_s2, sh_rows = _fp8_parts(shared_w2)
    fp8 = s2 is not None
    _moe_decode_gemm2_split_kernel[grid](
        act,
        w2,
        shared_w2,
        ids,
        y,
        num_tokens,
        w2.stride(0),
        w2.stride(1),
        shared_w2.stride(0) if shared_mode == 2 else 0,
        ids.stride(0),
        s2 if fp8 else w2,
        shared_s2 if fp8 and shared_mode == 2 else y,
        s2.stride(0) if fp8 else 0,
        s2.stride(1) if fp8 else 0,
        shared_s2.stride(0) if fp8 and shared_mode == 2 else 0,
        TOP_K=top_k,
        I=inter,
        I_SH=inter_sh,
        I_MAX=act.shape[1],
        H=hidden,
        NUM_SLOTS=num_slots,
        CHOICES_PER_PROGRAM=gemm2.CHOICES_PER_PROGRAM,
        BLOCK_N=gemm2.BLOCK_N,
        BLOCK_K=gemm2.BLOCK_K,
        num_warps=gemm2.num_warps,
        num_stages=gemm2.num_stages,
        enable_fp_fusion=False,
        FP8=fp8,
        SCALE_ROWS=rows,
        SH_SCALE_ROWS=sh_rows,
        **pdl_launch(act),
    )
    block_n = min(COMBINE_BLOCK_N, next_pow2(hidden))
    has_gate = shared_mode != 0
    _moe_decode_combine_kernel[(num_tokens, triton.cdiv(hidden, block_n))](
        y,
        weights,
        shared_out if shared_mode == 1 else out,
        gate if has_gate else out,
        out,
        weights.stride(0),
        shared_out.stride(0) if shared_mode == 1 else 0,
        gate.stride(0) if has_gate else 0,
        out.stride(0),
        TOP_K=top_k,
        H=hidden,
        NUM_SLOTS=num_slots,
        SHARED_MODE=shared_mode,
        BLOCK_N=block_n,
        num_warps=COMBINE_WARPS,
        enable_fp_fusion=False,
        **pdl_launch(y),
    )


def decode_gemms(
    x: torch.Tensor | Fp8Rows,
    w13: torch.Tensor | Fp8Weight,
    w2: torch.Tensor | Fp8Weight,
    gemm1: GemmConfig,
    gemm2: GemmConfig,
    *,
    logits: torch.Tensor | None = None,
    top_k: int,
    renormalize: bool = True,
    topk_weights: torch.Tensor | None = None,
    topk_ids: torch.Tensor | None = None,
    shared_w13: torch.Tensor | Fp8Weight | None = None,
    shared_w2: torch.Tensor | Fp8Weight | None = None,
    shared_out: torch.Tensor | None = None,
    shared_gate_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Steps 2 and 3 of the module docstring. Routing from `logits` [T, ≥E] (routed in-kernel) or from given
    topk_weights / topk_ids [T, k]; the shared expert from its weights (gate logit: logits[:, E] or
    shared_gate_logits) or from its given output shared_out [T, H]. Returns [T, H] in x's dtype.

    Block-FP8 weights (every weight given an Fp8Weight; gemm1.BLOCK_K the group, 128, and gemm2 the choice
    split): x's per-token-group quantization (the one it came with as Fp8Rows, else made here) is the gate/up
    GEMMs' input, and the down GEMMs quantize each act row themselves, so the rounding points are
    fused_moe_fp8_ref's and the shared expert's fp8_linear -> silu_and_mul -> fp8_linear."""
    fp8 = isinstance(w13, Fp8Weight)
    num_tokens, hidden = x.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    if num_tokens > DECODE_MAX_TOKENS:
        raise ValueError(f"the MoE decode path holds at most {DECODE_MAX_TOKENS} tokens, got {num_tokens}")
    route = logits is not None
    shared_mode = 2 if shared_w13 is not None else (1 if shared_out is not None else 0)
    if fp8 and not (isinstance(w2, Fp8Weight) and (shared_mode != 2 or isinstance(shared_w13, Fp8Weight))):
        raise ValueError("the MoE decode path takes block-FP8 weights for every expert GEMM or for none")
    if fp8 and (gemm1.BLOCK_K != GROUP_SIZE or not gemm2.CHOICES_PER_PROGRAM):
        raise ValueError(
            f"block-FP8 decode GEMMs need gate/up BLOCK_K {GROUP_SIZE} and the split down, got {gemm1}, {gemm2}"
        )
    inter_sh = shared_w13.shape[0] // 2 if shared_mode == 2 else inter
    inter_max = max(inter, inter_sh)
    num_entries = num_tokens * top_k
    device = x.device
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=device)
    if num_tokens == 0:
        return out
    rows, xq, sx = quantized(x, quantize_activation_triton) if fp8 else (x, x, x)  # [T, H] (e4m3), [T, G]
    num_rows = num_entries + (num_tokens if shared_mode == 2 else 0)
    act = torch.empty(num_rows, inter_max, dtype=x.dtype, device=device)
    if route:
        ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=device)
        weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    else:
        assert topk_ids is not None and topk_weights is not None
        ids, weights = topk_ids, topk_weights
    w13, s13, rows13 = _fp8_parts(w13)
    sh13, shared_s13, sh_rows13 = _fp8_parts(shared_w13 if shared_mode == 2 else w13)
    precision = dot_precision(x.dtype)
    grid1 = (num_entries + int(shared_mode == 2), triton.cdiv(inter_max, gemm1.BLOCK_N))
    _moe_decode_gemm1_kernel[grid1](
        xq,
        w13,
        sh13,
        logits if route else rows,
        ids,
        weights,
        act,
        num_tokens,
        xq.stride(0),
        w13.stride(0),
        w13.stride(1),
        sh13.stride(0) if shared_mode == 2 else 0,
        logits.stride(0) if route else 0,
        ids.stride(0),
        sx,
        s13 if fp8 else w13,
        shared_s13 if fp8 else w13,
        sx.stride(0) if fp8 else 0,
        s13.stride(0) if fp8 else 0,
        s13.stride(1) if fp8 else 0,
        shared_s13.stride(0) if fp8 and shared_mode == 2 else 0,
        E=num_experts,
        TOP_K=top_k,
        I=inter,
        I_SH=inter_sh,
        I_MAX=inter_max,
        H=hidden,
        ROUTE=route,
        RENORMALIZE=renormalize,
        DOT_PRECISION=precision,
        BLOCK_T=_block_t(num_tokens),
        BLOCK_TR=min(_block_t(num_tokens), max(gemm1.ROUTE_ROWS, next_pow2(num_tokens))),
        BLOCK_KK=next_pow2(top_k),
        BLOCK_E=next_pow2(num_experts),
        **gemm1.launch(),
        **pdl_launch(rows),
        FP8=fp8,
        SCALE_ROWS=rows13,
        SH_SCALE_ROWS=sh_rows13,
    )
    if shared_mode == 2:
        gate = logits[:, num_experts:] if route and shared_gate_logits is None else shared_gate_logits
    else:
        gate = shared_gate_logits
    has_gate = shared_mode != 0
    assert not has_gate or gate is not None, "the shared expert needs its gate logits"
    if gemm2.CHOICES_PER_PROGRAM:
        _down_split(act, w2, shared_w2 if shared_mode == 2 else w2, ids, weights, shared_out, gate, out, gemm2,
                    top_k=top_k, inter=inter, inter_sh=inter_sh, shared_mode=shared_mode)  # fmt: skip
        return out
    _moe_decode_gemm2_kernel[(num_tokens, triton.cdiv(hidden, gemm2.BLOCK_N))](
        act,
        w2,
        shared_w2 if shared_mode == 2 else w2,
        ids,
        weights,
        shared_out if shared_mode == 1 else out,
        gate if has_gate else out,
        out,
        num_tokens,
        w2.stride(0),
        w2.stride(1),
        shared_w2.stride(0) if shared_mode == 2 else 0,
        ids.stride(0),
        weights.stride(0),
        shared_out.stride(0) if shared_mode == 1 else 0,
        gate.stride(0) if has_gate else 0,
        out.stride(0),
        TOP_K=top_k,
        I=inter,
        I_SH=inter_sh,
        I_MAX=inter_max,
        H=hidden,
        SHARED_MODE=shared_mode,
        BLOCK_N=gemm2.BLOCK_N,
        BLOCK_K=gemm2.BLOCK_K,
        num_warps=gemm2.num_warps,
        num_stages=gemm2.num_stages,
        enable_fp_fusion=False,
        **pdl_launch(act),
    )
    return out


def moe_block_triton(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
    shared_w13: torch.Tensor | None = None,
    shared_w2: torch.Tensor | None = None,
    shared_gate_weight: torch.Tensor | None = None,
    config: MoEConfig | None = None,
) -> torch.Tensor:
    """The MoE block of one layer, as moe.fused_moe_block_ref: x [T, H] -> [T, H]. The path and launch configs
    come from the tuning table (moe_configs) unless `config` is given (the tuner's candidates)."""
    from deltaserve.kernels import moe_configs

    assert x.stride(-1) == 1 and w13.stride(-1) == 1 and w2.stride(-1) == 1 and router_weight.is_contiguous()
    has_shared = shared_w13 is not None
    assert has_shared == (shared_w2 is not None) == (shared_gate_weight is not None), "shared expert: all three"
    num_tokens, hidden = x.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    if config is None:
        config = moe_configs.config_for(num_tokens, num_experts, inter, hidden, top_k, x.dtype, x.device)
    if config.path == "decode" and num_tokens <= DECODE_MAX_TOKENS:
        logits = router_logits_triton(x, router_weight, shared_gate_weight)
        shared = {"shared_w13": shared_w13, "shared_w2": shared_w2}
        if num_tokens <= ROUTE_IN_GEMM1_MAX_TOKENS:
            return decode_gemms(
                x, w13, w2, config.gemm1, config.gemm2, logits=logits, top_k=top_k, renormalize=renormalize, **shared
            )
        from deltaserve.kernels.moe_routing_triton import moe_route_triton

        weights, ids = moe_route_triton(logits[:, :num_experts], top_k, renormalize)
        gate = logits[:, num_experts:] if has_shared else None
        return decode_gemms(
            x, w13, w2, config.gemm1, config.gemm2, top_k=top_k, topk_weights=weights, topk_ids=ids,
            shared_gate_logits=gate, **shared,
        )  # fmt: skip
    # Grouped path: the router and gate logits in one GEMV launch up to ROUTER_GEMV_MAX_TOKENS tokens, cuBLAS
    # above (the H200 measured the tl.dot router kernel at 14-24 µs a call for 65-256 tokens against 9-12 µs for
    # the two F.linear calls, docs/kernels.md#moe-decode), the shared MLP through cuBLAS and the fused
    # SiLU-and-mul, the routed experts (with the shared sum in their epilogue) through moe_triton.
    from deltaserve.kernels.activation_triton import silu_and_mul_triton
    from deltaserve.kernels.moe_routing_triton import moe_route_triton
    from deltaserve.kernels.moe_triton import fused_moe_triton

    if num_tokens <= ROUTER_GEMV_MAX_TOKENS:
        logits = router_logits_triton(x, router_weight, shared_gate_weight)
        router, gate = logits[:, :num_experts], (logits[:, num_experts:] if has_shared else None)
    else:
        router = torch.nn.functional.linear(x, router_weight)
        gate = torch.nn.functional.linear(x, shared_gate_weight) if has_shared else None
    weights, ids = moe_route_triton(router, top_k, renormalize)
    if not has_shared:
        return fused_moe_triton(x, w13, w2, weights, ids, config=config)
    shared = torch.nn.functional.linear(silu_and_mul_triton(torch.nn.functional.linear(x, shared_w13)), shared_w2)
    return fused_moe_triton(x, w13, w2, weights, ids, shared, gate, config=config)


# The block-FP8 MoE block's decode path (docs/fp8.md#decode): up to FP8_DECODE_MAX_TOKENS tokens (the bf16 table's
# decode buckets on the 35B-A3B: 1-8) the router, routing, routed and shared experts take the four launches above
# with FP8 weights; the gate/up GEMM walks K a group (128) at a time, the down GEMM is the choice split (each act
# row quantized where it is read). Launch settings per bucket, before any FP8 tuning: the bf16 H200 table's at the
# same buckets with BLOCK_K the group (and bucket 8's down the choice split, which FP8 needs).
FP8_DECODE_MAX_TOKENS = FP8_BLOCK_MAX_TOKENS
FP8_DECODE_CONFIGS = {
    1: MoEConfig("decode", GemmConfig(16, 128, 1, 8, ROUTE_ROWS=1), GemmConfig(32, 128, 4, 1, CHOICES_PER_PROGRAM=1)),
    2: MoEConfig("decode", GemmConfig(16, 128, 1, 8, ROUTE_ROWS=1), GemmConfig(16, 128, 4, 1, CHOICES_PER_PROGRAM=1)),
    4: MoEConfig("decode", GemmConfig(16, 128, 1, 8, ROUTE_ROWS=1), GemmConfig(16, 128, 4, 1, CHOICES_PER_PROGRAM=1)),
    8: MoEConfig("decode", GemmConfig(32, 128, 4, 3), GemmConfig(16, 128, 4, 1, CHOICES_PER_PROGRAM=1)),
}


def moe_block_fp8_triton(
    x: torch.Tensor | Fp8Rows,
    router_weight: torch.Tensor,
    w13: Fp8Weight,
    w2: Fp8Weight,
    top_k: int,
    renormalize: bool,
    shared_w13: Fp8Weight | None = None,
    shared_w2: Fp8Weight | None = None,
    shared_gate_weight: torch.Tensor | None = None,
    config: MoEConfig | None = None,
) -> torch.Tensor:
    """The MoE block of one layer with block-FP8 experts (and shared expert), as fp8_moe.fused_moe_block_fp8_ref:
    x [T, H] (or Fp8Rows: its quantization is the experts' input) -> [T, H]. Up to FP8_DECODE_MAX_TOKENS tokens
    the decode path (router GEMV, gate/up with in-kernel routing, the split down and its combine: four launches);
    above, the composition of the FP8 ops (router, routing, shared MLP, fused_moe_fp8_triton)."""
    has_shared = shared_w13 is not None
    assert has_shared == (shared_w2 is not None) == (shared_gate_weight is not None), "shared expert: all three"
    num_tokens = x.shape[0]
    num_experts = w13.shape[0]
    logits = router_logits_triton(plain(x), router_weight, shared_gate_weight)  # [T, E (+1)]
    if config is None and num_tokens <= FP8_DECODE_MAX_TOKENS:
        config = FP8_DECODE_CONFIGS[max(1, next_pow2(num_tokens))]
    if config is not None and config.path == "decode" and num_tokens <= ROUTE_IN_GEMM1_MAX_TOKENS:
        return decode_gemms(x, w13, w2, config.gemm1, config.gemm2, logits=logits, top_k=top_k,
                            renormalize=renormalize, shared_w13=shared_w13, shared_w2=shared_w2)  # fmt: skip
    weights, ids = moe_route_triton(logits[:, :num_experts], top_k, renormalize)
    if not has_shared:
        return fused_moe_fp8_triton(x, w13, w2, weights, ids)
    shared = fp8_linear_triton(silu_and_mul_fp8_triton(fp8_linear_triton(x, shared_w13)), shared_w2)
    return fused_moe_fp8_triton(x, w13, w2, weights, ids, shared, logits[:, num_experts:])
