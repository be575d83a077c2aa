"""Decides, per call, whether an op runs its Triton kernel or its torch twin; the ops' optional `out` tensors.

Triton runs on CUDA tensors unless DELTASERVE_USE_TRITON=0. CPU tensors always take the torch twin in the
engine; tests reach the Triton launchers directly under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch

from deltaserve import env


def use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda and env.use_triton()


def output(out: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """The op's output: `out` when the caller gives one (a contiguous view of a larger buffer, so a mixed step's
    decode and prefill halves land in one tensor without a copy), else a new tensor of like's dtype and device."""
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    if tuple(out.shape) != tuple(shape) or out.dtype != like.dtype or out.device != like.device:
        raise ValueError(f"out: {tuple(out.shape)} {out.dtype} on {out.device}, want {tuple(shape)} {like.dtype}")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    return out
