"""Gated activations, fp32 inside and one rounding: SiLU-and-mul for the SwiGLU MLPs (out = SiLU(x[:, :I]) * x[:, I:])
and the gated attention's output gate (out = o * sigmoid(gate), docs/ARCHITECTURE.md#gated-full-attention)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltaserve.kernels._dispatch import triton_or_ref


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    xf = x.float()
    return (F.silu(xf[..., :half]) * xf[..., half:]).to(x.dtype)  # [T, I]


silu_and_mul = triton_or_ref(silu_and_mul_ref, "activation_triton.silu_and_mul_triton")


def sigmoid_gate_mul_ref(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """o, gate [T, N] (rows may be strided) -> o * sigmoid(gate) [T, N] contiguous, in fp32 with one rounding, as
    vLLM's compiled graph fuses it."""
    return (o.float() * torch.sigmoid(gate.float())).to(o.dtype)


sigmoid_gate_mul = triton_or_ref(sigmoid_gate_mul_ref, "activation_triton.sigmoid_gate_mul_triton")
