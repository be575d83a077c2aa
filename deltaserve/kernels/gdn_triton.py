"""Triton kernels for the Gated DeltaNet core: the in-place recurrent decode and the varlen prefill.

Both run the delta rule in fp32 on the state slots ssm_states [num_slots, HV, dk, dv] (S in the ref's
orientation): S ← e^g·S; u = β(v − Sᵀk̂); S ← S + k̂uᵀ; o = Sᵀq̂, with the gates and the q/k L2 norms
computed in-kernel in fp32 (g = −e^A_log·softplus(a + dt_bias), β = sigmoid(b), q̂ = l2norm(q)·dk^-0.5).
Value head h reads q/k head h // (HV/HK). A program that updates S owns one (sequence, value head,
BV-column block): its [dk, BV] slice of S lives in registers and no other program touches it, so the
in-place updates need no synchronisation.

- `gdn_decode_triton`: one token per sequence, q̂/k̂ not rounded (vLLM's packed decode). Slots < 0 are
  CUDA-graph padding: their output row is zeros and no state is read or written. Grid from shapes only,
  the value-column block fastest (dv/BV × HV × B), so the programs of one head's contiguous state run
  side by side; every load that does not need the slot is issued with the slot load and the state load
  right behind it, before any reduction (docs/kernels.md#gated-deltanet).
- `gdn_prefill_triton`: varlen by query_start_loc; the state starts from the slot (zeros when
  has_initial_state is False, or when the slot is < 0) and the final state is written back; an optional in-step
  checkpoint per sequence stores the fp32 state at the start of one of its chunks into another slot. As the ref
  (vLLM's prefill), q̂/k̂ are rounded to the input dtype before the core. The chunked WY form (chunks of 64,
  four launches: a parallel per-chunk prepare with a blocked (I + A)^-1, a parallel w/u kernel, a sequential
  scan over chunks that does only the state-dependent dots, and a parallel output kernel; dot operands in the
  input dtype, bf16 tensor cores on the GPU); it matches the chunked fp32 ref to ~1e-6 at fp32. Derivation:
  docs/kernels.md#gated-deltanet. `chunk_inverse_triton` runs the prepare's blocked inverse alone (tests).
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from deltaserve.kernels._dispatch import output
from deltaserve.kernels._triton import (
    dot_precision,
    i64,
    next_pow2,
    pdl_launch,
    pdl_wait,
    search_steps,
    sm_count,
    softplus_f32,
)  # fmt: skip

# Chunk length of the chunked prefill (the ref's CHUNK_SIZE).
CHUNK = 64
# The scan's launch configurations (BV value columns a program, warps, pipeline stages), one picked per call by
# scan_launch from the call's program count (the H100 sweep behind them: docs/kernels.md#gated-deltanet). Few programs
# (at most two waves of one an SM: one sequence of either served shape): a third stage hides the chunk loads that a
# program alone on its SM waits for (one 35B-A3B sequence's scan -37 %). Many programs from sequences of similar
# length: BV 64 does the same work in half the programs, each loading k̂ and w once for 64 columns (four sequences
# -25 %). At 4 warps the scan holds 122 registers (sm_90).
SCAN_FEW = (32, 4, 3)
SCAN_MANY = (64, 4, 2)
# SCAN_FEW where its 3 stages (115 KB of shared memory a program at dk 128) exceed the device's (sm_86 / sm_89: ~99
# KB): a launch that does not fit falls back to this, once per device (_SCAN_STAGES_DO_NOT_FIT).
SCAN_FEW_2_STAGES = (32, 4, 2)
# Warps of the chunked prefill's other launches (their sm_90 registers and H200 times: docs/kernels.md#gated-deltanet).
# Prepare: 4 warps at 242 registers fit 2 programs an SM (8 warps: 168 registers, 1 program).
CHUNK_PREPARE_WARPS = 4
# q / k norms: one launch of [64, dk] tiles per key head before the prepare (docs/kernels.md#gated-deltanet).
CHUNK_NORM_WARPS = 4
# The state-free w / u kernel and the output kernel: parallel over chunks, [64, 128] tiles. The w / u kernel runs
# 8 warps: at 4, Triton 3.6 computed u = Xu·v wrong at dk 64 / dv 32 in bf16 on the H200 (relative error 0.84),
# and at the served heads 8 warps are also faster (a 27B 2048-token layer's chunked prefill 0.645 -> 0.557 ms,
# 35B-A3B 8x1024 0.921 -> 0.918).
CHUNK_WU_WARPS = 8
CHUNK_OUT_WARPS = 4
CHUNK_OUT_BV = 64
# CUDA's limit on a grid's second and third dimensions (the decode grid puts sequences third).
MAX_GRID_YZ = 65535
# The devices (index) where SCAN_FEW's 3 stages did not fit: their calls launch SCAN_FEW_2_STAGES.
_SCAN_STAGES_DO_NOT_FIT: set[int] = set()

logger = logging.getLogger(__name__)


@triton.jit
def gates_of(b_a, b_b, b_A_log, b_dt_bias):
    """(e^g, β) from the loaded a, b, A_log, dt_bias scalars, in fp32."""
    b_g = -tl.exp(b_A_log.to(tl.float32)) * softplus_f32(b_a.to(tl.float32) + b_dt_bias.to(tl.float32))
    return tl.exp(b_g), 1.0 / (1.0 + tl.exp(-b_b.to(tl.float32)))


@triton.jit
def l2norm_vector(b_x):
    return b_x / tl.sqrt(tl.sum(b_x * b_x, axis=0) + 1e-6)


@triton.jit
def _l2norm_rows(b_x):
    """Each row of a [rows, dk] fp32 block over its own L2 norm (ε inside the root, as the ref)."""
    return b_x / tl.sqrt(tl.sum(b_x * b_x, axis=1) + 1e-6)[:, None]


@triton.jit
def _gdn_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    a_ptr,
    b_ptr,
    A_log_ptr,
    dt_bias_ptr,
    ssm_states_ptr,
    state_indices_ptr,
    out_ptr,
    stride_q_t,
    stride_q_h,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_a_t,
    stride_b_t,
    stride_s_slot,
    stride_s_head,
    stride_s_k,
    scale,
    HV: tl.constexpr,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    i_v = tl.program_id(0)
    i_h = tl.program_id(1)
    i_b = i64(tl.program_id(2))
    i_hk = i_h // GROUP
    o_k = tl.arange(0, BK)  # [BK]
    m_k = o_k < DK
    o_v = i_v * BV + tl.arange(0, BV)  # [BV]
    m_v = o_v < DV
    # The slot, the state (last written by this layer in an earlier step) and the weights go out before the wait
    # (_triton.pdl_wait, docs/kernels.md#programmatic-dependent-launch): under PDL the state stream overlaps the conv
    # kernel before this one.
    # Padded rows of a CUDA-graph batch carry slot -1: masks, not a branch, so no load waits on the slot's value.
    i_slot = i64(tl.load(state_indices_ptr + i_b))
    b_A_log = tl.load(A_log_ptr + i_h)
    b_dt_bias = tl.load(dt_bias_ptr + i_h)
    is_live = i_slot >= 0
    p_s = ssm_states_ptr + i_slot * stride_s_slot + i_h * stride_s_head + o_k[:, None] * stride_s_k + o_v[None, :]
    m_s = m_k[:, None] & m_v[None, :] & is_live
    b_s = tl.load(p_s, mask=m_s, other=0.0).to(tl.float32)  # [BK, BV]
    pdl_wait(USE_PDL)
    b_q = tl.load(q_ptr + i_b * stride_q_t + i_hk * stride_q_h + o_k, mask=m_k, other=0.0)
    b_k = tl.load(k_ptr + i_b * stride_k_t + i_hk * stride_k_h + o_k, mask=m_k, other=0.0)
    b_v = tl.load(v_ptr + i_b * stride_v_t + i_h * stride_v_h + o_v, mask=m_v, other=0.0)
    b_a = tl.load(a_ptr + i_b * stride_a_t + i_h)
    b_b = tl.load(b_ptr + i_b * stride_b_t + i_h)

    b_q = l2norm_vector(b_q.to(tl.float32)) * scale
    b_k = l2norm_vector(b_k.to(tl.float32))
    b_decay, b_beta = gates_of(b_a, b_b, b_A_log, b_dt_bias)
    b_s = b_s * b_decay
    b_u = b_beta * (b_v.to(tl.float32) - tl.sum(b_s * b_k[:, None], axis=0))  # [BV]
    b_s += b_k[:, None] * b_u[None, :]
    b_o = tl.sum(b_s * b_q[:, None], axis=0)  # [BV]
    tl.store(p_s, b_s, mask=m_s)
    tl.store(out_ptr + (i_b * HV + i_h) * DV + o_v, tl.where(is_live, b_o, 0.0), mask=m_v)


def check_states(ssm_states: torch.Tensor, num_v_heads: int, head_k_dim: int, head_v_dim: int) -> None:
    assert ssm_states.shape[1:] == (num_v_heads, head_k_dim, head_v_dim), f"ssm_states {tuple(ssm_states.shape)}"
    assert ssm_states.stride(-1) == 1, "ssm_states: the dv dim must be contiguous"


def state_block_v(head_v_dim: int) -> int:
    # [dk, BV] fp32 state tile in registers: 128 × 32 over 4 warps is 32 registers a thread.
    return min(32, next_pow2(head_v_dim))


def gdn_decode_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q, k [B, HK, dk]; v [B, HV, dv]; a, b [B, HV] -> o [B, HV, dv] (into `out` when given; zeros where slot
    < 0); states in place."""
    batch, num_k_heads, head_k_dim = q.shape
    num_v_heads, head_v_dim = v.shape[1], v.shape[2]
    check_states(ssm_states, num_v_heads, head_k_dim, head_v_dim)
    for name, t in (("q", q), ("k", k), ("v", v), ("a", a), ("b", b)):
        assert t.stride(-1) == 1, f"{name}: last dim must be contiguous"
    out = output(out, (batch, num_v_heads, head_v_dim), v)
    if batch == 0:
        return out
    block_v = state_block_v(head_v_dim)
    if batch > MAX_GRID_YZ or num_v_heads > MAX_GRID_YZ:
        raise ValueError(f"gdn_decode: {batch} sequences x {num_v_heads} value heads exceed the grid ({MAX_GRID_YZ})")
    _gdn_decode_kernel[(triton.cdiv(head_v_dim, block_v), num_v_heads, batch)](
        q,
        k,
        v,
        a,
        b,
        A_log,
        dt_bias,
        ssm_states,
        state_indices,
        out,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        a.stride(0),
        b.stride(0),
        ssm_states.stride(0),
        ssm_states.stride(1),
        ssm_states.stride(2),
        head_k_dim**-0.5,
        HV=num_v_heads,
        GROUP=num_v_heads // num_k_heads,
        DK=head_k_dim,
        DV=head_v_dim,
        BK=next_pow2(head_k_dim),
        BV=block_v,
        num_warps=4,
        **pdl_launch(q),
    )
    return out


