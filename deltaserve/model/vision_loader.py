"""Loads `model.visual.*` (docs/multimodal.md#the-vision-tower; vLLM's `visual.*` also accepted) into a VisionTower:
every tensor checked by name and shape, the Conv3d patch kernel flattened to the GEMM weight the tower uses."""

from __future__ import annotations

from typing import Protocol

import torch

from deltaserve.config import VisionConfig
from deltaserve.model.vision import VisionTower

VISION_PREFIXES = ("model.visual.", "visual.")


class _Checkpoint(Protocol):
    weight_map: dict[str, str]

    def get_shaped(self, name: str, shape: tuple[int, ...]) -> torch.Tensor: ...

    def check_finite(self, param: torch.Tensor, label: str) -> None: ...


def vision_prefix(ckpt: _Checkpoint) -> str | None:
    """The checkpoint's vision prefix, or None when it has no vision tensors."""
    for prefix in VISION_PREFIXES:
        if any(name.startswith(prefix) for name in ckpt.weight_map):
            return prefix
    return None


def _copy(param: torch.Tensor, value: torch.Tensor) -> None:
    param.data.copy_(value.reshape(param.shape).to(dtype=param.dtype))


def load_vision_tower(tower: VisionTower, config: VisionConfig, ckpt: _Checkpoint) -> int:
    """Fills the tower from the checkpoint; returns the number of tensors read. Missing or mis-shaped tensors,
    and tensors holding NaN or inf, raise the checkpoint's CheckpointError naming them."""
    prefix = vision_prefix(ckpt)
    if prefix is None:
        # let the checkpoint name the first tensor it lacks
        prefix = VISION_PREFIXES[0]
    width, merged = config.hidden_size, config.hidden_size * config.spatial_merge_size**2
    kernel = (width, config.in_channels, config.temporal_patch_size, config.patch_size, config.patch_size)
    names = 0

    def load(param: torch.Tensor, name: str, shape: tuple[int, ...]) -> None:
        nonlocal names
        _copy(param, ckpt.get_shaped(prefix + name, shape))
        ckpt.check_finite(param, prefix + name)
        names += 1

    with torch.no_grad():
        load(tower.patch_weight, "patch_embed.proj.weight", kernel)
        load(tower.patch_bias, "patch_embed.proj.bias", (width,))
        load(tower.pos_embed, "pos_embed.weight", (config.num_position_embeddings, width))
        for index, block in enumerate(tower.blocks):
            p = f"blocks.{index}."
            load(block.norm1_weight, p + "norm1.weight", (width,))
            load(block.norm1_bias, p + "norm1.bias", (width,))
            load(block.norm2_weight, p + "norm2.weight", (width,))
            load(block.norm2_bias, p + "norm2.bias", (width,))
            load(block.qkv_weight, p + "attn.qkv.weight", (3 * width, width))
            load(block.qkv_bias, p + "attn.qkv.bias", (3 * width,))
            load(block.proj_weight, p + "attn.proj.weight", (width, width))
            load(block.proj_bias, p + "attn.proj.bias", (width,))
            load(block.fc1_weight, p + "mlp.linear_fc1.weight", (config.intermediate_size, width))
            load(block.fc1_bias, p + "mlp.linear_fc1.bias", (config.intermediate_size,))
            load(block.fc2_weight, p + "mlp.linear_fc2.weight", (width, config.intermediate_size))
            load(block.fc2_bias, p + "mlp.linear_fc2.bias", (width,))
        load(tower.merger_norm_weight, "merger.norm.weight", (width,))
        load(tower.merger_norm_bias, "merger.norm.bias", (width,))
        load(tower.merger_fc1_weight, "merger.linear_fc1.weight", (merged, merged))
        load(tower.merger_fc1_bias, "merger.linear_fc1.bias", (merged,))
        load(tower.merger_fc2_weight, "merger.linear_fc2.weight", (config.out_hidden_size, merged))
        load(tower.merger_fc2_bias, "merger.linear_fc2.bias", (config.out_hidden_size,))
    return names
