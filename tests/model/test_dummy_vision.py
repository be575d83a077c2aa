"""--load-format dummy on a vision checkpoint: the runner's Qwen35Model builds the vision tower and init_dummy_weights
fills it like the decoder (seeded normal matrices, zero biases), with its plain LayerNorms at weight 1, so the dummy
tower's image embeddings depend on the pixels (a zero LayerNorm weight would make every embedding 0)."""

from __future__ import annotations

import torch

from deltaserve.config import ModelConfig
from deltaserve.model.loader import VISION_LAYER_NORM_WEIGHTS, init_dummy_weights
from deltaserve.model.qwen3_5 import Qwen35Model
from tests.model.vision_driver import tiny_vision_checkpoint


def test_dummy_weights_fill_the_vision_tower() -> None:
    config = ModelConfig.from_pretrained(tiny_vision_checkpoint("moe-vl"))
    model = Qwen35Model(config, torch.float32, "cpu", build_vision=True)
    init_dummy_weights(model, seed=0)
    tower = model.visual
    assert tower is not None
    params = dict(model.named_parameters())
    visual = {name: p for name, p in params.items() if name.startswith("visual.")}
    assert len(visual) == 3 + 6 + 12 * config.vision.depth  # patch and pos table, merger, 12 per block
    for name, param in visual.items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in VISION_LAYER_NORM_WEIGHTS:
            assert torch.equal(param, torch.ones_like(param)), name
        elif param.dim() == 1:
            assert not param.any(), name
        else:
            assert 0.015 < param.std().item() < 0.025 and torch.isfinite(param).all(), name
    grid = (1, 4, 4)
    generator = torch.Generator().manual_seed(1)
    a, b = (torch.rand(16, config.vision.patch_dim, generator=generator) for _ in range(2))
    with torch.no_grad():
        out_a, out_b = tower(a, [grid]), tower(b, [grid])
    assert out_a.shape == (4, config.vision.out_hidden_size) and out_a.abs().min() > 0
    assert not torch.allclose(out_a, out_b)
    # the same seed gives the same tower on every rank / run
    again = Qwen35Model(config, torch.float32, "cpu", build_vision=True)
    init_dummy_weights(again, seed=0)
    assert all(torch.equal(p, params[n]) for n, p in again.named_parameters())
