"""MultimodalInput: the plain-data, picklable record of one request's images and videos after processing, as
the engine carries it from the API to the runner.

Per item: the patch rows the vision tower encodes, the grid, and where the item sits in the expanded prompt.
An item's placeholder span [offset, offset + length) covers its whole replacement (for a video: timestamps,
vision_start/end of every group and the pads); its embedding runs are the pad tokens only, and the tower's
output rows for the item fill those runs in order. The 3-D MRoPE positions of the whole prompt and the decode
position delta are computed once, here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class MultimodalItem:
    modality: str  # "image" or "video"
    pixel_values: np.ndarray  # [num_patches, C·Tp·P·P] float32
    grid_thw: tuple[int, int, int]  # patch grid (t, h, w) before the 2x2 merge
    offset: int  # first token of the placeholder span, in prompt positions
    length: int  # tokens in the placeholder span
    embed_runs: tuple[tuple[int, int], ...]  # (first token, count) of each pad run: 1 per image, t per video
    identifier: str  # content hash (source bytes + processing): the key of an encoder-output cache

    @property
    def num_embeds(self) -> int:
        """Rows of the vision tower's output for this item (= pad tokens)."""
        return sum(count for _, count in self.embed_runs)

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class EmbedSlice:
    """Part of one item's encoder output that one step consumes: rows [src_start, src_end) of the item's output
    go to step-relative token rows [dst_start, dst_start + (src_end - src_start))."""

    item_index: int
    src_start: int
    src_end: int
    dst_start: int


@dataclass(frozen=True)
class MultimodalInput:
    items: tuple[MultimodalItem, ...]
    mrope_positions: np.ndarray  # [3, L] int64: the prompt's MRoPE rows (T, H, W)
    mrope_delta: int  # decode: the token at index p >= L gets position p + mrope_delta on all three axes

    @property
    def prompt_len(self) -> int:
        return int(self.mrope_positions.shape[1])

    def positions(self, start: int, end: int) -> np.ndarray:
        """Positions [3, end - start] of token indices [start, end): the prompt table, then index + delta."""
        prompt_len = self.prompt_len
        out = np.empty((3, end - start), dtype=np.int64)
        split = min(max(start, 0), prompt_len), min(end, prompt_len)
        num_prompt = max(split[1] - split[0], 0)
        if num_prompt:
            out[:, :num_prompt] = self.mrope_positions[:, split[0] : split[1]]
        first_decode = max(start, prompt_len)
        if end > first_decode:
            out[:, num_prompt:] = np.arange(first_decode, end, dtype=np.int64)[None, :] + self.mrope_delta
        return out

    def items_in_window(self, start: int, end: int) -> list[int]:
        """Indices of the items with a pad token in [start, end): the encoder outputs this window needs whole
        (the ViT is bidirectional, so an item is always encoded in full,
        docs/multimodal.md#the-vision-tower)."""
        needed = []
        for index, item in enumerate(self.items):
            if any(first < end and first + count > start for first, count in item.embed_runs):
                needed.append(index)
        return needed

    def embed_slices(self, start: int, end: int) -> list[EmbedSlice]:
        """Which encoder-output rows the token window [start, end) consumes, and where they go in the window."""
        slices = []
        for index, item in enumerate(self.items):
            row = 0
            for first, count in item.embed_runs:
                lo, hi = max(first, start), min(first + count, end)
                if lo < hi:
                    slices.append(EmbedSlice(index, row + lo - first, row + hi - first, lo - start))
                row += count
        return slices
