"""Triton RMSNorms: the zero-centred (1+w) norm with an optional fused residual add, and the GDN gated norm.

Both normalise over the last dim of a [N, d] or [T, heads, d] input whose last dim is contiguous; the
leading dims may be strided (the four-op preamble norms the query halves of [query | gate] pairs in place
in the qkv rows). A program owns BLOCK_ROWS whole rows: at d = 5120 one row of 8192 lanes over 16 warps,
at d = 128-256 a tile of rows so each program still moves a few KiB. Math as the refs: fp32 throughout,
the residual sum rounded only for its store, one rounding of the output. For an FP8 model's projections the
zero-centred norm and the gated norm before out_proj also quantize their rounded output per token and group of 128
(rms_norm_fp8_triton, gated_rms_norm_fp8_triton), so the FP8 GEMMs after them launch no quantization of their own
(kernels/fp8.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.kernels._triton import i64, next_pow2, pdl_launch, pdl_wait, require_last_dim_contiguous, silu_f32
from deltaserve.kernels.fp8 import GROUP, Fp8Rows
from deltaserve.kernels.fp8_triton import empty_quantization, quantize_activation_triton, quantize_stored_tile


def _rows(t: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """(view, heads, outer stride, head stride): row r of the [rows, d] view starts at (r//heads, r%heads)."""
    require_last_dim_contiguous("x", t)
    if t.dim() == 1:
        t = t.unsqueeze(0)
    if t.dim() > 3:
        t = t.reshape(-1, t.shape[-2], t.shape[-1])
    if t.dim() == 2:
        return t, 1, t.stride(0), 0
    return t, t.shape[1], t.stride(0), t.stride(1)


def _tile(dim: int) -> tuple[int, int, int]:
    """(BLOCK_D, BLOCK_ROWS, num_warps) for rows of length dim."""
    block_d = next_pow2(dim)
    block_rows = max(1, min(16, 2048 // block_d))
    num_warps = max(1, min(16, block_d * block_rows // 512))
    return block_d, block_rows, num_warps


@triton.jit(do_not_specialize=["num_rows"])
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    q_ptr,
    s_ptr,
    num_rows,
    num_heads,
    stride_x_outer,
    stride_x_head,
    stride_r_outer,
    stride_r_head,
    eps,
    D: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr = False,
    QUANT: tl.constexpr = False,
    GROUP: tl.constexpr = 128,
):
    o_row = i64(tl.program_id(0)) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # [BLOCK_ROWS]
    m_row = o_row < num_rows
    i_outer = o_row // num_heads
    i_head = o_row % num_heads
    o_d = tl.arange(0, BLOCK_D)
    m = m_row[:, None] & (o_d < D)[None, :]  # [BLOCK_ROWS, BLOCK_D]
    b_w = tl.load(weight_ptr + o_d, mask=o_d < D, other=0.0).to(tl.float32)  # a weight: may load before the wait
    pdl_wait(USE_PDL)

    p_x = x_ptr + (i_outer * stride_x_outer + i_head * stride_x_head)[:, None] + o_d[None, :]
    b_x = tl.load(p_x, mask=m, other=0.0).to(tl.float32)
    o_out = o_row[:, None] * D + o_d[None, :]
    if HAS_RESIDUAL:
        p_r = residual_ptr + (i_outer * stride_r_outer + i_head * stride_r_head)[:, None] + o_d[None, :]
        b_x += tl.load(p_r, mask=m, other=0.0).to(tl.float32)
        # The residual stream is stored rounded; the norm below reads the unrounded fp32 sum.
        tl.store(residual_out_ptr + o_out, b_x, mask=m)
    inv_rms = tl.rsqrt(tl.sum(b_x * b_x, axis=1) / D + eps)  # [BLOCK_ROWS]
    b_y = b_x * inv_rms[:, None] * (1.0 + b_w)[None, :]
    tl.store(out_ptr + o_out, b_y, mask=m)
    if QUANT:  # the stored rows' quantization, read back (fp8_triton.quantize_stored_tile)
        num_groups: tl.constexpr = (BLOCK_D + GROUP - 1) // GROUP
        row0 = i64(tl.program_id(0)) * BLOCK_ROWS
        quantize_stored_tile(out_ptr, q_ptr, s_ptr, row0, num_rows, 0, D, BLOCK_ROWS, num_groups, GROUP)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """y = x̂·(1 + w) over the last dim; with residual: s = x + residual (fp32), returns (norm(s), s rounded)."""
    return _rms_norm(x, weight, eps, residual, None)


def rms_norm_fp8_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[Fp8Rows, torch.Tensor | None]:
    """rms_norm_triton on x [T, H] with the rounded output also quantized per token and group of 128 in the same
    launch, as kernels/fp8.py's rms_norm_fp8_ref: (Fp8Rows of the normed rows, the rounded residual sum)."""
    assert x.dim() == 2, f"rms_norm_fp8 takes rows [T, H], not {tuple(x.shape)}"
    q, scale = empty_quantization(*x.shape, x.device)
    out, residual_out = _rms_norm(x, weight, eps, residual, (q, scale))
    return Fp8Rows(out, q, scale), residual_out


def _rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    quant: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    dim = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    residual_out = None if residual is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    xv, num_heads, sx0, sx1 = _rows(x)
    num_rows = x.numel() // dim
    if residual is not None:
        assert residual.shape == x.shape, f"residual {tuple(residual.shape)} != x {tuple(x.shape)}"
        rv, _, sr0, sr1 = _rows(residual)
    else:
        rv, sr0, sr1 = xv, 0, 0
    if num_rows == 0:
        return out, residual_out
    block_d, block_rows, num_warps = _tile(dim)  # the quantizing launch keeps the plain norm's tile
    q, scale = quant if quant is not None else (out, out)
    _rms_norm_kernel[(triton.cdiv(num_rows, block_rows),)](
        xv,
        rv,
        weight,
        out,
        residual_out if residual_out is not None else out,
        q,
        scale,
        num_rows,
        num_heads,
        sx0,
        sx1,
        sr0,
        sr1,
        eps,
        D=dim,
        HAS_RESIDUAL=residual is not None,
        BLOCK_ROWS=block_rows,
        BLOCK_D=block_d,
        QUANT=quant is not None,
        GROUP=GROUP,
        num_warps=num_warps,
        **pdl_launch(x),
    )
    return out, residual_out


@triton.jit(do_not_specialize=["num_rows"])
def _gated_rms_norm_kernel(
    x_ptr,
    z_ptr,
    weight_ptr,
    out_ptr,
    num_rows,
    num_heads,
    stride_x_outer,
    stride_x_head,
    stride_z_outer,
    stride_z_head,
    eps,
    q_ptr,
    s_ptr,
    D: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr = False,
    QUANT: tl.constexpr = False,
    GROUP: tl.constexpr = 128,
):
    o_row = i64(tl.program_id(0)) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # [BLOCK_ROWS]
    m_row = o_row < num_rows
    i_outer = o_row // num_heads
    i_head = o_row % num_heads
    o_d = tl.arange(0, BLOCK_D)
    m = m_row[:, None] & (o_d < D)[None, :]  # [BLOCK_ROWS, BLOCK_D]
    b_w = tl.load(weight_ptr + o_d, mask=o_d < D, other=0.0).to(tl.float32)  # a weight: may load before the wait
    pdl_wait(USE_PDL)

    p_x = x_ptr + (i_outer * stride_x_outer + i_head * stride_x_head)[:, None] + o_d[None, :]
    p_z = z_ptr + (i_outer * stride_z_outer + i_head * stride_z_head)[:, None] + o_d[None, :]
    b_x = tl.load(p_x, mask=m, other=0.0).to(tl.float32)
    b_z = tl.load(p_z, mask=m, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(b_x * b_x, axis=1) / D + eps)  # [BLOCK_ROWS]
    b_y = b_x * inv_rms[:, None] * b_w[None, :] * silu_f32(b_z)
    tl.store(out_ptr + o_row[:, None] * D + o_d[None, :], b_y, mask=m)
    if QUANT:  # D a multiple of GROUP: each row's groups are groups of the [T, heads·D] rows out_proj reads
        row0 = i64(tl.program_id(0)) * BLOCK_ROWS
        quantize_stored_tile(out_ptr, q_ptr, s_ptr, row0, num_rows, 0, D, BLOCK_ROWS, BLOCK_D // GROUP, GROUP)


def gated_rms_norm_triton(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x)·w ⊙ SiLU(z) over the last dim (plain weight), fp32 inside, one rounding; out contiguous."""
    return _gated_rms_norm(x, z, weight, eps, None)


def gated_rms_norm_fp8_triton(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> Fp8Rows:
    """gated_rms_norm_triton on x, z [T, heads, d] as the [T, heads·d] rows out_proj reads, with their
    per-token-group quantization (as kernels/fp8.py's gated_rms_norm_fp8_ref): in the same launch when d is a
    multiple of 128 (every Qwen3.5 / 3.6 width), else the norm and then quantize_activation_triton."""
    num_tokens, width = x.shape[0], x.shape[1] * x.shape[2]
    if x.shape[-1] % GROUP:
        y = _gated_rms_norm(x, z, weight, eps, None).view(num_tokens, width)
        return Fp8Rows(y, *quantize_activation_triton(y))
    q, scale = empty_quantization(num_tokens, width, x.device)
    return Fp8Rows(_gated_rms_norm(x, z, weight, eps, (q, scale)).view(num_tokens, width), q, scale)


def _gated_rms_norm(
    x: torch.Tensor,
    z: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    quant: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    assert z.shape == x.shape, f"z {tuple(z.shape)} != x {tuple(x.shape)}"
    dim = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    num_rows = x.numel() // dim
    if num_rows == 0:
        return out
    xv, num_heads, sx0, sx1 = _rows(x)
    zv, z_heads, sz0, sz1 = _rows(z)
    assert z_heads == num_heads
    block_d, block_rows, num_warps = _tile(dim)
    q, scale = quant if quant is not None else (out, out)
    _gated_rms_norm_kernel[(triton.cdiv(num_rows, block_rows),)](
        xv, zv, weight, out, num_rows, num_heads, sx0, sx1, sz0, sz1, eps, q, scale,
        D=dim, BLOCK_ROWS=block_rows, BLOCK_D=block_d, QUANT=quant is not None, GROUP=GROUP,
        num_warps=num_warps, **pdl_launch(x),
    )  # fmt: skip
    return out
