"""Checkpoint loading: sharded safetensors in Hugging Face layout -> the model's (fused) parameters.

Handles the prefixes and layouts of architecture doc §2: `model.language_model.*` with a top-level
`lm_head` (Qwen3.5/3.6) or `model.*` (Qwen3-Next and text-only forms); `mtp.*` and `model.visual.*` are
recognised and skipped; q/k/v projections fused into one qkv weight; Qwen3.5's flat `in_proj_qkv/z/b/a`
versus Qwen3-Next's group-interleaved `in_proj_qkvz/ba`; fused 3-D experts versus one tensor per expert;
tied embeddings with or without an `lm_head.weight`; `A_log` kept in fp32. A missing or mis-shaped tensor
raises CheckpointError naming it; tensors nobody consumed are reported. `load_format="dummy"` fills every
parameter with seeded random values instead.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from deltaserve.config import ModelConfig
from deltaserve.model.qwen3_5 import DecoderLayer, Qwen35Model
from deltaserve.model.vision_loader import load_vision_tower

logger = logging.getLogger(__name__)

SKIPPED_PREFIXES = ("mtp.", "model.visual.", "visual.", "model.mtp.")


class CheckpointError(ValueError):
    """A checkpoint whose tensors do not match the config; the message names the tensor."""


@dataclass
class LoadReport:
    num_tensors_loaded: int = 0
    skipped: list[str] = field(default_factory=list)  # recognised and deliberately not loaded (mtp, vision)
    unexpected: list[str] = field(default_factory=list)  # neither loaded nor recognised


class Checkpoint:
    """Lazy access to the tensors of a (possibly sharded) safetensors checkpoint."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        index = model_dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        else:
            shards = sorted(model_dir.glob("*.safetensors"))
            if not shards:
                raise CheckpointError(f"{model_dir}: no *.safetensors files and no model.safetensors.index.json")
            weight_map = {}
            for shard in shards:
                with safe_open(shard, framework="pt") as f:
                    weight_map.update(dict.fromkeys(f.keys(), shard.name))  # noqa: SIM118
        self.weight_map = weight_map
        self._handles: dict[str, object] = {}
        self.consumed: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self.weight_map

    def get(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise CheckpointError(f"{self.model_dir}: tensor `{name}` is missing from the checkpoint")
        shard = self.weight_map[name]
        if shard not in self._handles:
            path = self.model_dir / shard
            if not path.is_file():
                raise CheckpointError(f"{self.model_dir}: shard {shard} (holding `{name}`) does not exist")
            self._handles[shard] = safe_open(path, framework="pt")
        self.consumed.add(name)
        return self._handles[shard].get_tensor(name)  # type: ignore[attr-defined]

    def get_shaped(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        tensor = self.get(name)
        if tuple(tensor.shape) != tuple(shape):
            raise CheckpointError(
                f"{self.model_dir}: tensor `{name}` has shape {list(tensor.shape)}, expected {list(shape)}"
            )
        return tensor


def _decoder_prefix(config: ModelConfig, ckpt: Checkpoint) -> str:
    if any(name.startswith("model.language_model.") for name in ckpt.weight_map):
        return "model.language_model."
    return "model."


def _copy(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(value.shape):
        raise CheckpointError(f"tensor `{name}` gives shape {list(value.shape)}, expected {list(param.shape)}")
    param.data.copy_(value.to(dtype=param.dtype))


def _load_attention(layer: DecoderLayer, ckpt: Checkpoint, p: str, config: ModelConfig) -> None:
    attn = layer.self_attn
    hidden, d = config.hidden_size, config.head_dim
    nq, nkv = config.num_attention_heads, config.num_key_value_heads
    q = ckpt.get_shaped(p + "q_proj.weight", (2 * nq * d, hidden))
    k = ckpt.get_shaped(p + "k_proj.weight", (nkv * d, hidden))
    v = ckpt.get_shaped(p + "v_proj.weight", (nkv * d, hidden))
    _copy(attn.qkv_proj, torch.cat([q, k, v]), p + "q_proj/k_proj/v_proj")
    _copy(attn.o_proj, ckpt.get_shaped(p + "o_proj.weight", (hidden, nq * d)), p + "o_proj.weight")
    _copy(attn.q_norm, ckpt.get_shaped(p + "q_norm.weight", (d,)), p + "q_norm.weight")
    _copy(attn.k_norm, ckpt.get_shaped(p + "k_norm.weight", (d,)), p + "k_norm.weight")


def _load_gdn(layer: DecoderLayer, ckpt: Checkpoint, p: str, config: ModelConfig) -> None:
    gdn = layer.linear_attn
    hidden = config.hidden_size
    num_k, num_v = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    ratio = num_v // num_k
    if config.is_gdn_interleaved:
        # Per key head g: [q_g (dk) | k_g (dk) | v of its ρ value heads (ρ·dv) | z of the same (ρ·dv)] (§2.2).
        group = 2 * dk + 2 * ratio * dv
        w = ckpt.get_shaped(p + "in_proj_qkvz.weight", (num_k * group, hidden)).reshape(num_k, group, hidden)
        q, k = w[:, :dk], w[:, dk : 2 * dk]
        v, z = w[:, 2 * dk : 2 * dk + ratio * dv], w[:, 2 * dk + ratio * dv :]
        flat = [t.reshape(-1, hidden) for t in (q, k, v, z)]
        _copy(gdn.in_proj_qkvz, torch.cat(flat), p + "in_proj_qkvz.weight")
        ba = ckpt.get_shaped(p + "in_proj_ba.weight", (2 * num_v, hidden)).reshape(num_k, 2 * ratio, hidden)
        b, a = ba[:, :ratio].reshape(num_v, hidden), ba[:, ratio:].reshape(num_v, hidden)
        _copy(gdn.in_proj_ba, torch.cat([b, a]), p + "in_proj_ba.weight")
    else:
        qkv = ckpt.get_shaped(p + "in_proj_qkv.weight", (config.conv_dim, hidden))
        z = ckpt.get_shaped(p + "in_proj_z.weight", (config.value_dim, hidden))
        _copy(gdn.in_proj_qkvz, torch.cat([qkv, z]), p + "in_proj_qkv/in_proj_z")
        b = ckpt.get_shaped(p + "in_proj_b.weight", (num_v, hidden))
        a = ckpt.get_shaped(p + "in_proj_a.weight", (num_v, hidden))
        _copy(gdn.in_proj_ba, torch.cat([b, a]), p + "in_proj_b/in_proj_a")
    conv = ckpt.get_shaped(p + "conv1d.weight", (config.conv_dim, 1, config.linear_conv_kernel_dim))
    _copy(gdn.conv1d, conv[:, 0], p + "conv1d.weight")
    _copy(gdn.A_log, ckpt.get_shaped(p + "A_log", (num_v,)).float(), p + "A_log")
    _copy(gdn.dt_bias, ckpt.get_shaped(p + "dt_bias", (num_v,)), p + "dt_bias")
    _copy(gdn.norm, ckpt.get_shaped(p + "norm.weight", (dv,)), p + "norm.weight")
    _copy(gdn.out_proj, ckpt.get_shaped(p + "out_proj.weight", (hidden, config.value_dim)), p + "out_proj.weight")


def _load_dense_mlp(mlp: torch.nn.Module, ckpt: Checkpoint, p: str, hidden: int, width: int) -> None:
    gate = ckpt.get_shaped(p + "gate_proj.weight", (width, hidden))
    up = ckpt.get_shaped(p + "up_proj.weight", (width, hidden))
    _copy(mlp.gate_up_proj, torch.cat([gate, up]), p + "gate_proj/up_proj")
    _copy(mlp.down_proj, ckpt.get_shaped(p + "down_proj.weight", (hidden, width)), p + "down_proj.weight")


def _load_moe(layer: DecoderLayer, ckpt: Checkpoint, p: str, config: ModelConfig) -> None:
    moe = layer.mlp
    hidden, num_experts, width = config.hidden_size, config.num_experts, config.moe_intermediate_size
    _copy(moe.gate, ckpt.get_shaped(p + "gate.weight", (num_experts, hidden)), p + "gate.weight")
    if ckpt.has(p + "experts.gate_up_proj"):
        w13 = ckpt.get_shaped(p + "experts.gate_up_proj", (num_experts, 2 * width, hidden))
        _copy(moe.w13, w13, p + "experts.gate_up_proj")
        _copy(moe.w2, ckpt.get_shaped(p + "experts.down_proj", (num_experts, hidden, width)), p + "experts.down_proj")
    else:
        for e in range(num_experts):
            ep = f"{p}experts.{e}."
            gate = ckpt.get_shaped(ep + "gate_proj.weight", (width, hidden))
            up = ckpt.get_shaped(ep + "up_proj.weight", (width, hidden))
            _copy(moe.w13[e], torch.cat([gate, up]), ep + "gate_proj/up_proj")
            _copy(moe.w2[e], ckpt.get_shaped(ep + "down_proj.weight", (hidden, width)), ep + "down_proj.weight")
    if moe.has_shared_expert:
        shared_width = config.shared_expert_intermediate_size
        _load_dense_mlp(moe.shared_expert, ckpt, p + "shared_expert.", hidden, shared_width)
        gate_w = ckpt.get_shaped(p + "shared_expert_gate.weight", (1, hidden))
        _copy(moe.shared_expert_gate, gate_w, p + "shared_expert_gate.weight")


def load_checkpoint(model: Qwen35Model, config: ModelConfig, model_dir: Path) -> LoadReport:
    ckpt = Checkpoint(model_dir)
    prefix = _decoder_prefix(config, ckpt)
    hidden = config.hidden_size
    with torch.no_grad():
        embed = ckpt.get_shaped(prefix + "embed_tokens.weight", (config.vocab_size, hidden))
        _copy(model.embed_tokens, embed, prefix + "embed_tokens.weight")
        for i, layer in enumerate(model.layers):
            p = f"{prefix}layers.{i}."
            _copy(
                layer.input_layernorm, ckpt.get_shaped(p + "input_layernorm.weight", (hidden,)), p + "input_layernorm"
            )
            post = ckpt.get_shaped(p + "post_attention_layernorm.weight", (hidden,))
            _copy(layer.post_attention_layernorm, post, p + "post_attention_layernorm.weight")
            if layer.is_full_attention:
                _load_attention(layer, ckpt, p + "self_attn.", config)
            else:
                _load_gdn(layer, ckpt, p + "linear_attn.", config)
            if config.moe_layers and config.moe_layers[i]:
                _load_moe(layer, ckpt, p + "mlp.", config)
            else:
                _load_dense_mlp(layer.mlp, ckpt, p + "mlp.", hidden, config.intermediate_size)
        _copy(model.norm, ckpt.get_shaped(prefix + "norm.weight", (hidden,)), prefix + "norm.weight")
        if not config.tie_word_embeddings:
            head = ckpt.get_shaped("lm_head.weight", (config.vocab_size, hidden))
            _copy(model.lm_head, head, "lm_head.weight")
        elif ckpt.has("lm_head.weight"):
            # A tied checkpoint may still carry a copy of the embedding; it must agree in shape.
            ckpt.get_shaped("lm_head.weight", (config.vocab_size, hidden))
        if getattr(model, "visual", None) is not None:
            # the vision tower was built: model.visual.* is consumed (else it stays a skipped prefix)
            load_vision_tower(model.visual, config.vision, ckpt)
    report = LoadReport(num_tensors_loaded=len(ckpt.consumed))
    for name in sorted(set(ckpt.weight_map) - ckpt.consumed):
        (report.skipped if name.startswith(SKIPPED_PREFIXES) else report.unexpected).append(name)
    if report.unexpected:
        logger.warning("%d unexpected tensors in %s: %s", len(report.unexpected), model_dir, report.unexpected[:20])
    return report


def init_dummy_weights(model: Qwen35Model, seed: int) -> None:
    """Seeded random weights of the right shapes, for benchmarks on real dimensions without weights."""
    device = model.embed_tokens.device
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "A_log":
                param.uniform_(math.log(1.0), math.log(16.0), generator=generator)
            elif leaf == "dt_bias":
                param.zero_()
            elif leaf == "norm" and ".linear_attn." in name:
                param.fill_(1.0)  # the GDN gated norm has a plain weight
            elif param.dim() == 1:
                param.zero_()  # zero-centred norms: applied as (1 + w)
            else:
                param.normal_(0.0, 0.02, generator=generator)
