"""Placeholder expansion in token ids (docs/multimodal.md#placeholders-and-prompt-expansion): the chat template leaves
one `<|image_pad|>` per image and one `<|video_pad|>` per video between `<|vision_start|>` and `<|vision_end|>`; each
becomes the item's tokens, consumed left to right per modality as transformers' Qwen3VLProcessor does.

Image: gh·gw/4 pads. Video (transformers >= 5.10, which keeps the template's outer start/end pair): per temporal
group, the timestamp text `<T seconds>` tokenised on its own (as vLLM does; identical to tokenising the whole
prompt because special tokens bound it), `<|vision_start|>`, (gh/2)·(gw/2) pads, `<|vision_end|>`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from deltaserve.multimodal.errors import MediaRequestError
from deltaserve.multimodal.video import timestamp_text


@dataclass(frozen=True)
class VisionTokenIds:
    image: int
    video: int
    vision_start: int
    vision_end: int


@dataclass(frozen=True)
class ExpansionItem:
    """What expansion needs of one processed item: its modality, grid and (videos) group timestamps."""

    modality: str
    grid_thw: tuple[int, int, int]
    timestamps: tuple[float, ...] = ()


@dataclass(frozen=True)
class ExpandedSpan:
    offset: int
    length: int
    embed_runs: tuple[tuple[int, int], ...]


def expand_placeholders(
    token_ids: list[int],
    items: list[ExpansionItem],
    tokens: VisionTokenIds,
    merge_size: int,
    encode: Callable[[str], list[int]],
) -> tuple[list[int], list[ExpandedSpan]]:
    """(expanded ids, one span per item in `items` order). `items` are in prompt order; the k-th image pad
    takes the k-th image item, the k-th video pad the k-th video item."""
    by_modality: dict[str, list[int]] = {"image": [], "video": []}
    for index, item in enumerate(items):
        by_modality[item.modality].append(index)
    num_image_pads = token_ids.count(tokens.image)
    num_video_pads = token_ids.count(tokens.video)
    if num_image_pads != len(by_modality["image"]) or num_video_pads != len(by_modality["video"]):
        raise MediaRequestError(
            f"the prompt has {num_image_pads} image and {num_video_pads} video placeholders for "
            f"{len(by_modality['image'])} image(s) and {len(by_modality['video'])} video(s); the placeholder tokens "
            "come from the chat template and must not appear in the text"
        )
    merge_area = merge_size * merge_size
    queues = {"image": iter(by_modality["image"]), "video": iter(by_modality["video"])}
    spans: list[ExpandedSpan | None] = [None] * len(items)
    out: list[int] = []
    for token in token_ids:
        if token == tokens.image:
            index = next(queues["image"])
            _, grid_h, grid_w = items[index].grid_thw
            count = grid_h * grid_w // merge_area
            spans[index] = ExpandedSpan(len(out), count, ((len(out), count),))
            out.extend([tokens.image] * count)
        elif token == tokens.video:
            index = next(queues["video"])
            item = items[index]
            grid_t, grid_h, grid_w = item.grid_thw
            if len(item.timestamps) != grid_t:
                raise MediaRequestError(f"video has {grid_t} temporal groups but {len(item.timestamps)} timestamps")
            count = grid_h * grid_w // merge_area
            offset = len(out)
            runs = []
            for seconds in item.timestamps:
                out.extend(encode(timestamp_text(seconds)))
                out.append(tokens.vision_start)
                runs.append((len(out), count))
                out.extend([tokens.video] * count)
                out.append(tokens.vision_end)
            spans[index] = ExpandedSpan(offset, len(out) - offset, tuple(runs))
        else:
            out.append(token)
    return out, [span for span in spans if span is not None]
