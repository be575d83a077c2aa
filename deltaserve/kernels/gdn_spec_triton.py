"""Triton kernel of the verify step's recurrent delta rule (kernels/gdn_spec.py: `gdn_verify_ref` is its twin).

One program owns one (verify sequence, value head, BV-column block): it loads its [dk, BV] slice of the sequence's
live state once, runs the chunk's 1 + k tokens in order with gdn_decode's arithmetic (fp32, q / k L2-normed in
fp32 and not rounded, gates in fp32: `delta_step`, which the commit's replay in kernels/gdn_spec_commit_triton.py
shares), stores each token's output row and the inputs the step consumed into the row scratch entry [s, j] (k by
the first value head of its group and a, b by the first column block, v by every program for its columns), and
never writes the live slot: the commit replays the accepted tokens on it. Token j + 1's row is loaded before token j
computes (`_load_token`), so the loads of one token overlap the reductions of the one before. Padded columns
(token_index -1) read no row, store nothing and leave the running state as it is. A sequence with slot < 0
(CUDA-graph padding) reads no slot, stores no scratch and zero output rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.kernels._dispatch import output
from deltaserve.kernels._triton import i64, next_pow2
from deltaserve.kernels.gdn_spec import verify_row_width
from deltaserve.kernels.gdn_triton import MAX_GRID_YZ, check_states, gates_of, l2norm_vector, state_block_v

# the verify kernel and the commit's replay launch [dk, BV] programs with these warps: one layout, one reduction order
VERIFY_NUM_WARPS = 4


@triton.jit
def delta_step(b_s, b_k, b_v, b_a, b_b, b_A_log, b_dt_bias):
    """One token of the delta rule on a [dk, BV] fp32 state slice from the loaded k [dk], v [BV], a, b: the state
    after it. The verify kernel and the commit's replay both step through here, on the same tile shapes and warps,
    so the replayed state is the one the verify held."""
    b_k = l2norm_vector(b_k.to(tl.float32))
    b_decay, b_beta = gates_of(b_a, b_b, b_A_log, b_dt_bias)
    b_new = b_s * b_decay
    b_u = b_beta * (b_v.to(tl.float32) - tl.sum(b_new * b_k[:, None], axis=0))  # [BV]
    return b_new + b_k[:, None] * b_u[None, :]


# width and token_index's row stride (= width) change with the step's widest chunk: unspecialised, so a step whose
# chunks are all one token (width 1) compiles no variant of its own while serving.
@triton.jit(do_not_specialize=["width", "stride_ti_seq"])
def _gdn_verify_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    a_ptr,
    b_ptr,
    A_log_ptr,
    dt_bias_ptr,
    ssm_states_ptr,
    state_indices_ptr,
    token_index_ptr,
    rows_ptr,
    out_ptr,
    width,
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
    stride_r_seq,
    stride_r_col,
    stride_ti_seq,
    scale,
    HK: tl.constexpr,
    HV: tl.constexpr,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_h = tl.program_id(1)
    i_s = i64(tl.program_id(2))
    i_hk = i_h // GROUP
    o_k = tl.arange(0, BK)  # [BK]
    m_k = o_k < DK
    o_v = i_v * BV + tl.arange(0, BV)  # [BV]
    m_v = o_v < DV
    # A padded sequence of a CUDA-graph bucket carries slot -1: it reads no slot, writes no scratch, zero output.
    i_slot = i64(tl.load(state_indices_ptr + i_s))
    is_live = i_slot >= 0
    m_s = m_k[:, None] & m_v[None, :] & is_live
    p_s = ssm_states_ptr + i_slot * stride_s_slot + i_h * stride_s_head + o_k[:, None] * stride_s_k + o_v[None, :]
    b_s = tl.load(p_s, mask=m_s, other=0.0).to(tl.float32)  # [BK, BV]: the live state, read once
    b_A_log = tl.load(A_log_ptr + i_h)
    b_dt_bias = tl.load(dt_bias_ptr + i_h)
    # the row scratch entry [s, j]: [k (HK·dk) | v (HV·dv) | a (HV) | b (HV)], what the commit replays
    p_r = rows_ptr + i_s * stride_r_seq
    writes_k = is_live & (i_v == 0) & (i_h % GROUP == 0)
    writes_ab = is_live & (i_v == 0)
    p_ti = token_index_ptr + i_s * stride_ti_seq
    # Token j + 1's index and row are loaded before token j computes (carried in registers), so their latency
    # overlaps the step's reductions instead of preceding them; the arithmetic is unchanged.
    i_row, is_real, b_q, b_k, b_v, b_a, b_b = _load_token(
        p_ti, 0, width, q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, i_hk, i_h, o_k, m_k, o_v, m_v,
        stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_a_t, stride_b_t,
    )  # fmt: skip
    for j in range(width):
        n_row, n_real, n_q, n_k, n_v, n_a, n_b = _load_token(
            p_ti, j + 1, width, q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, i_hk, i_h, o_k, m_k, o_v, m_v,
            stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_a_t, stride_b_t,
        )  # fmt: skip
        p_col = p_r + j * stride_r_col
        tl.store(p_col + i_hk * DK + o_k, b_k, mask=m_k & is_real & writes_k)
        tl.store(p_col + HK * DK + i_h * DV + o_v, b_v, mask=m_v & is_real & is_live)
        tl.store(p_col + HK * DK + HV * DV + i_h, b_a, mask=is_real & writes_ab)
        tl.store(p_col + HK * DK + HV * DV + HV + i_h, b_b, mask=is_real & writes_ab)
        b_new = delta_step(b_s, b_k, b_v, b_a, b_b, b_A_log, b_dt_bias)
        b_q = l2norm_vector(b_q.to(tl.float32)) * scale
        b_o = tl.sum(b_new * b_q[:, None], axis=0)  # [BV]
        b_s = tl.where(is_real, b_new, b_s)
        tl.store(out_ptr + (i_row * HV + i_h) * DV + o_v, tl.where(is_live, b_o, 0.0), mask=m_v & is_real)
        i_row, is_real, b_q, b_k, b_v, b_a, b_b = n_row, n_real, n_q, n_k, n_v, n_a, n_b


@triton.jit
def _load_token(
    p_ti, j, width, q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, i_hk, i_h, o_k, m_k, o_v, m_v,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_a_t, stride_b_t,
):  # fmt: skip
    """Token column j of the chunk: its step row and whether it is real (a padded column, -1, or a column past the
    step's width reads nothing: row 0 may not exist in an empty step), and its q, k [dk], v [BV], a, b as stored."""
    i_t = i64(tl.load(p_ti + j, mask=j < width, other=-1))
    is_real = i_t >= 0
    i_row = tl.maximum(i_t, 0)
    b_q = tl.load(q_ptr + i_row * stride_q_t + i_hk * stride_q_h + o_k, mask=m_k & is_real, other=0.0)
    b_k = tl.load(k_ptr + i_row * stride_k_t + i_hk * stride_k_h + o_k, mask=m_k & is_real, other=0.0)
    b_v = tl.load(v_ptr + i_row * stride_v_t + i_h * stride_v_h + o_v, mask=m_v & is_real, other=0.0)
    b_a = tl.load(a_ptr + i_row * stride_a_t + i_h, mask=is_real, other=0.0)
    b_b = tl.load(b_ptr + i_row * stride_b_t + i_h, mask=is_real, other=0.0)
    return i_row, is_real, b_q, b_k, b_v, b_a, b_b


def gdn_verify_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
    token_index: torch.Tensor,
    scratch_rows: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q, k [N, HK, dk]; v [N, HV, dv]; a, b [N, HV] (the verify rows); token_index [S, W] -> o [N, HV, dv];
    scratch_rows [S_max, >= W, R] gets each real token's [k | v | a | b] in the inputs' dtype; the live slots are
    read only."""
    num_k_heads, head_k_dim = q.shape[1], q.shape[2]
    num_v_heads, head_v_dim = v.shape[1], v.shape[2]
    num_seqs, width = token_index.shape
    check_states(ssm_states, num_v_heads, head_k_dim, head_v_dim)
    for name, t in (("q", q), ("k", k), ("v", v), ("a", a), ("b", b), ("token_index", token_index)):
        assert t.stride(-1) == 1, f"{name}: last dim must be contiguous"
    assert scratch_rows.stride(-1) == 1, "scratch_rows: contiguous rows"
    assert scratch_rows.shape[2] == verify_row_width(num_k_heads, head_k_dim, num_v_heads, head_v_dim)
    assert scratch_rows.shape[0] >= num_seqs and scratch_rows.shape[1] >= width, "scratch_rows too small for the step"
    # stored as loaded, so the commit replays the very values: one dtype for the inputs and the scratch
    assert k.dtype == v.dtype == a.dtype == b.dtype == scratch_rows.dtype, "k, v, a, b and scratch_rows differ in dtype"
    out = output(out, tuple(v.shape), v)
    if num_seqs == 0:
        return out
    if num_seqs > MAX_GRID_YZ or num_v_heads > MAX_GRID_YZ:
        raise ValueError(f"gdn_verify: {num_seqs} sequences x {num_v_heads} heads exceed the grid ({MAX_GRID_YZ})")
    block_v = state_block_v(head_v_dim)
    _gdn_verify_kernel[(triton.cdiv(head_v_dim, block_v), num_v_heads, num_seqs)](
        q, k, v, a, b, A_log, dt_bias, ssm_states, state_indices, token_index, scratch_rows, out, width,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0), b.stride(0),
        ssm_states.stride(0), ssm_states.stride(1), ssm_states.stride(2),
        scratch_rows.stride(0), scratch_rows.stride(1),
        token_index.stride(0), head_k_dim**-0.5,
        HK=num_k_heads, HV=num_v_heads, GROUP=num_v_heads // num_k_heads, DK=head_k_dim, DV=head_v_dim,
        BK=next_pow2(head_k_dim), BV=block_v, num_warps=VERIFY_NUM_WARPS,
    )  # fmt: skip
    return out
