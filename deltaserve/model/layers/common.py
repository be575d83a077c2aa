"""Small helpers shared by the layers: parameter construction without initialisation cost, plain or block-FP8."""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.kernels.fp8 import Fp8Weight


def empty_param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    """An uninitialised, frozen parameter; the loader fills it (real weights or seeded dummies)."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def projection(
    *shape: int,
    dtype: torch.dtype,
    device: torch.device | str,
    fp8: bool = False,
    parts: tuple[int, ...] | None = None,
) -> nn.Parameter | Fp8Weight:
    """A projection weight [..., N, K]: a plain parameter, or with `fp8` (a block-FP8 checkpoint, docs/fp8.md) an
    Fp8Weight whose scale layout suits the row counts `parts` it fuses (kernels/fp8.py, fp8_block_rows)."""
    if fp8:
        return Fp8Weight(*shape, device=device, parts=parts)
    return empty_param(*shape, dtype=dtype, device=device)
