"""Triton launchers of the FlashInfer path's prep and state copies (kernels/gdn_flashinfer.py, twins
`gdn_prefill_prep_ref`, `gather_states_ref`, `scatter_states_ref`).

`gdn_prefill_prep_triton` does in one launch what vLLM's fused_post_conv_prep (apply_l2norm=True) does before it
calls FlashInfer, with its rounding: per key head q̂ = q·(1/√(Σq² + 1e-6)) and k̂ likewise in fp32, stored in the
input dtype; per value head v copied to a contiguous row, g = −e^A_log·softplus(a + dt_bias) (vLLM's two-sided
softplus, x itself above 20) and β = σ(b) in fp32. In torch these would be about ten launches and as many passes
over q and k, an estimated time of the order of FlashInfer's own kernel at 8 x 1024 tokens
(docs/kernels.md#flashinfers-gdn-prefill).
Grid: (⌈T / 16⌉, HK + HV), as vLLM's: programs below HK do a key head's q and k, the others a value head.

`gather_states_triton` and `scatter_states_triton` move the start and final states between deltaserve's slots
[slots, HV, dk, dv] and FlashInfer's [N, HV, dv, dk], transposing on the way, one launch each; in torch they were
about 6 and 12 launches (index_select, copies, masks, the no-sync anchor of write_slots), whose host time made the
path cost a multiple of FlashInfer's own kernel on calls of a few thousand rows
(docs/kernels.md#flashinfers-gdn-prefill). Grid: (N, HV, ⌈dk / 32⌉), a program moving 32 rows of dk of one head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.kernels._triton import i64, next_pow2, require_last_dim_contiguous

# Tokens a program covers (vLLM's BLOCK_T) and its warps.
PREP_BLOCK_T = 16
PREP_WARPS = 4
# dk rows of one head's state a gather or scatter program moves (all dv columns), and its warps.
STATE_BLOCK_K = 32
STATE_WARPS = 4


@triton.jit
def _l2norm_rows(src_ptr, dst_ptr, o_t, m_t, stride_src, stride_dst, DK: tl.constexpr, BK: tl.constexpr):
    """One head's [BT, DK] rows: x / √(Σx² + 1e-6) in fp32, stored in dst's dtype."""
    o_k = tl.arange(0, BK)
    m = m_t[:, None] & (o_k < DK)[None, :]
    b_x = tl.load(src_ptr + i64(o_t)[:, None] * stride_src + o_k[None, :], mask=m, other=0.0).to(tl.float32)
    b_inv = 1.0 / tl.sqrt(tl.sum(b_x * b_x, axis=1) + 1e-6)
    b_y = (b_x * b_inv[:, None]).to(dst_ptr.dtype.element_ty)
    tl.store(dst_ptr + i64(o_t)[:, None] * stride_dst + o_k[None, :], b_y, mask=m)


@triton.jit(do_not_specialize=["num_tokens"])
def _gdn_prep_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    a_ptr,
    b_ptr,
    A_log_ptr,
    dt_bias_ptr,
    qn_ptr,
    kn_ptr,
    vc_ptr,
    g_ptr,
    beta_ptr,
    num_tokens,
    stride_q_t,
    stride_q_h,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_a_t,
    stride_b_t,
    HK: tl.constexpr,
    HV: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    i_t = tl.program_id(0)
    i_h = tl.program_id(1)
    o_t = i_t * BT + tl.arange(0, BT)  # [BT] token rows
    m_t = o_t < num_tokens
    if i_h < HK:
        _l2norm_rows(q_ptr + i_h * stride_q_h, qn_ptr + i_h * DK, o_t, m_t, stride_q_t, HK * DK, DK, BK)
        _l2norm_rows(k_ptr + i_h * stride_k_h, kn_ptr + i_h * DK, o_t, m_t, stride_k_t, HK * DK, DK, BK)
    else:
        i_v = i_h - HK
        o_v = tl.arange(0, BV)
        m = m_t[:, None] & (o_v < DV)[None, :]
        b_v = tl.load(v_ptr + i64(o_t)[:, None] * stride_v_t + i_v * stride_v_h + o_v[None, :], mask=m, other=0.0)
        tl.store(vc_ptr + i64(o_t)[:, None] * (HV * DV) + i_v * DV + o_v[None, :], b_v, mask=m)
        b_a = tl.load(a_ptr + i64(o_t) * stride_a_t + i_v, mask=m_t, other=0.0).to(tl.float32)
        b_b = tl.load(b_ptr + i64(o_t) * stride_b_t + i_v, mask=m_t, other=0.0).to(tl.float32)
        x = b_a + tl.load(dt_bias_ptr + i_v).to(tl.float32)
        # vLLM's softplus: each side in the form that does not overflow, x itself above the threshold 20
        b_sp = tl.where(x > 0, x + tl.log(1.0 + tl.exp(-x)), tl.log(1.0 + tl.exp(x)))
        b_sp = tl.where(x <= 20.0, b_sp, x)
        b_g = -tl.exp(tl.load(A_log_ptr + i_v).to(tl.float32)) * b_sp
        tl.store(g_ptr + i64(o_t) * HV + i_v, b_g, mask=m_t)
        tl.store(beta_ptr + i64(o_t) * HV + i_v, tl.sigmoid(b_b), mask=m_t)


def gdn_prefill_prep_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k [T, HK, dk]; v [T, HV, dv]; a, b [T, HV] (row-strided views, last dim contiguous) -> (q̂, k̂ [T, HK, dk]
    in the input dtype, v [T, HV, dv], g [T, HV] fp32, β [T, HV] fp32), all contiguous."""
    num_tokens, num_k_heads, head_k_dim = q.shape
    num_v_heads, head_v_dim = v.shape[1], v.shape[2]
    for name, t in (("q", q), ("k", k), ("v", v), ("a", a), ("b", b)):
        require_last_dim_contiguous(name, t)
    device = q.device
    q_hat = torch.empty(num_tokens, num_k_heads, head_k_dim, dtype=q.dtype, device=device)
    k_hat = torch.empty(num_tokens, num_k_heads, head_k_dim, dtype=k.dtype, device=device)
    v_out = torch.empty(num_tokens, num_v_heads, head_v_dim, dtype=v.dtype, device=device)
    g = torch.empty(num_tokens, num_v_heads, dtype=torch.float32, device=device)
    beta = torch.empty(num_tokens, num_v_heads, dtype=torch.float32, device=device)
    if num_tokens == 0:
        return q_hat, k_hat, v_out, g, beta
    grid = (triton.cdiv(num_tokens, PREP_BLOCK_T), num_k_heads + num_v_heads)
    _gdn_prep_kernel[grid](
        q, k, v, a, b, A_log, dt_bias, q_hat, k_hat, v_out, g, beta, num_tokens,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0), b.stride(0),
        HK=num_k_heads, HV=num_v_heads, DK=head_k_dim, DV=head_v_dim, BT=PREP_BLOCK_T, BK=next_pow2(head_k_dim),
        BV=next_pow2(head_v_dim), num_warps=PREP_WARPS,
    )  # fmt: skip
    return q_hat, k_hat, v_out, g, beta


