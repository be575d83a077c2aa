"""Triton skinny GEMM: y = x·Wᵀ for at most 16 rows of x, streaming W [N, K] once at close to copy bandwidth.

Grid: (column blocks, SPLIT_K). Each program owns BLOCK_N output columns and one K_SPLIT-deep slice of K. W is
read as [BLOCK_K, BLOCK_N] tiles whose K run is contiguous (16-byte vectors through cp.async, NUM_STAGES deep),
x as [16, BLOCK_K] tiles (L2-resident), tl.dot with the rows padded to 16; sums in fp32.

SPLIT_K = 1 (today's wide projections) walks the whole K and stores y directly. SPLIT_K > 1 (KERNEL_NOTES C18:
the 2048-output projections, whose 128 column blocks alone leave the H200 at one program per SM) reduces in the
same launch and deterministically: every program stores its fp32 partial [rows, BLOCK_N] into a workspace
[SPLIT_K, rows, N], then bumps its column block's counter (acq_rel atomic); the program that sees SPLIT_K - 1
(the last to arrive) sums the SPLIT_K partials in split order 0, 1, ... (a fixed order, so the same bits every
run whatever the schedule), rounds once to y's dtype (F.linear's rounding point) and stores y, then puts the
counter back to 0 so the next launch (or a CUDA-graph replay) starts clean. The counters are one persistent
zero-initialised int32 buffer per device (`split_counters`), SPLITK_MAX_COL_BLOCKS long: `skinny_config` only
splits a grid of at most SPLITK_MAX_PROGRAMS / 2 column blocks, so that bounds every split launch.
The buffer is shared by all split launches on a device, so they must not overlap in time: one stream (the
engine's decode stream) orders them. Grids come from shapes only (CUDA-graph safe, no host sync).
Under programmatic dependent launch (DELTASERVE_PDL, KERNEL_NOTES C21 / C24) each program loads its first W tile
before it waits for the previous kernel: W does not depend on it, so that tile streams while the previous kernel
finishes; x, the partials and the counters come after the wait (the counters' single-stream rule holds: a launch's
programs reach them only once the launch before has completed).

With USE_GEMV (KERNEL_NOTES C29) up to GEMV_MAX_ROWS rows (one) take `_gemv_kernel` instead: no tensor cores,
each program holds BLOCK_N whole rows of W in registers, all loaded before the PDL wait.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.kernels._triton import dot_precision, i64, next_pow2, pdl_launch, pdl_wait

# ~4 programs per SM on the H200's 132 SMs is the aim; K is split (doubling) while the doubled grid stays within
# ~5 per SM: [2048, 4096] 128 -> 512; 386 column blocks ([12352, 2048]) stay whole, since 772 programs would run
# as two waves at the 3 of 32 columns that fit an SM (72 KiB of shared memory each).
SPLITK_TARGET_PROGRAMS = 4 * 132
SPLITK_MAX_PROGRAMS = 5 * 132
# A split keeps at least this much K (4 BLOCK_K = 256 tiles: with 4 stages, 3 of them in flight).
SPLITK_MIN_DEPTH = 1024
# Counters per device: a split launch has <= SPLITK_MAX_PROGRAMS / 2 column blocks (see skinny_config).
SPLITK_MAX_COL_BLOCKS = 1024

_split_counters: dict[torch.device, torch.Tensor] = {}

# The register GEMV (KERNEL_NOTES C29): up to GEMV_MAX_ROWS rows, weights of depth next_pow2(K) <= GEMV_MAX_DEPTH.
# On the H200 (session 13) one row beat cuBLAS in the served step (35B-A3B B = 1 2.67 -> 2.48 ms, 27B 13.96 -> 13.06)
# and 2-4 rows lost (27B B = 2 14.49 -> 16.93), so one row only; decode_step's `nogemv` variant turns it off.
USE_GEMV = True
GEMV_MAX_ROWS = 1
GEMV_MAX_DEPTH = 8192
# W elements a program holds in registers (32 KiB of bf16: 64 a thread at 8 warps, eight 16-byte loads)
GEMV_TILE_ELEMS = 16384
GEMV_NUM_WARPS = 8


@triton.jit(do_not_specialize=["num_rows"])
def _skinny_gemm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    partial_ptr,
    counter_ptr,
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
    SPLIT_K: tl.constexpr,
    K_SPLIT: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    i_n, i_s = tl.program_id(0), tl.program_id(1)
    o_m = tl.arange(0, BLOCK_M)
    m_m = o_m < num_rows
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    m_n = o_n < N
    k_start = i_s * K_SPLIT
    o_k = k_start + tl.arange(0, BLOCK_K)  # [BLOCK_K]
    p_x = x_ptr + i64(o_m)[:, None] * stride_x + o_k[None, :]  # [BLOCK_M, BLOCK_K]
    p_w = w_ptr + i64(o_n)[None, :] * stride_w + o_k[:, None]  # [BLOCK_K, BLOCK_N]
    b_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # The first W tile does not depend on the previous kernel: under PDL it loads before the wait, while that kernel
    # still runs (KERNEL_NOTES C24); x, the partials and the counters wait.
    m_k = o_k < K
    b_w = tl.load(p_w, mask=m_k[:, None] & m_n[None, :], other=0.0)
    pdl_wait(USE_PDL)
    b_x = tl.load(p_x, mask=m_m[:, None] & m_k[None, :], other=0.0)
    b_acc = tl.dot(b_x, b_w, b_acc, input_precision=DOT_PRECISION)
    p_x += BLOCK_K
    p_w += BLOCK_K
    # a constant trip count (K_SPLIT is a constexpr multiple of BLOCK_K) lets the loads be pipelined
    for k0 in range(BLOCK_K, K_SPLIT, BLOCK_K):
        m_k = (o_k + k0) < K
        b_x = tl.load(p_x, mask=m_m[:, None] & m_k[None, :], other=0.0)
        b_w = tl.load(p_w, mask=m_k[:, None] & m_n[None, :], other=0.0)
        b_acc = tl.dot(b_x, b_w, b_acc, input_precision=DOT_PRECISION)
        p_x += BLOCK_K
        p_w += BLOCK_K
    m_y = m_m[:, None] & m_n[None, :]
    p_y = y_ptr + i64(o_m)[:, None] * stride_y + o_n[None, :]  # [BLOCK_M, BLOCK_N]
    if SPLIT_K == 1:
        tl.store(p_y, b_acc, mask=m_y)
    else:
        # partials [SPLIT_K, num_rows, N] fp32, row-major
        o_p = i64(o_m)[:, None] * N + o_n[None, :]  # [BLOCK_M, BLOCK_N]
        tl.store(partial_ptr + i64(i_s) * num_rows * N + o_p, b_acc, mask=m_y)
        # every thread's partial stores precede the one release below (the barrier orders them, the atomic's
        # release publishes them at GPU scope)
        tl.debug_barrier()
        count = tl.atomic_add(counter_ptr + i_n, 1, sem="acq_rel", scope="gpu")
        if count == SPLIT_K - 1:
            # the last arriver: the acquire above makes the other programs' partials visible; .cg reads them
            # from L2, past this SM's L1. Summed in split order: the bits do not depend on who arrived last.
            b_y = tl.load(partial_ptr + o_p, mask=m_y, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT_K):
                p_s = partial_ptr + s * num_rows * N + o_p
                b_y += tl.load(p_s, mask=m_y, other=0.0, cache_modifier=".cg")
            tl.store(p_y, b_y, mask=m_y)  # the one rounding to y's dtype
            tl.atomic_xchg(counter_ptr + i_n, 0, sem="relaxed", scope="gpu")


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
    launch before, so all of the program's weight bytes are in flight while that launch finishes (the skinny GEMM
    can only hoist its first tile, C24). After the wait each of the BLOCK_M x rows (L2-resident) is multiplied with
    the tile in fp32 and summed over K (in-thread, then across threads); one rounding to y's dtype."""
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


