"""One decoder layer's checkpoint tensors -> its (fused) parameters, under tensor parallelism this rank's slices.

The mapping of docs/ARCHITECTURE.md#configs-and-checkpoint-layout, for the parts a layer is made of: q/k/v projections
fused into one qkv weight (and their biases when `attention_bias`); Qwen3.5's flat `in_proj_qkv/z/b/a` versus
Qwen3-Next's group-interleaved `in_proj_qkvz/ba`; fused 3-D experts versus one tensor per expert, and the shared
expert; the dense MLP's gate|up; `A_log` kept in fp32. Each reads only this rank's rows or columns
(model/parallel.py's LocalShapes) and touches the tensors it needs none of. `copy_param` fills a parameter and checks it
finite, or fills a block-FP8 one from its packed bytes (model/fp8_loader.py). loader.py walks the layers.
"""

from __future__ import annotations

import torch

from deltaserve.config import ModelConfig
from deltaserve.kernels.fp8 import Fp8Weight
from deltaserve.model.checkpoint import Checkpoint
from deltaserve.model.checkpoint_files import CheckpointError
from deltaserve.model.fp8_loader import copy_packed
from deltaserve.model.parallel import LocalShapes, Shard
from deltaserve.model.qwen3_5 import DecoderLayer


def _rows(shard: Shard, unit: int, offset: int = 0) -> slice:
    """The rows (or columns) of a shard of heads / channels that are `unit` wide, after `offset` leading ones."""
    return slice(offset + shard.start * unit, offset + shard.stop * unit)


ALL = slice(None)


def copy_param(ckpt: Checkpoint, param: torch.Tensor | Fp8Weight, value: torch.Tensor, name: str) -> None:
    if isinstance(param, Fp8Weight) or value.dtype == torch.uint8:
        copy_packed(ckpt, param, value, name)  # block FP8 (model/fp8_loader.py)
        return
    if tuple(param.shape) != tuple(value.shape):
        raise CheckpointError(f"tensor `{name}` gives shape {list(value.shape)}, expected {list(param.shape)}")
    param.data.copy_(value.to(dtype=param.dtype))
    ckpt.check_finite(param, name)


def _load_attention(layer: DecoderLayer, ckpt: Checkpoint, p: str, config: ModelConfig, shapes: LocalShapes) -> None:
    attn = layer.self_attn
    hidden, d = config.hidden_size, config.head_dim
    nq, nkv = config.num_attention_heads, config.num_key_value_heads
    # this rank's heads: 2·d rows each in q_proj (per head [query | gate]), d rows in k/v_proj, d columns in o_proj
    q_rows, kv_rows = _rows(shapes.q_heads, 2 * d), _rows(shapes.kv_heads, d)
    q = ckpt.get_shaped(p + "q_proj.weight", (2 * nq * d, hidden), (q_rows,))
    k = ckpt.get_shaped(p + "k_proj.weight", (nkv * d, hidden), (kv_rows,))
    v = ckpt.get_shaped(p + "v_proj.weight", (nkv * d, hidden), (kv_rows,))
    copy_param(ckpt, attn.qkv_proj, torch.cat([q, k, v]), p + "q_proj/k_proj/v_proj")
    o = ckpt.get_shaped(p + "o_proj.weight", (hidden, nq * d), (ALL, _rows(shapes.q_heads, d)))
    copy_param(ckpt, attn.o_proj, o, p + "o_proj.weight")
    if config.has_attention_bias:
        # transformers' attention_bias puts a bias on all four projections (Qwen3_5Attention, bias=attention_bias)
        q_b = ckpt.get_shaped(p + "q_proj.bias", (2 * nq * d,), (q_rows,))
        k_b = ckpt.get_shaped(p + "k_proj.bias", (nkv * d,), (kv_rows,))
        v_b = ckpt.get_shaped(p + "v_proj.bias", (nkv * d,), (kv_rows,))
        copy_param(ckpt, attn.qkv_bias, torch.cat([q_b, k_b, v_b]), p + "q_proj/k_proj/v_proj.bias")
        if attn.o_bias is None:
            ckpt.touch(p + "o_proj.bias", (hidden,))  # row-parallel: only rank 0 adds it
        else:
            copy_param(ckpt, attn.o_bias, ckpt.get_shaped(p + "o_proj.bias", (hidden,)), p + "o_proj.bias")
    copy_param(ckpt, attn.q_norm, ckpt.get_shaped(p + "q_norm.weight", (d,)), p + "q_norm.weight")
    copy_param(ckpt, attn.k_norm, ckpt.get_shaped(p + "k_norm.weight", (d,)), p + "k_norm.weight")


