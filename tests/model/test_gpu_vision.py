"""On the GPU: encoding a step's images makes the host wait for nothing (no synchronising copy, so the step loop
keeps its host / GPU overlap; docs/multimodal.md#speed-under-image-traffic), and gives the values of the earlier
path, which cast the patches to the tower's dtype on the host and copied them from pageable memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deltaserve.config import ModelConfig
from deltaserve.model.loader import load_checkpoint
from deltaserve.model.qwen3_5 import Qwen35Model
from deltaserve.model.vision import gather_mm_embeds
from tests.support.vision import tiny_vision_checkpoint

GRIDS = [(1, 16, 16), (1, 16, 16), (1, 4, 6), (2, 6, 4)]  # two images of one size, another, a video


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["dense-vl", "moe-vl"])
def test_encoding_waits_for_no_sync_and_keeps_its_values(variant: str) -> None:
    path: Path = tiny_vision_checkpoint(variant)
    config = ModelConfig.from_pretrained(path)
    model = Qwen35Model(config, torch.bfloat16, "cuda", build_vision=True)
    load_checkpoint(model, config, path)
    tower = model.visual
    generator = torch.Generator().manual_seed(0)
    sizes = [t * h * w for t, h, w in GRIDS]
    pixels = torch.randn(sum(sizes), 3 * 2 * 16 * 16, generator=generator)  # fp32 on the host, as the runner has
    items = list(zip(torch.split(pixels, sizes), GRIDS, strict=True))
    with torch.inference_mode():
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any synchronising call raises
        try:
            encoded = tower.encode(items)
            mm = gather_mm_embeds([(3, encoded[0][:5]), (40, torch.ones(2, encoded[0].shape[1]))], "cuda")
        finally:
            torch.cuda.set_sync_debug_mode("default")
        # the earlier path: cast on the host, blocking copy
        before = tower(pixels.to(torch.bfloat16).to("cuda"), GRIDS)
    assert torch.equal(torch.cat(encoded), before)
    assert mm is not None and mm[0].tolist() == [3, 4, 5, 6, 7, 40, 41]
    assert torch.equal(mm[1][:5], encoded[0][:5]) and torch.equal(mm[1][5:].cpu(), torch.ones(2, mm[1].shape[1]))