def gemv_config(num_cols: int, depth: int, num_rows: int = 1) -> dict[str, int] | None:
    """BLOCK_N / BLOCK_K / warps of the register GEMV for num_rows rows of x and an [N, K] weight, or None where it
    does not apply: USE_GEMV off, more than GEMV_MAX_ROWS rows, or a depth past GEMV_MAX_DEPTH (the tile would no
    longer fit a program's registers). The one rule both kernels.linear and linear_triton follow. One row:
    [2048, 4096] -> 4 weight rows a program, 512 programs; [12352, 2048] -> 8 rows, 1544 programs. More x rows
    shrink the tile in proportion (the fp32 products of every x row are live at once: at 4 rows and the one-row
    tile, 118 registers)."""
    block_k = triton.next_power_of_2(depth)
    if not USE_GEMV or num_rows > GEMV_MAX_ROWS or block_k > GEMV_MAX_DEPTH:
        return None
    block_n = max(1, GEMV_TILE_ELEMS // (block_k * next_pow2(num_rows)))
    return {"BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": GEMV_NUM_WARPS, "num_stages": 1}


def skinny_config(num_cols: int, depth: int) -> dict[str, int]:
    """BLOCK_N / BLOCK_K / SPLIT_K / warps / stages for an [N, K] weight (see the module docstring).

    BLOCK_N: 16 columns up to N = 4096, 32 up to 16384, 64 beyond. SPLIT_K doubles while the doubled grid holds
    at most SPLITK_MAX_PROGRAMS programs and each split keeps >= SPLITK_MIN_DEPTH of K: [2048, 4096] -> 128 x 4,
    [9216, 2048] -> 288 x 2, [5120, 6144] -> 160 x 4; [12352, 2048] (386 blocks) and wider stay at 1.
    """
    block_n = 16 if num_cols <= 4096 else (32 if num_cols <= 16384 else 64)
    block_k = min(256, triton.next_power_of_2(depth))
    num_col_blocks = triton.cdiv(num_cols, block_n)
    split_k = 1
    while num_col_blocks * split_k * 2 <= SPLITK_MAX_PROGRAMS and depth // (2 * split_k) >= SPLITK_MIN_DEPTH:
        split_k *= 2
    # 4 stages = 3 tiles in flight: 24 KiB of W a 16-column program (48 KiB of shared memory, 4 fit an SM)
    return {"BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split_k, "num_warps": 4, "num_stages": 4}


def split_counters(device: torch.device) -> torch.Tensor:
    """The device's persistent split-K counters [SPLITK_MAX_COL_BLOCKS] int32, all 0 between launches.

    Allocated on first use, which must not be inside a CUDA-graph capture (the buffer would live in the
    graph's private pool): the engine's eager warm-up, or any eager call, comes first."""
    counters = _split_counters.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("linear_triton: call it once eagerly before capturing (split-K counters)")
        counters = torch.zeros(SPLITK_MAX_COL_BLOCKS, dtype=torch.int32, device=device)
        _split_counters[device] = counters
    return counters


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, config: dict[str, int]) -> torch.Tensor:
    """x [M, K] (M >= 1, last dim contiguous), weight [N, K] (last dim contiguous) -> [M, N] in x's dtype, through
    `_gemv_kernel` with config = gemv_config(N, K, M) (the caller has checked it applies)."""
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
    gemv = gemv_config(num_cols, depth, num_rows)
    if gemv is not None:
        return gemv_triton(x, weight, gemv)
    config = skinny_config(num_cols, depth)
    split_k = config["SPLIT_K"]
    num_col_blocks = triton.cdiv(num_cols, config["BLOCK_N"])
    # each split's K slice, a whole number of BLOCK_K tiles; the last slices may run past K (masked)
    k_split = triton.cdiv(triton.cdiv(depth, split_k), config["BLOCK_K"]) * config["BLOCK_K"]
    if split_k == 1:
        partials, counters = y, y  # unused: the kernel stores y directly
    else:
        assert num_col_blocks <= SPLITK_MAX_COL_BLOCKS, (num_cols, config)
        partials = torch.empty(split_k, num_rows, num_cols, dtype=torch.float32, device=x.device)
        counters = split_counters(x.device)
    _skinny_gemm_kernel[(num_col_blocks, split_k)](
        x,
        weight,
        y,
        partials,
        counters,
        num_rows,
        x.stride(0),
        weight.stride(0),
        y.stride(0),
        N=num_cols,
        K=depth,
        DOT_PRECISION=dot_precision(x.dtype),
        BLOCK_M=16,
        K_SPLIT=k_split,
        **config,
        **pdl_launch(x),
    )
    return y
