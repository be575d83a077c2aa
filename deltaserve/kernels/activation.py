"""SiLU-and-mul for the SwiGLU MLPs: out = SiLU(x[:, :I]) * x[:, I:], fp32 inside, one rounding."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltaserve.kernels._dispatch import use_triton


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    xf = x.float()
    return (F.silu(xf[..., :half]) * xf[..., half:]).to(x.dtype)  # [T, I]


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if use_triton(x):
        from deltaserve.kernels.activation_triton import silu_and_mul_triton

        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)
