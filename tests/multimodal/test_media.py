"""Media loading: data URLs and local files, decoding as vLLM's ImageMediaIO does (EXIF orientation, transparency
on white, palette and greyscale to RGB), PyAV video files and frame lists, and every bad input refused with a
MediaError (a ValueError) that names the problem."""

from __future__ import annotations

import base64
import io
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from deltaserve.multimodal.errors import (
    MediaDecodeError,
    MediaError,
    MediaPathError,
    MediaRequestError,
    MediaSizeError,
    MediaTypeError,
)
from deltaserve.multimodal.media import MediaLoader
from tests.multimodal.synthetic import synthetic_image, synthetic_video


def encode(image: Image.Image, fmt: str = "PNG", **kwargs: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **kwargs)
    return buffer.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def test_png_data_url_round_trips() -> None:
    pixels = synthetic_image(20, 30)
    loaded = MediaLoader().load_image(data_url(encode(Image.fromarray(pixels))))
    np.testing.assert_array_equal(loaded.pixels, pixels)
    assert loaded.pixels.dtype == np.uint8 and loaded.pixels.flags.c_contiguous


def test_rgba_is_composited_on_white() -> None:
    rgba = np.zeros((4, 4, 4), dtype=np.uint8)
    rgba[..., 0] = 200
    rgba[..., 3] = 0  # fully transparent: white
    rgba[0, 0] = (10, 20, 30, 255)  # opaque: kept
    rgba[1, 1] = (0, 0, 0, 128)  # half: blended towards white
    out = MediaLoader().load_image(data_url(encode(Image.fromarray(rgba, "RGBA")))).pixels
    assert tuple(out[2, 2]) == (255, 255, 255)
    assert tuple(out[0, 0]) == (10, 20, 30)
    assert all(120 <= v <= 135 for v in out[1, 1])  # (1 - 128/255)·255 on each channel


def test_palette_with_transparency_and_greyscale() -> None:
    palette = Image.new("P", (3, 2))
    palette.putpalette([255, 0, 0, 0, 255, 0] + [0] * 762)
    palette.putdata([0, 1, 0, 1, 0, 1])
    palette.info["transparency"] = 1  # index 1 transparent
    out = MediaLoader().load_image(data_url(encode(palette, transparency=1))).pixels
    assert tuple(out[0, 0]) == (255, 0, 0) and tuple(out[0, 1]) == (255, 255, 255)
    grey = Image.fromarray(np.arange(12, dtype=np.uint8).reshape(3, 4) * 20, "L")
    out = MediaLoader().load_image(data_url(encode(grey))).pixels
    assert out.shape == (3, 4, 3) and (out[..., 0] == out[..., 2]).all() and out[2, 3, 1] == 220


def test_exif_orientation_is_applied() -> None:
    """Orientation 6 (rotate 90° clockwise to display): vLLM's loader returns the displayed image."""
    pixels = synthetic_image(10, 16)
    image = Image.fromarray(pixels)
    exif = image.getexif()
    exif[0x0112] = 6
    out = MediaLoader().load_image(data_url(encode(image, "PNG", exif=exif.tobytes()))).pixels
    assert out.shape == (16, 10, 3)
    np.testing.assert_array_equal(out, np.rot90(pixels, k=-1))


@pytest.mark.parametrize(
    ("url", "error", "match"),
    [
        (data_url(b"\x89PNG\r\n\x1a\n not really a png"), MediaDecodeError, "Failed to load image"),
        (data_url(encode(Image.new("RGB", (8, 8)))[:40]), MediaDecodeError, "Failed to load image"),
        ("data:image/png;base64,@@@notbase64", MediaDecodeError, "base64"),
        (data_url(b"hello", "text/plain"), MediaTypeError, "text/plain"),
        ("data:image/png,rawbytes", MediaTypeError, "base64"),
        ("https://example.com/cat.png", MediaRequestError, "network"),
        ("ftp://example.com/cat.png", MediaRequestError, "data: or file:"),
        ("file:///etc/passwd", MediaPathError, "allowed-local-media-path"),
    ],
)
def test_bad_images_are_refused_by_name(url: str, error: type[MediaError], match: str) -> None:
    with pytest.raises(error, match=match) as info:
        MediaLoader().load_image(url)
    assert isinstance(info.value, ValueError)


