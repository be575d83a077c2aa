"""Writes tests/multimodal/data/processor_fixtures.json: transformers' own Qwen3-VL processors (torchvision
backend on the CPU, the default backend and what vLLM runs) on every case of processor_cases.py.

torchvision cannot be installed beside this project's CPU torch 2.13, so this runs ONCE, in a separate venv,
and its output is committed; test_processor_parity.py compares deltaserve's processing against it in CI.
How the committed file was made (CPU, x86_64, Python 3.11):

    python3 -m venv /tmp/vision-tv
    /tmp/vision-tv/bin/pip install torch==2.14.1 torchvision==0.29.1
    /tmp/vision-tv/bin/pip install transformers==5.24.0 pillow==13.0.0 numpy==2.4.6 jinja2
    python -m deltaserve.cli make-tiny /tmp/tiny-dense-vl --variant dense-vl     # in the project venv
    /tmp/vision-tv/bin/python tests/multimodal/make_processor_fixtures.py /tmp/tiny-dense-vl

Recorded per case: grid_thw, shape and the sha256 of the fp32 pixel bytes (bitwise equality), for videos the
sampled source indices and group timestamps, for the chat the rendered text and the input ids, or the error.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
from PIL import Image

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from processor_cases import IMAGE_CASES, IMAGE_PROCESSOR, PROMPT_CASE, VIDEO_CASES, VIDEO_PROCESSOR  # noqa: E402
from synthetic import synthetic_image, synthetic_video  # noqa: E402


def digest(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array, dtype=np.float32).tobytes()).hexdigest()


def main(tiny_dir: str) -> None:
    import torch
    import torchvision
    import transformers
    from transformers import AutoProcessor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    image_processor = Qwen2VLImageProcessor(**IMAGE_PROCESSOR)
    out: dict[str, object] = {
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__,
                     "torchvision": torchvision.__version__, "numpy": np.__version__},
        "images": {}, "videos": {}, "prompt": {},
    }  # fmt: skip
    for case in IMAGE_CASES:
        image = synthetic_image(case["height"], case["width"], case.get("seed", 0))
        kwargs = {"size": case["size"]} if "size" in case else {}
        try:
            # a PIL image, as vLLM hands it over: a [1, 1, 3] array would be read as channels-first
            result = image_processor(images=[Image.fromarray(image)], return_tensors="pt", **kwargs)
        except ValueError as exc:
            out["images"][case["name"]] = {"error": str(exc)}
            continue
        pixels = result["pixel_values"].numpy()
        out["images"][case["name"]] = {
            "grid_thw": result["image_grid_thw"][0].tolist(), "shape": list(pixels.shape), "sha256": digest(pixels),
        }  # fmt: skip
    for case in VIDEO_CASES:
        processor = Qwen3VLVideoProcessor(**VIDEO_PROCESSOR)
        frames = synthetic_video(case["frames"], case["height"], case["width"], case.get("seed", 0))
        metadata = VideoMetadata(total_num_frames=case["frames"], fps=case["fps"],
                                 frames_indices=list(range(case["frames"])))  # fmt: skip
        kwargs = dict(case.get("kwargs", {}))
        kwargs.setdefault("cap_pixels_per_frame", False)
        result = processor(videos=[frames], video_metadata=[metadata], do_sample_frames=case["sample"],
                           return_metadata=True, return_tensors="pt", **kwargs)  # fmt: skip
        pixels = result["pixel_values_videos"].numpy()
        meta = result["video_metadata"][0]
        indices = [int(i) for i in meta.frames_indices]
        stamps = transformers.Qwen3VLProcessor._calculate_timestamps(None, list(indices), meta.fps, 2)
        out["videos"][case["name"]] = {
            "grid_thw": result["video_grid_thw"][0].tolist(), "shape": list(pixels.shape), "sha256": digest(pixels),
            "frames_indices": indices, "timestamps": stamps,
        }  # fmt: skip
    processor = AutoProcessor.from_pretrained(tiny_dir)
    case = PROMPT_CASE
    images = [synthetic_image(spec["height"], spec["width"], spec["seed"]) for spec in case["images"]]
    video_spec = case["video"]
    video = synthetic_video(video_spec["frames"], video_spec["height"], video_spec["width"], video_spec["seed"])
    metadata = VideoMetadata(total_num_frames=video_spec["frames"], fps=video_spec["fps"],
                             frames_indices=list(range(video_spec["frames"])))  # fmt: skip
    text = processor.tokenizer.apply_chat_template(case["messages"], tokenize=False, add_generation_prompt=True)
    pil_images = [Image.fromarray(image) for image in images]
    result = processor(text=[text], images=pil_images, videos=[video], return_tensors="pt",
                       videos_kwargs={"video_metadata": [metadata], "do_sample_frames": False,
                                      "cap_pixels_per_frame": False})  # fmt: skip
    out["prompt"] = {
        "name": case["name"], "text": text, "input_ids": result["input_ids"][0].tolist(),
        "mm_token_type_ids": result["mm_token_type_ids"][0].tolist(),
        "image_grid_thw": result["image_grid_thw"].tolist(), "video_grid_thw": result["video_grid_thw"].tolist(),
        "pixel_values_sha256": digest(result["pixel_values"].numpy()),
        "pixel_values_videos_sha256": digest(result["pixel_values_videos"].numpy()),
    }  # fmt: skip
    target = HERE / "data" / "processor_fixtures.json"
    target.parent.mkdir(exist_ok=True)
    target.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {target}: {len(out['images'])} images, {len(out['videos'])} videos, 1 chat")


if __name__ == "__main__":
    main(sys.argv[1])
