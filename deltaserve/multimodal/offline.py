"""The offline API's multimodal input: vLLM's `multi_modal_data` ({"image": ..., "video": ...}) as decoded media.

Images are PIL images or [H, W, 3] uint8 RGB arrays; videos are [N, H, W, 3] uint8 arrays of frames already
sampled, or (frames, fps) pairs (fps: the frames' rate, for the timestamps; default the processor's fps). The
k-th image placeholder of the prompt takes the k-th image, the k-th video placeholder the k-th video.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from deltaserve.multimodal.errors import MediaRequestError
from deltaserve.multimodal.media import LoadedImage, LoadedVideo
from deltaserve.multimodal.video import VideoMetadata


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list | tuple) and not _is_video_pair(value) else [value]


def _is_video_pair(value: Any) -> bool:
    return isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], int | float)


def _rgb(image: Any) -> np.ndarray:
    if hasattr(image, "convert"):  # a PIL image
        image = np.asarray(image.convert("RGB"))
    array = np.asarray(image)
    if array.ndim != 3 or array.shape[2] != 3 or array.dtype != np.uint8:
        raise MediaRequestError(f"an image must be a PIL image or an [H, W, 3] uint8 array, got {array.shape}")
    return np.ascontiguousarray(array)


def loaded_media(multi_modal_data: dict[str, Any], default_fps: float) -> list[LoadedImage | LoadedVideo]:
    """Images first, then videos, each in the given order (the processor pairs them with placeholders by kind)."""
    unknown = set(multi_modal_data) - {"image", "video"}
    if unknown:
        raise MediaRequestError(f"multi_modal_data: unsupported modalities {sorted(unknown)} (image, video)")
    loaded: list[LoadedImage | LoadedVideo] = []
    for image in _as_list(multi_modal_data.get("image", [])):
        pixels = _rgb(image)
        loaded.append(LoadedImage(pixels, hashlib.sha256(pixels.tobytes()).hexdigest()))
    for video in _as_list(multi_modal_data.get("video", [])):
        frames, fps = (video[0], float(video[1])) if _is_video_pair(video) else (video, default_fps)
        frames = np.asarray(frames)
        if frames.ndim != 4 or frames.shape[3] != 3 or frames.dtype != np.uint8:
            raise MediaRequestError(f"a video must be an [N, H, W, 3] uint8 array of frames, got {frames.shape}")
        metadata = VideoMetadata(total_num_frames=len(frames), fps=fps, frames_indices=tuple(range(len(frames))))
        digest = hashlib.sha256(frames.tobytes() + str(fps).encode()).hexdigest()
        loaded.append(LoadedVideo(np.ascontiguousarray(frames), metadata, do_sample_frames=False, digest=digest))
    return loaded
