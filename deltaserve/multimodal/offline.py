"""The offline API's multimodal input: vLLM's `multi_modal_data` ({"image": ..., "video": ...}) as decoded media.

Images are PIL images or [H, W, 3] uint8 RGB arrays; videos are [N, H, W, 3] uint8 arrays of frames already
sampled, (frames, fps) pairs (fps: the frames' rate, for the timestamps; default the processor's fps), or
(frames, metadata) pairs as vLLM's Qwen3-VL processor takes them: metadata {"fps", "frames_indices" (which source
frame each given frame is; default all in order), "total_num_frames", "do_sample_frames" (default False: the
frames are the ones to use; True: the processor samples them)}. The k-th image placeholder of the prompt takes
the k-th image, the k-th video placeholder the k-th video.
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
    return isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], int | float | dict)


def _video_metadata(num_frames: int, spec: float | dict[str, Any]) -> tuple[VideoMetadata, bool]:
    """(metadata, do_sample_frames) of a (frames, fps) or (frames, vLLM metadata dict) pair."""
    if not isinstance(spec, dict):
        return VideoMetadata(num_frames, float(spec), tuple(range(num_frames))), False
    fps = spec.get("fps")
    if isinstance(fps, bool) or not isinstance(fps, int | float) or fps <= 0:
        raise MediaRequestError(f"video metadata: `fps` must be a positive number, got {fps!r}")
    indices = tuple(int(i) for i in spec.get("frames_indices", range(num_frames)))
    if len(indices) != num_frames:
        raise MediaRequestError(f"video metadata names {len(indices)} frames_indices for {num_frames} frames")
    total = int(spec.get("total_num_frames", num_frames))
    return VideoMetadata(total, float(fps), indices), bool(spec.get("do_sample_frames", False))


def _rgb(image: Any) -> np.ndarray:
    if hasattr(image, "convert"):  # a PIL image
        image = np.asarray(image.convert("RGB"))
    array = np.asarray(image)
    if array.ndim != 3 or array.shape[2] != 3 or array.dtype != np.uint8:
        raise MediaRequestError(f"an image must be a PIL image or an [H, W, 3] uint8 array, got {array.shape}")
    return np.ascontiguousarray(array)


def _array_digest(array: np.ndarray, extra: str = "") -> str:
    """An array item's identity (the prefix cache's and an encoder cache's key): its shape and its bytes, so two
    arrays of equal bytes and another shape (a solid 256 x 512 image and a solid 512 x 256 one) never share it."""
    digest = hashlib.sha256(f"{array.shape}|{array.dtype}|{extra}|".encode())
    digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


def loaded_media(multi_modal_data: dict[str, Any], default_fps: float) -> list[LoadedImage | LoadedVideo]:
    """Images first, then videos, each in the given order (the processor pairs them with placeholders by kind)."""
    unknown = set(multi_modal_data) - {"image", "video"}
    if unknown:
        raise MediaRequestError(f"multi_modal_data: unsupported modalities {sorted(unknown)} (image, video)")
    loaded: list[LoadedImage | LoadedVideo] = []
    for image in _as_list(multi_modal_data.get("image", [])):
        pixels = _rgb(image)
        loaded.append(LoadedImage(pixels, _array_digest(pixels)))
    for video in _as_list(multi_modal_data.get("video", [])):
        frames, spec = video if _is_video_pair(video) else (video, default_fps)
        frames = np.asarray(frames)
        if frames.ndim != 4 or frames.shape[3] != 3 or frames.dtype != np.uint8:
            raise MediaRequestError(f"a video must be an [N, H, W, 3] uint8 array of frames, got {frames.shape}")
        metadata, do_sample = _video_metadata(len(frames), spec)
        digest = _array_digest(frames, repr(metadata))
        loaded.append(LoadedVideo(np.ascontiguousarray(frames), metadata, do_sample_frames=do_sample, digest=digest))
    return loaded
