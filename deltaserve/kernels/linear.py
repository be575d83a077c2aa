"""Linear layers, y = x·Wᵀ (+ b): cuBLAS in general, a Triton register GEMV for one row of x.

At decode sizes a projection only streams its weight. One row without bias (the B = 1 decode step's projections)
goes to linear_triton's register GEMV where Triton runs (KERNEL_NOTES C29): each program loads its whole weight
tile before the programmatic-dependent-launch wait, so the weight streams while the launch before finishes; on the
H200 it took the 35B-A3B B = 1 decode step from 2.67 to 2.48 ms and the 27B one from 13.96 to 13.06 ms against
cuBLAS (benchmarks/results/decode-step-c29-*-b1-h200-20261203-s13.json; an earlier run: 2.66 -> 2.53, 14.27 ->
13.27). fp32 accumulation and one rounding to the input dtype: F.linear's rounding point (the sum order differs,
fp32-level noise). Everything else takes F.linear: more rows (the GEMV lost at 2-4 rows; the tensor-core skinny
GEMM of linear_triton lost to cuBLAS at 1-16 rows, C5 / C18 / C24), a bias, weights of SKINNY_MAX_COLS outputs
or more (cuBLAS streams the 1 GB lm_head at 98-99 % of the copy bandwidth), or depths past the GEMV's tile.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltaserve.kernels import linear_triton
from deltaserve.kernels._dispatch import use_triton

# Vocabulary-sized projections stay on cuBLAS (see the module docstring).
SKINNY_MAX_COLS = 65536


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K], weight [N, K] (, bias [N]) -> [..., N] in x's dtype (F.linear: fp32 accumulation on the GPU, one
    rounding)."""
    return F.linear(x, weight, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    is_plain = (
        bias is None
        and x.dim() == 2
        and weight.shape[0] < SKINNY_MAX_COLS
        and x.dtype == weight.dtype
        and x.stride(1) == 1
        and weight.stride(1) == 1
        and weight.stride(0) == weight.shape[1]
        and use_triton(x)
    )
    # the GEMV's own rule (switch, rows, depth) lives in linear_triton.gemv_config
    config = linear_triton.gemv_config(weight.shape[0], weight.shape[1], x.shape[0]) if is_plain else None
    if config is not None and x.shape[0] > 0:
        return linear_triton.gemv_triton(x, weight, config)
    return linear_ref(x, weight, bias)
