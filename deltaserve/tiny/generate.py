"""Writes a complete tiny Hugging Face checkpoint folder: config, sharded safetensors, tokenizer, generation config.

The folder is assembled in a hidden temporary sibling and renamed into place, so a reader never sees a
half-written checkpoint, and regenerating over an existing tiny checkpoint replaces it whole.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from deltaserve.tiny.spec import (
    EXPERT_LAYOUTS,
    VariantSpec,
    build_config,
    build_generation_config,
    variant_spec,
)
from deltaserve.tiny.tokenizer import ALL_ADDED_TOKENS, added_token_ids, build_tokenizer, build_tokenizer_config
from deltaserve.tiny.vision import VISION_VARIANTS, preprocessor_config, shapes_for, video_preprocessor_config
from deltaserve.tiny.weights import build_tensors

# The padded vocabulary is a multiple of this, as the releases pad theirs (248320 = 3880 * 64).
VOCAB_PADDING_MULTIPLE = 64
# Files a tiny checkpoint may hold; an existing folder with anything else in it is not ours to replace.
_CHECKPOINT_SUFFIXES = (".json", ".safetensors", ".jinja", ".txt")


def _padded_vocab_size(num_tokens: int) -> int:
    """Strictly above the tokenizer's size, so the checkpoint has padding rows like the releases."""
    return (num_tokens // VOCAB_PADDING_MULTIPLE + 1) * VOCAB_PADDING_MULTIPLE


def _resolve_expert_layout(spec: VariantSpec, expert_layout: str | None) -> str | None:
    if expert_layout is not None and expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"unknown expert_layout {expert_layout!r}; choose one of {', '.join(EXPERT_LAYOUTS)}")
    if not spec.is_moe:
        return None
    return expert_layout or spec.default_expert_layout


def _shard_indices(tensors: dict[str, torch.Tensor], num_shards: int) -> list[int]:
    """Shard index of each tensor (in order): contiguous runs of about equal bytes, none of them empty."""
    sizes = [tensor.numel() * tensor.element_size() for tensor in tensors.values()]
    total = sum(sizes)
    indices: list[int] = []
    bytes_before = 0
    for position, size in enumerate(sizes):
        proportional = num_shards * bytes_before // total
        if position == 0:
            index = 0
        else:
            # Never skip a shard, and leave at least one tensor for every shard still to come.
            lowest = max(indices[-1], num_shards - (len(sizes) - position))
            index = min(max(proportional, lowest), indices[-1] + 1, num_shards - 1)
        indices.append(index)
        bytes_before += size
    return indices


def save_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file(tensors, str(path), metadata={"format": "pt"})
    # safetensors creates its files owner-only; a shared cache folder must stay readable like the JSON files.
    os.chmod(path, 0o644)


def _write_weights(folder: Path, tensors: dict[str, torch.Tensor], num_shards: int) -> None:
    """model.safetensors for one shard; otherwise model-0000i-of-0000N.safetensors plus the index."""
    if num_shards == 1:
        save_safetensors(folder / "model.safetensors", tensors)
        return
    if num_shards > len(tensors):
        raise ValueError(f"num_shards={num_shards} exceeds the checkpoint's {len(tensors)} tensors")
    shard_of = _shard_indices(tensors, num_shards)
    file_names = [f"model-{index + 1:05d}-of-{num_shards:05d}.safetensors" for index in range(num_shards)]
    weight_map: dict[str, str] = {}
    for shard, file_name in enumerate(file_names):
        shard_tensors = {
            name: tensor for (name, tensor), index in zip(tensors.items(), shard_of, strict=True) if index == shard
        }
        save_safetensors(folder / file_name, shard_tensors)
        weight_map.update(dict.fromkeys(shard_tensors, file_name))
    total_size = sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(folder / "model.safetensors.index.json", index)


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    path.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_checkpoint(
    folder: Path,
    spec: VariantSpec,
    seed: int,
    is_tied: bool,
    expert_layout: str | None,
    num_shards: int,
) -> None:
    shapes = shapes_for(spec.name)
    tokenizer = build_tokenizer(spec.tokenizer_class)
    token_ids = added_token_ids(tokenizer)
    num_tokens = tokenizer.get_vocab_size(with_added_tokens=True)
    if num_tokens != max(token_ids.values()) + 1 or len(token_ids) != len(ALL_ADDED_TOKENS):
        raise RuntimeError("the tiny tokenizer's added tokens are not contiguous at the end of its vocabulary")
    vocab_size = _padded_vocab_size(num_tokens)
    tensors = build_tensors(spec, shapes, vocab_size, num_tokens, seed, is_tied, expert_layout)
    _write_weights(folder, tensors, num_shards)
    _write_json(folder / "config.json", build_config(spec, shapes, vocab_size, token_ids, is_tied))
    _write_json(folder / "generation_config.json", build_generation_config(token_ids))
    tokenizer.save(str(folder / "tokenizer.json"))
    tokenizer_config = build_tokenizer_config(spec.tokenizer_class, token_ids, shapes.max_position_embeddings)
    _write_json(folder / "tokenizer_config.json", tokenizer_config)
    if spec.name in VISION_VARIANTS:
        _write_json(folder / "preprocessor_config.json", preprocessor_config(shapes))
        _write_json(folder / "video_preprocessor_config.json", video_preprocessor_config(shapes))


def _is_replaceable(folder: Path) -> bool:
    """An existing folder may be replaced if it is empty or holds only checkpoint files (not someone's data)."""
    if not folder.is_dir():
        return False
    entries = list(folder.iterdir())
    return all(entry.is_file() and entry.name.endswith(_CHECKPOINT_SUFFIXES) for entry in entries)


def _install(staging: Path, out_dir: Path) -> None:
    """Rename the staged folder into place, replacing an existing checkpoint folder whole."""
    if not out_dir.exists():
        os.replace(staging, out_dir)
        return
    if not _is_replaceable(out_dir):
        raise FileExistsError(f"{out_dir} exists and holds files that are not a checkpoint's; not replacing it")
    retired = out_dir.with_name(f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}")
    os.replace(out_dir, retired)
    try:
        os.replace(staging, out_dir)
    finally:
        shutil.rmtree(retired, ignore_errors=True)


def make_tiny(
    out_dir: Path | str,
    variant: str,
    seed: int = 0,
    *,
    tie_word_embeddings: bool | None = None,
    expert_layout: str | None = None,
    num_shards: int = 2,
) -> Path:
    """Write a tiny random checkpoint of `variant` ("dense", "moe" or "next") into out_dir and return its path.

    tie_word_embeddings defaults to the family's choice (dense tied, moe and next untied); expert_layout
    ("fused" or "per_expert") defaults to the release's layout (moe fused, next per expert) and is ignored for
    dense. num_shards=1 writes a single model.safetensors without an index. An existing checkpoint folder at
    out_dir is replaced whole; the same arguments always give the same bytes.
    """
    spec = variant_spec(variant)
    if num_shards < 1:
        raise ValueError(f"num_shards must be at least 1, got {num_shards}")
    is_tied = spec.is_tied_by_default if tie_word_embeddings is None else bool(tie_word_embeddings)
    layout = _resolve_expert_layout(spec, expert_layout)
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    staging.mkdir()
    try:
        _write_checkpoint(staging, spec, seed, is_tied, layout, num_shards)
        _install(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir
