"""Small helpers shared by the layers: parameter construction without initialisation cost."""

from __future__ import annotations

import torch
from torch import nn


def empty_param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    """An uninitialised, frozen parameter; the loader fills it (real weights or seeded dummies)."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)
