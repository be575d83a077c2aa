"""The request-side entry point: a chat request's content parts + the model's processor configs -> (expanded prompt
token ids, MultimodalInput).

    processor = MultimodalProcessor.from_model_dir(model_dir, vision_tokens, encode, allowed_local_media_path=...,
                                                   limit_mm_per_prompt='{"image": 2, "video": 1}')
    refs = processor.parse_messages(messages)          # content parts in prompt order; limits enforced
    ids = <render the chat template over messages and tokenise, as for text>
    ids, mm_input = processor.process(ids, refs)       # load, preprocess, expand, positions

Content parts are vLLM's: {"type": "image_url", "image_url": {"url": ...}} (or "image_url": "<url>"), and
{"type": "video_url", "video_url": {"url": ...}}; plus {"type": "video", "video": [<frame url>, ...]} for a list
of frames (Qwen's chat format; optional "fps"). Every error is a MediaError (a ValueError): the API answers 400.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from deltaserve.multimodal.errors import MediaLimitError, MediaRequestError
from deltaserve.multimodal.image import preprocess_image
from deltaserve.multimodal.inputs import MultimodalInput, MultimodalItem
from deltaserve.multimodal.media import DEFAULT_MAX_IMAGE_PIXELS, LoadedImage, LoadedVideo, MediaLoader
from deltaserve.multimodal.positions import mrope_positions, token_types
from deltaserve.multimodal.processor_config import ProcessorConfigs
from deltaserve.multimodal.prompt import ExpansionItem, VisionTokenIds, expand_placeholders
from deltaserve.multimodal.video import preprocess_video, sample_frame_indices

MODALITIES = ("image", "video")
# vLLM's default per-modality limit when --limit-mm-per-prompt does not name the modality
DEFAULT_LIMIT = 999


def parse_limit_mm_per_prompt(value: str | dict[str, Any] | None) -> dict[str, int]:
    """vLLM's --limit-mm-per-prompt JSON: {"image": 2} or {"video": {"count": 1, "num_frames": 32, ...}} (the
    extra keys size profiling dummies; only count limits requests). Unnamed modalities default to 999."""
    limits = dict.fromkeys(MODALITIES, DEFAULT_LIMIT)
    if value is None or value == "":
        return limits
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--limit-mm-per-prompt must be JSON, e.g. '{{\"image\": 2}}' ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"--limit-mm-per-prompt must be a JSON object, got {value!r}")
    for modality, spec in value.items():
        count = spec.get("count", DEFAULT_LIMIT) if isinstance(spec, dict) else spec
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"--limit-mm-per-prompt: the count for {modality!r} must be an integer >= 0, got {spec!r}")
        limits[modality] = count
    return limits


@dataclass(frozen=True)
class MediaRef:
    """One multimodal content part, in prompt order."""

    modality: str
    location: str  # e.g. "messages[0].content[1]", for error messages
    url: str | None = None
    frame_urls: tuple[str, ...] = ()
    fps: float | None = None


def location_param(location: str) -> str:
    """ "messages[0].content[1]" -> "messages.0.content", the API's spelling of the field at fault."""
    return location.split("]", 1)[0].replace("[", ".") + ".content" if location.startswith("messages[") else location


def _part_url(part: dict[str, Any], key: str, location: str) -> str:
    value = part.get(key)
    if isinstance(value, dict):
        value = value.get("url")
    if not isinstance(value, str) or not value:
        raise MediaRequestError(
            f"{location}: `{key}` must be a URL string or an object with a `url` string", location_param(location)
        )
    return value


