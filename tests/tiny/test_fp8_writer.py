"""deltaserve/tiny/fp8.py, the writer of the FP8 test checkpoints, against transformers' own FP8 quantizer: the same
float8 bytes and scales wherever transformers quantizes (sides that are multiples of 128), the format's ceil grid
where it does not, the per-expert layout, and the quantization_config transformers writes."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors import safe_open
from transformers import FineGrainedFP8Config
from transformers.integrations.finegrained_fp8 import Fp8Quantize

from deltaserve.tiny.fp8 import quantize_block_fp8, write_fp8_checkpoint
from deltaserve.tiny.trained import trained_model_dir


def test_quantization_equals_transformers_fp8_quantizer() -> None:
    torch.manual_seed(0)
    weight = torch.randn(256, 384, dtype=torch.bfloat16) * torch.logspace(-3, 1, 384).bfloat16()
    weight[:128, :128] = 0  # an all-zero block: transformers' scale 1
    quantizer = SimpleNamespace(quantization_config=FineGrainedFP8Config())
    theirs = Fp8Quantize(quantizer)._quantize_one("layer.q_proj.weight", weight)
    q, scale_inv = quantize_block_fp8(weight)
    assert torch.equal(q.view(torch.uint8), theirs["layer.q_proj.weight"].view(torch.uint8))
    assert torch.equal(scale_inv, theirs["layer.q_proj.weight_scale_inv"])


def test_partial_blocks_take_the_ceil_grid() -> None:
    """200 x 72: a 128 x 72 block and a 72 x 72 one, each with its own scale (transformers leaves such a weight
    unquantized)."""
    weight = torch.ones(200, 72)
    weight[128:] = 3.0
    q, scale_inv = quantize_block_fp8(weight)
    assert q.shape == (200, 72) and scale_inv.shape == (2, 1)
    assert torch.equal(scale_inv, 1.0 / (448.0 / torch.tensor([[1.0], [3.0]])))  # transformers' inverse of 448 / amax
    assert torch.equal(q.float(), torch.full((200, 72), 448.0))
    assert torch.allclose(q.float() * scale_inv.repeat_interleave(128, 0)[:200], weight, rtol=1e-6)


def test_checkpoint_layout_and_config(tmp_path: Path) -> None:
    out = write_fp8_checkpoint(trained_model_dir("moe"), tmp_path / "moe")
    config = json.loads((out / "config.json").read_text())
    quant = config["quantization_config"]
    assert quant == json.loads(
        json.dumps(FineGrainedFP8Config(modules_to_not_convert=quant["modules_to_not_convert"]).to_dict())
    )
    kept = set(quant["modules_to_not_convert"])
    p = "model.language_model.layers.0."
    assert {
        p + "linear_attn.in_proj_a",
        p + "linear_attn.in_proj_b",
        p + "mlp.gate",
        p + "mlp.shared_expert_gate",
    } <= kept
    assert {"lm_head", "model.language_model.embed_tokens", "mtp.fc"} <= kept
    with safe_open(out / "model.safetensors", framework="pt") as handle:
        names = set(handle.keys())
        assert handle.get_slice(p + "mlp.experts.7.down_proj.weight").get_dtype() == "F8_E4M3"
        assert handle.get_slice(p + "mlp.experts.7.down_proj.weight_scale_inv").get_dtype() == "F32"
        assert handle.get_slice(p + "linear_attn.in_proj_a.weight").get_dtype() == "BF16"
    assert p + "mlp.experts.gate_up_proj" not in names and p + "mlp.experts.0.gate_proj.weight" in names
    assert "mtp.layers.0.mlp.experts.0.up_proj.weight_scale_inv" in names  # the MTP layer is quantized too
