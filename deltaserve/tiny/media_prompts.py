"""Synthetic media prompts: deterministic images and videos, the fixed prompt sets built from them, each prompt
through deltaserve's processor, and transformers' reference kwargs for a processed prompt.

The media token gate (deltaserve/gates/media.py) checks deltaserve on these prompts, and the vision training recipe
(train_vision.py) trains on prompts drawn from the same builders at seeds the gate does not use; they live here,
beside the corpus their words come from, so that the tiny checkpoints' code needs nothing from the gates.

Nothing is downloaded: pixels are integer arithmetic over numpy (bit-identical everywhere). Per kind, prompt i of
seed s is always the same chat (one user message, text and media parts, the checkpoint's chat template):
- image: one image; the first prompts are edge sizes (smart_resize upscaling to min_pixels, odd sizes, extreme
  aspect ratios), then seeded sizes, with the image before, between or after the text;
- multi-image: two or three images interleaved with text (some prompts repeat an image);
- video: one video of 2..8 frames (odd counts exercise the temporal padding) at fps 1..30 (the timestamps),
  some prompts with a second video or an image beside it (both grids in one MRoPE table).
Media go in as vLLM spells `multi_modal_data`: images as [H, W, 3] uint8 arrays, videos as (frames, metadata)
pairs, the metadata dict vLLM's Qwen3-VL processor requires (fps, frames_indices, total_num_frames, duration,
do_sample_frames=False: the frames are the ones to use).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deltaserve.multimodal.inputs import MultimodalInput
from deltaserve.multimodal.positions import token_types

MEDIA_KINDS = ("image", "multi-image", "video")
MEDIA_CHOICES = (*MEDIA_KINDS, "all")
# (height, width) edge cases that lead the image set: min_pixels upscaling, odd sizes, extreme aspect ratios
EDGE_IMAGE_SIZES = ((32, 32), (256, 256), (33, 479), (480, 40), (97, 131), (64, 1000))
VIDEO_FPS = (1.0, 2.0, 3.0, 24.0, 30.0)
WORDS_PER_PIECE = (1, 8)


def synthetic_image(height: int, width: int, seed: int = 0) -> np.ndarray:
    """[height, width, 3] uint8: a smooth gradient plus hashed noise per channel (integer arithmetic only)."""
    y, x = np.mgrid[0:height, 0:width].astype(np.uint64)
    out = np.empty((height, width, 3), dtype=np.uint8)
    for c in range(3):
        v = x * np.uint64(2654435761) + y * np.uint64(40503) + np.uint64(c * 97 + seed * 7919 + 1)
        v ^= v >> np.uint64(13)
        v *= np.uint64(0x5BD1E995)
        v ^= v >> np.uint64(15)
        noise = (v & np.uint64(255)) >> np.uint64(1)
        across = (x * np.uint64(255)) // np.uint64(max(width - 1, 1))
        down = (y * np.uint64(97)) // np.uint64(max(height - 1, 1)) * np.uint64(c + 1)
        gradient = (across + down) >> np.uint64(1)
        out[..., c] = ((noise + gradient) & np.uint64(255)).astype(np.uint8)
    return out


def synthetic_video(num_frames: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """[num_frames, height, width, 3] uint8, each frame its own seed."""
    return np.stack([synthetic_image(height, width, seed * 1000 + i) for i in range(num_frames)])


def video_metadata(num_frames: int, fps: float) -> dict[str, Any]:
    """vLLM's metadata dict for a video given as its frames (all of them, in order, not to be resampled)."""
    return {
        "fps": fps,
        "total_num_frames": num_frames,
        "frames_indices": list(range(num_frames)),
        "duration": num_frames / fps,
        "do_sample_frames": False,
    }


