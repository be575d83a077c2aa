"""RMSNorms of the decoder: zero-centred (1+w) with an optional fused residual add, and the GDN gated norm.

Rounding follows vLLM (docs/ARCHITECTURE.md#norms-and-rounding-points): the residual sum is taken in fp32, stored
rounded, and the norm reads the unrounded fp32 sum; every norm does fp32 math and rounds once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltaserve.kernels._dispatch import triton_or_ref


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """y = x̂·(1 + w) over the last dim. With `residual`: s = x + residual; returns (norm(s), s rounded)."""
    xf = x.float()
    residual_out = None
    if residual is not None:
        xf = xf + residual.float()
        residual_out = xf.to(x.dtype)
    inv_rms = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = xf * inv_rms * (1.0 + weight.float())
    return y.to(x.dtype), residual_out


rms_norm = triton_or_ref(rms_norm_ref, "norm_triton.rms_norm_triton")


def gated_rms_norm_ref(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """GDN output norm: RMSNorm(x)·w ⊙ SiLU(z) over the last dim, plain weight, all fp32, one rounding."""
    xf = x.float()
    inv_rms = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = xf * inv_rms * weight.float() * F.silu(z.float())
    return y.to(x.dtype)


gated_rms_norm = triton_or_ref(gated_rms_norm_ref, "norm_triton.gated_rms_norm_triton")
