"""Triton register GEMV: y = x·Wᵀ for up to GEMV_MAX_ROWS rows of x, the weight streamed ahead of the
programmatic-dependent-launch wait (docs/kernels.md#linear-projections).

`_gemv_kernel` uses no tensor cores: each program holds BLOCK_N whole rows of W [N, K] as one [BLOCK_N,
next_pow2(K)] register tile, loaded in one go BEFORE the PDL wait (W never depends on the launch before, so all of
its bytes are in flight while that launch finishes), then multiplies it with x's rows one after another after the
wait, each summed in fp32 and rounded once to y's dtype (F.linear's rounding point; the sum order differs,
fp32-level noise). kernels.linear sends it the rows gemv_config accepts (no bias); everything else takes F.linear.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.kernels._triton import i64, pdl_launch, pdl_wait

# Weights of depth next_pow2(K) <= GEMV_MAX_DEPTH take the GEMV: deeper tiles no longer fit a program's registers.
GEMV_MAX_DEPTH = 8192
# W elements a program holds in registers (32 KiB of bf16: 64 a thread at 8 warps, eight 16-byte loads)
GEMV_TILE_ELEMS = 16384
GEMV_NUM_WARPS = 8
# The most rows of x the GEMV takes (more go to cuBLAS). The rows run one after another over the one weight tile, so
# a row adds its products and one reduction, not registers (the tile divided per row lost at 2-4 rows). Two rows
# beat cuBLAS on both shapes' decode steps; three and four lost (docs/kernels.md#linear-projections).
GEMV_MAX_ROWS = 2


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
    each of x's first num_rows rows (of at most BLOCK_M; L2-resident) in turn is loaded in W's layout (each thread
    its own K columns), multiplied with the tile in fp32 and summed over K (in-thread, then across threads); one
    rounding to y's dtype. One row's products are live at a time, so the tile is the one-row tile whatever BLOCK_M
    is, and a compiled variant serves every num_rows up to it."""
    i_n = tl.program_id(0)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    m_n = o_n < N
    o_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    m_k = o_k < K
    p_w = w_ptr + i64(o_n)[:, None] * stride_w + o_k[None, :]  # [BLOCK_N, BLOCK_K]
    b_w = tl.load(p_w, mask=m_n[:, None] & m_k[None, :], other=0.0)
    pdl_wait(USE_PDL)
    for i_m in tl.static_range(BLOCK_M):
        if i_m < num_rows:
            b_x = tl.load(x_ptr + i_m * stride_x + o_k, mask=m_k, other=0.0)  # [BLOCK_K]
            b_y = tl.sum(b_x.to(tl.float32)[None, :] * b_w.to(tl.float32), axis=1)  # [BLOCK_N] fp32
            tl.store(y_ptr + i_m * stride_y + o_n, b_y, mask=m_n)  # the one rounding to y's dtype


def gemv_config(depth: int, num_rows: int = 1) -> dict[str, int] | None:
    """BLOCK_M / BLOCK_N / BLOCK_K / warps of the register GEMV for num_rows rows of x and a weight of depth K, or
    None where it does not serve: more than GEMV_MAX_ROWS rows, or a tile that would not fit a program's registers
    (next_pow2(K) past GEMV_MAX_DEPTH). [2048, 4096] -> 4 weight rows a program, 512 programs; [12352, 2048] -> 8
    rows, 1544 programs. BLOCK_M is the row count's power of two: one row keeps the one-row variant (48 registers
    on sm_90, 5 programs an SM; BLOCK_M = 4 holds 74, 3 an SM), and each variant is met at start-up by the CUDA-graph
    bucket of its size (1, 2, 4: a 3-row step runs the 4-row variant)."""
    block_k = triton.next_power_of_2(depth)
    if block_k > GEMV_MAX_DEPTH or not 1 <= num_rows <= GEMV_MAX_ROWS:
        return None
    return {"BLOCK_M": triton.next_power_of_2(num_rows), "BLOCK_N": GEMV_TILE_ELEMS // block_k, "BLOCK_K": block_k,
            "num_warps": GEMV_NUM_WARPS, "num_stages": 1}  # fmt: skip


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, config: dict[str, int]) -> torch.Tensor:
    """x [M, K] (1 <= M <= config's BLOCK_M, last dim contiguous), weight [N, K] (last dim contiguous) -> [M, N] in
    x's dtype, through `_gemv_kernel` with a config such as gemv_config(K, M)."""
    num_rows, depth = x.shape
    num_cols = weight.shape[0]
    assert 1 <= num_rows <= config["BLOCK_M"], (num_rows, config["BLOCK_M"])
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
        **config,
        **pdl_launch(x),
    )
    return y