@dataclass
class MediaPrompt:
    """One gate prompt: the rendered chat text (one placeholder per item) and its media in prompt order."""

    kind: str
    index: int
    text: str
    parts: list[str]  # "text", "image", "video" in prompt order
    images: list[np.ndarray] = field(default_factory=list)  # [H, W, 3] uint8
    videos: list[tuple[np.ndarray, float]] = field(default_factory=list)  # ([N, H, W, 3] uint8, fps)
    description: list[str] = field(default_factory=list)  # e.g. "image 33x479 seed 5", for records

    def multi_modal_data(self) -> dict[str, Any]:
        """vLLM's `multi_modal_data` for this prompt."""
        data: dict[str, Any] = {}
        if self.images:
            data["image"] = self.images[0] if len(self.images) == 1 else list(self.images)
        if self.videos:
            pairs = [(frames, video_metadata(len(frames), fps)) for frames, fps in self.videos]
            data["video"] = pairs[0] if len(pairs) == 1 else pairs
        return data

    def vllm_prompt(self) -> dict[str, Any]:
        return {"prompt": self.text, "multi_modal_data": self.multi_modal_data()}


class _Builder:
    """Seeded pieces of one prompt: words from the shipped corpus, sizes, seeds."""

    def __init__(self, kind: str, index: int, seed: int, words: list[str]) -> None:
        offset = MEDIA_KINDS.index(kind) if kind in MEDIA_KINDS else 0
        self.rng = np.random.default_rng([seed, offset, index])
        self.words = words
        self.item_seed = (seed * 1009 + offset * 97 + index) * 8
        self.parts: list[str] = []
        self.content: list[dict[str, Any]] = []
        self.prompt = MediaPrompt(kind, index, "", self.parts)

    def text(self) -> None:
        n = int(self.rng.integers(WORDS_PER_PIECE[0], WORDS_PER_PIECE[1] + 1))
        start = int(self.rng.integers(0, max(len(self.words) - n, 1)))
        self.parts.append("text")
        self.content.append({"type": "text", "text": " ".join(self.words[start : start + n])})

    def image(self, height: int, width: int) -> None:
        self.item_seed += 1
        self.prompt.images.append(synthetic_image(height, width, self.item_seed))
        self.prompt.description.append(f"image {height}x{width} seed {self.item_seed}")
        self.parts.append("image")
        self.content.append({"type": "image"})

    def random_image(self) -> None:
        self.image(int(self.rng.integers(32, 321)), int(self.rng.integers(32, 321)))

    def video(self) -> None:
        num_frames = int(self.rng.integers(2, 9))
        height, width = int(self.rng.integers(32, 161)), int(self.rng.integers(32, 161))
        fps = float(VIDEO_FPS[int(self.rng.integers(0, len(VIDEO_FPS)))])
        self.item_seed += 1
        self.prompt.videos.append((synthetic_video(num_frames, height, width, self.item_seed), fps))
        self.prompt.description.append(f"video {num_frames}x{height}x{width} at {fps:g} fps seed {self.item_seed}")
        self.parts.append("video")
        self.content.append({"type": "video"})

    def finish(self, tokenizer: Any) -> MediaPrompt:
        messages = [{"role": "user", "content": self.content}]
        self.prompt.text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.prompt


def corpus_words() -> list[str]:
    """The words of the corpus the package ships (deltaserve/tiny/corpus.txt)."""
    return (Path(__file__).resolve().parent / "corpus.txt").read_text().split()


def _image_prompt(b: _Builder, index: int) -> None:
    size = EDGE_IMAGE_SIZES[index] if index < len(EDGE_IMAGE_SIZES) else None
    place = index % 3  # image first, between two texts, last
    if place:
        b.text()
    b.image(*size) if size else b.random_image()
    if place != 2:
        b.text()


def _multi_image_prompt(b: _Builder, index: int) -> None:
    num_images = 2 + index % 2
    for k in range(num_images):
        if (index + k) % 2 == 0:
            b.text()
        if k == 1 and index % 5 == 0:
            # the same image twice: two items with one content hash
            b.prompt.images.append(b.prompt.images[-1])
            b.prompt.description.append(b.prompt.description[-1] + " (again)")
            b.parts.append("image")
            b.content.append({"type": "image"})
        else:
            b.random_image()
    b.text()


def _video_prompt(b: _Builder, index: int) -> None:
    b.text()
    if index % 8 == 5:
        b.random_image()
        b.text()
    b.video()
    if index % 8 == 3:
        b.text()
        b.video()
    if index % 2:
        b.text()


BUILDERS = {"image": _image_prompt, "multi-image": _multi_image_prompt, "video": _video_prompt}


def make_media_prompts(tokenizer: Any, kind: str, num_prompts: int, seed: int = 0) -> list[MediaPrompt]:
    """The fixed prompt set of one kind (prompt i depends only on kind, i and seed)."""
    words = corpus_words()
    return [make_media_prompt(tokenizer, kind, index, seed, words) for index in range(num_prompts)]


