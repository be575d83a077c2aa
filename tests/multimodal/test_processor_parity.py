"""deltaserve's image and video preprocessing against transformers' own Qwen3-VL processors, bit for bit.

Two references: (1) the committed fixtures of transformers' torchvision-backed processors (the default backend,
what vLLM runs; torchvision cannot be installed beside this project's torch, so make_processor_fixtures.py ran
them once in a separate venv and recorded grids and sha256 digests of the fp32 pixels); (2) transformers' PIL
backend, Qwen2VLImageProcessorPil, run live here against deltaserve's "pil" resize backend.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from deltaserve.multimodal.errors import MediaSizeError
from deltaserve.multimodal.image import preprocess_image
from deltaserve.multimodal.processor_config import ImageProcessorConfig, ProcessorConfigs, VideoProcessorConfig, _apply
from deltaserve.multimodal.video import VideoMetadata, preprocess_video
from tests.multimodal.processor_cases import IMAGE_CASES, IMAGE_PROCESSOR, VIDEO_CASES, VIDEO_PROCESSOR
from tests.multimodal.synthetic import synthetic_image, synthetic_video

FIXTURES = json.loads((Path(__file__).parent / "data" / "processor_fixtures.json").read_text())


def digest(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array, dtype=np.float32).tobytes()).hexdigest()


def image_config(case: dict, backend: str = "torch") -> ImageProcessorConfig:
    settings = {**IMAGE_PROCESSOR, **({"size": case["size"]} if "size" in case else {}), "resize_backend": backend}
    return _apply(ImageProcessorConfig(), settings, "case")


@pytest.mark.parametrize("case", IMAGE_CASES, ids=[c["name"] for c in IMAGE_CASES])
def test_image_equals_transformers_torchvision(case: dict) -> None:
    expected = FIXTURES["images"][case["name"]]
    image = synthetic_image(case["height"], case["width"], case.get("seed", 0))
    if "error" in expected:
        with pytest.raises(MediaSizeError, match="aspect ratio"):
            preprocess_image(image, image_config(case))
        return
    rows, grid = preprocess_image(image, image_config(case))
    assert list(grid) == expected["grid_thw"]
    assert list(rows.shape) == expected["shape"]
    assert rows.dtype == np.float32
    assert digest(rows) == expected["sha256"], "pixel_values differ from transformers' bit for bit"


@pytest.mark.parametrize("case", VIDEO_CASES, ids=[c["name"] for c in VIDEO_CASES])
def test_video_equals_transformers_torchvision(case: dict) -> None:
    expected = FIXTURES["videos"][case["name"]]
    frames = synthetic_video(case["frames"], case["height"], case["width"], case.get("seed", 0))
    config = _apply(VideoProcessorConfig(), {**VIDEO_PROCESSOR, **case.get("kwargs", {})}, "case")
    metadata = VideoMetadata(case["frames"], case["fps"], tuple(range(case["frames"])))
    video = preprocess_video(frames, metadata, config, do_sample_frames=case["sample"])
    assert list(video.grid_thw) == expected["grid_thw"]
    assert list(video.pixel_values.shape) == expected["shape"]
    assert list(video.timestamps) == expected["timestamps"]
    assert digest(video.pixel_values) == expected["sha256"], "pixel_values_videos differ from transformers'"


PIL_CASES = [
    c for c in IMAGE_CASES if c["height"] * c["width"] <= 1_000_000 and "error" not in FIXTURES["images"][c["name"]]
]


@pytest.mark.parametrize("case", PIL_CASES, ids=[c["name"] for c in PIL_CASES])
def test_image_pil_backend_equals_transformers_pil_processor(case: dict) -> None:
    """transformers' PIL backend (no torchvision needed), live: smart_resize, PIL bicubic, float64 rescale,
    normalise and the block layout."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    image = synthetic_image(case["height"], case["width"], case.get("seed", 0))
    reference = Qwen2VLImageProcessorPil(**IMAGE_PROCESSOR)
    kwargs = {"size": case["size"]} if "size" in case else {}
    out = reference(images=[Image.fromarray(image)], return_tensors="np", **kwargs)
    rows, grid = preprocess_image(image, image_config(case, backend="pil"))
    assert list(grid) == out["image_grid_thw"][0].tolist()
    np.testing.assert_array_equal(rows, out["pixel_values"])


def test_checkpoint_processor_files_are_read(tmp_path: Path) -> None:
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**IMAGE_PROCESSOR, "processor_class": "x"}))
    configs = ProcessorConfigs.from_model_dir(tmp_path)
    assert (configs.image.min_pixels, configs.image.max_pixels, configs.image.patch_size) == (65536, 16777216, 16)
    # no video file: transformers falls back to the image processor's file
    assert configs.video.patch_size == 16 and configs.video.min_pixels == 65536
    bare = ProcessorConfigs.from_model_dir(tmp_path / "missing")
    # transformers' class defaults are Qwen2-VL's for images (doc §1.1)
    assert (bare.image.patch_size, bare.image.min_pixels, bare.video.patch_size) == (14, 3136, 16)
    overridden = configs.with_overrides({"max_pixels": 4096, "min_pixels": 1024})
    assert (overridden.image.min_pixels, overridden.image.max_pixels) == (1024, 4096)
