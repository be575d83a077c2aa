"""Decides, per call, whether an op runs its Triton kernel or its torch twin.

Triton runs on CUDA tensors unless DELTASERVE_USE_TRITON=0. CPU tensors always take the torch twin in the
engine; tests reach the Triton launchers directly under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch

from deltaserve import env


def use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda and env.use_triton()
