"""Deterministic synthetic images and videos (integer arithmetic only, numpy only), so the fixture script and the
tests build bit-identical inputs in any environment: a smooth gradient plus hashed noise per channel."""

from __future__ import annotations

import numpy as np


def synthetic_image(height: int, width: int, seed: int = 0) -> np.ndarray:
    """[height, width, 3] uint8."""
    y, x = np.mgrid[0:height, 0:width].astype(np.uint64)
    out = np.empty((height, width, 3), dtype=np.uint8)
    for c in range(3):
        v = x * np.uint64(2654435761) + y * np.uint64(40503) + np.uint64(c * 97 + seed * 7919 + 1)
        v ^= v >> np.uint64(13)
        v *= np.uint64(0x5BD1E995)
        v ^= v >> np.uint64(15)
        noise = (v & np.uint64(255)) >> np.uint64(1)
        across = (x * np.uint64(255)) // np.uint64(max(width - 1, 1))
        down = (y * np.uint64(97)) // np.uint64(max(height - 1, 1)) * np.uint64(c + 1)
        gradient = (across + down) >> np.uint64(1)
        out[..., c] = ((noise + gradient) & np.uint64(255)).astype(np.uint8)
    return out


def synthetic_video(num_frames: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """[num_frames, height, width, 3] uint8, each frame its own seed."""
    return np.stack([synthetic_image(height, width, seed * 1000 + i) for i in range(num_frames)])