# Side of one diagonal block of the blocked (I + A)^-1: a chunk is four BLK x BLK blocks on each side.
BLK = tl.constexpr(16)


@triton.jit
def _inv_diag4(p_a, BT: tl.constexpr):
    """(I + A_m)^-1 of the four diagonal blocks of the strictly lower [BT, BT] fp32 A at p_a (row-major), [BLK, BLK]
    fp32 each, by forward substitution, the four in lockstep so their reductions overlap: X_i = e_i − Σ_{j<i} A_ij
    X_j, rows j < i already final. Built transposed (Y = Xᵀ, column i set at step i) so that each step's reduction
    runs along a tile's rows, within a warp (shuffles, no barrier), and row i of A is loaded straight into the
    tile's layout (element (c, j) holds A_ij for every c; L1-resident, independent of X): no layout conversion,
    and so no shared-memory round trip, on the serial chain. Returns the four X blocks."""
    o_r = tl.arange(0, BLK)
    b_y0 = tl.where(o_r[:, None] == o_r[None, :], 1.0, 0.0)
    b_y1 = b_y0
    b_y2 = b_y0
    b_y3 = b_y0
    o_row = 0 * o_r[:, None] + o_r[None, :]  # [BLK, BLK] column j of every row
    for i in range(1, BLK):
        is_col = o_r[None, :] == i  # [1, BLK]
        b_e = tl.where(o_r == i, 1.0, 0.0)  # [BLK]
        p_row = p_a + i * BT + o_row  # row i of block 0, over j (across the tile)
        b_a0 = tl.load(p_row)  # [BLK, BLK]
        b_a1 = tl.load(p_row + (BLK * BT + BLK))
        b_a2 = tl.load(p_row + 2 * (BLK * BT + BLK))
        b_a3 = tl.load(p_row + 3 * (BLK * BT + BLK))
        b_y0 = tl.where(is_col, (b_e - tl.sum(b_y0 * b_a0, axis=1))[:, None], b_y0)
        b_y1 = tl.where(is_col, (b_e - tl.sum(b_y1 * b_a1, axis=1))[:, None], b_y1)
        b_y2 = tl.where(is_col, (b_e - tl.sum(b_y2 * b_a2, axis=1))[:, None], b_y2)
        b_y3 = tl.where(is_col, (b_e - tl.sum(b_y3 * b_a3, axis=1))[:, None], b_y3)
    return tl.trans(b_y0), tl.trans(b_y1), tl.trans(b_y2), tl.trans(b_y3)