def _load_gdn(layer: DecoderLayer, ckpt: Checkpoint, p: str, config: ModelConfig, shapes: LocalShapes) -> None:
    gdn = layer.linear_attn
    hidden = config.hidden_size
    num_k, num_v = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    key_dim = num_k * dk
    ratio = num_v // num_k
    heads_k, heads_v = shapes.k_heads, shapes.v_heads  # this rank's key heads and their value heads
    # the flat [q | k | v] channels of this rank's heads (in_proj_qkv rows and conv1d channels)
    qkv_parts = (_rows(heads_k, dk), _rows(heads_k, dk, key_dim), _rows(heads_v, dv, 2 * key_dim))
    if config.is_gdn_interleaved:
        # Per key head g: [q_g (dk) | k_g (dk) | v of its ρ value heads (ρ·dv) | z of the same (ρ·dv)]
        # (docs/ARCHITECTURE.md#configs-and-checkpoint-layout); a rank's key heads are consecutive groups of rows.
        group = 2 * dk + 2 * ratio * dv
        w = ckpt.get_shaped(p + "in_proj_qkvz.weight", (num_k * group, hidden), (_rows(heads_k, group),))
        w = w.reshape(heads_k.size, group, -1)  # -1: hidden, or FP8 bytes with their scales (fp8_loader.py)
        q, k = w[:, :dk], w[:, dk : 2 * dk]
        v, z = w[:, 2 * dk : 2 * dk + ratio * dv], w[:, 2 * dk + ratio * dv :]
        flat = [t.reshape(-1, t.shape[-1]) for t in (q, k, v, z)]
        copy_param(ckpt, gdn.in_proj_qkvz, torch.cat(flat), p + "in_proj_qkvz.weight")
        ba = ckpt.get_shaped(p + "in_proj_ba.weight", (2 * num_v, hidden), (_rows(heads_k, 2 * ratio),))
        ba = ba.reshape(heads_k.size, 2 * ratio, hidden)
        b, a = ba[:, :ratio].reshape(heads_v.size, hidden), ba[:, ratio:].reshape(heads_v.size, hidden)
        copy_param(ckpt, gdn.in_proj_ba, torch.cat([b, a]), p + "in_proj_ba.weight")
    else:
        name = p + "in_proj_qkv.weight"
        qkv = [ckpt.get_shaped(name, (config.conv_dim, hidden), (rows,)) for rows in qkv_parts]
        z = ckpt.get_shaped(p + "in_proj_z.weight", (config.value_dim, hidden), (_rows(heads_v, dv),))
        copy_param(ckpt, gdn.in_proj_qkvz, torch.cat([*qkv, z]), p + "in_proj_qkv/in_proj_z")
        b = ckpt.get_shaped(p + "in_proj_b.weight", (num_v, hidden), (_rows(heads_v, 1),))
        a = ckpt.get_shaped(p + "in_proj_a.weight", (num_v, hidden), (_rows(heads_v, 1),))
        copy_param(ckpt, gdn.in_proj_ba, torch.cat([b, a]), p + "in_proj_b/in_proj_a")
    conv_shape = (config.conv_dim, 1, config.linear_conv_kernel_dim)
    conv = torch.cat([ckpt.get_shaped(p + "conv1d.weight", conv_shape, (rows,)) for rows in qkv_parts])
    copy_param(ckpt, gdn.conv1d, conv[:, 0], p + "conv1d.weight")
    heads = (_rows(heads_v, 1),)
    copy_param(ckpt, gdn.A_log, ckpt.get_shaped(p + "A_log", (num_v,), heads).float(), p + "A_log")
    copy_param(ckpt, gdn.dt_bias, ckpt.get_shaped(p + "dt_bias", (num_v,), heads), p + "dt_bias")
    copy_param(ckpt, gdn.norm, ckpt.get_shaped(p + "norm.weight", (dv,)), p + "norm.weight")
    out = ckpt.get_shaped(p + "out_proj.weight", (hidden, config.value_dim), (ALL, _rows(heads_v, dv)))
    copy_param(ckpt, gdn.out_proj, out, p + "out_proj.weight")


def _load_dense_mlp(mlp: torch.nn.Module, ckpt: Checkpoint, p: str, hidden: int, width: Shard) -> None:
    """width: this rank's slice of the intermediate width (column-parallel gate/up rows, row-parallel down)."""
    rows = (_rows(width, 1),)
    gate = ckpt.get_shaped(p + "gate_proj.weight", (width.total, hidden), rows)
    up = ckpt.get_shaped(p + "up_proj.weight", (width.total, hidden), rows)
    copy_param(ckpt, mlp.gate_up_proj, torch.cat([gate, up]), p + "gate_proj/up_proj")
    down = ckpt.get_shaped(p + "down_proj.weight", (hidden, width.total), (ALL, _rows(width, 1)))
    copy_param(ckpt, mlp.down_proj, down, p + "down_proj.weight")


