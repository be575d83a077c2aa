"""Tiny checkpoints built with transformers' own classes, and the strict comparison of deltaserve against them.

build() makes a Qwen3.5 / Qwen3.5-MoE / Qwen3-Next model (text-only or the *ForConditionalGeneration composite)
from transformers' config classes at tiny dimensions, perturbs every weight (transformers initialises the
zero-centred norms to 0) and saves it with save_pretrained, next to the tiny tokenizer. edit_config() then mutates
config.json the way a checkpoint in the wild might. assert_strict() loads the folder in both engines (the reference
by config.architectures[0], refusing a partly random one) and requires identical greedy tokens and fp32 logits.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from deltaserve.engine.llm import LLM
from deltaserve.sampling_params import SamplingParams

TEXT = {
    "vocab_size": 1344,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "max_position_embeddings": 512,
}
DENSE = {"intermediate_size": 96}
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48}
VISION = {
    "depth": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "out_hidden_size": 64,
    "num_position_embeddings": 16,
    "patch_size": 4,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}
KINDS = ("dense", "dense-mm", "moe", "moe-mm", "next")
PROMPTS = [[5, 17, 99, 300, 41], [1000, 3, 3, 3, 7, 8, 250, 12, 60, 61, 62, 900, 14], [42]]
NUM_TOKENS = 4
LOGIT_TOLERANCE = 1e-4  # fp32: the same math in another order (the token gate's bound)


def build(
    kind: str, out: Path, tokenizer_dir: Path, seed: int = 0, top: dict[str, Any] | None = None, **text: Any
) -> Path:
    """Saves a perturbed transformers model of `kind` to out; text overrides the decoder config, top the composite's."""
    import transformers

    fields = {**TEXT, **(MOE if kind.startswith("moe") or kind == "next" else {}), **DENSE, **text}
    if kind.startswith("moe"):
        fields.pop("intermediate_size", None)
    if kind == "next":
        config = transformers.Qwen3NextConfig(**fields)
        cls = transformers.Qwen3NextForCausalLM
    elif kind in ("dense", "moe"):
        config_cls = transformers.Qwen3_5TextConfig if kind == "dense" else transformers.Qwen3_5MoeTextConfig
        config = config_cls(**fields)
        cls = transformers.Qwen3_5ForCausalLM if kind == "dense" else transformers.Qwen3_5MoeForCausalLM
    else:
        composite = transformers.Qwen3_5Config if kind == "dense-mm" else transformers.Qwen3_5MoeConfig
        config = composite(text_config=fields, vision_config=VISION, **(top or {}))
        cls = (
            transformers.Qwen3_5ForConditionalGeneration
            if kind == "dense-mm"
            else transformers.Qwen3_5MoeForConditionalGeneration
        )
    torch.manual_seed(seed)
    model = cls(config).float()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    return out


def copy_with(src: Path, dst: Path, edit: Callable[[dict[str, Any]], None] | None = None) -> Path:
    """A copy of checkpoint src whose config.json went through edit (in place on the parsed dict)."""
    shutil.copytree(src, dst)
    if edit is not None:
        config = json.loads((dst / "config.json").read_text())
        edit(config)
        (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The decoder's part of a parsed config.json (text_config for composites)."""
    return config.get("text_config", config)


def load_reference(folder: Path) -> torch.nn.Module:
    """transformers' model for folder by config.architectures[0], fp32; a reference with missing or mis-shaped
    weights (partly random) fails the test instead of being compared."""
    import transformers

    architecture = json.loads((folder / "config.json").read_text())["architectures"][0]
    model, info = getattr(transformers, architecture).from_pretrained(
        folder, dtype=torch.float32, output_loading_info=True
    )
    bad = {key: info.get(key) for key in ("missing_keys", "mismatched_keys") if info.get(key)}
    assert not bad, f"the transformers reference is partly random: {bad}"
    return model.eval()


def reference_tokens(model: torch.nn.Module) -> list[list[int]]:
    with torch.no_grad():
        return [
            model.generate(torch.tensor([p]), max_new_tokens=NUM_TOKENS, min_new_tokens=NUM_TOKENS, do_sample=False)[
                0, len(p) :
            ].tolist()
            for p in PROMPTS
        ]


def assert_strict(folder: Path, reference: torch.nn.Module | None = None) -> LLM:
    """deltaserve on folder equals transformers: greedy tokens identical on every prompt, logits within fp32
    rounding, nothing unexpected left in the checkpoint. Returns the LLM for further checks of its load report."""
    reference = reference if reference is not None else load_reference(folder)
    llm = LLM(folder, dtype="float32", device="cpu")
    assert llm.engine.runner.load_report.unexpected == []
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    ours = [list(out.outputs[0].token_ids) for out in outputs]
    assert ours == reference_tokens(reference)
    ids = PROMPTS[1]
    with torch.no_grad():
        ref_logits = reference(torch.tensor([ids])).logits[0].float()
    our_logits = llm.prefill_logits(ids)
    rel = float((our_logits - ref_logits).norm() / ref_logits.norm())
    assert rel < LOGIT_TOLERANCE, f"logits differ from transformers: relative error {rel:.2e}"
    return llm
