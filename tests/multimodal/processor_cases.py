"""The preprocessing cases shared by make_processor_fixtures.py (which runs transformers' own torchvision-backed
Qwen3-VL processors on them, once) and test_processor_parity.py (which runs deltaserve's on them in CI).

Sizes are (height, width). Images cover sizes needing rounding (half-to-even 720 -> 704), tiny (1x1) and huge
(5000x4000) inputs, min/max pixel overrides and an aspect ratio the processor refuses; videos cover sampling by
fps and by num_frames, min_frames clamping, odd frame counts, tiny frames, fractional fps and the per-frame cap.
"""

from __future__ import annotations

from typing import Any

# The Qwen3.5 release values (multimodal doc §1.1, §2.1); each case may override `size`.
IMAGE_PROCESSOR = {"size": {"shortest_edge": 65536, "longest_edge": 16777216}, "patch_size": 16,
                   "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                   "image_std": [0.5, 0.5, 0.5]}  # fmt: skip
VIDEO_PROCESSOR = {"size": {"shortest_edge": 4096, "longest_edge": 25165824}, "patch_size": 16,
                   "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                   "image_std": [0.5, 0.5, 0.5]}  # fmt: skip

IMAGE_CASES: list[dict[str, Any]] = [
    {"name": "img-384x512-valid", "height": 384, "width": 512},
    {"name": "img-375x500", "height": 375, "width": 500},
    {"name": "img-333x1001", "height": 333, "width": 1001},
    {"name": "img-150x200-upscaled", "height": 150, "width": 200},
    {"name": "img-80x100", "height": 80, "width": 100},
    {"name": "img-720x1280-half-even", "height": 720, "width": 1280},
    {"name": "img-1x1-tiny", "height": 1, "width": 1},
    {"name": "img-3x700-aspect", "height": 3, "width": 700},
    {"name": "img-2000x3000", "height": 2000, "width": 3000},
    {"name": "img-4000x5000-huge", "height": 4000, "width": 5000},
    {
        "name": "img-480x640-min-max",
        "height": 480,
        "width": 640,
        "size": {"shortest_edge": 4096, "longest_edge": 65536},
    },  # fmt: skip
    {"name": "img-1024-max", "height": 1024, "width": 1024, "size": {"shortest_edge": 65536, "longest_edge": 262144}},
    {"name": "img-47x33-small", "height": 47, "width": 33, "size": {"shortest_edge": 1024, "longest_edge": 4096}},
    {"name": "img-97x61-odd", "height": 97, "width": 61, "size": {"shortest_edge": 2048, "longest_edge": 8192}},
]

VIDEO_CASES: list[dict[str, Any]] = [
    {"name": "vid-9f-fps3", "frames": 9, "height": 64, "width": 96, "fps": 3.0, "sample": True},
    {"name": "vid-15f-fps30-min-frames", "frames": 15, "height": 48, "width": 80, "fps": 30.0, "sample": True},
    {"name": "vid-5f-presampled-odd", "frames": 5, "height": 64, "width": 64, "fps": 2.0, "sample": False},
    {
        "name": "vid-7f-num-frames",
        "frames": 7,
        "height": 40,
        "width": 72,
        "fps": 24.0,
        "sample": True,
        "kwargs": {"num_frames": 5, "fps": None},
    },  # fmt: skip
    {
        "name": "vid-4f-720p-cap-on",
        "frames": 4,
        "height": 720,
        "width": 1280,
        "fps": 2.0,
        "sample": True,
        "kwargs": {"cap_pixels_per_frame": True},
    },  # fmt: skip
    {
        "name": "vid-4f-720p-cap-off",
        "frames": 4,
        "height": 720,
        "width": 1280,
        "fps": 2.0,
        "sample": True,
        "kwargs": {"cap_pixels_per_frame": False},
    },  # fmt: skip
    {"name": "vid-6f-tiny-16x20", "frames": 6, "height": 16, "width": 20, "fps": 2.0, "sample": True},
    {"name": "vid-10f-fps7.5", "frames": 10, "height": 32, "width": 64, "fps": 7.5, "sample": True},
    {
        "name": "vid-3f-presampled-budget",
        "frames": 3,
        "height": 200,
        "width": 300,
        "fps": 1.0,
        "sample": False,
        "kwargs": {"size": {"shortest_edge": 4096, "longest_edge": 60000}},
    },  # fmt: skip
]

# One chat with text, two images and a video, through transformers' whole Qwen3VLProcessor (template rendering,
# placeholder expansion with timestamps, tokenisation). Media are referenced by generator arguments.
PROMPT_CASE: dict[str, Any] = {
    "name": "chat-two-images-and-a-video",
    "images": [{"height": 64, "width": 96, "seed": 1}, {"height": 300, "width": 200, "seed": 2}],
    "video": {"frames": 5, "height": 64, "width": 64, "seed": 3, "fps": 2.0},
    "messages": [
        {"role": "system", "content": "You describe pictures."},
        {"role": "user", "content": [
            {"type": "text", "text": "Look at this:"},
            {"type": "image"},
            {"type": "text", "text": " and this clip "},
            {"type": "video"},
            {"type": "image"},
            {"type": "text", "text": "What changed?"},
        ]},
    ],
}  # fmt: skip