def make_media_prompt(
    tokenizer: Any, kind: str, index: int, seed: int = 0, words: list[str] | None = None
) -> MediaPrompt:
    """Prompt `index` of the set (kind, seed): also what the vision training recipe draws its rows from, at seeds
    the gate does not use (deltaserve/tiny/train_vision.py)."""
    if kind not in BUILDERS:
        raise ValueError(f"unknown media kind {kind!r}; known: {', '.join(MEDIA_KINDS)}")
    builder = _Builder(kind, index, seed, corpus_words() if words is None else words)
    BUILDERS[kind](builder, index)
    return builder.finish(tokenizer)


def media_kinds(choice: str) -> tuple[str, ...]:
    """`--media`: one kind, a comma-separated list of kinds, or all (in MEDIA_KINDS order)."""
    names = [name.strip() for name in choice.split(",") if name.strip()]
    unknown = [name for name in names if name not in MEDIA_CHOICES]
    if unknown or not names:
        raise ValueError(f"--media {choice!r}: expected {', '.join(MEDIA_CHOICES)} or a comma-separated list")
    return MEDIA_KINDS if "all" in names else tuple(k for k in MEDIA_KINDS if k in names)


def media_argument(value: str) -> str:
    """argparse type of --media: the value, once media_kinds accepts it."""
    import argparse

    try:
        media_kinds(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def reference_inputs(
    ids: list[int], mm_input: MultimodalInput, image_token_id: int, video_token_id: int
) -> dict[str, torch.Tensor]:
    """transformers' forward kwargs for the expanded prompt `ids` (it may continue past the prompt) and its
    items: pixel_values / image_grid_thw, pixel_values_videos / video_grid_thw, mm_token_type_ids."""
    kwargs: dict[str, torch.Tensor] = {
        "input_ids": torch.tensor([ids]),
        "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
        "mm_token_type_ids": torch.from_numpy(token_types(ids, image_token_id, video_token_id))[None],
    }
    for modality, pixel_key, grid_key in (("image", "pixel_values", "image_grid_thw"),
                                          ("video", "pixel_values_videos", "video_grid_thw")):  # fmt: skip
        items = [it for it in mm_input.items if it.modality == modality]
        if items:
            kwargs[pixel_key] = torch.from_numpy(np.concatenate([it.pixel_values for it in items]))
            kwargs[grid_key] = torch.tensor([list(it.grid_thw) for it in items])
    return kwargs


@dataclass
class ProcessedPrompt:
    """A gate prompt after deltaserve's processor: expanded ids and the items' rows, grids and MRoPE table."""

    prompt: MediaPrompt
    ids: list[int]
    mm_input: MultimodalInput


class MediaRefusedError(ValueError):
    """The checkpoint's media are refused as the engine refuses them (its processor and tower disagree)."""


def process_prompts(model_dir: Path, tokenizer: Any, prompts: list[MediaPrompt]) -> list[ProcessedPrompt]:
    """Each prompt through deltaserve's processor, tokenised as LLM.generate tokenises a text prompt."""
    from deltaserve.config import ModelConfig
    from deltaserve.multimodal.offline import loaded_media
    from deltaserve.multimodal.processor import MultimodalProcessor
    from deltaserve.multimodal.prompt import VisionTokenIds

    vision = ModelConfig.from_pretrained(model_dir).vision
    ids = VisionTokenIds(vision.image_token_id, vision.video_token_id, vision.vision_start_token_id,
                         vision.vision_end_token_id)  # fmt: skip
    processor = MultimodalProcessor.from_model_dir(
        model_dir, ids, lambda text: tokenizer.encode(text, add_special_tokens=False)
    )
    processor.check_vision_geometry(vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size)
    if processor.refusal is not None:
        raise MediaRefusedError(processor.refusal)
    processed = []
    for prompt in prompts:
        media = loaded_media(prompt.multi_modal_data(), processor.configs.video.fps or 2.0)
        expanded, mm_input = processor.process_loaded(tokenizer.encode(prompt.text, add_special_tokens=True), media)
        processed.append(ProcessedPrompt(prompt, expanded, mm_input))
    return processed
