"""Block-FP8 copies of tiny checkpoints in the format of Qwen's -FP8 releases (docs/fp8.md), for the FP8 tests.

`write_fp8_checkpoint(src, out)` quantizes every projection the releases quantize (full-attention q/k/v/o_proj,
GDN in_proj_qkv / in_proj_z / in_proj_qkvz / out_proj, dense-MLP, shared-expert and routed-expert gate/up/down_proj,
and the same inside the MTP layer) to float8_e4m3fn [N, K] with a float32 `weight_scale_inv`
[ceil(N/128), ceil(K/128)]; fused 3-D experts (`experts.gate_up_proj`, `experts.down_proj`, the bf16 releases'
layout) become one tensor per expert, as the FP8 releases store them. Every other tensor (lm_head, embeddings,
norms, in_proj_a / in_proj_b / in_proj_ba, the router, shared_expert_gate, mtp.fc, the vision tower) is copied
unchanged and listed, by module, in the quantization_config's modules_to_not_convert, which is what transformers'
FineGrainedFP8Config writes (`to_dict()`).

The quantization is transformers' Fp8Quantize, per 128 x 128 block: scale = 448 / amax (1 for an all-zero block),
q = clamp(w · scale, +-448) rounded to e4m3, stored inverse 1 / scale. Unlike transformers' quantizer, which leaves
a weight whose sides are not multiples of 128 unquantized, a partial block at the right or bottom edge is quantized
on its own (the format's ceil(N/128) x ceil(K/128) grid, which vLLM reads): the tiny checkpoints' sides are 32-256.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from deltaserve.model.checkpoint_files import FP8_PROJECTION

FP8_MAX = 448.0
BLOCK = 128
QUANTIZED = FP8_PROJECTION  # the projections the releases quantize (the loader's own list)
# 2-D module weights that stay unquantized in the releases (listed in modules_to_not_convert)
KEPT_MODULES = re.compile(
    r"(lm_head|embed_tokens|linear_attn\.in_proj_(a|b|ba)|mlp\.gate|mlp\.shared_expert_gate|mtp\.fc)\.weight$"
)


def quantize_block_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (float8_e4m3fn [N, K], weight_scale_inv fp32 [ceil(N/128), ceil(K/128)]) as the module
    docstring says."""
    rows, cols = weight.shape
    grid_rows, grid_cols = math.ceil(rows / BLOCK), math.ceil(cols / BLOCK)
    padded = torch.zeros(grid_rows * BLOCK, grid_cols * BLOCK, dtype=torch.float32)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(grid_rows, BLOCK, grid_cols, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3))  # [R, C]; the zero padding changes no amax
    scale = torch.where(amax > 0, FP8_MAX / amax.clamp(min=torch.finfo(torch.float32).tiny), torch.ones_like(amax))
    q = (blocks * scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(grid_rows * BLOCK, grid_cols * BLOCK)[:rows, :cols].contiguous(), (1.0 / scale).float()


def _per_expert(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """Fused experts.gate_up_proj [E, 2I, H] / experts.down_proj [E, H, I] -> one [N, K] weight per expert."""
    prefix = name.rsplit("experts.", 1)[0] + "experts."
    out = {}
    for e in range(tensor.shape[0]):
        if name.endswith("gate_up_proj"):
            width = tensor.shape[1] // 2
            out[f"{prefix}{e}.gate_proj.weight"] = tensor[e, :width]
            out[f"{prefix}{e}.up_proj.weight"] = tensor[e, width:]
        else:
            out[f"{prefix}{e}.down_proj.weight"] = tensor[e]
    return out


def write_fp8_checkpoint(src: Path, out: Path) -> Path:
    """A block-FP8 copy of checkpoint folder src in out (replaced if it exists); returns out."""
    src, out = Path(src), Path(out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(src.glob("*.safetensors")):
        with safe_open(shard, framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensor = handle.get_tensor(name)
                if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                    tensors.update(_per_expert(name, tensor))
                else:
                    tensors[name] = tensor
    written: dict[str, torch.Tensor] = {}
    kept: list[str] = []
    for name, tensor in tensors.items():
        if QUANTIZED.match(name) and tensor.dim() == 2:
            q, scale_inv = quantize_block_fp8(tensor)
            written[name], written[name.removesuffix(".weight") + ".weight_scale_inv"] = q, scale_inv
            continue
        written[name] = tensor.contiguous()
        if KEPT_MODULES.search(name):
            kept.append(name.removesuffix(".weight"))
    save_file(written, str(out / "model.safetensors"), metadata={"format": "pt"})
    from transformers import FineGrainedFP8Config

    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = FineGrainedFP8Config(modules_to_not_convert=sorted(kept)).to_dict()
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for extra in src.iterdir():
        if extra.suffix != ".safetensors" and extra.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(extra, out / extra.name)
    return out
