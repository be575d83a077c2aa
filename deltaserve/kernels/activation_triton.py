"""Triton gated activations, fp32 inside, one rounding: SiLU-and-mul for the SwiGLU MLPs (out = SiLU(x[..., :I]) ⊙
x[..., I:]) and the attention output gate (out = o ⊙ sigmoid(gate): one launch where the torch twin takes five,
two upcasts, sigmoid, mul, downcast).

Grid (row, column block): rows are tokens (they may be strided), BLOCK_I columns per program, so every load is a
coalesced run of one row. Before an FP8 projection (the down projection, o_proj) the `*_fp8` launchers also quantize
the rounded output per token and group of 128 in the same launch (kernels/fp8.py's Fp8Rows), a block holding whole
groups.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from deltaserve.kernels._triton import i64, next_pow2, pdl_launch, pdl_wait, require_last_dim_contiguous, silu_f32
from deltaserve.kernels.fp8 import GROUP, Fp8Rows
from deltaserve.kernels.fp8_triton import empty_quantization, quantize_stored_tile


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    q_ptr,
    s_ptr,
    stride_x,
    I: tl.constexpr,
    BLOCK_I: tl.constexpr,
    USE_PDL: tl.constexpr = False,
    QUANT: tl.constexpr = False,
    GROUP: tl.constexpr = 128,
):
    i_t = i64(tl.program_id(0))
    o_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    m_i = o_i < I
    pdl_wait(USE_PDL)
    p_x = x_ptr + i_t * stride_x + o_i
    b_gate = tl.load(p_x, mask=m_i, other=0.0).to(tl.float32)
    b_up = tl.load(p_x + I, mask=m_i, other=0.0).to(tl.float32)
    tl.store(out_ptr + i_t * I + o_i, silu_f32(b_gate) * b_up, mask=m_i)
    if QUANT:
        # this program's whole groups of its row (BLOCK_I is a multiple of GROUP, or the row's only block)
        group0 = tl.program_id(1) * (BLOCK_I // GROUP)
        quantize_stored_tile(out_ptr, q_ptr, s_ptr, i_t, i_t + 1, group0, I, 1, (BLOCK_I + GROUP - 1) // GROUP, GROUP)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] -> [..., I] (contiguous)."""
    return _silu_and_mul(x, None)


def silu_and_mul_fp8_triton(x: torch.Tensor) -> Fp8Rows:
    """x [T, 2I] -> Fp8Rows of silu_and_mul_triton's rows [T, I] with their per-token-group quantization, one
    launch (as kernels/fp8.py's silu_and_mul_fp8_ref)."""
    assert x.dim() == 2, f"silu_and_mul_fp8 takes rows [T, 2I], not {tuple(x.shape)}"
    return _with_quantization(lambda quant: _silu_and_mul(x, quant), x.shape[0], x.shape[1] // 2, x.device)


def _silu_and_mul(x: torch.Tensor, quant: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    require_last_dim_contiguous("x", x)
    half = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], half, dtype=x.dtype, device=x.device)
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    num_rows = x2.shape[0]
    if num_rows == 0 or half == 0:
        return out
    block_i = min(1024, next_pow2(half))  # >= GROUP whenever a row has more than one block: whole groups a block
    q, scale = quant if quant is not None else (out, out)
    _silu_and_mul_kernel[(num_rows, triton.cdiv(half, block_i))](
        x2, out, q, scale, x2.stride(0), I=half, BLOCK_I=block_i, QUANT=quant is not None, GROUP=GROUP,
        num_warps=max(1, min(4, block_i // 256)), **pdl_launch(x),
    )  # fmt: skip
    return out


def _with_quantization(
    produce: Callable[[tuple[torch.Tensor, torch.Tensor]], torch.Tensor], rows: int, cols: int, device: torch.device
) -> Fp8Rows:
    """Fp8Rows of what `produce((q, scale))` stores, with the quantization buffers of [rows, cols]."""
    quant = empty_quantization(rows, cols, device)
    return Fp8Rows(produce(quant), *quant)


@triton.jit
def _sigmoid_gate_mul_kernel(
    o_ptr,
    gate_ptr,
    out_ptr,
    q_ptr,
    s_ptr,
    stride_o,
    stride_g,
    N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr = False,
    QUANT: tl.constexpr = False,
    GROUP: tl.constexpr = 128,
):
    i_t = i64(tl.program_id(0))
    o_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    # The gate half of the qkv projection, several launches back (the attention kernels write o): it may load
    # before the wait (_triton.pdl_wait).
    b_g = tl.load(gate_ptr + i_t * stride_g + o_n, mask=m_n, other=0.0).to(tl.float32)
    pdl_wait(USE_PDL)
    b_o = tl.load(o_ptr + i_t * stride_o + o_n, mask=m_n, other=0.0).to(tl.float32)
    b_sig = 1.0 / (1.0 + tl.exp(-b_g))
    tl.store(out_ptr + i_t * N + o_n, b_o * b_sig, mask=m_n)
    if QUANT:
        group0 = tl.program_id(1) * (BLOCK_N // GROUP)  # as _silu_and_mul_kernel's
        quantize_stored_tile(out_ptr, q_ptr, s_ptr, i_t, i_t + 1, group0, N, 1, (BLOCK_N + GROUP - 1) // GROUP, GROUP)


def sigmoid_gate_mul_triton(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """o, gate [T, N] -> o * sigmoid(gate) [T, N] (contiguous, o's dtype)."""
    return _sigmoid_gate_mul(o, gate, None)


def sigmoid_gate_mul_fp8_triton(o: torch.Tensor, gate: torch.Tensor) -> Fp8Rows:
    """Fp8Rows of sigmoid_gate_mul_triton's rows [T, N] with their per-token-group quantization, one launch (as
    kernels/fp8.py's sigmoid_gate_mul_fp8_ref)."""
    return _with_quantization(lambda quant: _sigmoid_gate_mul(o, gate, quant), o.shape[0], o.shape[1], o.device)


def _sigmoid_gate_mul(
    o: torch.Tensor, gate: torch.Tensor, quant: tuple[torch.Tensor, torch.Tensor] | None
) -> torch.Tensor:
    require_last_dim_contiguous("o", o)
    require_last_dim_contiguous("gate", gate)
    assert o.shape == gate.shape and o.dim() == 2, (o.shape, gate.shape)
    num_rows, width = o.shape
    out = torch.empty(num_rows, width, dtype=o.dtype, device=o.device)
    if num_rows == 0 or width == 0:
        return out
    block_n = min(1024, next_pow2(width))  # whole groups a block, as _silu_and_mul's
    q, scale = quant if quant is not None else (out, out)
    _sigmoid_gate_mul_kernel[(num_rows, triton.cdiv(width, block_n))](
        o, gate, out, q, scale, o.stride(0), gate.stride(0), N=width, BLOCK_N=block_n, QUANT=quant is not None,
        GROUP=GROUP, num_warps=max(1, min(4, block_n // 256)), **pdl_launch(o),
    )  # fmt: skip
    return out