@triton.jit
def _mm(b_x, b_y):
    """b_x @ b_y on [BLK, BLK] fp32 tiles with exact fp32 products and sums (X stays fp32 until its store)."""
    return tl.dot(b_x, b_y, input_precision="ieee")


@triton.jit
def _mm_acc(b_x, b_y, b_acc):
    """b_acc + b_x @ b_y on [BLK, BLK] fp32 tiles, exact fp32 as _mm."""
    return tl.dot(b_x, b_y, b_acc, input_precision="ieee")


@triton.jit
def _blocked_inverse(p_a, BT: tl.constexpr):
    """X = (I + A)^-1 for the strictly lower [BT, BT] fp32 A at p_a (row-major, BT = 4·BLK), written over it.

    I + A is block lower triangular with diagonal blocks D_m = I + A_mm: X_mm = D_m^-1 (_inv_diag4), then
    X_ij = −X_ii Σ_{j≤m<i} A_im X_mj for i > j by fp32 dots, by distance from the diagonal. The blocks above
    the diagonal stay the zeros A has there. The caller puts a barrier between A's store and this call."""
    o_r = tl.arange(0, BLK)
    o_b = o_r[:, None] * BT + o_r[None, :]  # [BLK, BLK] one block
    b_x00, b_x11, b_x22, b_x33 = _inv_diag4(p_a, BT)
    b_a10 = tl.load(p_a + BLK * BT + o_b)
    b_a20 = tl.load(p_a + 2 * BLK * BT + o_b)
    b_a21 = tl.load(p_a + 2 * BLK * BT + BLK + o_b)
    b_a30 = tl.load(p_a + 3 * BLK * BT + o_b)
    b_a31 = tl.load(p_a + 3 * BLK * BT + BLK + o_b)
    b_a32 = tl.load(p_a + 3 * BLK * BT + 2 * BLK + o_b)
    b_x10 = -_mm(b_x11, _mm(b_a10, b_x00))
    b_x21 = -_mm(b_x22, _mm(b_a21, b_x11))
    b_x32 = -_mm(b_x33, _mm(b_a32, b_x22))
    b_x20 = -_mm(b_x22, _mm_acc(b_a21, b_x10, _mm(b_a20, b_x00)))
    b_x31 = -_mm(b_x33, _mm_acc(b_a32, b_x21, _mm(b_a31, b_x11)))
    b_x30 = -_mm(b_x33, _mm_acc(b_a32, b_x20, _mm_acc(b_a31, b_x10, _mm(b_a30, b_x00))))
    # Every thread's reads of A are done before any X block lands on them.
    tl.debug_barrier()
    tl.store(p_a + o_b, b_x00)
    tl.store(p_a + BLK * BT + o_b, b_x10)
    tl.store(p_a + BLK * BT + BLK + o_b, b_x11)
    tl.store(p_a + 2 * BLK * BT + o_b, b_x20)
    tl.store(p_a + 2 * BLK * BT + BLK + o_b, b_x21)
    tl.store(p_a + 2 * BLK * BT + 2 * BLK + o_b, b_x22)
    tl.store(p_a + 3 * BLK * BT + o_b, b_x30)
    tl.store(p_a + 3 * BLK * BT + BLK + o_b, b_x31)
    tl.store(p_a + 3 * BLK * BT + 2 * BLK + o_b, b_x32)
    tl.store(p_a + 3 * BLK * BT + 3 * BLK + o_b, b_x33)


@triton.jit
def _chunk_inverse_kernel(x_ptr, BT: tl.constexpr):
    """One [BT, BT] tile per program: the strictly lower A at x_ptr replaced by (I + A)^-1 (_blocked_inverse)."""
    _blocked_inverse(x_ptr + i64(tl.program_id(0)) * BT * BT, BT)


def chunk_inverse_triton(strict_lower: torch.Tensor) -> torch.Tensor:
    """strict_lower [N, CHUNK, CHUNK] fp32 (zeros on and above the diagonal) -> (I + A)^-1 [N, CHUNK, CHUNK]: the
    prepare kernel's blocked inverse on its own, for the tests."""
    assert strict_lower.shape[1:] == (CHUNK, CHUNK) and strict_lower.dtype == torch.float32
    out = strict_lower.contiguous().clone()
    if out.shape[0]:
        _chunk_inverse_kernel[(out.shape[0],)](out, BT=CHUNK, num_warps=CHUNK_PREPARE_WARPS)
    return out


@triton.jit
def _chunk_bounds(
    query_start_loc_ptr, chunk_offsets_ptr, i_c, num_seqs, BT: tl.constexpr, NUM_SEARCH_STEPS: tl.constexpr
):
    """(start, end): the first token row of global chunk i_c and the end of its sequence. The owning sequence
    is the last b with chunk_offsets[b] <= i_c (binary search); the caller has checked i_c < the chunk total."""
    i_lo = 0
    i_hi = num_seqs
    for _ in tl.static_range(NUM_SEARCH_STEPS):
        i_mid = (i_lo + i_hi) // 2
        is_at_or_before = tl.load(chunk_offsets_ptr + i_mid) <= i_c
        i_lo = tl.where(is_at_or_before, i_mid, i_lo)
        i_hi = tl.where(is_at_or_before, i_hi, i_mid)
    start = tl.load(query_start_loc_ptr + i_lo) + (i_c - tl.load(chunk_offsets_ptr + i_lo)) * BT
    return start, tl.load(query_start_loc_ptr + i_lo + 1)