def test_huge_dimensions_are_refused_before_decoding() -> None:
    huge = encode(Image.new("L", (20000, 10000)))  # 200 M pixels; a few KB of PNG
    with pytest.raises(MediaSizeError, match="exceed the maximum"):
        MediaLoader().load_image(data_url(huge))
    with pytest.raises(MediaSizeError, match="exceed the maximum"):
        MediaLoader(max_image_pixels=100).load_image(data_url(encode(Image.new("RGB", (11, 10)))))


def test_local_files_only_under_the_allowed_folder(tmp_path: Path) -> None:
    allowed = tmp_path / "media"
    allowed.mkdir()
    pixels = synthetic_image(6, 7)
    (allowed / "ok.png").write_bytes(encode(Image.fromarray(pixels)))
    (tmp_path / "secret.png").write_bytes(encode(Image.fromarray(pixels)))
    loader = MediaLoader(allowed)
    np.testing.assert_array_equal(loader.load_image(f"file://{allowed}/ok.png").pixels, pixels)
    for url in (f"file://{tmp_path}/secret.png", f"file://{allowed}/../secret.png"):
        with pytest.raises(MediaPathError, match="must be a subpath"):
            loader.load_image(url)
    (allowed / "link.png").symlink_to(tmp_path / "secret.png")
    with pytest.raises(MediaPathError, match="must be a subpath"):
        loader.load_image(f"file://{allowed}/link.png")
    with pytest.raises(MediaPathError, match="does not exist"):
        loader.load_image(f"file://{allowed}/missing.png")
    with pytest.raises(ValueError, match="allowed-local-media-path"):
        MediaLoader(tmp_path / "nope")


def write_video(path: Path, frames: np.ndarray, fps: int, codec: str = "ffv1", pix_fmt: str = "bgr0") -> None:
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=Fraction(fps))
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = pix_fmt
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def test_lossless_video_file_decodes_every_frame(tmp_path: Path) -> None:
    frames = synthetic_video(7, 32, 48, seed=5)  # odd count
    write_video(tmp_path / "clip.mkv", frames, fps=7)
    loaded = MediaLoader(tmp_path).load_video(f"file://{tmp_path}/clip.mkv")
    np.testing.assert_array_equal(loaded.frames, frames)
    assert loaded.metadata.total_num_frames == 7 and loaded.metadata.fps == 7.0
    assert loaded.metadata.frames_indices == tuple(range(7)) and loaded.do_sample_frames
    again = MediaLoader().load_video(data_url((tmp_path / "clip.mkv").read_bytes(), "video/x-matroska"))
    np.testing.assert_array_equal(again.frames, frames)


def test_h264_mp4_and_frame_lists(tmp_path: Path) -> None:
    frames = synthetic_video(10, 64, 64, seed=6)
    write_video(tmp_path / "clip.mp4", frames, fps=25, codec="libx264", pix_fmt="yuv420p")
    loaded = MediaLoader(tmp_path).load_video(f"file://{tmp_path}/clip.mp4")
    assert loaded.frames.shape == (10, 64, 64, 3) and loaded.metadata.fps == 25.0
    jpegs = [encode(Image.fromarray(f), "JPEG") for f in frames[:3]]
    url = "data:video/jpeg;base64," + ",".join(base64.b64encode(j).decode() for j in jpegs)
    listed = MediaLoader().load_video(url, fps=2.0)
    assert listed.frames.shape == (3, 64, 64, 3) and not listed.do_sample_frames
    assert listed.metadata.fps == 2.0 and listed.metadata.frames_indices == (0, 1, 2)


@pytest.mark.parametrize(
    ("payload", "mime", "error", "match"),
    [
        (b"\x00\x00\x00\x18ftypmp42 garbage", "video/mp4", MediaDecodeError, "Failed to load video"),
        (b"hello", "application/json", MediaTypeError, "application/json"),
    ],
)
def test_bad_videos_are_refused_by_name(payload: bytes, mime: str, error: type[MediaError], match: str) -> None:
    with pytest.raises(error, match=match):
        MediaLoader().load_video(data_url(payload, mime))


def test_video_frames_past_the_pixel_limit(tmp_path: Path) -> None:
    write_video(tmp_path / "big.mkv", synthetic_video(2, 40, 40), fps=2)
    with pytest.raises(MediaSizeError, match="Video frame dimensions 40x40"):
        MediaLoader(tmp_path, max_image_pixels=1000).load_video(f"file://{tmp_path}/big.mkv")
