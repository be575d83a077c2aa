"""The image and video processor settings of a checkpoint: preprocessor_config.json and
video_preprocessor_config.json, with transformers' class defaults where a field is absent
(docs/multimodal.md#image-preprocessing, docs/multimodal.md#video-preprocessing) and vLLM's `--mm-processor-kwargs`
overrides on top.

Pitfall (docs/multimodal.md#image-preprocessing): the image processor's *class* defaults are Qwen2-VL's (patch 14, min
3136, max 1003520, CLIP mean/std), so a checkpoint folder without preprocessor_config.json gets those, exactly as
transformers does. `size.shortest_edge` / `size.longest_edge` are pixel *areas* (min_pixels / max_pixels), not edge
lengths.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from deltaserve.multimodal.errors import MediaRequestError

# transformers' OPENAI_CLIP_MEAN / OPENAI_CLIP_STD (Qwen2VLImageProcessor class defaults)
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# IMAGENET_STANDARD_MEAN / STD (Qwen3VLVideoProcessor class defaults)
STANDARD_MEAN = (0.5, 0.5, 0.5)
STANDARD_STD = (0.5, 0.5, 0.5)
BICUBIC = 3  # PIL.Image.Resampling.BICUBIC
RESIZE_BACKENDS = ("torch", "pil")


class ProcessorConfigError(ValueError):
    """A processor config file deltaserve cannot honour; the message names the file and the field."""


@dataclass(frozen=True)
class ImageProcessorConfig:
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    do_convert_rgb: bool = True
    resample: int = BICUBIC
    # "torch": torchvision's CPU uint8 antialiased bicubic, the transformers default backend that vLLM runs;
    # "pil": transformers' PIL backend (backend="pil"). Not a checkpoint field: a deltaserve switch
    # (docs/multimodal.md#image-preprocessing).
    resize_backend: str = "torch"

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


@dataclass(frozen=True)
class VideoProcessorConfig:
    min_pixels: int = 128 * 32 * 32
    max_pixels: int = 32 * 32 * 768
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = STANDARD_MEAN
    image_std: tuple[float, ...] = STANDARD_STD
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    do_convert_rgb: bool = True
    resample: int = BICUBIC
    fps: float | None = 2.0
    num_frames: int | None = None
    min_frames: int = 4
    max_frames: int = 768
    do_sample_frames: bool = True
    # transformers 5.17-5.24 default: off (None warns and means off); the default may change
    # (docs/multimodal.md#video-preprocessing).
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 768
    resize_backend: str = "torch"

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


_INT_FIELDS = ("patch_size", "temporal_patch_size", "merge_size", "min_frames", "max_frames", "max_video_tokens")
_BOOL_FIELDS = ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb", "do_sample_frames", "cap_pixels_per_frame")


def _fail(source: str, key: str, problem: str) -> ProcessorConfigError:
    return ProcessorConfigError(f"{source}: field `{key}` {problem}")


def _number(source: str, key: str, value: Any, kind: type) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(source, key, f"must be a number, got {value!r}")
    if kind is int and (not float(value).is_integer() or value <= 0):
        raise _fail(source, key, f"must be a positive integer, got {value!r}")
    return kind(value)


def _apply(config: Any, data: dict[str, Any], source: str) -> Any:
    """Returns config with the recognised fields of data applied (unknown fields are ignored, as transformers'
    processors ignore keys they do not define)."""
    changes: dict[str, Any] = {}
    size = data.get("size")
    if size is not None:
        if not isinstance(size, dict):
            raise _fail(source, "size", f"must be an object with shortest_edge/longest_edge, got {size!r}")
        if "shortest_edge" in size:
            changes["min_pixels"] = _number(source, "size.shortest_edge", size["shortest_edge"], int)
        if "longest_edge" in size:
            changes["max_pixels"] = _number(source, "size.longest_edge", size["longest_edge"], int)
        if {"height", "width"} & set(size):
            raise _fail(source, "size", "with height/width is not supported: Qwen3-VL resizes by pixel area")
    # min_pixels / max_pixels as constructor kwargs override size (transformers' backward compatibility)
    for key in ("min_pixels", "max_pixels"):
        if data.get(key) is not None:
            changes[key] = _number(source, key, data[key], int)
    for key in _INT_FIELDS:
        if data.get(key) is not None and hasattr(config, key):
            changes[key] = _number(source, key, data[key], int)
    for key in _BOOL_FIELDS:
        if data.get(key) is not None and hasattr(config, key):
            if not isinstance(data[key], bool):
                raise _fail(source, key, f"must be true or false, got {data[key]!r}")
            changes[key] = data[key]
    for key in ("image_mean", "image_std"):
        value = data.get(key)
        if value is not None:
            values = [value] * 3 if isinstance(value, (int, float)) else value
            if not isinstance(values, list | tuple) or len(values) != 3:
                raise _fail(source, key, f"must be 3 numbers, got {value!r}")
            changes[key] = tuple(_number(source, key, v, float) for v in values)
    if data.get("rescale_factor") is not None:
        changes["rescale_factor"] = _number(source, "rescale_factor", data["rescale_factor"], float)
    if data.get("resample") is not None:
        if data["resample"] != BICUBIC:
            raise _fail(source, "resample", f"is {data['resample']!r}; only BICUBIC (3) resizing is implemented")
        changes["resample"] = BICUBIC
    if isinstance(config, VideoProcessorConfig):
        for key in ("fps", "num_frames"):
            if key in data:
                value = data[key]
                changes[key] = None if value is None else _number(source, key, value, float if key == "fps" else int)
    if data.get("resize_backend") is not None:
        if data["resize_backend"] not in RESIZE_BACKENDS:
            raise _fail(source, "resize_backend", f"must be one of {', '.join(RESIZE_BACKENDS)}")
        changes["resize_backend"] = data["resize_backend"]
    if data.get("do_center_crop"):
        raise _fail(source, "do_center_crop", "is true; Qwen3-VL processors do not crop")
    result = replace(config, **changes)
    if result.min_pixels > result.max_pixels:
        raise _fail(source, "size", f"has shortest_edge {result.min_pixels} > longest_edge {result.max_pixels}")
    return result


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ProcessorConfigError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ProcessorConfigError(f"{path}: must hold a JSON object")
    return data


@dataclass(frozen=True)
class ProcessorConfigs:
    image: ImageProcessorConfig
    video: VideoProcessorConfig

    @classmethod
    def from_model_dir(
        cls, model_dir: str | Path, mm_processor_kwargs: dict[str, Any] | None = None
    ) -> ProcessorConfigs:
        """Reads the two processor files (transformers' defaults for a missing one) and applies vLLM-style
        mm_processor_kwargs, which go to both processors (as vLLM forwards them to the HF processor call)."""
        model_dir = Path(model_dir)
        # transformers' priority: the nested processor_config.json (how v5 saves), then the legacy files; the
        # video processor falls back to the image processor's file when it has none of its own.
        nested_path = model_dir / "processor_config.json"
        nested = _read_json(nested_path) or {}
        image_path = model_dir / "preprocessor_config.json"
        video_path = model_dir / "video_preprocessor_config.json"
        image_source, image_data = str(nested_path), nested.get("image_processor")
        if not isinstance(image_data, dict):
            image_source, image_data = str(image_path), _read_json(image_path)
        video_source, video_data = str(nested_path), nested.get("video_processor")
        if not isinstance(video_data, dict):
            video_source, video_data = str(video_path), _read_json(video_path)
        if video_data is None:
            video_source, video_data = str(image_path), _read_json(image_path)
        image = _apply(ImageProcessorConfig(), image_data, image_source) if image_data else ImageProcessorConfig()
        video = _apply(VideoProcessorConfig(), video_data, video_source) if video_data else VideoProcessorConfig()
        return cls(image, video).with_overrides(mm_processor_kwargs)

    def with_overrides(self, overrides: dict[str, Any] | None, source: str = "mm_processor_kwargs") -> ProcessorConfigs:
        """Per-server (--mm-processor-kwargs) or per-request overrides; errors are request errors."""
        if not overrides:
            return self
        if not isinstance(overrides, dict):
            raise MediaRequestError(f"{source} must be a JSON object, got {overrides!r}")
        try:
            return ProcessorConfigs(_apply(self.image, overrides, source), _apply(self.video, overrides, source))
        except ProcessorConfigError as exc:
            raise MediaRequestError(str(exc)) from None