@triton.jit(do_not_specialize=["num_tokens"])
def _gdn_qk_norm_kernel(
    q_ptr,
    k_ptr,
    qn_ptr,
    kn_ptr,
    num_tokens,
    stride_q_t,
    stride_q_h,
    stride_k_t,
    stride_k_h,
    HK: tl.constexpr,
    DK: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
):
    """Per (BT rows, key head): q̂ = q/‖q‖ and k̂ = k/‖k‖ in fp32, rounded to the input dtype (the ref's rounding
    point) into qn / kn [T, HK, dk], once per key head: the prepare, w / u and output kernels of every value head
    of the group read them."""
    i_t = tl.program_id(0)
    i_hk = tl.program_id(1)
    o_t = i_t * BT + tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_tk = (o_t < num_tokens)[:, None] & (o_k < DK)[None, :]
    b_q = tl.load(q_ptr + i64(o_t)[:, None] * stride_q_t + i_hk * stride_q_h + o_k[None, :], mask=m_tk, other=0.0)
    b_k = tl.load(k_ptr + i64(o_t)[:, None] * stride_k_t + i_hk * stride_k_h + o_k[None, :], mask=m_tk, other=0.0)
    o_n = (i64(o_t)[:, None] * HK + i_hk) * DK + o_k[None, :]
    tl.store(qn_ptr + o_n, _l2norm_rows(b_q.to(tl.float32)).to(qn_ptr.dtype.element_ty), mask=m_tk)
    tl.store(kn_ptr + o_n, _l2norm_rows(b_k.to(tl.float32)).to(kn_ptr.dtype.element_ty), mask=m_tk)


