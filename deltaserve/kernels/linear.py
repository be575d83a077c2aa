"""Linear layers, y = x·Wᵀ (+ b): cuBLAS in general, a Triton register GEMV for one row of x (up to
linear_triton.GEMV_MAX_ROWS).

At decode sizes a projection only streams its weight. One row without bias (the B = 1 decode step's projections)
goes to linear_triton's register GEMV where Triton runs: each program loads its whole weight tile before the
programmatic-dependent-launch wait, so the weight streams while the launch before finishes; on the H200 it beat
cuBLAS in the served decode step on both shapes (docs/kernels.md#linear-projections). fp32 accumulation and one
rounding to the input dtype: F.linear's rounding point (the sum order differs, fp32-level noise). Everything else
takes F.linear: more rows (the GEMV lost at 2-4 rows, and tensor-core skinny GEMMs lost to cuBLAS at 1-16 rows), a
bias, weights of SKINNY_MAX_COLS outputs or more (cuBLAS streams the 1 GB lm_head at 98-99 % of the copy
bandwidth), or depths past the GEMV's tile. A block-FP8 weight (kernels/fp8.py's Fp8Weight) takes the FP8 GEMM,
which reads the quantization of rows that come as Fp8Rows; other weights read such rows' plain values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltaserve.kernels import linear_triton
from deltaserve.kernels._dispatch import use_triton
from deltaserve.kernels.fp8 import Fp8Rows, Fp8Weight, fp8_linear, plain

# Vocabulary-sized projections stay on cuBLAS (see the module docstring).
SKINNY_MAX_COLS = 65536


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K], weight [N, K] (, bias [N]) -> [..., N] in x's dtype (F.linear: fp32 accumulation on the GPU, one
    rounding)."""
    return F.linear(x, weight, bias)


def linear(
    x: torch.Tensor | Fp8Rows, weight: torch.Tensor | Fp8Weight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    if isinstance(weight, Fp8Weight):
        return fp8_linear(x, weight, bias)  # a block-FP8 projection (kernels/fp8.py), quantized rows or not
    x = plain(x)  # a bf16 projection beside FP8 ones (the router, in_proj_ba) reads the rows themselves
    is_few_plain_rows = (
        bias is None
        and x.dim() == 2
        and weight.shape[0] < SKINNY_MAX_COLS
        and x.dtype == weight.dtype
        and x.stride(1) == 1
        and weight.stride(1) == 1
        and weight.stride(0) == weight.shape[1]
        and use_triton(x)
    )
    # the GEMV's row and depth limits live in linear_triton.gemv_config
    config = linear_triton.gemv_config(weight.shape[1], x.shape[0]) if is_few_plain_rows else None
    if config is not None:
        return linear_triton.gemv_triton(x, weight, config)
    return linear_ref(x, weight, bias)
