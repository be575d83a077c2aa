"""--load-format dummy follows vLLM's dummy weights (initialize_dummy_weights): every floating-point parameter, the
vision tower's included, from U(-1e-3, 1e-3) with the generator re-seeded to 1234 for each tensor, so equally
shaped tensors are equal and every run (and rank) gets the same model; the dummy tower's image embeddings still
depend on the pixels."""

from __future__ import annotations

import torch

from deltaserve.config import ModelConfig
from deltaserve.model.loader import DUMMY_WEIGHT_BOUND, VLLM_DUMMY_SEED, init_dummy_weights
from deltaserve.model.qwen3_5 import Qwen35Model
from tests.support.vision import tiny_vision_checkpoint


def test_dummy_weights_are_vllms_and_fill_the_vision_tower() -> None:
    config = ModelConfig.from_pretrained(tiny_vision_checkpoint("moe-vl"))
    model = Qwen35Model(config, torch.float32, "cpu", build_vision=True)
    init_dummy_weights(model)
    tower = model.visual
    assert tower is not None
    params = dict(model.named_parameters())
    visual = {name: p for name, p in params.items() if name.startswith("visual.")}
    assert len(visual) == 3 + 6 + 12 * config.vision.depth  # patch and pos table, merger, 12 per block
    by_shape: dict[tuple[tuple[int, ...], torch.dtype], torch.Tensor] = {}
    for name, param in params.items():
        assert param.abs().max() <= DUMMY_WEIGHT_BOUND and param.any(), name
        # vLLM's draw: uniform_ from a CPU generator seeded 1234 for this tensor alone
        expected = torch.empty_like(param).uniform_(
            -DUMMY_WEIGHT_BOUND, DUMMY_WEIGHT_BOUND, generator=torch.Generator().manual_seed(VLLM_DUMMY_SEED)
        )
        assert torch.equal(param, expected), name
        key = (tuple(param.shape), param.dtype)
        if key in by_shape:
            assert torch.equal(param, by_shape[key]), name
        by_shape[key] = param
    grid = (1, 4, 4)
    generator = torch.Generator().manual_seed(1)
    a, b = (torch.rand(16, config.vision.patch_dim, generator=generator) for _ in range(2))
    with torch.no_grad():
        out_a, out_b = tower(a, [grid]), tower(b, [grid])
    assert out_a.shape == (4, config.vision.out_hidden_size) and out_a.abs().min() > 0
    # (weakly: the merger's bias dominates weights this small, in vLLM's tower as in ours)
    assert (out_a - out_b).abs().max() > 1e-9  # 5.7e-8 here, against an fp32 ulp of ~1e-10 at 1e-3
    # the same model on every rank / run, whatever the engine's --seed
    again = Qwen35Model(config, torch.float32, "cpu", build_vision=True)
    init_dummy_weights(again)
    assert all(torch.equal(p, params[n]) for n, p in again.named_parameters())