def _expert(weights: torch.Tensor | Fp8Weight, index: int) -> torch.Tensor | Fp8Weight:
    """Expert `index` of a stacked [E, N, K] weight, plain or block-FP8, sharing its storage."""
    return weights.expert(index) if isinstance(weights, Fp8Weight) else weights[index]


def _load_moe(layer: DecoderLayer, ckpt: Checkpoint, p: str, config: ModelConfig, shapes: LocalShapes) -> None:
    moe = layer.mlp
    hidden, num_experts, width = config.hidden_size, config.num_experts, config.moe_intermediate_size
    # this rank's experts (all but under expert parallelism) and its slice of each one's width (all under it)
    experts, inter = shapes.experts, shapes.moe_intermediate
    copy_param(ckpt, moe.gate, ckpt.get_shaped(p + "gate.weight", (num_experts, hidden)), p + "gate.weight")
    if ckpt.has(p + "experts.gate_up_proj"):
        name = p + "experts.gate_up_proj"
        shape = (num_experts, 2 * width, hidden)
        gate = ckpt.get_shaped(name, shape, (_rows(experts, 1), _rows(inter, 1)))
        up = ckpt.get_shaped(name, shape, (_rows(experts, 1), _rows(inter, 1, width)))
        copy_param(ckpt, moe.w13, torch.cat([gate, up], dim=1), name)
        down_index = (_rows(experts, 1), ALL, _rows(inter, 1))
        down = ckpt.get_shaped(p + "experts.down_proj", (num_experts, hidden, width), down_index)
        copy_param(ckpt, moe.w2, down, p + "experts.down_proj")
    else:
        for e in range(num_experts):
            ep = f"{p}experts.{e}."
            if not experts.start <= e < experts.stop:
                for leaf, shape in (("gate_proj", (width, hidden)), ("up_proj", (width, hidden)),
                                    ("down_proj", (hidden, width))):  # fmt: skip
                    ckpt.touch(f"{ep}{leaf}.weight", shape)  # held by another rank
                continue
            rows = (_rows(inter, 1),)
            gate = ckpt.get_shaped(ep + "gate_proj.weight", (width, hidden), rows)
            up = ckpt.get_shaped(ep + "up_proj.weight", (width, hidden), rows)
            local = e - experts.start
            copy_param(ckpt, _expert(moe.w13, local), torch.cat([gate, up]), ep + "gate_proj/up_proj")
            down = ckpt.get_shaped(ep + "down_proj.weight", (hidden, width), (ALL, _rows(inter, 1)))
            copy_param(ckpt, _expert(moe.w2, local), down, ep + "down_proj.weight")
    if moe.has_shared_expert:
        _load_dense_mlp(moe.shared_expert, ckpt, p + "shared_expert.", hidden, shapes.shared_intermediate)
        gate_w = ckpt.get_shaped(p + "shared_expert_gate.weight", (1, hidden))
        copy_param(ckpt, moe.shared_expert_gate, gate_w, p + "shared_expert_gate.weight")
    else:
        # Width 0: transformers' zero-width shared expert adds exactly 0, so its (empty) tensors and its gate are
        # read for their shapes and not used.
        for name, shape in (("gate_proj.weight", (0, hidden)), ("up_proj.weight", (0, hidden)),
                            ("down_proj.weight", (hidden, 0))):  # fmt: skip
            if ckpt.has(p + "shared_expert." + name):
                ckpt.get_shaped(p + "shared_expert." + name, shape)
        if ckpt.has(p + "shared_expert_gate.weight"):
            ckpt.get_shaped(p + "shared_expert_gate.weight", (1, hidden))


def load_decoder_layer(
    layer: DecoderLayer, ckpt: Checkpoint, p: str, config: ModelConfig, shapes: LocalShapes, is_moe: bool
) -> None:
    """One decoder layer under prefix p (`…layers.{i}.`): its two norms, its mixer and its MLP or MoE block."""
    hidden = config.hidden_size
    pre = ckpt.get_shaped(p + "input_layernorm.weight", (hidden,))
    copy_param(ckpt, layer.input_layernorm, pre, p + "input_layernorm")
    post = ckpt.get_shaped(p + "post_attention_layernorm.weight", (hidden,))
    copy_param(ckpt, layer.post_attention_layernorm, post, p + "post_attention_layernorm.weight")
    if layer.is_full_attention:
        _load_attention(layer, ckpt, p + "self_attn.", config, shapes)
    else:
        _load_gdn(layer, ckpt, p + "linear_attn.", config, shapes)
    if is_moe:
        _load_moe(layer, ckpt, p + "mlp.", config, shapes)
    else:
        _load_dense_mlp(layer.mlp, ckpt, p + "mlp.", hidden, shapes.intermediate)
