"""The `random-mm` dataset of `vllm bench serve` (vLLM 0.26 RandomMultiModalDataset): random text plus synthetic images.

Each request is the `random` dataset's text (dataset.py: lengths, offsets, consecutive allowed ids, decode/encode
retries) followed by N synthetic RGB images, sent by the client as one user message on /v1/chat/completions whose
content is [{"type": "text", "text": PROMPT}, {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,
..."}} x N] (vLLM's `openai-chat` request function, images last). Exactly as vLLM builds them:

- allowed text ids: the vocabulary minus every added token marked special in the tokenizer's added_tokens_decoder
  (placeholders and vision delimiters included, so the text never carries <|image_pad|>);
- N per request: uniform in [floor(n(1-r)), ceil(n(1+r))] for n = --random-mm-base-items-per-request and
  r = --random-mm-num-mm-items-range-ratio in [0, 1], the maximum clamped to the sum of the per-modality limits
  (--random-mm-limit-mm-per-prompt) of the modalities the buckets name;
- each item: a bucket (height, width, num_frames) drawn with the bucket config's probabilities (zero entries
  dropped, the rest renormalised; a modality at its limit is dropped and the rest renormalised again); its pixels
  uniform uint8 [height, width, 3]; saved by Pillow as JPEG at its default quality (75) and base64-encoded;
- one `numpy.random.default_rng(seed)` drives it all, in vLLM's order: input lengths, output lengths, offsets,
  the shared prefix (with its own decode/encode retries), then per request its text's retries, its item count,
  and per item the bucket draw followed by the pixels.
So one seed and tokenizer give the same requests, byte for byte, in both engines' runs. Video buckets
(num_frames > 1; vLLM writes them as MP4 through OpenCV) are refused by name: this client sends images only.
vLLM aligns no random-mm prompt with the server's /tokenize (only `random` and `prefix_repetition`), and neither
does this client.
"""

from __future__ import annotations

import argparse
import ast
import base64
import contextlib
import io
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from deltaserve.bench.dataset import SampleRequest, Tokenizer, decode_to_target_len, length_bounds

Bucket = tuple[int, int, int]  # (height, width, num_frames)

DEFAULT_BASE_ITEMS_PER_REQUEST = 1
DEFAULT_NUM_MM_ITEMS_RANGE_RATIO = 0.0
DEFAULT_LIMIT_MM_PER_PROMPT: dict[str, int] = {"image": 255, "video": 1}
DEFAULT_BUCKET_CONFIG: dict[Bucket, float] = {(256, 256, 1): 0.5, (720, 1280, 1): 0.5, (720, 1280, 16): 0.0}


@dataclass(frozen=True)
class MmOptions:
    """The random-mm flags, with vLLM's defaults."""

    base_items_per_request: int = DEFAULT_BASE_ITEMS_PER_REQUEST
    num_mm_items_range_ratio: float = DEFAULT_NUM_MM_ITEMS_RANGE_RATIO
    limit_mm_per_prompt: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_LIMIT_MM_PER_PROMPT))
    bucket_config: dict[Bucket, float] = field(default_factory=lambda: dict(DEFAULT_BUCKET_CONFIG))

    def as_record(self) -> dict[str, Any]:
        """The JSON-safe form a result record keeps (bucket keys as vLLM's CLI spells them)."""
        return {
            "random_mm_base_items_per_request": self.base_items_per_request,
            "random_mm_num_mm_items_range_ratio": self.num_mm_items_range_ratio,
            "random_mm_limit_mm_per_prompt": dict(self.limit_mm_per_prompt),
            "random_mm_bucket_config": format_bucket_config(self.bucket_config),
        }