def media_refs_from_messages(messages: list[dict[str, Any]]) -> list[MediaRef]:
    """The image and video parts of OpenAI chat messages, in the order the chat template renders them."""
    refs = []
    for m, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for p, part in enumerate(content):
            if not isinstance(part, dict):
                continue
            location = f"messages[{m}].content[{p}]"
            kind = part.get("type") or next((k for k in ("image_url", "video_url") if k in part), None)
            if kind in ("image_url", "input_image"):
                refs.append(MediaRef("image", location, url=_part_url(part, "image_url", location)))
            elif kind == "image":
                refs.append(MediaRef("image", location, url=_part_url(part, "image", location)))
            elif kind == "video_url":
                refs.append(MediaRef("video", location, url=_part_url(part, "video_url", location)))
            elif kind == "video":
                frames = part.get("video")
                fps = part.get("fps")
                if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float)) or fps <= 0):
                    raise MediaRequestError(
                        f"{location}: `fps` must be a positive number, got {fps!r}", location_param(location)
                    )
                if isinstance(frames, list):
                    if not frames or not all(isinstance(f, str) and f for f in frames):
                        raise MediaRequestError(
                            f"{location}: `video` must be a non-empty list of frame URLs", location_param(location)
                        )
                    refs.append(MediaRef("video", location, frame_urls=tuple(frames), fps=fps))
                else:
                    refs.append(MediaRef("video", location, url=_part_url(part, "video", location), fps=fps))
    return refs


