"""The tiny vision variants (make-tiny --variant dense-vl / moe-vl): real-format processor files, a vision tower
transformers loads into its composite class with nothing missing or unexpected, and the text variant's decoder
unchanged."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from deltaserve.multimodal.processor_config import ProcessorConfigs
from tests.support.vision import tiny_vision_checkpoint


def _tensors(folder: object) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


@pytest.mark.parametrize(("variant", "text_variant"), [("dense-vl", "dense"), ("moe-vl", "moe")])
def test_vision_variant(variant: str, text_variant: str, tmp_path: object) -> None:
    from transformers import AutoModelForImageTextToText

    from deltaserve.tiny import make_tiny

    folder = tiny_vision_checkpoint(variant)
    configs = ProcessorConfigs.from_model_dir(folder)
    assert (configs.image.min_pixels, configs.image.max_pixels, configs.image.patch_size) == (65536, 16777216, 16)
    assert (configs.video.min_pixels, configs.video.max_pixels, configs.video.fps) == (4096, 25165824, 2.0)
    config = json.loads((folder / "config.json").read_text())
    assert config["vision_config"]["num_position_embeddings"] == 2304 and config["vision_config"]["depth"] == 2
    model, info = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert type(model).__name__ == config["architectures"][0]
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    # same decoder as the text variant: vision variants add a tower, they do not change the language model
    text = _tensors(make_tiny(tmp_path / text_variant, text_variant))
    vision = _tensors(folder)
    for name, tensor in text.items():
        if not name.startswith("model.visual."):
            assert torch.equal(tensor, vision[name]), name
    decoder_names = {n for n in vision if not n.startswith("model.visual.")}
    assert decoder_names == {n for n in text if not n.startswith("model.visual.")}
