"""Video preprocessing equal to transformers' Qwen3VLVideoProcessor (docs/multimodal.md#video-preprocessing): frame
sampling, the video smart_resize over the t·h·w budget (with the optional per-frame cap), temporal padding of an odd
frame count with the last frame, patchify, and the per-group timestamps the prompt carries.

Frames arrive decoded (uint8 RGB [N, H, W, 3]) with their metadata: the source fps and the source index of each
frame. Sampling is the processor's own (`do_sample_frames`), or skipped when the caller sampled already.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from deltaserve.multimodal.errors import MediaRequestError, MediaSizeError
from deltaserve.multimodal.image import MAX_ASPECT_RATIO, patchify, rescale_and_normalize, resize_uint8
from deltaserve.multimodal.processor_config import VideoProcessorConfig

# transformers assumes this source fps when a video has none, and warns (docs/multimodal.md#video-preprocessing)
DEFAULT_SOURCE_FPS = 24.0


@dataclass(frozen=True)
class VideoMetadata:
    """What the processor needs to know of the source: its frame count, its fps and which source frame each
    decoded frame is (all of them, in order, for a fully decoded file)."""

    total_num_frames: int
    fps: float | None
    frames_indices: tuple[int, ...]


def sample_frame_indices(total_num_frames: int, source_fps: float | None, config: VideoProcessorConfig) -> np.ndarray:
    """Indices into the source frames (docs/multimodal.md#video-preprocessing): n = int(N / fps_src · fps), clamped to
    [min_frames, min(max_frames, N)], spread by numpy linspace rounded half-to-even; num_frames instead of fps if
    set."""
    num_frames = config.num_frames
    fps = config.fps
    if num_frames is not None and fps is not None:
        raise MediaSizeError("video sampling: `num_frames` and `fps` are mutually exclusive; set only one")
    if num_frames is None and fps is not None:
        source_fps = DEFAULT_SOURCE_FPS if source_fps is None else source_fps
        num_frames = int(total_num_frames / source_fps * fps)
        num_frames = min(max(num_frames, config.min_frames), config.max_frames, total_num_frames)
    if num_frames is None:
        num_frames = min(max(total_num_frames, config.min_frames), config.max_frames)
    return np.linspace(0, total_num_frames - 1, num_frames).round().astype(int)


def video_smart_resize(
    num_frames: int, height: int, width: int, temporal_factor: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Per-frame (h, w) of a video whose budget is over t·h·w (docs/multimodal.md#video-preprocessing); β uses n, not
    the rounded t̄."""
    if num_frames < temporal_factor:
        raise MediaSizeError(f"a video needs at least {temporal_factor} frames, got {num_frames}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise MediaSizeError(
            f"video frames of {width}x{height} have an aspect ratio above {MAX_ASPECT_RATIO}, which the processor "
            "cannot resize"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def target_frame_size(num_frames: int, height: int, width: int, config: VideoProcessorConfig) -> tuple[int, int]:
    """The (h, w) every sampled frame is resized to, including transformers' optional per-frame cap."""
    if not config.do_resize:
        return height, width
    max_pixels = config.max_pixels
    if config.cap_pixels_per_frame:
        frame_cap = config.max_video_tokens * config.factor * config.factor
        pixels_per_frame = max(min(frame_cap, config.max_pixels // num_frames), int(config.min_pixels * 1.05))
        max_pixels = pixels_per_frame * num_frames
    return video_smart_resize(
        num_frames, height, width, config.temporal_patch_size, config.factor, config.min_pixels, max_pixels
    )


def group_timestamps(frames_indices: list[int], source_fps: float | None, temporal_patch_size: int) -> list[float]:
    """Seconds of each temporal group: the mean of its first and last frame time, indices padded to a multiple
    of the temporal patch by repeating the last
    (docs/multimodal.md#video-preprocessing)."""
    fps = DEFAULT_SOURCE_FPS if source_fps is None else source_fps
    indices = list(frames_indices)
    if len(indices) % temporal_patch_size:
        indices.extend(indices[-1] for _ in range(temporal_patch_size - len(indices) % temporal_patch_size))
    seconds = [index / fps for index in indices]
    return [
        (seconds[i] + seconds[i + temporal_patch_size - 1]) / 2 for i in range(0, len(seconds), temporal_patch_size)
    ]


def timestamp_text(seconds: float) -> str:
    """The text before each temporal group: `<T seconds>` with one decimal, Python's correctly rounded format."""
    return f"<{seconds:.1f} seconds>"


@dataclass(frozen=True)
class ProcessedVideo:
    pixel_values: np.ndarray  # [grid_t·gh·gw, 3·Tp·P·P] float32
    grid_thw: tuple[int, int, int]
    timestamps: tuple[float, ...]  # one per temporal group


def select_frames(
    num_decoded: int, metadata: VideoMetadata, config: VideoProcessorConfig, do_sample_frames: bool | None
) -> tuple[np.ndarray, list[int]]:
    """(positions into the decoded frames, their source indices): the processor's sampling when it applies."""
    sample = config.do_sample_frames if do_sample_frames is None else do_sample_frames
    if not sample:
        return np.arange(num_decoded), list(metadata.frames_indices)
    if num_decoded != metadata.total_num_frames:
        raise MediaSizeError(
            f"video sampling needs every source frame: got {num_decoded} of {metadata.total_num_frames}; pass "
            "do_sample_frames=False for frames that were sampled already"
        )
    # transformers samples from total_num_frames and the chosen indices become the frames' source indices
    chosen = sample_frame_indices(metadata.total_num_frames, metadata.fps, config)
    return chosen, [int(i) for i in chosen]


def preprocess_frames(frames: np.ndarray, source_indices: list[int], source_fps: float | None,
                      config: VideoProcessorConfig) -> ProcessedVideo:  # fmt: skip
    """Already-selected uint8 frames [n, H, W, 3] -> patches, grid and timestamps."""
    num_frames, height, width = frames.shape[:3]
    new_h, new_w = target_frame_size(num_frames, height, width, config)
    if new_h % config.factor or new_w % config.factor:
        raise MediaSizeError(f"video of {width}x{height} is not a multiple of {config.factor} and do_resize is off")
    if config.resize_backend != "torch":
        # transformers' video processors have only the torchvision backend: there is no PIL reference to match
        raise MediaRequestError(f"video resize_backend {config.resize_backend!r} is not supported; use 'torch'")
    resized = resize_uint8(frames, new_h, new_w, "torch")
    normed = rescale_and_normalize(
        resized, config.do_rescale, config.rescale_factor, config.do_normalize, config.image_mean,
        config.image_std, "torch",
    )  # fmt: skip
    if pad := -num_frames % config.temporal_patch_size:
        # an odd frame count is completed with copies of the last frame (docs/multimodal.md#video-preprocessing)
        normed = np.concatenate([normed, np.repeat(normed[-1:], pad, axis=0)])
    rows = patchify(normed, config.patch_size, config.temporal_patch_size, config.merge_size)
    grid = (normed.shape[0] // config.temporal_patch_size, new_h // config.patch_size, new_w // config.patch_size)
    timestamps = group_timestamps(source_indices, source_fps, config.temporal_patch_size)
    return ProcessedVideo(rows, grid, tuple(timestamps))


def preprocess_video(
    frames: np.ndarray, metadata: VideoMetadata, config: VideoProcessorConfig, do_sample_frames: bool | None = None
) -> ProcessedVideo:
    """Decoded frames + metadata -> ProcessedVideo, as Qwen3VLVideoProcessor with return_metadata does."""
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise MediaSizeError(f"video frames must be uint8 [N, H, W, 3], got {frames.dtype} {list(frames.shape)}")
    if len(metadata.frames_indices) != frames.shape[0]:
        raise MediaSizeError(
            f"video metadata names {len(metadata.frames_indices)} frame indices for {frames.shape[0]} frames"
        )
    chosen, source = select_frames(frames.shape[0], metadata, config, do_sample_frames)
    return preprocess_frames(frames[chosen], source, metadata.fps, config)
