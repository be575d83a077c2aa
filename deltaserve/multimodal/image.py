"""Image preprocessing equal to transformers' Qwen2VLImageProcessor (the processor of Qwen3-VL, Qwen3.5 and
Qwen3.6): smart_resize, the resize kernel, fused rescale + normalise, and the 2x2-block patch layout
(docs/multimodal.md#image-preprocessing).

Two resize backends, as transformers has two: "torch" (its default torchvision backend, which on the CPU runs
torch's native uint8 antialiased bicubic; what vLLM runs) and "pil" (its PIL backend, `backend="pil"`).
Input is a decoded uint8 RGB array [H, W, 3]; output rows are [gh·gw, C·Tp·P·P] float32 in block order.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from deltaserve.multimodal.errors import MediaSizeError
from deltaserve.multimodal.processor_config import ImageProcessorConfig

MAX_ASPECT_RATIO = 200


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Target (h, w) of an image, both multiples of factor, area steered into [min_pixels, max_pixels]
    (docs/multimodal.md#image-preprocessing).

    Python doubles and round-half-to-even throughout; the rescale steps use the original size, not the rounded one.
    """
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise MediaSizeError(
            f"image of {width}x{height} pixels has an aspect ratio above {MAX_ASPECT_RATIO}, which the processor "
            f"cannot resize (got {max(height, width) / min(height, width):.1f})"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def resize_uint8(frames: np.ndarray, height: int, width: int, backend: str) -> np.ndarray:
    """frames [N, H, W, 3] uint8 -> [N, 3, height, width] uint8 (channel-first, as the processors work).

    "torch": F.interpolate on the contiguous uint8 NCHW tensor, bicubic, antialias, align_corners False: what
    torchvision's resize dispatches to for uint8 bicubic on the CPU. Same size: returned untouched, as
    torchvision does. "pil": PIL.Image.resize(BICUBIC) per frame, as transformers' PIL backend does (always).
    """
    if backend == "pil":
        out = [np.asarray(Image.fromarray(frame).resize((width, height), resample=Image.Resampling.BICUBIC))
               for frame in frames]  # fmt: skip
        return np.ascontiguousarray(np.stack(out).transpose(0, 3, 1, 2))
    tensor = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).contiguous()  # [N, 3, H, W]
    if tuple(tensor.shape[-2:]) != (height, width):
        tensor = F.interpolate(tensor, size=(height, width), mode="bicubic", antialias=True, align_corners=False)
    return tensor.numpy()


def rescale_and_normalize(
    images: np.ndarray,
    do_rescale: bool,
    rescale_factor: float,
    do_normalize: bool,
    mean: tuple[float, ...],
    std: tuple[float, ...],
    backend: str,
) -> np.ndarray:
    """images [N, 3, H, W] uint8 -> float32, rounded as the chosen transformers backend rounds
    (docs/multimodal.md#image-preprocessing).

    torch backend: rescale folded into mean/std (mean/rescale, std/rescale as fp32 tensors), then one fp32
    (x - mean') / std'. PIL backend: x·rescale in float64 cast to fp32, then (x - mean) / std in fp32.
    """
    if backend == "pil":
        x = images
        if do_rescale:
            x = (x.astype(np.float64) * rescale_factor).astype(np.float32)
        if do_normalize:
            x = x.astype(np.float32) if not np.issubdtype(x.dtype, np.floating) else x
            m = np.array(mean, dtype=x.dtype)[None, :, None, None]
            s = np.array(std, dtype=x.dtype)[None, :, None, None]
            x = (x - m) / s
        return np.ascontiguousarray(x, dtype=np.float32)
    tensor = torch.from_numpy(images)
    if do_rescale and do_normalize:
        mean_t = torch.tensor(mean) * (1.0 / rescale_factor)
        std_t = torch.tensor(std) * (1.0 / rescale_factor)
        out = (tensor.to(torch.float32) - mean_t[None, :, None, None]) / std_t[None, :, None, None]
    elif do_normalize:
        mean_t, std_t = torch.tensor(mean), torch.tensor(std)
        out = (tensor.to(torch.float32) - mean_t[None, :, None, None]) / std_t[None, :, None, None]
    elif do_rescale:
        out = tensor * rescale_factor
    else:
        out = tensor.to(torch.float32)
    return out.to(torch.float32).numpy()


def patchify(frames: np.ndarray, patch_size: int, temporal_patch_size: int, merge_size: int) -> np.ndarray:
    """frames [T, C, H, W] (T a multiple of Tp) -> rows [T/Tp · gh·gw, C·Tp·P·P]
    (docs/multimodal.md#image-preprocessing, docs/multimodal.md#video-preprocessing).

    Rows: temporal group, then 2x2 merge blocks (block row, block col, in-row, in-col); features (c, t, y, x).
    """
    num_frames, channels, height, width = frames.shape
    grid_t = num_frames // temporal_patch_size
    grid_h, grid_w = height // patch_size, width // patch_size
    m, p = merge_size, patch_size
    x = frames.reshape(grid_t, temporal_patch_size, channels, grid_h // m, m, p, grid_w // m, m, p)
    # (g, bi, bj, ii, jj, c, t, y, x)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return np.ascontiguousarray(x).reshape(grid_t * grid_h * grid_w, channels * temporal_patch_size * p * p)


def preprocess_image(image: np.ndarray, config: ImageProcessorConfig) -> tuple[np.ndarray, tuple[int, int, int]]:
    """One uint8 RGB image [H, W, 3] -> (pixel_values [gh·gw, 3·Tp·P·P] float32, grid_thw (1, gh, gw))."""
    height, width = image.shape[:2]
    if config.do_resize:
        new_h, new_w = smart_resize(height, width, config.factor, config.min_pixels, config.max_pixels)
    else:
        new_h, new_w = height, width
    if new_h % config.factor or new_w % config.factor:
        raise MediaSizeError(f"image of {width}x{height} is not a multiple of {config.factor} and do_resize is off")
    if config.do_resize and config.resize_backend == "pil":
        # transformers' PIL backend calls PIL's resize even at the same size (an identity for BICUBIC)
        resized = resize_uint8(image[None], new_h, new_w, "pil")
    else:
        resized = resize_uint8(image[None], new_h, new_w, "torch")
    normed = rescale_and_normalize(
        resized, config.do_rescale, config.rescale_factor, config.do_normalize, config.image_mean,
        config.image_std, config.resize_backend,
    )  # fmt: skip
    # a still image fills both temporal slices with the same frame (docs/multimodal.md#image-preprocessing)
    frames = np.repeat(normed, config.temporal_patch_size, axis=0)  # [Tp, 3, h, w]
    rows = patchify(frames, config.patch_size, config.temporal_patch_size, config.merge_size)
    return rows, (1, new_h // config.patch_size, new_w // config.patch_size)
