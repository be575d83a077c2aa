"""The vision tower loaded from model.visual.* against transformers' Qwen3_5VisionModel (fp32, CPU): images of
several grids and a video in one call, per-item splitting, and the loader's refusals."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from deltaserve.config import ConfigError, ModelConfig
from deltaserve.model.loader import CheckpointError, load_checkpoint
from deltaserve.model.qwen3_5 import Qwen35Model
from deltaserve.model.vision import (
    VisionBlock,
    VisionTower,
    _rotate_half,
    attention_segments,
    interpolation_taps,
    vision_rope,
)
from tests.support.threads import one_thread  # noqa: F401 (module-scoped autouse fixture)
from tests.support.vision import tiny_vision_checkpoint


@pytest.fixture(scope="module")
def dense_vl() -> Path:
    return tiny_vision_checkpoint("dense-vl")


@pytest.fixture(scope="module")
def towers(dense_vl: Path) -> tuple[VisionTower, torch.nn.Module]:
    from transformers import Qwen3_5ForConditionalGeneration

    config = ModelConfig.from_pretrained(dense_vl)
    model = Qwen35Model(config, torch.float32, "cpu", build_vision=True)
    report = load_checkpoint(model, config, dense_vl)
    assert not any(name.startswith("model.visual.") for name in report.skipped + report.unexpected)
    reference = Qwen3_5ForConditionalGeneration.from_pretrained(dense_vl, dtype=torch.float32).eval()
    return model.visual, reference.model.visual


GRIDS = [(1, 16, 16), (1, 4, 6), (3, 6, 4), (1, 20, 2)]


def test_tower_equals_transformers(towers: tuple[VisionTower, torch.nn.Module]) -> None:
    ours, reference = towers
    torch.manual_seed(0)
    pixels = torch.randn(sum(t * h * w for t, h, w in GRIDS), 3 * 2 * 16 * 16)
    with torch.inference_mode():
        expected = reference(pixels, grid_thw=torch.tensor(GRIDS)).pooler_output
        got = ours(pixels, GRIDS)
        parts = ours.encode([(pixels[:256], GRIDS[0]), (pixels[256:280], GRIDS[1])])
    assert got.shape == expected.shape == (sum(t * h * w for t, h, w in GRIDS) // 4, 64)
    rel = float((got - expected).norm() / expected.norm())
    assert rel < 1e-5, rel
    # one item per encode entry; each item attends only within itself, so a batch equals the items alone
    assert [p.shape[0] for p in parts] == [64, 6]
    torch.testing.assert_close(parts[1], got[64:70], rtol=1e-5, atol=1e-5)
    # the output depends on the image: a changed patch changes its own item's output only
    changed = pixels.clone()
    changed[300] += 1.0
    with torch.inference_mode():
        moved = ours(changed, GRIDS)
    assert not torch.allclose(moved[70:76], got[70:76]) and torch.equal(moved[:70], got[:70])


def test_interpolation_matches_align_corners_bilinear() -> None:
    """The resampled table equals F.interpolate(align_corners=True) of the square grid, in block order."""
    side, grid = 48, (1, 6, 10)
    table = torch.randn(side * side, 8, dtype=torch.float64)
    indices, weights = interpolation_taps([grid], side, 2)
    ours = (table[indices] * weights[:, :, None].double()).sum(1)  # [60, 8]
    image = table.T.reshape(1, 8, side, side)
    full = torch.nn.functional.interpolate(image, size=(6, 10), mode="bilinear", align_corners=True)[0]  # [8, 6, 10]
    blocks = full.permute(1, 2, 0).reshape(3, 2, 5, 2, 8).permute(0, 2, 1, 3, 4).reshape(60, 8)
    # fp32 source coordinates (as transformers computes them) move values by ~1e-5; a wrong layout moves them O(1)
    torch.testing.assert_close(ours, blocks, rtol=0, atol=1e-4)


def test_missing_vision_tensor_is_named(dense_vl: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(dense_vl, broken)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    name = "model.visual.blocks.1.attn.qkv.weight"
    shard = broken / index["weight_map"].pop(name)
    tensors = load_file(shard)
    del tensors[name]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    config = ModelConfig.from_pretrained(broken)
    with pytest.raises(CheckpointError, match=r"model\.visual\.blocks\.1\.attn\.qkv\.weight"):
        load_checkpoint(Qwen35Model(config, torch.float32, "cpu", build_vision=True), config, broken)
    # a text-only model never reads the tower: the tensors stay a skipped prefix
    report = load_checkpoint(Qwen35Model(config, torch.float32, "cpu"), config, broken)
    assert any(n.startswith("model.visual.") for n in report.skipped) and not report.unexpected


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("deepstack_visual_indexes", [1, 2], "deepstack"),
        ("hidden_act", "relu", "hidden_act"),
        ("num_position_embeddings", 2300, "perfect square"),
        ("out_hidden_size", 32, "out_hidden_size"),
        ("patch_size", [16, 16], "patch_size"),
    ],
)
def test_vision_config_fields_refused_by_name(dense_vl: Path, field: str, value: object, match: str) -> None:
    data = json.loads((dense_vl / "config.json").read_text())
    data["vision_config"][field] = value
    with pytest.raises(ConfigError, match=match) as info:
        ModelConfig.from_dict(data, dense_vl / "config.json")
    assert f"vision_config.{field}" in str(info.value)


def test_pixel_values_must_match_grids(towers: tuple[VisionTower, torch.nn.Module]) -> None:
    with pytest.raises(ValueError, match="do not match"):
        towers[0](torch.from_numpy(np.zeros((10, 1536), dtype=np.float32)), [(1, 4, 4)])


def test_attention_segments_share_a_run_per_size() -> None:
    # images of one size (and a video whose frame groups have that size) in a row: one batched run
    assert attention_segments([(1, 4, 4), (1, 4, 4), (3, 2, 8), (1, 6, 4), (1, 4, 4)]) == [
        (0, 16, 5),
        (80, 24, 1),
        (104, 16, 1),
    ]
    assert attention_segments([(2, 4, 6)]) == [(0, 24, 2)]


def _block_before(block: VisionBlock, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  grids: list[tuple[int, int, int]]) -> torch.Tensor:  # fmt: skip
    """The block as it was before the launch cuts: q and k rotated apart, one attention call per item."""
    num_tokens, width = x.shape
    h = F.layer_norm(x, (width,), block.norm1_weight, block.norm1_bias, 1e-6)
    qkv = F.linear(h, block.qkv_weight, block.qkv_bias).view(num_tokens, 3, block.num_heads, block.head_dim)
    q, k, v = qkv.unbind(1)
    cos_f, sin_f = cos[:, None, :], sin[:, None, :]
    q = (q.float() * cos_f + _rotate_half(q.float()) * sin_f).to(x.dtype)
    k = (k.float() * cos_f + _rotate_half(k.float()) * sin_f).to(x.dtype)
    out = torch.empty(num_tokens, block.num_heads, block.head_dim, dtype=x.dtype)
    start = 0
    for t, gh, gw in grids:
        length, end = gh * gw, start + t * gh * gw
        qs, ks, vs = (z[start:end].view(t, length, block.num_heads, block.head_dim).transpose(1, 2) for z in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, scale=block.head_dim**-0.5)
        out[start:end] = o.transpose(1, 2).reshape(t * length, block.num_heads, block.head_dim)
        start = end
    x = x + F.linear(out.reshape(num_tokens, width), block.proj_weight, block.proj_bias)
    h = F.layer_norm(x, (width,), block.norm2_weight, block.norm2_bias, 1e-6)
    h = F.gelu(F.linear(h, block.fc1_weight, block.fc1_bias), approximate=block.approximate)
    return x + F.linear(h, block.fc2_weight, block.fc2_bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_equal_their_form_before_the_launch_cuts(towers: tuple[VisionTower, torch.nn.Module],
                                                        dtype: torch.dtype) -> None:  # fmt: skip
    """Rotating q and k together and batching a step's same-size items into one attention call change no bit:
    every block of the trained tower against its earlier form, on three same-size images and a video."""
    ours, _ = towers
    grids = [(1, 8, 8), (1, 8, 8), (2, 4, 16), (1, 4, 6)]
    config = ours.config
    cos, sin = vision_rope(grids, config.head_dim, config.rope_theta, config.spatial_merge_size)
    torch.manual_seed(1)
    x = torch.randn(sum(t * h * w for t, h, w in grids), config.hidden_size).to(dtype)
    segments = attention_segments(grids)
    assert len(segments) == 2  # 64 + 64 + 2 x 64 in one run, then 24
    with torch.inference_mode():
        for block in ours.blocks:
            block = copy.deepcopy(block).to(dtype)  # the module-scoped tower stays fp32
            got, expected = block(x, cos, sin, segments), _block_before(block, x, cos, sin, grids)
            assert torch.equal(got, expected)
            x = expected
