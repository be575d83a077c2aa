"""Linear layers without bias, y = x·Wᵀ: cuBLAS in general, a Triton skinny GEMM for decode-sized inputs.

At decode sizes (a few token rows) a projection only streams its weight: the 35B-A3B B = 1 step's cuBLAS
GEMMs ran at about 42 % of the copy bandwidth in sum (benchmarks/results/profile-decode-35b-a3b-h200-20261129
.json: 2.2 ms against a 0.9 ms floor), worst on the 2048-output projections. `linear` routes up to
SKINNY_MAX_ROWS rows on CUDA to linear_triton (fp32 accumulation, one rounding to the input dtype: the rounding
point of F.linear's bf16 output; the sum order differs, fp32-level noise) and everything else to F.linear,
including weights of SKINNY_MAX_COLS outputs or more: cuBLAS streams the 1 GB lm_head at 98 % of the copy
bandwidth already (242 µs in the same record).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltaserve.kernels._dispatch import use_triton

# Rows (tokens) up to which the skinny GEMM runs; one row tile of 16 covers them (tl.dot's minimum M).
SKINNY_MAX_ROWS = 16
# Vocabulary-sized projections stay on cuBLAS (see the module docstring).
SKINNY_MAX_COLS = 65536


def linear_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K], weight [N, K] -> [..., N] in x's dtype (F.linear: fp32 accumulation on the GPU, one rounding)."""
    return F.linear(x, weight)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    is_skinny = x.dim() == 2 and x.shape[0] <= SKINNY_MAX_ROWS and weight.shape[0] < SKINNY_MAX_COLS
    if is_skinny and use_triton(x) and x.dtype == weight.dtype:
        from deltaserve.kernels.linear_triton import linear_triton

        return linear_triton(x, weight)
    return linear_ref(x, weight)