@triton.jit(do_not_specialize=["num_seqs"])
def _gdn_chunk_prepare_kernel(
    qn_ptr,
    kn_ptr,
    a_ptr,
    b_ptr,
    A_log_ptr,
    dt_bias_ptr,
    query_start_loc_ptr,
    chunk_offsets_ptr,
    gcum_ptr,
    xw_ptr,
    xu_ptr,
    aqk_ptr,
    scratch_ptr,
    num_seqs,
    stride_a_t,
    stride_b_t,
    HK: tl.constexpr,
    HV: tl.constexpr,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    NUM_SEARCH_STEPS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Per (chunk, value head), everything that does not depend on the running state, from q̂ and k̂
    (_gdn_qk_norm_kernel's, rounded): Γ = cumsum(g), X = (I + A)^-1 with A_ij = β_i k̂_i·k̂_j e^(Γi−Γj) (j < i),
    stored as Xw = X·diag(β e^Γ) and Xu = X·diag(β), and the intra-chunk scores Aqk_ij = q̂_i·k̂_j e^(Γi−Γj) (j ≤ i).
    X by the blocked inverse (_blocked_inverse) through scratch_ptr [chunks, HV, BT, BT] fp32."""
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    if i_c >= tl.load(chunk_offsets_ptr + num_seqs):
        return
    start, end = _chunk_bounds(query_start_loc_ptr, chunk_offsets_ptr, i_c, num_seqs, BT, NUM_SEARCH_STEPS)
    o_t = start + tl.arange(0, BT)  # [BT]
    m_t = o_t < end
    o_k = tl.arange(0, BK)
    m_k = o_k < DK
    i_hk = i_h // GROUP
    m_tk = m_t[:, None] & m_k[None, :]
    o_n = (i64(o_t)[:, None] * HK + i_hk) * DK + o_k[None, :]
    b_k = tl.load(kn_ptr + o_n, mask=m_tk, other=0.0)  # [BT, BK] k̂, input dtype
    b_q = tl.load(qn_ptr + o_n, mask=m_tk, other=0.0)

    b_a = tl.load(a_ptr + i64(o_t) * stride_a_t + i_h, mask=m_t, other=0.0).to(tl.float32)
    b_b = tl.load(b_ptr + i64(o_t) * stride_b_t + i_h, mask=m_t, other=0.0).to(tl.float32)
    b_dt = tl.load(dt_bias_ptr + i_h).to(tl.float32)
    # Padded rows past the sequence end carry g = 0 and β = 0 (k̂ = 0): they change nothing.
    b_g = tl.where(m_t, -tl.exp(tl.load(A_log_ptr + i_h).to(tl.float32)) * softplus_f32(b_a + b_dt), 0.0)
    b_beta = tl.where(m_t, 1.0 / (1.0 + tl.exp(-b_b)), 0.0)
    b_gcum = tl.cumsum(b_g, axis=0)  # [BT]
    tl.store(gcum_ptr + i64(o_t) * HV + i_h, b_gcum, mask=m_t)

    o_i = tl.arange(0, BT)
    o_x = (i64(i_c) * HV + i_h) * BT * BT + o_i[:, None] * BT + o_i[None, :]  # [BT, BT] this chunk's tiles
    # exp(−inf) = 0 masks j > i without overflowing e^(Γi−Γj) there.
    b_decay = tl.exp(tl.where(o_i[:, None] >= o_i[None, :], b_gcum[:, None] - b_gcum[None, :], float("-inf")))
    b_aqk = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION) * b_decay
    tl.store(aqk_ptr + o_x, b_aqk)
    is_lower = o_i[:, None] > o_i[None, :]
    b_decay = tl.exp(tl.where(is_lower, b_gcum[:, None] - b_gcum[None, :], 0.0))
    b_A = tl.dot(b_k, tl.trans(b_k), input_precision=DOT_PRECISION) * b_beta[:, None] * b_decay
    b_A = tl.where(is_lower, b_A, 0.0)  # [BT, BT] strictly lower
    # X = (I + A)^-1 blocked on [BLK, BLK] tiles (Triton cannot slice a register tile: A goes through an fp32
    # scratch tile that this program alone reads and writes, L1/L2-resident; barriers order the round trips).
    p_scratch = scratch_ptr + o_x
    tl.store(p_scratch, b_A)
    tl.debug_barrier()
    _blocked_inverse(scratch_ptr + (i64(i_c) * HV + i_h) * BT * BT, BT)
    tl.debug_barrier()
    b_X = tl.load(p_scratch)  # [BT, BT] fp32
    tl.store(xw_ptr + o_x, b_X * (b_beta * tl.exp(b_gcum))[None, :])
    tl.store(xu_ptr + o_x, b_X * b_beta[None, :])


@triton.jit(do_not_specialize=["num_seqs"])
def _gdn_chunk_wu_kernel(
    kn_ptr,
    v_ptr,
    xw_ptr,
    xu_ptr,
    query_start_loc_ptr,
    chunk_offsets_ptr,
    w_ptr,
    u_ptr,
    num_seqs,
    stride_v_t,
    stride_v_h,
    HK: tl.constexpr,
    HV: tl.constexpr,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    NUM_SEARCH_STEPS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Per (chunk, value head), the scan inputs that need no state: w = Xw·k̂ rounded to the input dtype
    [T, HV, dk] and u = Xu·v rounded to the input dtype [T, HV, dv] (vLLM's FLA rounds both: its
    recompute_w_u stores u in v's dtype). Rows past the sequence end are not stored (the scan loads them as zeros)."""
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    if i_c >= tl.load(chunk_offsets_ptr + num_seqs):
        return
    start, end = _chunk_bounds(query_start_loc_ptr, chunk_offsets_ptr, i_c, num_seqs, BT, NUM_SEARCH_STEPS)
    DT: tl.constexpr = v_ptr.dtype.element_ty
    o_i = tl.arange(0, BT)
    m_t = (start + o_i) < end
    o_k = tl.arange(0, BK)
    o_v = tl.arange(0, BV)
    o_x = o_i[:, None] * BT + o_i[None, :]  # [BT, BT]
    p_x = (i64(i_c) * HV + i_h) * (BT * BT)
    m_tk = m_t[:, None] & (o_k < DK)[None, :]
    b_k = tl.load(
        kn_ptr + i64(start) * (HK * DK) + (i_h // GROUP) * DK + o_i[:, None] * (HK * DK) + o_k[None, :],
        mask=m_tk,
        other=0.0,
    )
    b_w = tl.dot(tl.load(xw_ptr + p_x + o_x), b_k, input_precision=DOT_PRECISION).to(DT)  # [BT, BK]
    tl.store(w_ptr + i64(start) * (HV * DK) + i_h * DK + o_i[:, None] * (HV * DK) + o_k[None, :], b_w, mask=m_tk)
    m_tv = m_t[:, None] & (o_v < DV)[None, :]
    b_v = tl.load(
        v_ptr + i64(start) * stride_v_t + i_h * stride_v_h + o_i[:, None] * stride_v_t + o_v[None, :],
        mask=m_tv,
        other=0.0,
    )
    b_u = tl.dot(tl.load(xu_ptr + p_x + o_x), b_v, input_precision=DOT_PRECISION).to(DT)  # [BT, BV]
    tl.store(u_ptr + i64(start) * (HV * DV) + i_h * DV + o_i[:, None] * (HV * DV) + o_v[None, :], b_u, mask=m_tv)


@triton.jit
def _gdn_chunk_scan_kernel(
    kn_ptr,
    w_ptr,
    u_ptr,
    gcum_ptr,
    ssm_states_ptr,
    query_start_loc_ptr,
    state_indices_ptr,
    has_initial_state_ptr,
    chunk_offsets_ptr,
    hs_ptr,
    vnew_ptr,
    ckpt_chunk_ptr,
    ckpt_slot_ptr,
    stride_s_slot,
    stride_s_head,
    stride_s_k,
    HK: tl.constexpr,
    HV: tl.constexpr,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BT: tl.constexpr,
    BKH: tl.constexpr,
    BV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_CKPT: tl.constexpr,
):
    """Per (sequence, value head, BV columns): walks the chunks in order with S [dk, BV] fp32 in registers and
    does only what needs S: stores S_c = round(S) (the chunk's start state, as the output dots read it),
    v' = round(u − w·S_c) [T, HV, dv], and S ← e^Γlast S + k̂ᵀ round((u − w·S_c) e^(Γlast−Γ)) (vLLM's FLA
    rounding point: the decay goes on the fp32 v', so k̂ feeds the dot as loaded, transposed by its addresses).
    w, u from _gdn_chunk_wu_kernel.
    dk is handled as up to two BKH-wide halves (S = [S_lo; S_hi]) to keep the tiles in registers; w·S_c is summed
    over both halves before it is taken from u (as vLLM's FLA kernel and gdn_prefill_ref do), and each operand is
    loaded just before its dot, so fewer tiles are live at once.
    HAS_CKPT: at the start of the sequence's chunk ckpt_chunk[b] (>= 1; -1: none) the fp32 S itself (not the
    rounded S_c) also goes to slot ckpt_slot[b], the state a prefill ending there leaves (an in-step checkpoint)."""
    i_b = tl.program_id(0)
    i_h = tl.program_id(1)
    i_v = tl.program_id(2)
    start = tl.load(query_start_loc_ptr + i_b)
    end = tl.load(query_start_loc_ptr + i_b + 1)
    if end == start:
        return
    DT: tl.constexpr = w_ptr.dtype.element_ty
    TWO_K: tl.constexpr = DK > BKH
    i_slot = i64(tl.load(state_indices_ptr + i_b))
    has_init = (tl.load(has_initial_state_ptr + i_b) != 0) & (i_slot >= 0)
    o_k = tl.arange(0, BKH)
    m_lo = o_k < DK
    m_hi = (o_k + BKH) < DK
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < DV
    p_s = ssm_states_ptr + i_slot * stride_s_slot + i_h * stride_s_head + o_k[:, None] * stride_s_k + o_v[None, :]
    p_s_hi = p_s + BKH * stride_s_k
    b_s = tl.load(p_s, mask=m_lo[:, None] & m_v[None, :] & has_init, other=0.0).to(tl.float32)  # [BKH, BV]
    b_s_hi = tl.load(p_s_hi, mask=m_hi[:, None] & m_v[None, :] & has_init & TWO_K, other=0.0).to(tl.float32)
    i_hk = i_h // GROUP
    i_chunk = tl.load(chunk_offsets_ptr + i_b)
    o_i = tl.arange(0, BT)
    # The chunk's tiles through block pointers over the sequence's rows: scalar bases and strides, no offset tiles
    # held across the walk (at 2 warps four int32 tiles of [64, 64] were 64 registers a thread each, and spilled),
    # and the rows past the end read as zeros by the boundary check.
    seq_len = end - start
    p_kn = kn_ptr + i64(start) * (HK * DK) + i_hk * DK
    p_w = w_ptr + i64(start) * (HV * DK) + i_h * DK
    p_u = u_ptr + i64(start) * (HV * DV) + i_h * DV
    p_vn = vnew_ptr + i64(start) * (HV * DV) + i_h * DV
    p_g = gcum_ptr + i64(start) * HV + i_h
    p_hs = hs_ptr + (i64(i_chunk) * HV + i_h) * (DK * DV)
    ckpt_start = start - BT  # no chunk starts there: no in-step checkpoint
    p_ck = p_s
    if HAS_CKPT:
        ckpt_start = start + tl.load(ckpt_chunk_ptr + i_b) * BT  # -1 -> start - BT: never met
        ckpt_slot = i64(tl.maximum(tl.load(ckpt_slot_ptr + i_b), 0))
        p_ck = ssm_states_ptr + ckpt_slot * stride_s_slot + i_h * stride_s_head + o_k[:, None] * stride_s_k
        p_ck += o_v[None, :]
    for chunk_start in range(start, end, BT):
        if HAS_CKPT:
            is_ckpt = chunk_start == ckpt_start
            tl.store(p_ck, b_s, mask=m_lo[:, None] & m_v[None, :] & is_ckpt)
            if TWO_K:
                tl.store(p_ck + BKH * stride_s_k, b_s_hi, mask=m_hi[:, None] & m_v[None, :] & is_ckpt)
        t0 = chunk_start - start
        m_t = (chunk_start + o_i) < end  # [BT]
        bp_w = tl.make_block_ptr(p_w, (seq_len, DK), (HV * DK, 1), (t0, 0), (BT, BKH), (1, 0))
        bp_u = tl.make_block_ptr(p_u, (seq_len, DV), (HV * DV, 1), (t0, i_v * BV), (BT, BV), (1, 0))
        bp_vn = tl.make_block_ptr(p_vn, (seq_len, DV), (HV * DV, 1), (t0, i_v * BV), (BT, BV), (1, 0))
        bp_hs = tl.make_block_ptr(p_hs, (DK, DV), (DV, 1), (0, i_v * BV), (BKH, BV), (1, 0))
        bp_kt = tl.make_block_ptr(p_kn, (DK, seq_len), (1, HK * DK), (0, t0), (BKH, BT), (0, 1))
        b_w = tl.load(bp_w, boundary_check=(0, 1), padding_option="zero")
        g_last = tl.load(p_g + (tl.minimum(t0 + BT, seq_len) - 1) * HV)
        # Rows past the end continue Γ flat (g = 0), as the prepare kernel's cumsum does.
        b_gcum = tl.where(m_t, tl.load(p_g + (t0 + o_i) * HV, mask=m_t, other=0.0), g_last)  # [BT]
        b_s_dt = b_s.to(DT)
        tl.store(bp_hs, b_s_dt, boundary_check=(0, 1))
        b_ws = tl.dot(b_w, b_s_dt, input_precision=DOT_PRECISION)
        if TWO_K:
            b_w_hi = tl.load(tl.advance(bp_w, (0, BKH)), boundary_check=(0, 1), padding_option="zero")
            b_s_hi_dt = b_s_hi.to(DT)
            tl.store(tl.advance(bp_hs, (BKH, 0)), b_s_hi_dt, boundary_check=(0, 1))
            b_ws += tl.dot(b_w_hi, b_s_hi_dt, input_precision=DOT_PRECISION)
        b_vnew = tl.load(bp_u, boundary_check=(0, 1), padding_option="zero").to(tl.float32) - b_ws  # [BT, BV]
        tl.store(bp_vn, b_vnew.to(DT), boundary_check=(0, 1))
        b_vdecay = (b_vnew * tl.exp(g_last - b_gcum)[:, None]).to(DT)  # [BT, BV]
        b_kt = tl.load(bp_kt, boundary_check=(0, 1), padding_option="zero")  # [BKH, BT] k̂ᵀ, input dtype
        b_s = b_s * tl.exp(g_last) + tl.dot(b_kt, b_vdecay, input_precision=DOT_PRECISION)
        if TWO_K:
            b_kt_hi = tl.load(tl.advance(bp_kt, (BKH, 0)), boundary_check=(0, 1), padding_option="zero")
            b_s_hi = b_s_hi * tl.exp(g_last) + tl.dot(b_kt_hi, b_vdecay, input_precision=DOT_PRECISION)
        p_hs += HV * DK * DV
    tl.store(p_s, b_s, mask=m_lo[:, None] & m_v[None, :] & (i_slot >= 0))
    if TWO_K:
        tl.store(p_s_hi, b_s_hi, mask=m_hi[:, None] & m_v[None, :] & (i_slot >= 0))


@triton.jit(do_not_specialize=["num_seqs"])
def _gdn_chunk_out_kernel(
    qn_ptr,
    gcum_ptr,
    aqk_ptr,
    hs_ptr,
    vnew_ptr,
    query_start_loc_ptr,
    chunk_offsets_ptr,
    out_ptr,
    num_seqs,
    scale,
    HK: tl.constexpr,
    HV: tl.constexpr,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BT: tl.constexpr,
    BKH: tl.constexpr,
    BV: tl.constexpr,
    NUM_SEARCH_STEPS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Per (chunk, value head, BV columns), in parallel: o = ((e^Γ q̂)·S_c + Aqk·v')·scale, the old scan's dot
    order (the dk halves first, Aqk·v' accumulated last), S_c and v' from _gdn_chunk_scan_kernel."""
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    i_v = tl.program_id(2)
    if i_c >= tl.load(chunk_offsets_ptr + num_seqs):
        return
    start, end = _chunk_bounds(query_start_loc_ptr, chunk_offsets_ptr, i_c, num_seqs, BT, NUM_SEARCH_STEPS)
    DT: tl.constexpr = vnew_ptr.dtype.element_ty
    TWO_K: tl.constexpr = DK > BKH
    o_i = tl.arange(0, BT)
    m_t = (start + o_i) < end
    o_k = tl.arange(0, BKH)
    m_lo = o_k < DK
    m_hi = (o_k + BKH) < DK
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < DV
    p_qn = qn_ptr + i64(start) * (HK * DK) + (i_h // GROUP) * DK + o_i[:, None] * (HK * DK) + o_k[None, :]
    p_g = gcum_ptr + i64(start) * HV + i_h
    p_hs = hs_ptr + (i64(i_c) * HV + i_h) * (DK * DV) + o_k[:, None] * DV + o_v[None, :]
    g_last = tl.load(p_g + (tl.minimum(start + BT, end) - 1 - start) * HV)
    b_gcum = tl.where(m_t, tl.load(p_g + o_i * HV, mask=m_t, other=0.0), g_last)  # [BT]
    b_q = tl.load(p_qn, mask=m_t[:, None] & m_lo[None, :], other=0.0)  # q̂ unscaled, input dtype
    b_s = tl.load(p_hs, mask=m_lo[:, None] & m_v[None, :], other=0.0)  # [BKH, BV] S_c, input dtype
    b_o = tl.dot((b_q * tl.exp(b_gcum)[:, None]).to(DT), b_s, input_precision=DOT_PRECISION)  # [BT, BV]
    if TWO_K:
        b_q_hi = tl.load(p_qn + BKH, mask=m_t[:, None] & m_hi[None, :], other=0.0)
        b_s_hi = tl.load(p_hs + BKH * DV, mask=m_hi[:, None] & m_v[None, :], other=0.0)
        b_o = tl.dot((b_q_hi * tl.exp(b_gcum)[:, None]).to(DT), b_s_hi, b_o, input_precision=DOT_PRECISION)
    o_tv = o_i[:, None] * (HV * DV) + o_v[None, :]  # [BT, BV] into v' / o rows
    m_tv = m_t[:, None] & m_v[None, :]
    b_vnew = tl.load(vnew_ptr + i64(start) * (HV * DV) + i_h * DV + o_tv, mask=m_tv, other=0.0)
    b_aqk = tl.load(aqk_ptr + (i64(i_c) * HV + i_h) * (BT * BT) + o_i[:, None] * BT + o_i[None, :])
    b_o = tl.dot(b_aqk, b_vnew, b_o, input_precision=DOT_PRECISION) * scale
    tl.store(out_ptr + i64(start) * (HV * DV) + i_h * DV + o_tv, b_o, mask=m_tv)


def scan_launch(
    num_seqs: int, num_tokens: int, max_query_len: int | None, num_v_heads: int, head_v_dim: int, num_sms: int
) -> tuple[int, int, int]:
    """The scan's (BV, warps, stages) for a call of num_seqs sequences and num_tokens rows: SCAN_FEW while its
    programs at BV 32 fit two waves of one an SM; beyond that SCAN_MANY when the sequences are of similar length (the
    longest, max_query_len, at most twice the mean), else SCAN_FEW, since a long sequence beside short ones walks its
    chunks alone once they end, where BV 64 is slower than 32 (335 against 283 µs for one 35B-A3B sequence of 8,192).
    max_query_len is the runner's host hint; without it a call counts as dissimilar (no device sync to find out)."""
    programs = num_seqs * num_v_heads * triton.cdiv(head_v_dim, SCAN_FEW[0])
    if programs <= 2 * num_sms:
        return SCAN_FEW
    is_even = max_query_len is not None and max_query_len * num_seqs <= 2 * num_tokens
    return SCAN_MANY if is_even else SCAN_FEW


def warmup_probes(
    num_v_heads: int, head_v_dim: int, num_sms: int, max_num_seqs: int, max_num_tokens: int, max_seq_len: int
) -> list[tuple[int, ...]]:
    """The prefill calls (their sequence lengths) the start-up warm-up adds to its one-sequence prefills so that every
    configuration scan_launch can pick compiles before serving: the fewest sequences past two waves, of equal length
    (SCAN_MANY), and at least three, one long beside one-token ones (SCAN_FEW with many programs); each of at most
    max_num_tokens rows, no sequence past max_seq_len, the first sequence two chunks where that fits (so an in-step
    checkpoint can be saved in it, the scan's HAS_CKPT variant); none that needs more than max_num_seqs sequences
    (no served call could pick it)."""
    per_seq = num_v_heads * triton.cdiv(head_v_dim, SCAN_FEW[0])
    num_even = 2 * num_sms // per_seq + 1
    num_uneven = max(num_even, 3)
    candidates = []
    if num_even <= max_num_seqs and max_num_tokens >= num_even:
        candidates.append(((min(2 * CHUNK, max_num_tokens // num_even, max_seq_len),) * num_even, SCAN_MANY))
    if num_uneven <= max_num_seqs and max_num_tokens >= num_uneven:
        first = min(2 * CHUNK, max_num_tokens - (num_uneven - 1), max_seq_len)
        candidates.append(((first,) + (1,) * (num_uneven - 1), SCAN_FEW))
    # a probe too small to pick its configuration (a step budget of a few rows) would only repeat another's
    return [
        lengths
        for lengths, config in candidates
        if scan_launch(len(lengths), sum(lengths), max(lengths), num_v_heads, head_v_dim, num_sms) == config
    ]


def _gdn_prefill_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    out: torch.Tensor,
    checkpoint_chunks: torch.Tensor | None = None,
    checkpoint_slots: torch.Tensor | None = None,
    max_query_len: int | None = None,
) -> None:
    num_tokens, num_k_heads, head_k_dim = q.shape
    num_v_heads, head_v_dim = v.shape[1], v.shape[2]
    num_seqs = state_indices.shape[0]
    group = num_v_heads // num_k_heads
    device = q.device
    # Chunk bookkeeping on the device (no host sync): chunks never straddle sequences.
    lengths = (query_start_loc[1:] - query_start_loc[:-1]).to(torch.int32)
    chunk_offsets = torch.zeros(num_seqs + 1, dtype=torch.int32, device=device)
    chunk_offsets[1:] = torch.cumsum((lengths + CHUNK - 1) // CHUNK, 0)
    max_chunks = triton.cdiv(num_tokens, CHUNK) + num_seqs
    qn = torch.empty(num_tokens, num_k_heads, head_k_dim, dtype=q.dtype, device=device)
    kn = torch.empty(num_tokens, num_k_heads, head_k_dim, dtype=k.dtype, device=device)
    gcum = torch.empty(num_tokens, num_v_heads, dtype=torch.float32, device=device)
    xw = torch.empty(max_chunks, num_v_heads, CHUNK, CHUNK, dtype=v.dtype, device=device)
    xu = torch.empty(max_chunks, num_v_heads, CHUNK, CHUNK, dtype=v.dtype, device=device)
    aqk = torch.empty(max_chunks, num_v_heads, CHUNK, CHUNK, dtype=v.dtype, device=device)
    # A, then X, in fp32 for the prepare kernel's blocked inverse (each program its own tile).
    a_scratch = torch.empty(max_chunks, num_v_heads, CHUNK, CHUNK, dtype=torch.float32, device=device)
    precision = dot_precision(q.dtype)
    _gdn_qk_norm_kernel[(triton.cdiv(num_tokens, CHUNK), num_k_heads)](
        q,
        k,
        qn,
        kn,
        num_tokens,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        HK=num_k_heads,
        DK=head_k_dim,
        BT=CHUNK,
        BK=next_pow2(head_k_dim),
        num_warps=CHUNK_NORM_WARPS,
    )
    _gdn_chunk_prepare_kernel[(max_chunks, num_v_heads)](
        qn,
        kn,
        a,
        b,
        A_log,
        dt_bias,
        query_start_loc,
        chunk_offsets,
        gcum,
        xw,
        xu,
        aqk,
        a_scratch,
        num_seqs,
        a.stride(0),
        b.stride(0),
        HK=num_k_heads,
        HV=num_v_heads,
        GROUP=group,
        DK=head_k_dim,
        BT=CHUNK,
        BK=next_pow2(head_k_dim),
        NUM_SEARCH_STEPS=search_steps(num_seqs),
        DOT_PRECISION=precision,
        num_warps=CHUNK_PREPARE_WARPS,
    )
    assert head_k_dim <= 128, "the chunked scan holds dk as at most two 64-wide halves"
    # The state-free halves of the old scan, in parallel over chunks: w and u (input dtype).
    w = torch.empty(num_tokens, num_v_heads, head_k_dim, dtype=v.dtype, device=device)
    u = torch.empty(num_tokens, num_v_heads, head_v_dim, dtype=v.dtype, device=device)
    _gdn_chunk_wu_kernel[(max_chunks, num_v_heads)](
        kn,
        v,
        xw,
        xu,
        query_start_loc,
        chunk_offsets,
        w,
        u,
        num_seqs,
        v.stride(0),
        v.stride(1),
        HK=num_k_heads,
        HV=num_v_heads,
        GROUP=group,
        DK=head_k_dim,
        DV=head_v_dim,
        BT=CHUNK,
        BK=next_pow2(head_k_dim),
        BV=next_pow2(head_v_dim),
        NUM_SEARCH_STEPS=search_steps(num_seqs),
        DOT_PRECISION=precision,
        num_warps=CHUNK_WU_WARPS,
    )
    # Each chunk's start state (input dtype, as the output dots read it) and v' (input dtype).
    hs = torch.empty(max_chunks, num_v_heads, head_k_dim, head_v_dim, dtype=v.dtype, device=device)
    vnew = torch.empty(num_tokens, num_v_heads, head_v_dim, dtype=v.dtype, device=device)
    block_kh = min(64, next_pow2(head_k_dim))
    has_ckpt = checkpoint_chunks is not None and checkpoint_slots is not None
    device_index = device.index if device.index is not None else 0
    config = scan_launch(num_seqs, num_tokens, max_query_len, num_v_heads, head_v_dim, sm_count(device))
    if config == SCAN_FEW and device_index in _SCAN_STAGES_DO_NOT_FIT:
        config = SCAN_FEW_2_STAGES

    def launch_scan(block_v: int, num_warps: int, num_stages: int) -> None:
        block_v = min(block_v, next_pow2(head_v_dim))
        _gdn_chunk_scan_kernel[(num_seqs, num_v_heads, triton.cdiv(head_v_dim, block_v))](
            kn,
            w,
            u,
            gcum,
            ssm_states,
            query_start_loc,
            state_indices,
            has_initial_state,
            chunk_offsets,
            hs,
            vnew,
            checkpoint_chunks if has_ckpt else state_indices,  # unread without HAS_CKPT
            checkpoint_slots if has_ckpt else state_indices,
            ssm_states.stride(0),
            ssm_states.stride(1),
            ssm_states.stride(2),
            HK=num_k_heads,
            HV=num_v_heads,
            GROUP=group,
            DK=head_k_dim,
            DV=head_v_dim,
            BT=CHUNK,
            BKH=block_kh,
            BV=block_v,
            DOT_PRECISION=precision,
            HAS_CKPT=has_ckpt,
            num_warps=num_warps,
            num_stages=num_stages,
        )

    try:
        launch_scan(*config)
    except OutOfResources as exc:  # raised before the kernel runs: nothing was written
        if config != SCAN_FEW:
            raise
        _SCAN_STAGES_DO_NOT_FIT.add(device_index)
        logger.warning("GDN prefill scan: %s; %d pipeline stages on this device", exc, SCAN_FEW_2_STAGES[2])
        launch_scan(*SCAN_FEW_2_STAGES)
    block_v_out = min(CHUNK_OUT_BV, next_pow2(head_v_dim))
    _gdn_chunk_out_kernel[(max_chunks, num_v_heads, triton.cdiv(head_v_dim, block_v_out))](
        qn,
        gcum,
        aqk,
        hs,
        vnew,
        query_start_loc,
        chunk_offsets,
        out,
        num_seqs,
        head_k_dim**-0.5,
        HK=num_k_heads,
        HV=num_v_heads,
        GROUP=group,
        DK=head_k_dim,
        DV=head_v_dim,
        BT=CHUNK,
        BKH=block_kh,
        BV=block_v_out,
        NUM_SEARCH_STEPS=search_steps(num_seqs),
        DOT_PRECISION=precision,
        num_warps=CHUNK_OUT_WARPS,
    )


def gdn_prefill_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    out: torch.Tensor | None = None,
    checkpoint_chunks: torch.Tensor | None = None,
    checkpoint_slots: torch.Tensor | None = None,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """q, k [T, HK, dk]; v [T, HV, dv]; a, b [T, HV] -> o [T, HV, dv] (into `out` when given); final states
    written to the slots; checkpoint_chunks / checkpoint_slots [B] int32 (optional, on the device): sequence b's
    fp32 state at the start of its chunk checkpoint_chunks[b] (>= 1; -1: none) also goes to checkpoint_slots[b].
    max_query_len: the longest sequence's rows, a host hint for the scan's launch (scan_launch; None: unknown)."""
    num_tokens, num_k_heads, head_k_dim = q.shape
    num_v_heads, head_v_dim = v.shape[1], v.shape[2]
    check_states(ssm_states, num_v_heads, head_k_dim, head_v_dim)
    for name, t in (("q", q), ("k", k), ("v", v), ("a", a), ("b", b)):
        assert t.stride(-1) == 1, f"{name}: last dim must be contiguous"
    out = output(out, (num_tokens, num_v_heads, head_v_dim), v)
    num_seqs = state_indices.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    _gdn_prefill_chunked(
        q, k, v, a, b, A_log, dt_bias, ssm_states, query_start_loc, state_indices, has_initial_state, out,
        checkpoint_chunks, checkpoint_slots, max_query_len,
    )  # fmt: skip
    return out
