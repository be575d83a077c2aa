"""Triton kernels for the gated-attention preamble: the fused q/k norm + RoPE + gate split, and 1-D RoPE.

`attn_preamble_triton` is one launch over a (token, head) grid with nq + nkv programs per token. Program (t, h) reads
one head straight out of the fused qkv row (query head h: [query d | gate d]; KV head h − nq: k), takes the zero-centred
RMSNorm in fp32, rounds the normed head to the input dtype (vLLM's rounding point,
docs/ARCHITECTURE.md#gated-full-attention), rotates the first rotary_dim dims in fp32 with the token's cos/sin row and
rounds once on store; the pass-through dims are stored from the rounded normed value and a query program also copies its
gate half raw. A head is loaded whole for the norm and its two rotary halves are re-read (they hit L1) rather than
shuffled between threads.

`rotary_embedding_triton` is the unfused path's fourth op: out-of-place NeoX RoPE over 1-D positions and
the [max_pos, r] cache, fp32 rotation, one rounding (the ref returns new tensors, so this does too).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.kernels._triton import i64, next_pow2, pdl_launch, pdl_wait, require_last_dim_contiguous


def _num_warps(head_dim: int) -> int:
    # One head per program: 4 warps at d = 256 (2 elements per thread, fully coalesced), fewer below.
    return max(1, min(4, next_pow2(head_dim) // 64))


@triton.jit
def _attn_preamble_kernel(
    qkv_ptr,
    q_weight_ptr,
    k_weight_ptr,
    cos_sin_ptr,
    q_ptr,
    k_ptr,
    gate_ptr,
    stride_qkv,
    stride_cos_sin,
    eps,
    NQ: tl.constexpr,
    NKV: tl.constexpr,
    D: tl.constexpr,
    ROT: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    i_t = i64(tl.program_id(0))
    i_h = tl.program_id(1)
    HALF: tl.constexpr = ROT // 2
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    o_r = tl.arange(0, BLOCK_HALF)
    m_r = o_r < HALF

    # The norm weights and this step's cos/sin rows (computed at the start of the forward) may load before the
    # wait (_triton.pdl_wait); qkv is the projection's output, the launch before.
    if i_h < NQ:
        p_w = q_weight_ptr
    else:
        p_w = k_weight_ptr
    b_w = tl.load(p_w + o_d, mask=m_d, other=0.0).to(tl.float32)  # [BLOCK_D]
    b_w1 = tl.load(p_w + o_r, mask=m_r, other=0.0).to(tl.float32)  # [BLOCK_HALF]
    b_w2 = tl.load(p_w + HALF + o_r, mask=m_r, other=0.0).to(tl.float32)
    p_cs = cos_sin_ptr + i_t * stride_cos_sin
    b_cos = tl.load(p_cs + o_r, mask=m_r, other=0.0).to(tl.float32)
    b_sin = tl.load(p_cs + HALF + o_r, mask=m_r, other=0.0).to(tl.float32)
    pdl_wait(USE_PDL)

    p_row = qkv_ptr + i_t * stride_qkv
    if i_h < NQ:
        p_x = p_row + i_h * (2 * D)
        p_out = q_ptr + i_t * (NQ * D) + i_h * D
        # The gate half of the head's [query | gate] pair, copied raw (sigmoid happens after attention).
        b_gate = tl.load(p_x + D + o_d, mask=m_d)
        tl.store(gate_ptr + i_t * (NQ * D) + i_h * D + o_d, b_gate, mask=m_d)
    else:
        p_x = p_row + NQ * 2 * D + (i_h - NQ) * D
        p_out = k_ptr + i_t * (NKV * D) + (i_h - NQ) * D

    b_x = tl.load(p_x + o_d, mask=m_d, other=0.0).to(tl.float32)  # [BLOCK_D]
    inv_rms = tl.rsqrt(tl.sum(b_x * b_x, axis=0) / D + eps)
    b_xn = (b_x * inv_rms * (1.0 + b_w)).to(q_ptr.dtype.element_ty)  # rounded normed head
    tl.store(p_out + o_d, b_xn, mask=m_d & (o_d >= ROT))

    # The rotary halves, normed and rounded exactly as above, then rotated in fp32.
    b_x1 = tl.load(p_x + o_r, mask=m_r, other=0.0).to(tl.float32)  # [BLOCK_HALF]
    b_x2 = tl.load(p_x + HALF + o_r, mask=m_r, other=0.0).to(tl.float32)
    b_x1 = (b_x1 * inv_rms * (1.0 + b_w1)).to(q_ptr.dtype.element_ty).to(tl.float32)
    b_x2 = (b_x2 * inv_rms * (1.0 + b_w2)).to(q_ptr.dtype.element_ty).to(tl.float32)
    tl.store(p_out + o_r, b_x1 * b_cos - b_x2 * b_sin, mask=m_r)
    tl.store(p_out + HALF + o_r, b_x2 * b_cos + b_x1 * b_sin, mask=m_r)


def attn_preamble_triton(
    qkv: torch.Tensor,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    cos_sin: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rotary_dim: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [T, ≥ nq·2d + nkv·d] (rows may be strided), cos_sin [T, r] -> q [T, nq·d], k [T, nkv·d], gate [T, nq·d]."""
    require_last_dim_contiguous("qkv", qkv)
    require_last_dim_contiguous("cos_sin", cos_sin)
    assert rotary_dim % 2 == 0 and rotary_dim <= head_dim
    assert qkv.shape[1] >= num_q_heads * 2 * head_dim + num_kv_heads * head_dim
    num_tokens = qkv.shape[0]
    q = torch.empty(num_tokens, num_q_heads * head_dim, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(num_tokens, num_kv_heads * head_dim, dtype=qkv.dtype, device=qkv.device)
    gate = torch.empty(num_tokens, num_q_heads * head_dim, dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q, k, gate
    _attn_preamble_kernel[(num_tokens, num_q_heads + num_kv_heads)](
        qkv,
        q_norm_weight,
        k_norm_weight,
        cos_sin,
        q,
        k,
        gate,
        qkv.stride(0),
        cos_sin.stride(0),
        eps,
        NQ=num_q_heads,
        NKV=num_kv_heads,
        D=head_dim,
        ROT=rotary_dim,
        BLOCK_D=next_pow2(head_dim),
        BLOCK_HALF=next_pow2(rotary_dim // 2),
        num_warps=_num_warps(head_dim),
        **pdl_launch(qkv),
    )
    return q, k, gate


@triton.jit
def _rotary_embedding_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    cos_sin_cache_ptr,
    q_out_ptr,
    k_out_ptr,
    stride_q,
    stride_k,
    stride_cache,
    NQ: tl.constexpr,
    NKV: tl.constexpr,
    D: tl.constexpr,
    ROT: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    i_t = i64(tl.program_id(0))
    i_h = tl.program_id(1)
    HALF: tl.constexpr = ROT // 2
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    o_r = tl.arange(0, BLOCK_HALF)
    m_r = o_r < HALF
    if i_h < NQ:
        p_x = q_ptr + i_t * stride_q + i_h * D
        p_out = q_out_ptr + i_t * (NQ * D) + i_h * D
    else:
        p_x = k_ptr + i_t * stride_k + (i_h - NQ) * D
        p_out = k_out_ptr + i_t * (NKV * D) + (i_h - NQ) * D

    b_x = tl.load(p_x + o_d, mask=m_d & (o_d >= ROT))
    tl.store(p_out + o_d, b_x, mask=m_d & (o_d >= ROT))
    i_pos = i64(tl.load(positions_ptr + i_t))
    p_cs = cos_sin_cache_ptr + i_pos * stride_cache
    b_cos = tl.load(p_cs + o_r, mask=m_r, other=0.0).to(tl.float32)  # [BLOCK_HALF]
    b_sin = tl.load(p_cs + HALF + o_r, mask=m_r, other=0.0).to(tl.float32)
    b_x1 = tl.load(p_x + o_r, mask=m_r, other=0.0).to(tl.float32)
    b_x2 = tl.load(p_x + HALF + o_r, mask=m_r, other=0.0).to(tl.float32)
    tl.store(p_out + o_r, b_x1 * b_cos - b_x2 * b_sin, mask=m_r)
    tl.store(p_out + HALF + o_r, b_x2 * b_cos + b_x1 * b_sin, mask=m_r)


def rotary_embedding_triton(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
    rotary_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T]; q [T, nq·d], k [T, nkv·d] (rows may be strided) -> new rotated q, k (contiguous)."""
    for name, t in (("q", q), ("k", k), ("cos_sin_cache", cos_sin_cache)):
        require_last_dim_contiguous(name, t)
    num_tokens = q.shape[0]
    num_q_heads = q.shape[1] // head_dim
    num_kv_heads = k.shape[1] // head_dim
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    _rotary_embedding_kernel[(num_tokens, num_q_heads + num_kv_heads)](
        positions,
        q,
        k,
        cos_sin_cache,
        q_out,
        k_out,
        q.stride(0),
        k.stride(0),
        cos_sin_cache.stride(0),
        NQ=num_q_heads,
        NKV=num_kv_heads,
        D=head_dim,
        ROT=rotary_dim,
        BLOCK_D=next_pow2(head_dim),
        BLOCK_HALF=next_pow2(rotary_dim // 2),
        num_warps=_num_warps(head_dim),
    )
    return q_out, k_out