@dataclass
class MultimodalProcessor:
    configs: ProcessorConfigs
    tokens: VisionTokenIds
    encode: Callable[[str], list[int]]  # text -> ids without special tokens (timestamps)
    loader: MediaLoader
    limits: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MODALITIES, DEFAULT_LIMIT))
    # why this checkpoint's media are refused (its processor files disagree with its vision tower), or None
    refusal: str | None = None

    def check_vision_geometry(self, patch_size: int, temporal_patch_size: int, merge_size: int) -> None:
        """Refuses every image and video (refusal) when the processor would cut patches the vision tower cannot
        read: a checkpoint without preprocessor_config.json gets transformers' class defaults (patch 14 for
        images), which a tower of patch 16 would reject mid-step. Text is still served."""
        tower = (patch_size, temporal_patch_size, merge_size)
        for name, config in (("image", self.configs.image), ("video", self.configs.video)):
            mine = (config.patch_size, config.temporal_patch_size, config.merge_size)
            if mine != tower:
                self.refusal = (
                    f"this checkpoint's {name} processor settings (patch_size, temporal_patch_size, merge_size = "
                    f"{mine}; from its processor config files or transformers' defaults where they are absent) "
                    f"disagree with its vision_config {tower}: images and videos are refused"
                )
                return

    @classmethod
    def from_model_dir(
        cls,
        model_dir: str | Path,
        tokens: VisionTokenIds,
        encode: Callable[[str], list[int]],
        *,
        allowed_local_media_path: str | Path | None = None,
        limit_mm_per_prompt: str | dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    ) -> MultimodalProcessor:
        return cls(
            ProcessorConfigs.from_model_dir(model_dir, mm_processor_kwargs),
            tokens,
            encode,
            MediaLoader(allowed_local_media_path, max_image_pixels),
            parse_limit_mm_per_prompt(limit_mm_per_prompt),
        )

    def parse_messages(self, messages: list[dict[str, Any]]) -> list[MediaRef]:
        refs = media_refs_from_messages(messages)
        self.check_limits(refs)
        return refs

    def check_limits(self, refs: list[MediaRef]) -> None:
        if self.refusal is not None and refs:
            raise MediaRequestError(self.refusal, location_param(refs[0].location))
        for modality in MODALITIES:
            count = sum(ref.modality == modality for ref in refs)
            limit = self.limits.get(modality, DEFAULT_LIMIT)
            if count > limit:
                hint = " Set `--limit-mm-per-prompt` to increase this limit." if limit < DEFAULT_LIMIT else ""
                raise MediaLimitError(f"At most {limit} {modality}(s) may be provided in one prompt.{hint}")

    def load(self, ref: MediaRef, configs: ProcessorConfigs | None = None) -> LoadedImage | LoadedVideo:
        """Fetches and decodes one item. A video file is sampled while it decodes (the processor's own frame
        sampling, so only the sampled frames are ever held) unless the config turns sampling off."""
        video = (configs or self.configs).video
        select = None
        if video.do_sample_frames:

            def select(total: int, fps: float | None) -> list[int]:
                return sample_frame_indices(total, fps, video).tolist()

        try:
            if ref.modality == "image":
                return self.loader.load_image(ref.url or "")
            if ref.frame_urls:
                return self.loader.load_frame_urls(list(ref.frame_urls), ref.fps)
            return self.loader.load_video(ref.url or "", ref.fps, select)
        except ValueError as exc:
            located = type(exc)(f"{ref.location}: {exc}")
            located.param = location_param(ref.location)  # type: ignore[attr-defined]  # plain ValueErrors too
            raise located from None

    def process(
        self,
        prompt_token_ids: list[int],
        refs: list[MediaRef],
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> tuple[list[int], MultimodalInput]:
        """Loads and preprocesses every item, expands the placeholders, computes the MRoPE positions."""
        self.check_limits(refs)
        for modality, token in (("image", self.tokens.image), ("video", self.tokens.video)):
            # checked before any media is fetched or decoded; expand_placeholders checks again
            num_pads, num_items = prompt_token_ids.count(token), sum(ref.modality == modality for ref in refs)
            if num_pads != num_items:
                raise MediaRequestError(
                    f"the prompt has {num_pads} {modality} placeholder(s) for {num_items} {modality}(s); the "
                    "placeholder tokens come from the chat template and must not appear in the text"
                )
        configs = self.configs.with_overrides(mm_processor_kwargs)
        loaded = [self.load(ref, configs) for ref in refs]
        return self.process_loaded(prompt_token_ids, loaded, configs)

    def process_loaded(
        self,
        prompt_token_ids: list[int],
        loaded: list[LoadedImage | LoadedVideo],
        configs: ProcessorConfigs | None = None,
    ) -> tuple[list[int], MultimodalInput]:
        """As process(), for media already decoded (the offline API's arrays, tests)."""
        if self.refusal is not None and loaded:
            raise MediaRequestError(self.refusal)
        configs = configs or self.configs
        processed: list[tuple[str, np.ndarray, tuple[int, int, int], tuple[float, ...], str]] = []
        for media in loaded:
            if isinstance(media, LoadedImage):
                rows, grid = preprocess_image(media.pixels, configs.image)
                key = _identifier("image", media.digest, configs.image)
                processed.append(("image", rows, grid, (), key))
            else:
                # a pre-sampled item is never resampled; a whole video follows the config's do_sample_frames
                sample = None if media.do_sample_frames else False
                video = preprocess_video(media.frames, media.metadata, configs.video, sample)
                key = _identifier("video", media.digest, configs.video)
                processed.append(("video", video.pixel_values, video.grid_thw, video.timestamps, key))
        merge_size = configs.image.merge_size
        if any(modality == "video" for modality, *_ in processed) and configs.video.merge_size != merge_size:
            raise MediaRequestError("the image and video processors disagree on merge_size")
        expansion = [ExpansionItem(modality, grid, stamps) for modality, _, grid, stamps, _ in processed]
        ids, spans = expand_placeholders(list(prompt_token_ids), expansion, self.tokens, merge_size, self.encode)
        types = token_types(ids, self.tokens.image, self.tokens.video)
        image_grids = [grid for modality, _, grid, _, _ in processed if modality == "image"]
        video_grids = [grid for modality, _, grid, _, _ in processed if modality == "video"]
        positions, delta = mrope_positions(types, image_grids, video_grids, merge_size)
        items = tuple(
            MultimodalItem(modality, rows, grid, span.offset, span.length, span.embed_runs, key)
            for (modality, rows, grid, _, key), span in zip(processed, spans, strict=True)
        )
        return ids, MultimodalInput(items, positions, delta)


def _identifier(modality: str, digest: str, config: object) -> str:
    """Item identity for an encoder cache: the source bytes' digest and every processing setting."""
    return hashlib.sha256(f"{modality}|{digest}|{config!r}".encode()).hexdigest()
