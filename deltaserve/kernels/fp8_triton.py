"""Triton block-FP8 kernels (docs/fp8.md): per-token-group activation quantization, the block-FP8 GEMM for the
dense projections, and the routed experts with FP8 weights. The twins are kernels/fp8.py's and fp8_moe.py's refs.

Rounding points, as the refs and vLLM: an activation row is quantized per group of 128 along K, scale =
max(|x|, 1e-10) / 448 in fp32 and q = clamp(x / scale, +-448) rounded to e4m3 (the division is IEEE, div_rn, so the
GPU quantizes exactly as the torch ref); the GEMMs take 128 K columns an iteration, one fp8 x fp8 dot with fp32
accumulation, scaled by the token's and the weight row's block scales and added to an fp32 accumulator; one rounding
to the activation dtype; a bias after it. Launched without FMA contraction, so each block's (dot · s_x) · s_w + acc
rounds as the ref's torch ops do. The weight scale of output row n is row n // SCALE_ROWS of the scale
tensor (SCALE_ROWS is the Fp8Weight's block_n: 128, or 1 for per-row scales).

The MoE reuses moe_triton's alignment (tokens sorted by expert in BLOCK_M-row runs, CUDA-graph safe) and its final
weighted sum; its gate/up GEMM rounds both halves and stores SiLU(gate)·up rounded, which is then quantized per
(token, choice) row for the down GEMM. Launch configurations are fixed, not tuned: the H200 comparison against
DeepGEMM / FlashInfer / CUTLASS decides what serves (docs/fp8.md#the-h200-plan).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.kernels._triton import i64, next_pow2, silu_f32, sm_count
from deltaserve.kernels.fp8 import AMAX_FLOOR, FP8_DTYPE, FP8_MAX, GROUP, Fp8Rows, Fp8Weight, quantized
from deltaserve.kernels.moe_triton import align_experts, grouped_block_m, over_token_chunks, weighted_sum_triton


@triton.jit
def round_to_e4m3(v):
    """v (fp32, |v| <= 448) rounded to nearest-even on the e4m3 grid, still fp32: 3 mantissa bits for normals (the
    carry runs into the exponent), steps of 2^-9 below 2^-6. The cast to e4m3 that follows is then exact. Why not
    just cast: Triton's interpreter drops the carry when rounding crosses a power of two (0.1214 -> 0.0625, not
    0.125), so the CPU tests would not see the hardware's RNE cast; this way both give the ref's bits."""
    bits = v.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    magnitude = tl.abs(v)
    subnormal = (magnitude + 16384.0) - 16384.0  # fp32 ulp at 2^14 is 2^-9: the add rounds to that step
    subnormal = tl.where(v < 0, -subnormal, subnormal)
    return tl.where(magnitude < 0.015625, subnormal, normal)


# the quantization's constants, as globals a jit function may read
_E4M3_MAX = tl.constexpr(FP8_MAX)
_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)
GROUP_SIZE = tl.constexpr(GROUP)


@triton.jit
def quantize_stored_tile(
    y_ptr, q_ptr, s_ptr, row0, row_end, group0, D, ROWS: tl.constexpr, NUM_GROUPS: tl.constexpr, GROUP: tl.constexpr
):
    """For a producer kernel that quantizes its own output: after its barrier, the rows row0 .. row0 + ROWS (those
    below row_end) of what it stored, y [*, D] contiguous, read back in their groups group0 .. group0 + NUM_GROUPS
    of GROUP columns (those inside D) and quantized as _quant_act_kernel does: q [*, D], scale [*, cdiv(D, GROUP)].
    Reading back keeps the quantization's tile out of the producer's own tensors, so those compile and round as in
    the plain kernel."""
    tl.debug_barrier()  # the program's stores are visible to all its threads
    o_i = tl.arange(0, ROWS * NUM_GROUPS)  # [P]: (row, group) pairs
    o_row = row0 + o_i // NUM_GROUPS
    o_group = group0 + o_i % NUM_GROUPS
    m_pair = o_row < row_end
    o_col = o_group[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [P, GROUP]
    m = m_pair[:, None] & (o_col < D)
    o_y = o_row[:, None] * D + o_col
    b_y = tl.load(y_ptr + o_y, mask=m, other=0.0).to(tl.float32)
    b_s = tl.maximum(tl.max(tl.abs(b_y), axis=1), _AMAX_FLOOR) / _E4M3_MAX  # [P]
    b_q = round_to_e4m3(tl.clamp(tl.math.div_rn(b_y, b_s[:, None] + tl.zeros_like(b_y)), -_E4M3_MAX, _E4M3_MAX))
    tl.store(q_ptr + o_y, b_q.to(q_ptr.dtype.element_ty), mask=m)
    tl.store(s_ptr + o_row * tl.cdiv(D, GROUP) + o_group, b_s, mask=m_pair & (o_group * GROUP < D))


@triton.jit
def quantized_row_dot(
    a_ptr,
    w_ptr,
    s_ptr,
    o_n,
    m_n,
    stride_n,
    stride_s_n,
    K: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One activation row a [K] (model dtype, contiguous) against the BLOCK_N rows o_n (m_n: those that exist) of a
    block-FP8 weight (e4m3 rows stride_n apart, block scales at s_ptr, row r's scale row r // SCALE_ROWS) ->
    [BLOCK_N] fp32, unrounded: the row quantized here per group of 128 as _quant_act_kernel quantizes it (the same
    e4m3 values and scales), then per group (q_a . q_w) · s_a · s_w added in fp32 in group order, as the GEMM.
    The row is row 0 of a 16-row tile so the products run on tensor cores (a conversion per weight element made
    the no-tensor-core GEMV instruction-bound: docs/fp8.md#decode)."""
    o_t = tl.arange(0, 16)
    o_k = tl.arange(0, GROUP_SIZE)
    p_w = w_ptr + i64(o_n)[None, :] * stride_n + o_k[:, None]  # [GROUP, BLOCK_N]
    p_s = s_ptr + i64(o_n // SCALE_ROWS) * stride_s_n  # [BLOCK_N]
    b_acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    for g in tl.static_range(0, (K + GROUP_SIZE - 1) // GROUP_SIZE):
        m_k = (g * GROUP_SIZE + o_k) < K
        b_a = tl.load(a_ptr + g * GROUP_SIZE + o_k, mask=m_k, other=0.0).to(tl.float32)  # [GROUP]
        b_sa = tl.maximum(tl.max(tl.abs(b_a)), _AMAX_FLOOR) / _E4M3_MAX
        b_q = round_to_e4m3(tl.clamp(tl.math.div_rn(b_a, b_sa + tl.zeros_like(b_a)), -_E4M3_MAX, _E4M3_MAX))
        b_tile = tl.where(o_t[:, None] == 0, b_q[None, :], 0.0).to(w_ptr.dtype.element_ty)  # [16, GROUP], exact
        b_w = tl.load(p_w + g * GROUP_SIZE, mask=m_k[:, None] & m_n[None, :], other=0.0)
        b_acc += tl.dot(b_tile, b_w) * b_sa * tl.load(p_s + g, mask=m_n, other=0.0)[None, :]
    return tl.sum(tl.where(o_t[:, None] == 0, b_acc, 0.0), axis=0)


def empty_quantization(rows: int, cols: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn [rows, cols], scale fp32 [rows, ceil(cols/128)]): the buffers of rows' quantization."""
    q = torch.empty(rows, cols, dtype=FP8_DTYPE, device=device)
    return q, torch.empty(rows, triton.cdiv(cols, GROUP), dtype=torch.float32, device=device)


@triton.jit
def _quant_act_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    stride_x,
    stride_q,
    stride_s,
    K: tl.constexpr,
    GROUP: tl.constexpr,
    FP8_MAX: tl.constexpr,
    AMAX_FLOOR: tl.constexpr,
):
    """One (row, group of GROUP columns): scale = max(|x|, floor) / FP8_MAX, q = clamp(x / scale) in e4m3."""
    i_m = i64(tl.program_id(0))
    i_g = tl.program_id(1)
    o_k = i_g * GROUP + tl.arange(0, GROUP)
    m_k = o_k < K
    b_x = tl.load(x_ptr + i_m * stride_x + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_s = tl.maximum(tl.max(tl.abs(b_x)), AMAX_FLOOR) / FP8_MAX
    b_q = round_to_e4m3(tl.clamp(tl.math.div_rn(b_x, b_s + tl.zeros_like(b_x)), -FP8_MAX, FP8_MAX))
    tl.store(q_ptr + i_m * stride_q + o_k, b_q.to(q_ptr.dtype.element_ty), mask=m_k)
    tl.store(s_ptr + i_m * stride_s + i_g, b_s)


def quantize_activation_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (last dim contiguous) -> (q float8_e4m3fn [M, K], scale fp32 [M, ceil(K/128)]), as
    quantize_activation_ref."""
    rows, cols = x.shape
    q, s = empty_quantization(rows, cols, x.device)
    if rows:
        _quant_act_kernel[(rows, s.shape[1])](
            x, q, s, x.stride(0), q.stride(0), s.stride(0), K=cols, GROUP=GROUP, FP8_MAX=FP8_MAX, AMAX_FLOOR=AMAX_FLOOR
        )
    return q, s


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(
    q_ptr,
    sx_ptr,
    w_ptr,
    sw_ptr,
    bias_ptr,
    y_ptr,
    part_ptr,
    count_ptr,
    M,
    stride_q,
    stride_sx,
    stride_w,
    stride_sw,
    stride_y,
    N: tl.constexpr,
    K: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr = 1,
    GROUPS_PER_SPLIT: tl.constexpr = 1,
):
    """y[BLOCK_M rows, BLOCK_N cols] = Σ_g (q_x[:, g] . q_w[:, g]ᵀ) · s_x[:, g] · s_w[:, g], one rounding (+ bias).
    With SPLIT > 1 the program sums only its GROUPS_PER_SPLIT groups (program_id 2) and stores that fp32 partial in
    part [SPLIT, M, N]; the tile's last program to finish (its count in count_ptr, one int32 a tile, reached
    SPLIT - 1) adds the tile's partials in split order, rounds, and sets the count back to 0 for the next launch."""
    i_m = tl.program_id(0)
    i_n = tl.program_id(1)
    i_s = tl.program_id(2)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    m_m = o_m < M
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    m_n = o_n < N
    o_k = tl.arange(0, GROUP)
    p_sw = sw_ptr + i64(o_n // SCALE_ROWS) * stride_sw  # [BLOCK_N] the scale row of each output row
    b_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if SPLIT > 1:
        g_start = i_s * GROUPS_PER_SPLIT
        g_end = tl.minimum(g_start + GROUPS_PER_SPLIT, tl.cdiv(K, GROUP))
    else:  # constant bounds: the loop compiles as it did before the split (the prefill tiles' pipelining)
        g_start = 0
        g_end = tl.cdiv(K, GROUP)
    for g in range(g_start, g_end):
        m_k = g * GROUP + o_k < K
        p_a = q_ptr + i64(o_m)[:, None] * stride_q + (g * GROUP + o_k)[None, :]  # [BLOCK_M, GROUP]
        p_b = w_ptr + i64(o_n)[None, :] * stride_w + (g * GROUP + o_k)[:, None]  # [GROUP, BLOCK_N]
        b_a = tl.load(p_a, mask=m_m[:, None] & m_k[None, :], other=0.0)
        b_b = tl.load(p_b, mask=m_k[:, None] & m_n[None, :], other=0.0)
        b_sa = tl.load(sx_ptr + i64(o_m) * stride_sx + g, mask=m_m, other=0.0)  # [BLOCK_M]
        b_sb = tl.load(p_sw + g, mask=m_n, other=0.0)  # [BLOCK_N]
        b_acc += tl.dot(b_a, b_b) * b_sa[:, None] * b_sb[None, :]
    if SPLIT > 1:
        m_tile = m_m[:, None] & m_n[None, :]
        p_part = part_ptr + (i64(i_s) * M + o_m)[:, None] * N + o_n[None, :]  # [BLOCK_M, BLOCK_N]
        tl.store(p_part, b_acc, mask=m_tile)
        # Every thread's partial is stored before the count moves (the barrier), and the count's release / acquire
        # orders it before the last program's reads, which bypass L1 (.cg) so no stale line of another SM's
        # partial is read; the sum keeps split order whichever program is last, so the bits never depend on timing
        tl.debug_barrier()
        p_count = count_ptr + i_m * tl.num_programs(1) + i_n
        if tl.atomic_add(p_count, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
            b_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for i_p in tl.static_range(SPLIT):
                p_p = part_ptr + (i_p * M + i64(o_m))[:, None] * N + o_n[None, :]
                b_acc += tl.load(p_p, mask=m_tile, other=0.0, cache_modifier=".cg")
            tl.store(p_count, 0)  # the counts are zero between launches (stream order; CUDA-graph replays alike)
            _store_rounded(b_acc, bias_ptr, y_ptr, o_m, o_n, m_m, m_n, stride_y, HAS_BIAS)
    else:
        _store_rounded(b_acc, bias_ptr, y_ptr, o_m, o_n, m_m, m_n, stride_y, HAS_BIAS)


@triton.jit
def _store_rounded(b_acc, bias_ptr, y_ptr, o_m, o_n, m_m, m_n, stride_y, HAS_BIAS: tl.constexpr):
    """y[o_m, o_n] = b_acc [BLOCK_M, BLOCK_N] fp32 rounded to y's dtype, then + bias (rounded again, as the ref's
    y + bias in the output dtype)."""
    b_y = b_acc.to(y_ptr.dtype.element_ty)
    if HAS_BIAS:
        b_bias = tl.load(bias_ptr + o_n, mask=m_n, other=0.0).to(tl.float32)
        b_y = (b_y.to(tl.float32) + b_bias[None, :]).to(y_ptr.dtype.element_ty)
    p_y = y_ptr + i64(o_m)[:, None] * stride_y + o_n[None, :]
    tl.store(p_y, b_y, mask=m_m[:, None] & m_n[None, :])


# Programs a launch should have before it splits K, per streaming multiprocessor: at decode rows a projection has as
# few as 16-32 column tiles, each walking all of K alone, so the weight read was bound by the latency of too few
# loads in flight (docs/fp8.md#decode)
SPLIT_PROGRAMS_PER_SM = 4
SPLIT_MAX_ROWS = 64  # the decode and verify rows (one row tile, CUDA-graph buckets): prefills keep one program a tile
SPLIT_MIN_GROUPS = 2  # K groups a split walks at least
# The tiles' counts of finished split programs (int32, zero between launches), one buffer a device shared by every
# split launch: launches on one stream run one after another, and each leaves its counts at zero
SPLIT_COUNTS = 1 << 16
_split_counts: dict[torch.device, torch.Tensor] = {}


def split_counts(device: torch.device, num_tiles: int) -> torch.Tensor:
    """The device's count buffer (made zeroed on first use: the engine's warm-up runs the decode shapes eagerly
    before any CUDA-graph capture)."""
    if num_tiles > SPLIT_COUNTS:
        raise ValueError(f"FP8 split GEMM: {num_tiles} output tiles, more than the {SPLIT_COUNTS} counts kept")
    counts = _split_counts.get(device)
    if counts is None:
        counts = _split_counts[device] = torch.zeros(SPLIT_COUNTS, dtype=torch.int32, device=device)
    return counts


def split_count(num_rows: int, num_tiles: int, num_groups: int, num_sms: int) -> tuple[int, int]:
    """(splits, groups a split) for a launch of num_tiles output tiles over num_groups K groups: up to
    SPLIT_MAX_ROWS rows, the largest power of two not above the splits that bring the launch to
    SPLIT_PROGRAMS_PER_SM programs an SM (rounded up) and not above num_groups / SPLIT_MIN_GROUPS (one value per
    projection shape, so the decode buckets compile every variant); (1, all) otherwise."""
    wanted = min(triton.cdiv(SPLIT_PROGRAMS_PER_SM * num_sms, num_tiles), num_groups // SPLIT_MIN_GROUPS)
    if num_rows > SPLIT_MAX_ROWS or wanted <= 1:
        return 1, num_groups
    splits = 1 << (wanted.bit_length() - 1)
    per_split = triton.cdiv(num_groups, splits)
    return triton.cdiv(num_groups, per_split), per_split  # no split left empty


def gemm_blocks(num_rows: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): 16-row tiles (tl.dot's least) and narrow columns for decode-sized M, so a B = 1 step
    still spreads N over many programs; wider tiles for prefill."""
    if num_rows <= 16:
        return 16, 64
    if num_rows <= 64:
        return next_pow2(num_rows), 64
    return 64, 128


def fp8_linear_triton(x: torch.Tensor | Fp8Rows, weight: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (last dim contiguous; or Fp8Rows [M, K], whose quantization it reads instead of launching one),
    weight Fp8Weight [N, K] (, bias [N]) -> [..., N] in x's dtype, as fp8_linear_ref."""
    cols = x.shape[-1]
    lead = x.shape[:-1]
    rows_n = weight.shape[0]
    if not isinstance(x, Fp8Rows):
        x = x.reshape(-1, cols)
        if x.stride(-1) != 1:
            x = x.contiguous()
    x2, q, s = quantized(x, quantize_activation_triton)  # [M, K], [M, K] e4m3, [M, G]
    num_rows = x2.shape[0]
    y = torch.empty(num_rows, rows_n, dtype=x.dtype, device=x.device)
    block_m, block_n = gemm_blocks(num_rows)
    tiles = (triton.cdiv(num_rows, block_m), triton.cdiv(rows_n, block_n))
    splits, per_split = split_count(num_rows, tiles[0] * tiles[1], triton.cdiv(cols, GROUP), sm_count(x.device))
    part = torch.empty(splits, num_rows, rows_n, dtype=torch.float32, device=x.device) if splits > 1 else y
    counts = split_counts(x.device, tiles[0] * tiles[1]) if splits > 1 else y
    if num_rows:
        _fp8_gemm_kernel[(*tiles, splits)](
            q, s, weight.weight, weight.scale, bias if bias is not None else y, y, part, counts, num_rows,
            q.stride(0), s.stride(0), weight.weight.stride(0), weight.scale.stride(0), y.stride(0),
            N=rows_n, K=cols, SCALE_ROWS=weight.block_n, HAS_BIAS=bias is not None, GROUP=GROUP,
            BLOCK_M=block_m, BLOCK_N=block_n, SPLIT=splits, GROUPS_PER_SPLIT=per_split,
            num_warps=4, num_stages=3, enable_fp_fusion=False,
        )  # fmt: skip
    return y.reshape(*lead, rows_n)


@triton.jit(do_not_specialize=["num_entries"])
def _moe_fp8_gemm1_kernel(
    q_ptr,
    sx_ptr,
    w_ptr,
    sw_ptr,
    act_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    num_entries,
    stride_q,
    stride_sx,
    stride_w_e,
    stride_w_n,
    stride_sw_e,
    stride_sw_n,
    TOP_K: tl.constexpr,
    I: tl.constexpr,
    H: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """act[entry, cols] = round(SiLU(round(gate)) · round(up)) for one expert's BLOCK_M sorted entries."""
    i_m = tl.program_id(0)
    i_n = tl.program_id(1)
    i_e = i64(tl.load(block_expert_ptr + i_m))
    if i_e < 0:
        return
    b_entry = tl.load(sorted_ids_ptr + i_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    m_m = b_entry < num_entries
    b_token = i64(b_entry // TOP_K)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)  # gate rows; the up rows are I further
    m_n = o_n < I
    o_k = tl.arange(0, GROUP)
    p_wg = w_ptr + i_e * stride_w_e + i64(o_n)[None, :] * stride_w_n + o_k[:, None]  # [GROUP, BLOCK_N]
    p_wu = p_wg + I * stride_w_n
    p_sg = sw_ptr + i_e * stride_sw_e + i64(o_n // SCALE_ROWS) * stride_sw_n  # [BLOCK_N]
    p_su = sw_ptr + i_e * stride_sw_e + i64((I + o_n) // SCALE_ROWS) * stride_sw_n
    b_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    b_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g in range(0, tl.cdiv(H, GROUP)):
        m_k = g * GROUP + o_k < H
        p_a = q_ptr + b_token[:, None] * stride_q + (g * GROUP + o_k)[None, :]
        b_a = tl.load(p_a, mask=m_m[:, None] & m_k[None, :], other=0.0)
        b_sa = tl.load(sx_ptr + b_token * stride_sx + g, mask=m_m, other=0.0)[:, None]
        b_wg = tl.load(p_wg + g * GROUP, mask=m_k[:, None] & m_n[None, :], other=0.0)
        b_wu = tl.load(p_wu + g * GROUP, mask=m_k[:, None] & m_n[None, :], other=0.0)
        b_gate += tl.dot(b_a, b_wg) * b_sa * tl.load(p_sg + g, mask=m_n, other=0.0)[None, :]
        b_up += tl.dot(b_a, b_wu) * b_sa * tl.load(p_su + g, mask=m_n, other=0.0)[None, :]
    b_gate = b_gate.to(act_ptr.dtype.element_ty).to(tl.float32)
    b_up = b_up.to(act_ptr.dtype.element_ty).to(tl.float32)
    p_act = act_ptr + i64(b_entry)[:, None] * I + o_n[None, :]
    tl.store(p_act, silu_f32(b_gate) * b_up, mask=m_m[:, None] & m_n[None, :])


@triton.jit(do_not_specialize=["num_entries"])
def _moe_fp8_gemm2_kernel(
    q_ptr,
    sx_ptr,
    w_ptr,
    sw_ptr,
    y_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    num_entries,
    stride_q,
    stride_sx,
    stride_w_e,
    stride_w_n,
    stride_sw_e,
    stride_sw_n,
    I: tl.constexpr,
    H: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """y[entry, cols] = round(quantized act row . expert's w2 rows) for one expert's BLOCK_M sorted entries."""
    i_m = tl.program_id(0)
    i_n = tl.program_id(1)
    i_e = i64(tl.load(block_expert_ptr + i_m))
    if i_e < 0:
        return
    b_entry = i64(tl.load(sorted_ids_ptr + i_m * BLOCK_M + tl.arange(0, BLOCK_M)))  # [BLOCK_M]
    m_m = b_entry < num_entries
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)  # output (hidden) columns
    m_n = o_n < H
    o_k = tl.arange(0, GROUP)
    p_w = w_ptr + i_e * stride_w_e + i64(o_n)[None, :] * stride_w_n + o_k[:, None]  # [GROUP, BLOCK_N]
    p_sw = sw_ptr + i_e * stride_sw_e + i64(o_n // SCALE_ROWS) * stride_sw_n
    b_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g in range(0, tl.cdiv(I, GROUP)):
        m_k = g * GROUP + o_k < I
        p_a = q_ptr + b_entry[:, None] * stride_q + (g * GROUP + o_k)[None, :]
        b_a = tl.load(p_a, mask=m_m[:, None] & m_k[None, :], other=0.0)
        b_sa = tl.load(sx_ptr + b_entry * stride_sx + g, mask=m_m, other=0.0)[:, None]
        b_w = tl.load(p_w + g * GROUP, mask=m_k[:, None] & m_n[None, :], other=0.0)
        b_acc += tl.dot(b_a, b_w) * b_sa * tl.load(p_sw + g, mask=m_n, other=0.0)[None, :]
    tl.store(y_ptr + b_entry[:, None] * H + o_n[None, :], b_acc, mask=m_m[:, None] & m_n[None, :])


MOE_BLOCK_N = 64


def _fused_moe_fp8_chunk(
    x: torch.Tensor | Fp8Rows,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    out: torch.Tensor,
    shared: torch.Tensor | None,
    shared_gate_logits: torch.Tensor | None,
    w13: Fp8Weight,
    w2: Fp8Weight,
) -> None:
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    num_entries = num_tokens * top_k
    block_m = grouped_block_m(num_entries, num_experts)  # 16-64: tl.dot's 16-row minimum holds
    sorted_ids, block_expert = align_experts(topk_ids, num_experts, block_m)
    num_blocks = block_expert.shape[0]
    _, qx, sx = quantized(x, quantize_activation_triton)  # the rows' own quantization when they came with it
    act = torch.empty(num_entries, inter, dtype=x.dtype, device=x.device)
    _moe_fp8_gemm1_kernel[(num_blocks, triton.cdiv(inter, MOE_BLOCK_N))](
        qx, sx, w13.weight, w13.scale, act, sorted_ids, block_expert, num_entries, qx.stride(0), sx.stride(0),
        w13.weight.stride(0), w13.weight.stride(1), w13.scale.stride(0), w13.scale.stride(1),
        TOP_K=top_k, I=inter, H=hidden, SCALE_ROWS=w13.block_n, GROUP=GROUP, BLOCK_M=block_m,
        BLOCK_N=MOE_BLOCK_N, num_warps=4, num_stages=3, enable_fp_fusion=False,
    )  # fmt: skip
    qa, sa = quantize_activation_triton(act)  # per (token, choice) row, as the ref quantizes each expert's input
    y = torch.empty(num_entries, hidden, dtype=x.dtype, device=x.device)
    _moe_fp8_gemm2_kernel[(num_blocks, triton.cdiv(hidden, MOE_BLOCK_N))](
        qa, sa, w2.weight, w2.scale, y, sorted_ids, block_expert, num_entries, qa.stride(0), sa.stride(0),
        w2.weight.stride(0), w2.weight.stride(1), w2.scale.stride(0), w2.scale.stride(1),
        I=inter, H=hidden, SCALE_ROWS=w2.block_n, GROUP=GROUP, BLOCK_M=block_m, BLOCK_N=MOE_BLOCK_N,
        num_warps=4, num_stages=3, enable_fp_fusion=False,
    )  # fmt: skip
    weighted_sum_triton(y, topk_weights, shared, shared_gate_logits, out)


def fused_moe_fp8_triton(
    x: torch.Tensor | Fp8Rows,
    w13: Fp8Weight,
    w2: Fp8Weight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    shared: torch.Tensor | None = None,
    shared_gate_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, H] (last dim contiguous; or Fp8Rows, read as fp8_linear_triton reads them); w13 Fp8Weight [E, 2I, H];
    w2 Fp8Weight [E, H, I]; topk_weights [T, k] fp32; topk_ids [T, k] -> [T, H], as fused_moe_fp8_ref (with the
    shared expert's output and gate logits, their sigmoid-gated sum)."""
    return over_token_chunks(
        lambda *rows: _fused_moe_fp8_chunk(*rows, w13, w2), x, topk_weights, topk_ids, shared, shared_gate_logits
    )
