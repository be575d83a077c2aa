"""Media loading: the URL of an OpenAI content part -> decoded uint8 RGB pixels (images) or frames + metadata
(videos), with every failure a MediaError naming the problem.

URLs are vLLM's: `data:<mime>;base64,<payload>` and `file://` URLs under `--allowed-local-media-path`. There are
no network fetches. Images decode with Pillow as vLLM's ImageMediaIO does (EXIF orientation applied, transparency
composited onto white, docs/multimodal.md#image-preprocessing); videos decode with PyAV (the first video stream, every
frame in order, rgb24), and `data:video/jpeg;base64,<frame>,<frame>,...` is a list of JPEG frames, as in vLLM.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import io
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from deltaserve.multimodal.errors import (
    MediaDecodeError,
    MediaPathError,
    MediaRequestError,
    MediaSizeError,
    MediaTypeError,
)
from deltaserve.multimodal.video import VideoMetadata

# vLLM's VLLM_MAX_IMAGE_PIXELS default (also Pillow's decompression-bomb error threshold): checked on the header,
# before any pixel is decoded, for images and for video frames.
DEFAULT_MAX_IMAGE_PIXELS = 178_956_970
# vLLM's default fps for a list of frames without metadata (its jpeg_sequence loader)
DEFAULT_FRAME_LIST_FPS = 1.0


# (total_num_frames, source fps or None) -> the source frame indices to keep
FrameSelector = Callable[[int, float | None], list[int]]


@dataclass(frozen=True)
class LoadedImage:
    pixels: np.ndarray  # [H, W, 3] uint8 RGB
    digest: str  # sha256 of the encoded bytes: the item's identity for encoder caching


@dataclass(frozen=True)
class LoadedVideo:
    frames: np.ndarray  # [N, H, W, 3] uint8 RGB
    metadata: VideoMetadata
    do_sample_frames: bool  # False when the frames are a pre-sampled list (the processor must not resample)
    digest: str


class MediaLoader:
    """Resolves and decodes content-part URLs under one server's settings."""

    def __init__(
        self,
        allowed_local_media_path: str | Path | None = None,
        max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
        rgba_background_color: tuple[int, int, int] = (255, 255, 255),
    ) -> None:
        self.allowed_local_media_path: Path | None = None
        if allowed_local_media_path:
            folder = Path(allowed_local_media_path).resolve()
            if not folder.is_dir():
                raise ValueError(f"Invalid `--allowed-local-media-path`: {folder} is not an existing directory.")
            self.allowed_local_media_path = folder
        self.max_image_pixels = max_image_pixels
        self.rgba_background_color = rgba_background_color

    # ---- URLs -> bytes
    def _read_url(self, url: str, modality: str) -> tuple[str | None, bytes | str]:
        """(MIME type or None, payload): bytes, or for a data URL the base64 text still to decode."""
        if not isinstance(url, str) or not url:
            raise MediaRequestError(f"{modality} URL must be a non-empty string")
        if url[:5].lower() == "data:":
            spec, sep, payload = url[5:].partition(",")
            if not sep:
                raise MediaRequestError(f"{modality} data URL has no ',' before its payload")
            mime, _, encoding = spec.partition(";")
            if encoding.lower() != "base64":
                raise MediaTypeError(f"{modality} data URLs must be base64-encoded (data:<mime>;base64,...)")
            return mime.strip().lower(), payload
        parsed = urlparse(url)
        if parsed.scheme in ("http", "https"):
            raise MediaRequestError(
                f"{modality} URL {url[:100]!r}: deltaserve does not fetch media over the network; send it as a "
                "base64 data URL or a file:// URL under --allowed-local-media-path"
            )
        if parsed.scheme != "file":
            raise MediaRequestError(f"{modality} URL must be a data: or file: URL, got {url[:100]!r}")
        return None, self._read_local_file(Path(unquote(parsed.netloc + parsed.path)))

    def _read_local_file(self, path: Path) -> bytes:
        folder = self.allowed_local_media_path
        if folder is None:
            raise MediaPathError("Cannot load local files without `--allowed-local-media-path`.")
        resolved = path.resolve()
        if folder not in resolved.parents:
            raise MediaPathError(f"The file path {path} must be a subpath of `--allowed-local-media-path {folder}`.")
        if not resolved.is_file():
            raise MediaPathError(f"The file {path} does not exist under `--allowed-local-media-path`.")
        return resolved.read_bytes()

    @staticmethod
    def _b64decode(payload: str, modality: str) -> bytes:
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise MediaDecodeError(f"{modality} data URL payload is not valid base64 ({exc})") from None

    # ---- images
    def load_image(self, url: str) -> LoadedImage:
        mime, payload = self._read_url(url, "image")
        if mime is not None:
            if not mime.startswith("image/"):
                raise MediaTypeError(f"image_url data URL has MIME type {mime!r}; expected image/*")
            payload = self._b64decode(payload, "image")
        return LoadedImage(self.decode_image(payload), hashlib.sha256(payload).hexdigest())

    def decode_image(self, data: bytes) -> np.ndarray:
        """Encoded bytes -> [H, W, 3] uint8 RGB, as vLLM's ImageMediaIO: size check on the header, EXIF
        orientation, then RGB with any transparency composited onto the background colour."""
        try:
            image = Image.open(io.BytesIO(data))
        except Image.DecompressionBombError as exc:
            raise MediaSizeError(f"Image dimensions exceed the maximum: {exc}") from None
        except (UnidentifiedImageError, OSError) as exc:
            raise MediaDecodeError(f"Failed to load image: {exc}") from None
        width, height = image.size
        if width * height > self.max_image_pixels:
            raise MediaSizeError(
                f"Image dimensions {width}x{height} ({width * height} pixels) exceed the maximum of "
                f"{self.max_image_pixels} pixels."
            )
        try:
            # vLLM ignores a malformed EXIF block rather than failing the request
            with contextlib.suppress(Exception):
                image = ImageOps.exif_transpose(image)
            image.load()
            image = self._to_rgb(image)
            pixels = np.array(image, dtype=np.uint8)
        except Image.DecompressionBombError as exc:
            raise MediaSizeError(f"Failed to load image: {exc}") from None
        except (OSError, SyntaxError, ValueError) as exc:
            raise MediaDecodeError(f"Failed to load image: {exc}") from None
        if pixels.ndim != 3 or pixels.shape[2] != 3 or 0 in pixels.shape:
            raise MediaDecodeError(f"Failed to load image: decoded to shape {list(pixels.shape)}")
        return pixels

    def _to_rgb(self, image: Image.Image) -> Image.Image:
        if image.mode == "RGB":
            return image
        has_transparency = image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info
        if not has_transparency:
            return image.convert("RGB")
        if image.mode != "RGBA":
            image = image.convert("RGBA")
        background = Image.new("RGB", image.size, self.rgba_background_color)
        background.paste(image, mask=image.getchannel("A"))
        return background

    # ---- videos
    def load_video(self, url: str, fps: float | None = None, select: FrameSelector | None = None) -> LoadedVideo:
        """A video file (any container PyAV reads) or `data:video/jpeg;base64,` frames; fps overrides the
        frame list's fps (vLLM's media_io_kwargs video.fps), the default being vLLM's 1.0.

        select(total_num_frames, source_fps) -> source indices: when given, only those frames of a file are kept
        while decoding (memory bounded by the sampled frames, not the video's length) and the result is marked
        already sampled; without it every frame is returned and the processor samples."""
        mime, payload = self._read_url(url, "video")
        if mime is None:
            return self._decode_video_file(payload, select)
        if mime == "video/jpeg":
            parts = [part for part in payload.split(",") if part]
            frames = [self._b64decode(part, "video frame") for part in parts]
            return self.load_frames(frames, fps)
        if not mime.startswith("video/"):
            raise MediaTypeError(f"video_url data URL has MIME type {mime!r}; expected video/*")
        return self._decode_video_file(self._b64decode(payload, "video"), select)

    def load_frame_urls(self, urls: list[str], fps: float | None = None) -> LoadedVideo:
        """A video given as a list of image URLs (data: or file:), one per frame."""
        frames = []
        for url in urls:
            mime, payload = self._read_url(url, "video frame")
            if mime is not None:
                if not mime.startswith("image/"):
                    raise MediaTypeError(f"video frame data URL has MIME type {mime!r}; expected image/*")
                payload = self._b64decode(payload, "video frame")
            frames.append(payload)
        return self.load_frames(frames, fps)

    def load_frames(self, frames: list[bytes], fps: float | None = None) -> LoadedVideo:
        """A pre-sampled list of encoded frames: all kept (no resampling), source indices 0..n-1."""
        if not frames:
            raise MediaRequestError("a video given as a list of frames needs at least one frame")
        decoded = [self.decode_image(frame) for frame in frames]
        shapes = {frame.shape for frame in decoded}
        if len(shapes) != 1:
            raise MediaSizeError(f"video frames must share one size, got {sorted(shapes)}")
        digest = hashlib.sha256()
        for frame in frames:
            digest.update(hashlib.sha256(frame).digest())
        fps = DEFAULT_FRAME_LIST_FPS if fps is None else float(fps)
        if fps <= 0:
            raise MediaRequestError(f"video fps must be positive, got {fps}")
        metadata = VideoMetadata(len(decoded), fps, tuple(range(len(decoded))))
        return LoadedVideo(np.stack(decoded), metadata, False, digest.hexdigest())

    def _decode_video_file(self, data: bytes, select: FrameSelector | None = None) -> LoadedVideo:
        import av

        try:
            with av.open(io.BytesIO(data), mode="r") as container:
                if not container.streams.video:
                    raise MediaDecodeError("Failed to load video: the file has no video stream")
                stream = container.streams.video[0]
                if stream.width * stream.height > self.max_image_pixels:
                    raise MediaSizeError(
                        f"Video frame dimensions {stream.width}x{stream.height} ({stream.width * stream.height} "
                        f"pixels) exceed the maximum of {self.max_image_pixels} pixels."
                    )
                fps = float(stream.average_rate) if stream.average_rate else None
                expected = stream.frames or None
        except (MediaSizeError, MediaDecodeError):
            raise
        except (av.FFmpegError, OSError, ValueError, IndexError) as exc:
            raise MediaDecodeError(f"Failed to load video: {exc}") from None
        if select is None:
            frames, total = self._decode_frames(data, None)
            indices = tuple(range(total))
        else:
            # the container's frame count can be absent or wrong: decode again with the true count if it was
            total = expected if expected is not None else self._decode_frames(data, set())[1]
            wanted = [int(i) for i in select(total, fps)]
            frames, actual = self._decode_frames(data, set(wanted))
            if actual != total:
                total, wanted = actual, [int(i) for i in select(actual, fps)]
                frames, _ = self._decode_frames(data, set(wanted))
            # a sampler may repeat an index (num_frames above the frame count): keep its order and repeats
            position = {index: n for n, index in enumerate(sorted(set(wanted)))}
            frames = [frames[position[i]] for i in wanted]
            indices = tuple(wanted)
        if not frames:
            raise MediaDecodeError("Failed to load video: no frame could be decoded")
        metadata = VideoMetadata(total, fps, indices)
        return LoadedVideo(np.stack(frames), metadata, select is None, hashlib.sha256(data).hexdigest())

    @staticmethod
    def _decode_frames(data: bytes, keep: set[int] | None) -> tuple[list[np.ndarray], int]:
        """Decodes every frame in order; returns (rgb24 frames whose index is in keep, or all when keep is None;
        the number of frames decoded)."""
        import av

        frames: list[np.ndarray] = []
        count = 0
        try:
            with av.open(io.BytesIO(data), mode="r") as container:
                for frame in container.decode(container.streams.video[0]):
                    if keep is None or count in keep:
                        frames.append(frame.to_ndarray(format="rgb24"))
                    count += 1
        except (av.FFmpegError, OSError, ValueError, IndexError) as exc:
            raise MediaDecodeError(f"Failed to load video: {exc}") from None
        return frames, count
