"""Triton register GEMV: y = x·Wᵀ for one row of x, the weight streamed ahead of the programmatic-dependent-launch
wait (docs/kernels.md#linear-projections).

`_gemv_kernel` uses no tensor cores: each program holds BLOCK_N whole rows of W [N, K] as one [BLOCK_N,
next_pow2(K)] register tile, loaded in one go BEFORE the PDL wait (W never depends on the launch before, so all of
its bytes are in flight while that launch finishes), then multiplies it with x after the wait, sums in fp32 and
rounds once to y's dtype (F.linear's rounding point; the sum order differs, fp32-level noise). kernels.linear sends
it one row without bias (gemv_config's rule); everything else takes F.linear.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.kernels._triton import i64, next_pow2, pdl_launch, pdl_wait

# Weights of depth next_pow2(K) <= GEMV_MAX_DEPTH take the GEMV: deeper tiles no longer fit a program's registers.
GEMV_MAX_DEPTH = 8192
# W elements a program holds in registers (32 KiB of bf16: 64 a thread at 8 warps, eight 16-byte loads)
GEMV_TILE_ELEMS = 16384
GEMV_NUM_WARPS = 8


@triton.jit(do_not_specialize=["num_rows"])
def _gemv_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    num_rows,
    stride_x,
    stride_w,
    stride_y,
    N: tl.constexpr,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """y[:num_rows, block] for BLOCK_N whole rows of W (BLOCK_K = next_pow2(K), masked past K), no tensor cores.

    The program's whole W tile [BLOCK_N, BLOCK_K] is loaded in one go BEFORE the PDL wait: W never depends on the
    launch before, so all of the program's weight bytes are in flight while that launch finishes. After the wait
    each of the BLOCK_M x rows (L2-resident) is multiplied with the tile in fp32 and summed over K (in-thread, then
    across threads); one rounding to y's dtype."""
    i_n = tl.program_id(0)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    m_n = o_n < N
    o_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    m_k = o_k < K
    p_w = w_ptr + i64(o_n)[None, :, None] * stride_w + o_k[None, None, :]  # [1, BLOCK_N, BLOCK_K]
    b_w = tl.load(p_w, mask=m_n[None, :, None] & m_k[None, None, :], other=0.0)
    pdl_wait(USE_PDL)
    # every row of x in one load, in W's layout (each thread its own K columns of every row), then one reduction
    o_m = tl.arange(0, BLOCK_M)
    m_m = o_m < num_rows
    p_x = x_ptr + i64(o_m)[:, None, None] * stride_x + o_k[None, None, :]  # [BLOCK_M, 1, BLOCK_K]
    b_x = tl.load(p_x, mask=m_m[:, None, None] & m_k[None, None, :], other=0.0)
    b_y = tl.sum(b_x.to(tl.float32) * b_w.to(tl.float32), axis=2)  # [BLOCK_M, BLOCK_N] fp32
    p_y = y_ptr + i64(o_m)[:, None] * stride_y + o_n[None, :]  # [BLOCK_M, BLOCK_N]
    tl.store(p_y, b_y, mask=m_m[:, None] & m_n[None, :])  # the one rounding to y's dtype


def gemv_config(depth: int) -> dict[str, int] | None:
    """BLOCK_N / BLOCK_K / warps of the register GEMV for one row of x and a weight of depth K, or None where the
    tile would not fit a program's registers (next_pow2(K) past GEMV_MAX_DEPTH). [2048, 4096] -> 4 weight rows a
    program, 512 programs; [12352, 2048] -> 8 rows, 1544 programs."""
    block_k = triton.next_power_of_2(depth)
    if block_k > GEMV_MAX_DEPTH:
        return None
    return {"BLOCK_N": GEMV_TILE_ELEMS // block_k, "BLOCK_K": block_k, "num_warps": GEMV_NUM_WARPS, "num_stages": 1}


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, config: dict[str, int]) -> torch.Tensor:
    """x [M, K] (M >= 1, last dim contiguous), weight [N, K] (last dim contiguous) -> [M, N] in x's dtype, through
    `_gemv_kernel` with a config such as gemv_config(K) (served with one row; the kernel takes any M, each row's
    fp32 products live at once, so more rows need a smaller tile)."""
    num_rows, depth = x.shape
    num_cols = weight.shape[0]
    y = torch.empty(num_rows, num_cols, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(num_cols, config["BLOCK_N"]),)](
        x,
        weight,
        y,
        num_rows,
        x.stride(0),
        weight.stride(0),
        y.stride(0),
        N=num_cols,
        K=depth,
        BLOCK_M=next_pow2(num_rows),
        **config,
        **pdl_launch(x),
    )
    return y
