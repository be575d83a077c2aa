"""Triton skinny GEMM: y = x·Wᵀ for at most 16 rows of x, streaming W [N, K] once at close to copy bandwidth.

Grid: one program per BLOCK_N output columns; each walks the whole K (no split-K partials, no second pass, so
the result does not depend on scheduling). W is read as [BLOCK_K, BLOCK_N] tiles whose K run is contiguous
(16-byte vectors through cp.async, NUM_STAGES deep), x as [16, BLOCK_K] tiles (L2-resident), tl.dot with
the rows padded to 16. BLOCK_N is chosen so the grid holds at least ~128 programs (one per SM on the H200):
16 columns up to N = 4096, 32 up to 16384, 64 beyond; with NUM_STAGES stages of 16 rows x BLOCK_K, each
program keeps 16-48 KiB of W in flight, what one SM needs to pull its share of 4.3 TB/s.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.kernels._triton import dot_precision, i64


@triton.jit(do_not_specialize=["num_rows"])
def _skinny_gemm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    num_rows,
    stride_x,
    stride_w,
    stride_y,
    N: tl.constexpr,
    K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    i_n = tl.program_id(0)
    o_m = tl.arange(0, BLOCK_M)
    m_m = o_m < num_rows
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    m_n = o_n < N
    o_k = tl.arange(0, BLOCK_K)
    p_x = x_ptr + i64(o_m)[:, None] * stride_x + o_k[None, :]  # [BLOCK_M, BLOCK_K]
    p_w = w_ptr + i64(o_n)[None, :] * stride_w + o_k[:, None]  # [BLOCK_K, BLOCK_N]
    b_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        m_k = (k0 + o_k) < K
        b_x = tl.load(p_x, mask=m_m[:, None] & m_k[None, :], other=0.0)
        b_w = tl.load(p_w, mask=m_k[:, None] & m_n[None, :], other=0.0)
        b_acc = tl.dot(b_x, b_w, b_acc, input_precision=DOT_PRECISION)
        p_x += BLOCK_K
        p_w += BLOCK_K
    p_y = y_ptr + i64(o_m)[:, None] * stride_y + o_n[None, :]
    tl.store(p_y, b_acc, mask=m_m[:, None] & m_n[None, :])


def skinny_config(num_cols: int, depth: int) -> dict[str, int]:
    """BLOCK_N / BLOCK_K / warps / stages for an [N, K] weight (see the module docstring)."""
    block_n = 16 if num_cols <= 4096 else (32 if num_cols <= 16384 else 64)
    block_k = min(256, triton.next_power_of_2(depth))
    return {"BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": 4, "num_stages": 4}


def linear_triton(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] (M ≤ 16, last dim contiguous), weight [N, K] contiguous -> [M, N] in x's dtype."""
    num_rows, depth = x.shape
    num_cols = weight.shape[0]
    assert weight.shape[1] == depth and weight.stride(1) == 1 and x.stride(1) == 1
    if num_rows > 16:
        raise ValueError(f"linear_triton takes at most 16 rows, got {num_rows}")
    y = torch.empty(num_rows, num_cols, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return y
    config = skinny_config(num_cols, depth)
    _skinny_gemm_kernel[(triton.cdiv(num_cols, config["BLOCK_N"]),)](
        x,
        weight,
        y,
        num_rows,
        x.stride(0),
        weight.stride(0),
        y.stride(0),
        N=num_cols,
        K=depth,
        DOT_PRECISION=dot_precision(x.dtype),
        BLOCK_M=16,
        **config,
    )
    return y
