"""The vision variants of the tiny checkpoints (`dense-vl`, `moe-vl`): the text variants' decoder, unchanged, with
a vision tower sized for exactness tests (two blocks, head_dim 32, the release's 48x48 position table) and the
image / video processor configs of the Qwen3.5 releases (docs/multimodal.md#image-preprocessing,
docs/multimodal.md#video-preprocessing).

The text variants (`dense`, `moe`, `next`) keep their own bytes: nothing here is read when they are written.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from deltaserve.tiny.spec import WIDE_SHAPES, WIDE_VARIANTS, TinyShapes

VISION_VARIANTS: dict[str, str] = {"dense-vl": "dense", "moe-vl": "moe"}  # vision variant -> its text variant

VISION_SHAPES = replace(
    TinyShapes(),
    vision_depth=2,
    vision_hidden_size=64,
    vision_intermediate_size=128,
    vision_num_heads=2,
    vision_num_position_embeddings=2304,
)

# Shipped by Qwen3.5-2B-Base and Qwen3.6-35B-A3B (docs/multimodal.md#image-preprocessing): areas, not edges.
IMAGE_MIN_PIXELS = 65536
IMAGE_MAX_PIXELS = 16777216
# video_preprocessor_config.json of the releases (docs/multimodal.md#video-preprocessing): budgets over t·h·w of all
# sampled frames
VIDEO_MIN_PIXELS = 4096
VIDEO_MAX_PIXELS = 25165824


def shapes_for(variant: str) -> TinyShapes:
    """The shapes of a variant: the vision variants', the FP8 gate's wide ones (spec.WIDE_SHAPES) or the default."""
    if variant in VISION_VARIANTS:
        return VISION_SHAPES
    return WIDE_SHAPES if variant in WIDE_VARIANTS else TinyShapes()


def _processor_config(
    shapes: TinyShapes, min_pixels: int, max_pixels: int, type_key: str, type_name: str
) -> dict[str, Any]:
    """The fields the image and the video processor configs share: pixel budget, patching, normalisation."""
    return {
        "size": {"longest_edge": max_pixels, "shortest_edge": min_pixels},
        "patch_size": shapes.vision_patch_size,
        "temporal_patch_size": shapes.vision_temporal_patch_size,
        "merge_size": shapes.vision_spatial_merge_size,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "processor_class": "Qwen3VLProcessor",
        type_key: type_name,
    }


def preprocessor_config(shapes: TinyShapes) -> dict[str, Any]:
    """preprocessor_config.json as the releases ship it (the legacy class name that transformers 5 maps)."""
    args = (IMAGE_MIN_PIXELS, IMAGE_MAX_PIXELS, "image_processor_type", "Qwen2VLImageProcessorFast")
    return _processor_config(shapes, *args)


def video_preprocessor_config(shapes: TinyShapes) -> dict[str, Any]:
    """video_preprocessor_config.json as the releases ship it."""
    args = (VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS, "video_processor_type", "Qwen3VLVideoProcessor")
    return _processor_config(shapes, *args)
