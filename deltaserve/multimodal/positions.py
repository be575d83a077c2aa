"""3-D MRoPE positions of a prompt, as transformers' Qwen3_5Model.get_rope_index computes them
(docs/multimodal.md#multimodal-positions, docs/ARCHITECTURE.md#positions-and-mrope), and the decode position delta.

Walk the token types (0 text, 1 image pad, 2 video pad) in maximal runs: text advances all three axes by one per
token; a pad run takes the next grid (videos split into single temporal groups) and gives token (i, j) of its
merged grid T = st, H = st + i, W = st + j, then st += max(rows, cols). delta = max position + 1 - length.
"""

from __future__ import annotations

import numpy as np

TEXT, IMAGE, VIDEO = 0, 1, 2


def token_types(token_ids: list[int] | np.ndarray, image_token_id: int, video_token_id: int) -> np.ndarray:
    """transformers' mm_token_type_ids: 1 at image pads, 2 at video pads, 0 elsewhere (vision_start/end and
    timestamps count as text)."""
    ids = np.asarray(token_ids, dtype=np.int64)
    types = np.zeros(ids.shape, dtype=np.int64)
    types[ids == image_token_id] = IMAGE
    types[ids == video_token_id] = VIDEO
    return types


def mrope_positions(
    types: np.ndarray,
    image_grids: list[tuple[int, int, int]],
    video_grids: list[tuple[int, int, int]],
    spatial_merge_size: int,
) -> tuple[np.ndarray, int]:
    """(positions [3, L] int64, delta) for one prompt; grids in prompt order per modality."""
    groups = {
        IMAGE: iter([(1, h, w) for _, h, w in image_grids]),
        VIDEO: iter([(1, h, w) for t, h, w in video_grids for _ in range(t)]),
    }
    length = len(types)
    positions = np.zeros((3, length), dtype=np.int64)
    boundaries = np.flatnonzero(np.diff(types)) + 1
    starts = np.concatenate([[0], boundaries]).astype(np.int64) if length else np.zeros(0, dtype=np.int64)
    ends = np.concatenate([boundaries, [length]]).astype(np.int64) if length else np.zeros(0, dtype=np.int64)
    current = 0
    for start, end in zip(starts.tolist(), ends.tolist(), strict=True):
        kind = int(types[start])
        if kind == TEXT:
            positions[:, start:end] = np.arange(current, current + end - start)[None, :]
            current += end - start
            continue
        try:
            _, grid_h, grid_w = next(groups[kind])
        except StopIteration:
            raise ValueError(f"more {('image', 'video')[kind - 1]} pad runs than grids") from None
        rows, cols = grid_h // spatial_merge_size, grid_w // spatial_merge_size
        if rows * cols != end - start:
            raise ValueError(f"a pad run of {end - start} tokens does not match a merged grid of {rows}x{cols}")
        positions[0, start:end] = current
        positions[1, start:end] = current + np.repeat(np.arange(rows), cols)
        positions[2, start:end] = current + np.tile(np.arange(cols), rows)
        current += max(rows, cols)
    delta = int(positions.max()) + 1 - length if length else 0
    return positions, delta
