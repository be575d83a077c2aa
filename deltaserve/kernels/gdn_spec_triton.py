"""Triton kernel of the verify step's recurrent delta rule (kernels/gdn_spec.py: `gdn_verify_ref` is its twin).

One program owns one (verify sequence, value head, BV-column block): it loads its [dk, BV] slice of the sequence's
live state once, runs the chunk's 1 + k tokens in order with gdn_decode's arithmetic (fp32, q / k L2-normed in
fp32 and not rounded, gates in fp32), stores each token's output row, the state after each token but the last into
the scratch entry [s, j], and the state after the last column (W - 1) into the live slot, over the slice it read
(the same program and layout, and every thread's load was consumed before the loop's first reduction barrier, so no
thread overwrites what another has still to read). Padded columns (token_index -1) read no row, leave the state as
it is and store it again, as the twin does. A sequence with slot < 0 (CUDA-graph padding) reads and writes no slot,
stores no scratch and zero output rows. The commit (spec_state_commit) copies a shorter accepted run's entry.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.kernels._dispatch import output
from deltaserve.kernels._triton import i64, next_pow2
from deltaserve.kernels.gdn_triton import MAX_GRID_YZ, _block_v, _check_states, _gates_of, _l2norm


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
    scratch_ptr,
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
    stride_x_seq,
    stride_x_col,
    stride_x_head,
    stride_x_k,
    stride_ti_seq,
    scale,
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
    p_x = scratch_ptr + i_s * stride_x_seq + i_h * stride_x_head + o_k[:, None] * stride_x_k + o_v[None, :]
    for j in range(width):
        i_t = i64(tl.load(token_index_ptr + i_s * stride_ti_seq + j))
        is_real = i_t >= 0
        i_row = tl.maximum(i_t, 0)
        # A padded column (-1) reads nothing: row 0 may not exist in an empty step.
        b_q = tl.load(q_ptr + i_row * stride_q_t + i_hk * stride_q_h + o_k, mask=m_k & is_real, other=0.0)
        b_k = tl.load(k_ptr + i_row * stride_k_t + i_hk * stride_k_h + o_k, mask=m_k & is_real, other=0.0)
        b_v = tl.load(v_ptr + i_row * stride_v_t + i_h * stride_v_h + o_v, mask=m_v & is_real, other=0.0)
        b_a = tl.load(a_ptr + i_row * stride_a_t + i_h, mask=is_real, other=0.0)
        b_b = tl.load(b_ptr + i_row * stride_b_t + i_h, mask=is_real, other=0.0)
        b_q = _l2norm(b_q.to(tl.float32)) * scale
        b_k = _l2norm(b_k.to(tl.float32))
        b_decay, b_beta = _gates_of(b_a, b_b, b_A_log, b_dt_bias)
        b_new = b_s * b_decay
        b_u = b_beta * (b_v.to(tl.float32) - tl.sum(b_new * b_k[:, None], axis=0))  # [BV]
        b_new += b_k[:, None] * b_u[None, :]
        b_o = tl.sum(b_new * b_q[:, None], axis=0)  # [BV]
        b_s = tl.where(is_real, b_new, b_s)
        is_scratch = tl.full((), j, tl.int32) < width - 1  # the last column's state goes to the live slot below
        tl.store(p_x + j * stride_x_col, b_s, mask=m_s & is_scratch)
        tl.store(out_ptr + (i_row * HV + i_h) * DV + o_v, tl.where(is_live, b_o, 0.0), mask=m_v & is_real)
    tl.store(p_s, b_s.to(ssm_states_ptr.dtype.element_ty), mask=m_s)  # the state after the last column: live


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
    scratch_ssm: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q, k [N, HK, dk]; v [N, HV, dv]; a, b [N, HV] (the verify rows); token_index [S, W] -> o [N, HV, dv];
    scratch_ssm [S_max, >= W - 1, HV, dk, dv] gets the state after each token but the last (fp32), the live slot
    the state after the last column."""
    num_k_heads, head_k_dim = q.shape[1], q.shape[2]
    num_v_heads, head_v_dim = v.shape[1], v.shape[2]
    num_seqs, width = token_index.shape
    _check_states(ssm_states, num_v_heads, head_k_dim, head_v_dim)
    for name, t in (("q", q), ("k", k), ("v", v), ("a", a), ("b", b), ("token_index", token_index)):
        assert t.stride(-1) == 1, f"{name}: last dim must be contiguous"
    assert scratch_ssm.dtype == torch.float32 and scratch_ssm.stride(-1) == 1, "scratch_ssm: fp32, dv contiguous"
    assert scratch_ssm.shape[0] >= num_seqs and scratch_ssm.shape[1] >= width - 1, "scratch_ssm too small for the step"
    out = output(out, tuple(v.shape), v)
    if num_seqs == 0:
        return out
    if num_seqs > MAX_GRID_YZ or num_v_heads > MAX_GRID_YZ:
        raise ValueError(f"gdn_verify: {num_seqs} sequences x {num_v_heads} heads exceed the grid ({MAX_GRID_YZ})")
    block_v = _block_v(head_v_dim)
    _gdn_verify_kernel[(triton.cdiv(head_v_dim, block_v), num_v_heads, num_seqs)](
        q, k, v, a, b, A_log, dt_bias, ssm_states, state_indices, token_index, scratch_ssm, out, width,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0), b.stride(0),
        ssm_states.stride(0), ssm_states.stride(1), ssm_states.stride(2),
        scratch_ssm.stride(0), scratch_ssm.stride(1), scratch_ssm.stride(2), scratch_ssm.stride(3),
        token_index.stride(0), head_k_dim**-0.5,
        HV=num_v_heads, GROUP=num_v_heads // num_k_heads, DK=head_k_dim, DV=head_v_dim, BK=next_pow2(head_k_dim),
        BV=block_v, num_warps=4,
    )  # fmt: skip
    return out
