"""Request-side multimodal processing for Qwen3.5 / Qwen3.6: media loading, preprocessing equal to transformers'
Qwen3-VL image and video processors, placeholder expansion and 3-D MRoPE positions, producing a plain-data
MultimodalInput for the engine (docs/multimodal.md). The vision tower itself is deltaserve/model/vision.py.
"""

from __future__ import annotations

from deltaserve.multimodal.errors import (
    MediaDecodeError,
    MediaError,
    MediaLimitError,
    MediaPathError,
    MediaRequestError,
    MediaSizeError,
    MediaTypeError,
)
from deltaserve.multimodal.inputs import EmbedSlice, MultimodalInput, MultimodalItem
from deltaserve.multimodal.processor import MediaRef, MultimodalProcessor, parse_limit_mm_per_prompt
from deltaserve.multimodal.prompt import VisionTokenIds

__all__ = [
    "EmbedSlice",
    "MediaDecodeError",
    "MediaError",
    "MediaLimitError",
    "MediaPathError",
    "MediaRef",
    "MediaRequestError",
    "MediaSizeError",
    "MediaTypeError",
    "MultimodalInput",
    "MultimodalItem",
    "MultimodalProcessor",
    "VisionTokenIds",
    "parse_limit_mm_per_prompt",
]
