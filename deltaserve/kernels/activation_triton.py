"""Triton SiLU-and-mul for the SwiGLU MLPs: out = SiLU(x[..., :I]) ⊙ x[..., I:], fp32 inside, one rounding.

Grid (row, column block): rows are tokens (they may be strided), BLOCK_I columns of the gate half and the
matching columns of the up half per program, so both loads are coalesced runs of the same row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.kernels._triton import i64, next_pow2, require_last_dim_contiguous, silu_f32


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, I: tl.constexpr, BLOCK_I: tl.constexpr):
    i_t = i64(tl.program_id(0))
    o_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    m_i = o_i < I
    p_x = x_ptr + i_t * stride_x + o_i
    b_gate = tl.load(p_x, mask=m_i, other=0.0).to(tl.float32)
    b_up = tl.load(p_x + I, mask=m_i, other=0.0).to(tl.float32)
    tl.store(out_ptr + i_t * I + o_i, silu_f32(b_gate) * b_up, mask=m_i)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] -> [..., I] (contiguous)."""
    require_last_dim_contiguous("x", x)
    half = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], half, dtype=x.dtype, device=x.device)
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    num_rows = x2.shape[0]
    if num_rows == 0 or half == 0:
        return out
    block_i = min(1024, next_pow2(half))
    _silu_and_mul_kernel[(num_rows, triton.cdiv(half, block_i))](
        x2, out, x2.stride(0), I=half, BLOCK_I=block_i, num_warps=max(1, min(4, block_i // 256))
    )
    return out
