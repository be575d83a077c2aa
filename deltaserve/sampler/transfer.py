"""Host -> device copies for the sampler's per-step metadata (row indices, per-row parameters, token keys)."""

from __future__ import annotations

import numpy as np
import torch


def to_device(values: np.ndarray | list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values -> device tensor; on CUDA through pinned memory so the copy does not sync the stream."""
    cpu = torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return cpu
    return cpu.pin_memory().to(device, non_blocking=True)