@triton.jit
def _state_tiles(states_ptr, fi_ptr, slot, i_n, stride_s, stride_h, stride_k, HV, DK, DV, BK, BV):
    """This program's tile of sequence i_n's head: pointers [BK, BV] into its slot's [dk, dv] rows and into the same
    elements of FlashInfer's [N, HV, dv, dk] copy (transposed), and the in-range mask. A slot < 0 addresses slot 0;
    the callers mask it."""
    i_h = tl.program_id(1)
    o_k = tl.program_id(2) * BK + tl.arange(0, BK)  # [BK] dk rows
    o_v = tl.arange(0, BV)  # [BV] dv columns
    m = (o_k < DK)[:, None] & (o_v < DV)[None, :]
    p_slot = states_ptr + i64(tl.maximum(slot, 0)) * stride_s + i_h * stride_h + o_k[:, None] * stride_k + o_v[None, :]
    p_fi = fi_ptr + (i64(i_n) * HV + i_h) * (DV * DK) + o_v[None, :] * DK + o_k[:, None]
    return p_slot, p_fi, m


@triton.jit
def _gather_states_kernel(
    states_ptr,
    slots_ptr,
    has_init_ptr,
    initial_ptr,
    stride_s,
    stride_h,
    stride_k,
    HV: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    i_n = tl.program_id(0)
    slot = tl.load(slots_ptr + i_n)
    reads = (slot >= 0) & (tl.load(has_init_ptr + i_n) != 0)
    p_slot, p_fi, m = _state_tiles(states_ptr, initial_ptr, slot, i_n, stride_s, stride_h, stride_k, HV, DK, DV, BK, BV)
    # a row that reads nothing stores zeros and loads nothing: a free slot may hold NaN
    b_s = tl.load(p_slot, mask=m & reads, other=0.0)  # [BK, BV]
    tl.store(p_fi, b_s, mask=m)


@triton.jit
def _scatter_states_kernel(
    states_ptr,
    slots_ptr,
    starts_ptr,
    final_ptr,
    stride_s,
    stride_h,
    stride_k,
    HV: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    i_n = tl.program_id(0)
    slot = tl.load(slots_ptr + i_n)
    writes = (slot >= 0) & (tl.load(starts_ptr + i_n + 1) > tl.load(starts_ptr + i_n))
    p_slot, p_fi, m = _state_tiles(states_ptr, final_ptr, slot, i_n, stride_s, stride_h, stride_k, HV, DK, DV, BK, BV)
    b_s = tl.load(p_fi, mask=m & writes, other=0.0)  # [BK, BV]
    tl.store(p_slot, b_s, mask=m & writes)


def _launch_state_copy(
    kernel: triton.JITFunction,
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
    per_seq: torch.Tensor,
    flashinfer_states: torch.Tensor,
) -> None:
    """One launch of a state copy between the slots and FlashInfer's [N, HV, dv, dk] tensor; grid (N, HV, ⌈dk / 32⌉).
    per_seq: what decides a sequence's copy (has_initial_state, or query_start_loc for the lengths)."""
    num_seqs, num_v_heads, head_k_dim, head_v_dim = (state_indices.shape[0], *ssm_states.shape[1:])
    if num_seqs == 0:
        return
    kernel[(num_seqs, num_v_heads, triton.cdiv(head_k_dim, STATE_BLOCK_K))](
        ssm_states, state_indices, per_seq, flashinfer_states, ssm_states.stride(0), ssm_states.stride(1),
        ssm_states.stride(2), HV=num_v_heads, DK=head_k_dim, DV=head_v_dim, BK=STATE_BLOCK_K,
        BV=next_pow2(head_v_dim), num_warps=STATE_WARPS,
    )  # fmt: skip


def gather_states_triton(
    ssm_states: torch.Tensor, state_indices: torch.Tensor, has_initial_state: torch.Tensor
) -> torch.Tensor:
    """ssm_states [slots, HV, dk, dv] fp32 (slot-strided views allowed, dv contiguous); state_indices [N];
    has_initial_state [N] -> [N, HV, dv, dk] fp32 contiguous: slot state_indices[n] transposed, zeros where
    has_initial_state[n] is False or the slot is < 0."""
    require_last_dim_contiguous("ssm_states", ssm_states)
    num_v_heads, head_k_dim, head_v_dim = ssm_states.shape[1:]
    initial = torch.empty(state_indices.shape[0], num_v_heads, head_v_dim, head_k_dim, dtype=ssm_states.dtype,
                          device=ssm_states.device)  # fmt: skip
    _launch_state_copy(_gather_states_kernel, ssm_states, state_indices, has_initial_state, initial)
    return initial


def scatter_states_triton(
    ssm_states: torch.Tensor, state_indices: torch.Tensor, query_start_loc: torch.Tensor, final: torch.Tensor
) -> None:
    """final [N, HV, dv, dk] into ssm_states[state_indices[n]] as [HV, dk, dv], for each sequence with a slot >= 0
    and at least one token; the writing sequences' slots are distinct (each sequence owns its slot)."""
    require_last_dim_contiguous("ssm_states", ssm_states)
    if not final.is_contiguous():
        raise ValueError("final: FlashInfer's final states are contiguous [N, HV, dv, dk]")
    _launch_state_copy(_scatter_states_kernel, ssm_states, state_indices, query_start_loc, final)