def parse_bucket_config(value: str | dict[Any, Any]) -> dict[Bucket, float]:
    """vLLM's --random-mm-bucket-config: a Python dict literal of (H, W, T) tuples to probabilities, e.g.
    "{(512, 512, 1): 1.0}" (string keys "(512, 512, 1)" also accepted, as in vLLM)."""
    if isinstance(value, str):
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError) as exc:
            raise ValueError(f"--random-mm-bucket-config: not a Python dict literal ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError("--random-mm-bucket-config must be a dict of (height, width, num_frames) -> probability")
    buckets: dict[Bucket, float] = {}
    for key, probability in value.items():
        parsed = key
        if isinstance(parsed, str):
            with contextlib.suppress(ValueError, SyntaxError):
                parsed = ast.literal_eval(parsed)
        if not (isinstance(parsed, tuple) and len(parsed) == 3 and all(isinstance(x, int) for x in parsed)):
            raise ValueError(f"--random-mm-bucket-config: invalid bucket key {key!r}; expected (height, width, frames)")
        buckets[(int(parsed[0]), int(parsed[1]), int(parsed[2]))] = float(probability)
    return buckets


def format_bucket_config(buckets: dict[Bucket, float]) -> str:
    """The literal parse_bucket_config reads back."""
    return "{" + ", ".join(f"({h}, {w}, {t}): {p!r}" for (h, w, t), p in buckets.items()) + "}"


def parse_limit_mm_per_prompt(value: str | dict[str, Any]) -> dict[str, int]:
    """--random-mm-limit-mm-per-prompt: JSON, e.g. '{"image": 1, "video": 0}'."""
    if isinstance(value, str):
        value = json.loads(value)
    if not isinstance(value, dict) or not all(isinstance(v, int) and v >= 0 for v in value.values()):
        raise ValueError(f"--random-mm-limit-mm-per-prompt must map modalities to counts >= 0, got {value!r}")
    return {str(k): int(v) for k, v in value.items()}


def modality_of(bucket: Bucket) -> str:
    if bucket[-1] == 1:
        return "image"
    if bucket[-1] > 1:
        return "video"
    raise ValueError(f"invalid multimodal bucket {bucket}: num_frames must be >= 1")


def normalize_buckets(buckets: dict[Bucket, float]) -> dict[Bucket, float]:
    """Zero-probability buckets dropped, the rest scaled to sum to 1 (negative values refused)."""
    if any(p < 0 for p in buckets.values()):
        raise ValueError("--random-mm-bucket-config: probabilities must be non-negative")
    kept = {k: p for k, p in buckets.items() if p > 0}
    if not kept:
        raise ValueError("--random-mm-bucket-config: every probability is zero")
    total = sum(kept.values())
    return {k: p / total for k, p in kept.items()}


def item_count_bounds(options: MmOptions) -> tuple[int, int, dict[str, int], dict[Bucket, float]]:
    """(min items, max items, limits of the sampled modalities, normalised buckets), as vLLM derives them."""
    ratio = options.num_mm_items_range_ratio
    if not 0.0 <= ratio <= 1.0:
        raise ValueError("--random-mm-num-mm-items-range-ratio must be in [0, 1]")
    for bucket in options.bucket_config:
        if modality_of(bucket) not in options.limit_mm_per_prompt:
            raise ValueError(f"modality {modality_of(bucket)} of bucket {bucket} is not in limit_mm_per_prompt")
    buckets = normalize_buckets(options.bucket_config)
    videos = [b for b in buckets if modality_of(b) == "video"]
    if videos:
        raise ValueError(f"video buckets {videos} are not supported: this client sends synthetic images only")
    modalities = {modality_of(b) for b in buckets}
    limits = {k: v for k, v in options.limit_mm_per_prompt.items() if k in modalities}
    base = options.base_items_per_request
    high = min(sum(limits.values()), math.ceil(base * (1 + ratio)))
    low = max(0, math.floor(base * (1 - ratio)))
    if low > high:
        raise ValueError(f"random-mm: the minimum item count {low} exceeds the maximum {high}")
    return low, high, limits, buckets


def _item_buckets(
    rng: np.random.Generator, low: int, high: int, buckets: dict[Bucket, float], limits: dict[str, int]
) -> Iterator[Bucket]:
    """One request's buckets, drawn lazily (the caller draws each item's pixels before the next bucket)."""
    count = int(rng.integers(low, high + 1))
    if count == 0:
        return
    num_by_modality = dict.fromkeys((modality_of(b) for b in buckets), 0)
    current = dict(buckets)
    while sum(num_by_modality.values()) < count:
        keys = list(current)
        # rng.choice over the list of tuples picks a row of the [K, 3] array (vLLM's draw, consumed identically)
        row = rng.choice(keys, p=list(current.values()))
        bucket = (int(row[0]), int(row[1]), int(row[2]))
        modality = modality_of(bucket)
        if num_by_modality[modality] < limits[modality]:
            num_by_modality[modality] += 1
            yield bucket
            continue
        current = {k: (0.0 if modality_of(k) == modality else p) for k, p in current.items()}
        if all(p == 0 for p in current.values()):
            return
        current = normalize_buckets(current)


def synthetic_image_url(rng: np.random.Generator, height: int, width: int) -> str:
    """Uniform random RGB pixels as a base64 JPEG data URL (Pillow's default quality), as vLLM's process_image."""
    from PIL import Image

    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    with io.BytesIO() as buffer:
        Image.fromarray(pixels).convert("RGB").save(buffer, format="JPEG")
        data = base64.b64encode(buffer.getvalue()).decode("utf-8")
    return f"data:image/jpeg;base64,{data}"


def added_special_ids(tokenizer: Any) -> list[int]:
    """Every added token marked special (vLLM's prohibited set for random-mm; all_special_ids lists only the
    special_tokens_map ones and would let a placeholder into the text)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None)
    if decoder is None:
        return list(tokenizer.all_special_ids)
    return [int(i) for i, token in decoder.items() if getattr(token, "special", False)]


def sample_random_mm(
    tokenizer: Tokenizer,
    num_requests: int,
    options: MmOptions,
    input_len: int = 1024,
    output_len: int = 128,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
    request_id_prefix: str = "",
) -> list[SampleRequest]:
    """The random-mm dataset, reproducible from `seed` for a given tokenizer; `mm_content` holds each request's
    image_url content parts in prompt order."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    num_special = int(tokenizer.num_special_tokens_to_add())
    input_low, input_high = length_bounds(max(0, int(input_len) - num_special), range_ratio)
    output_low, output_high = length_bounds(int(output_len), range_ratio, floor_at=1)
    input_lens = rng.integers(input_low, input_high + 1, size=num_requests)
    output_lens = rng.integers(output_low, output_high + 1, size=num_requests)
    offsets = rng.integers(0, tokenizer.vocab_size, size=num_requests)
    low, high, limits, buckets = item_count_bounds(options)

    prohibited = np.asarray(added_special_ids(tokenizer), dtype=np.int64)
    allowed = np.setdiff1d(np.arange(tokenizer.vocab_size), prohibited)
    prefix_ids: list[int] = []
    if prefix_len > 0:
        drawn = allowed[rng.integers(0, len(allowed), size=prefix_len)].tolist()
        _, prefix_ids, _ = decode_to_target_len(tokenizer, drawn, prefix_len, rng)

    requests: list[SampleRequest] = []
    for i in range(num_requests):
        inner = allowed[(int(offsets[i]) + i + np.arange(int(input_lens[i]))) % len(allowed)].tolist()
        target_len = prefix_len + int(input_lens[i])
        prompt, ids, mismatch = decode_to_target_len(tokenizer, prefix_ids + inner, target_len, rng)
        parts = tuple(
            {"type": "image_url", "image_url": {"url": synthetic_image_url(rng, h, w)}}
            for h, w, _ in _item_buckets(rng, low, high, buckets, limits)
        )
        requests.append(
            SampleRequest(
                prompt=prompt,
                prompt_len=len(ids),
                expected_output_len=int(output_lens[i]),
                target_len=target_len,
                request_id=f"{request_id_prefix}{i}",
                token_mismatch=mismatch,
                mm_content=parts,
            )
        )
    return requests


def add_mm_arguments(group: argparse._ArgumentGroup) -> None:
    """`vllm bench serve`'s random-mm flags, with its defaults."""
    group.add_argument(
        "--random-mm-base-items-per-request",
        type=int,
        default=DEFAULT_BASE_ITEMS_PER_REQUEST,
        help="random-mm: base number of images per request",
    )
    group.add_argument(
        "--random-mm-num-mm-items-range-ratio",
        type=float,
        default=DEFAULT_NUM_MM_ITEMS_RANGE_RATIO,
        help="random-mm: r in [0, 1]; the count is uniform in [floor(n(1-r)), ceil(n(1+r))]",
    )
    group.add_argument(
        "--random-mm-limit-mm-per-prompt",
        type=parse_limit_mm_per_prompt,
        default=dict(DEFAULT_LIMIT_MM_PER_PROMPT),
        help='random-mm: per-modality caps, JSON, e.g. \'{"image": 1, "video": 0}\'',
    )
    group.add_argument(
        "--random-mm-bucket-config",
        type=parse_bucket_config,
        default=dict(DEFAULT_BUCKET_CONFIG),
        help='random-mm: {(height, width, num_frames): probability}, e.g. "{(512, 512, 1): 1.0}" (images only)',
    )


def mm_options(args: argparse.Namespace) -> MmOptions:
    """MmOptions from parsed add_mm_arguments flags."""
    return MmOptions(
        base_items_per_request=args.random_mm_base_items_per_request,
        num_mm_items_range_ratio=args.random_mm_num_mm_items_range_ratio,
        limit_mm_per_prompt=dict(args.random_mm_limit_mm_per_prompt),
        bucket_config=dict(args.random_mm_bucket_config),
    )
