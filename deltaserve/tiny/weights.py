"""Seeded random weights for the tiny checkpoints, named and laid out exactly as the real releases.

Each logical tensor draws from its own generator, seeded from (seed, logical name). So a layer's weights do not
depend on which other tensors a variant has: for one seed, the dense, MoE and Next checkpoints share their
embeddings, attention and Gated DeltaNet weights, and the fused and per-expert layouts hold the same experts.

The scales are chosen for greedy token-exactness tests, which need well-separated logits and varied generations
rather than a trained model: projections ~ N(0, 1/fan_in), embeddings ~ N(0, 1), zero-centred norm weights
~ N(0, 0.1^2) (applied as 1 + w), and residual-writing projections scaled up so that the layers, not the current
token's embedding, decide the next token.
"""

from __future__ import annotations

import hashlib
import math

import torch

from deltaserve.tiny.spec import TinyShapes, VariantSpec

# Std of the logits an untied lm_head produces from a unit-RMS final hidden state: large enough that the top-2
# margin is rarely below bf16 resolution, small enough that sampling tests still see several candidates.
LOGIT_STD = 4.0
# Gain on the projections that write into the residual stream (o_proj, out_proj, down_proj). With gain 1 the
# layers add far less than the embedding, so the model mostly predicts a fixed successor of the current token
# (and with tied embeddings repeats it); a larger gain lets context decide.
RESIDUAL_WRITE_GAIN = 3.0
# Router logits spread: wide enough that the top-k choice is rarely a near-tie.
ROUTER_GAIN = 2.0
ZERO_CENTRED_NORM_STD = 0.1
GATED_NORM_NOISE_STD = 0.1
DT_BIAS_STD = 0.1
VISION_STD = 0.02


class _TensorFactory:
    """Draws each named tensor from a generator seeded by (seed, name), in float32."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def _generator(self, name: str) -> torch.Generator:
        digest = hashlib.sha256(f"deltaserve-tiny/{self.seed}/{name}".encode()).digest()
        return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))

    def normal(self, name: str, shape: tuple[int, ...], std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=self._generator(name), dtype=torch.float32) * std + mean

    def uniform(self, name: str, shape: tuple[int, ...], low: float, high: float) -> torch.Tensor:
        return torch.rand(shape, generator=self._generator(name), dtype=torch.float32) * (high - low) + low

    def linear(self, name: str, num_out: int, num_in: int, gain: float = 1.0) -> torch.Tensor:
        """An [out, in] projection with std gain / sqrt(fan_in)."""
        return self.normal(name, (num_out, num_in), gain / math.sqrt(num_in))

    def zero_centred_norm(self, name: str, size: int) -> torch.Tensor:
        return self.normal(name, (size,), ZERO_CENTRED_NORM_STD)


def _attention(factory: _TensorFactory, shapes: TinyShapes, logical: str) -> dict[str, torch.Tensor]:
    """Gated full attention; q_proj rows are per head [query (d) | gate (d)], as in the release."""
    hidden, head_dim = shapes.hidden_size, shapes.head_dim
    num_q, num_kv = shapes.num_attention_heads, shapes.num_key_value_heads
    return {
        "self_attn.q_proj.weight": factory.linear(f"{logical}.q_proj", 2 * num_q * head_dim, hidden),
        "self_attn.k_proj.weight": factory.linear(f"{logical}.k_proj", num_kv * head_dim, hidden),
        "self_attn.v_proj.weight": factory.linear(f"{logical}.v_proj", num_kv * head_dim, hidden),
        "self_attn.o_proj.weight": factory.linear(f"{logical}.o_proj", hidden, num_q * head_dim, RESIDUAL_WRITE_GAIN),
        "self_attn.q_norm.weight": factory.zero_centred_norm(f"{logical}.q_norm", head_dim),
        "self_attn.k_norm.weight": factory.zero_centred_norm(f"{logical}.k_norm", head_dim),
    }


def _interleave_qkvz(shapes: TinyShapes, qkv: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Qwen3-Next's in_proj_qkvz: per key head g, [q_g | k_g | v of g's value heads | z of g's value heads]."""
    num_k_heads = shapes.linear_num_key_heads
    key_dim, head_k_dim = shapes.linear_key_dim, shapes.linear_key_head_dim
    values_per_group = shapes.linear_num_value_heads // num_k_heads * shapes.linear_value_head_dim
    query, key, value = qkv[:key_dim], qkv[key_dim : 2 * key_dim], qkv[2 * key_dim :]
    groups = []
    for group in range(num_k_heads):
        groups += [
            query[group * head_k_dim : (group + 1) * head_k_dim],
            key[group * head_k_dim : (group + 1) * head_k_dim],
            value[group * values_per_group : (group + 1) * values_per_group],
            z[group * values_per_group : (group + 1) * values_per_group],
        ]
    return torch.cat(groups, dim=0)


def _interleave_ba(shapes: TinyShapes, b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """Qwen3-Next's in_proj_ba: per key head g, [b of g's value heads | a of g's value heads]."""
    ratio = shapes.linear_num_value_heads // shapes.linear_num_key_heads
    groups = []
    for group in range(shapes.linear_num_key_heads):
        groups += [b[group * ratio : (group + 1) * ratio], a[group * ratio : (group + 1) * ratio]]
    return torch.cat(groups, dim=0)


def _gated_delta_net(
    factory: _TensorFactory, shapes: TinyShapes, spec: VariantSpec, logical: str
) -> dict[str, torch.Tensor]:
    """Gated DeltaNet projections, conv, decay and gated norm, in the variant's projection layout."""
    hidden = shapes.hidden_size
    num_v_heads = shapes.linear_num_value_heads
    qkv = factory.linear(f"{logical}.in_proj_qkv", shapes.linear_conv_dim, hidden)
    z = factory.linear(f"{logical}.in_proj_z", shapes.linear_value_dim, hidden)
    b = factory.linear(f"{logical}.in_proj_b", num_v_heads, hidden)
    a = factory.linear(f"{logical}.in_proj_a", num_v_heads, hidden)
    if spec.gdn_layout == "interleaved":
        projections = {
            "linear_attn.in_proj_qkvz.weight": _interleave_qkvz(shapes, qkv, z),
            "linear_attn.in_proj_ba.weight": _interleave_ba(shapes, b, a),
        }
    else:
        projections = {
            "linear_attn.in_proj_qkv.weight": qkv,
            "linear_attn.in_proj_z.weight": z,
            "linear_attn.in_proj_b.weight": b,
            "linear_attn.in_proj_a.weight": a,
        }
    kernel = shapes.linear_conv_kernel_dim
    return {
        **projections,
        "linear_attn.conv1d.weight": factory.normal(
            f"{logical}.conv1d", (shapes.linear_conv_dim, 1, kernel), 1 / math.sqrt(kernel)
        ),
        # A in [1, 16], as the releases' initialisation draws it.
        "linear_attn.A_log": factory.uniform(f"{logical}.A_log", (num_v_heads,), 1.0, 16.0).log(),
        "linear_attn.dt_bias": factory.normal(f"{logical}.dt_bias", (num_v_heads,), DT_BIAS_STD),
        # Plain weight (not zero-centred), shared by all value heads.
        "linear_attn.norm.weight": factory.normal(
            f"{logical}.norm", (shapes.linear_value_head_dim,), GATED_NORM_NOISE_STD, mean=1.0
        ),
        "linear_attn.out_proj.weight": factory.linear(
            f"{logical}.out_proj", hidden, shapes.linear_value_dim, RESIDUAL_WRITE_GAIN
        ),
    }


def _swiglu(factory: _TensorFactory, logical: str, prefix: str, hidden: int, width: int) -> dict[str, torch.Tensor]:
    return {
        f"{prefix}gate_proj.weight": factory.linear(f"{logical}.gate_proj", width, hidden),
        f"{prefix}up_proj.weight": factory.linear(f"{logical}.up_proj", width, hidden),
        f"{prefix}down_proj.weight": factory.linear(f"{logical}.down_proj", hidden, width, RESIDUAL_WRITE_GAIN),
    }


def _mlp(
    factory: _TensorFactory, shapes: TinyShapes, spec: VariantSpec, logical: str, expert_layout: str | None
) -> dict[str, torch.Tensor]:
    """Dense SwiGLU, or router + routed experts (fused 3-D or per expert) + sigmoid-gated shared expert."""
    hidden = shapes.hidden_size
    if not spec.is_moe:
        return _swiglu(factory, f"{logical}.mlp", "mlp.", hidden, shapes.intermediate_size)
    tensors = {"mlp.gate.weight": factory.linear(f"{logical}.mlp.gate", shapes.num_experts, hidden, ROUTER_GAIN)}
    experts = [
        _swiglu(factory, f"{logical}.mlp.experts.{expert}", "", hidden, shapes.moe_intermediate_size)
        for expert in range(shapes.num_experts)
    ]
    if expert_layout == "fused":
        # gate_up_proj [E, 2I, H]: per expert the gate rows, then the up rows. down_proj [E, H, I].
        tensors["mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([expert["gate_proj.weight"], expert["up_proj.weight"]], dim=0) for expert in experts]
        )
        tensors["mlp.experts.down_proj"] = torch.stack([expert["down_proj.weight"] for expert in experts])
    else:
        for index, expert in enumerate(experts):
            for name, tensor in expert.items():
                tensors[f"mlp.experts.{index}.{name}"] = tensor
    tensors.update(
        _swiglu(
            factory,
            f"{logical}.mlp.shared_expert",
            "mlp.shared_expert.",
            hidden,
            shapes.shared_expert_intermediate_size,
        )
    )
    tensors["mlp.shared_expert_gate.weight"] = factory.linear(f"{logical}.mlp.shared_expert_gate", 1, hidden)
    return tensors


def _decoder_layer(
    factory: _TensorFactory,
    shapes: TinyShapes,
    spec: VariantSpec,
    logical: str,
    layer_type: str,
    expert_layout: str | None,
) -> dict[str, torch.Tensor]:
    hidden = shapes.hidden_size
    tensors = {"input_layernorm.weight": factory.zero_centred_norm(f"{logical}.input_layernorm", hidden)}
    if layer_type == "full_attention":
        tensors.update(_attention(factory, shapes, f"{logical}.self_attn"))
    else:
        tensors.update(_gated_delta_net(factory, shapes, spec, f"{logical}.linear_attn"))
    tensors["post_attention_layernorm.weight"] = factory.zero_centred_norm(
        f"{logical}.post_attention_layernorm", hidden
    )
    tensors.update(_mlp(factory, shapes, spec, logical, expert_layout))
    return tensors


def _vision_tower(factory: _TensorFactory, shapes: TinyShapes) -> dict[str, torch.Tensor]:
    """The ViT under model.visual.*: Conv3d patch embed, learned positions, blocks, 2x2 patch merger."""
    width = shapes.vision_hidden_size
    merged_width = width * shapes.vision_spatial_merge_size**2
    patch = (
        shapes.vision_in_channels,
        shapes.vision_temporal_patch_size,
        shapes.vision_patch_size,
        shapes.vision_patch_size,
    )
    patch_fan_in = math.prod(patch)
    tensors = {
        "patch_embed.proj.weight": factory.normal(
            "visual.patch_embed.proj", (width, *patch), 1 / math.sqrt(patch_fan_in)
        ),
        "patch_embed.proj.bias": factory.normal("visual.patch_embed.proj.bias", (width,), VISION_STD),
        "pos_embed.weight": factory.normal(
            "visual.pos_embed", (shapes.vision_num_position_embeddings, width), VISION_STD
        ),
    }

    def layer_norm(name: str, size: int) -> dict[str, torch.Tensor]:
        return {
            f"{name}.weight": factory.normal(f"visual.{name}", (size,), VISION_STD, mean=1.0),
            f"{name}.bias": factory.normal(f"visual.{name}.bias", (size,), VISION_STD),
        }

    def linear_with_bias(name: str, num_out: int, num_in: int) -> dict[str, torch.Tensor]:
        return {
            f"{name}.weight": factory.linear(f"visual.{name}", num_out, num_in),
            f"{name}.bias": factory.normal(f"visual.{name}.bias", (num_out,), VISION_STD),
        }

    for block in range(shapes.vision_depth):
        prefix = f"blocks.{block}"
        tensors.update(layer_norm(f"{prefix}.norm1", width))
        tensors.update(layer_norm(f"{prefix}.norm2", width))
        tensors.update(linear_with_bias(f"{prefix}.attn.qkv", 3 * width, width))
        tensors.update(linear_with_bias(f"{prefix}.attn.proj", width, width))
        tensors.update(linear_with_bias(f"{prefix}.mlp.linear_fc1", shapes.vision_intermediate_size, width))
        tensors.update(linear_with_bias(f"{prefix}.mlp.linear_fc2", width, shapes.vision_intermediate_size))
    tensors.update(layer_norm("merger.norm", width))
    tensors.update(linear_with_bias("merger.linear_fc1", merged_width, merged_width))
    tensors.update(linear_with_bias("merger.linear_fc2", shapes.hidden_size, merged_width))
    return tensors


def build_tensors(
    spec: VariantSpec,
    shapes: TinyShapes,
    vocab_size: int,
    num_tokenizer_tokens: int,
    seed: int,
    is_tied: bool,
    expert_layout: str | None,
) -> dict[str, torch.Tensor]:
    """Every checkpoint tensor, by its checkpoint name, in a stable order: bf16, except A_log in fp32.

    Rows of the embedding and lm_head past the tokenizer's size are zero, like padding that was never trained:
    their logits are exactly 0, so greedy decoding never picks an id the tokenizer cannot decode.
    """
    factory = _TensorFactory(seed)
    hidden = shapes.hidden_size
    is_real_row = (torch.arange(vocab_size) < num_tokenizer_tokens).unsqueeze(1)
    tensors: dict[str, torch.Tensor] = {}
    decoder = spec.decoder_prefix
    tensors[f"{decoder}embed_tokens.weight"] = factory.normal("embed_tokens", (vocab_size, hidden), 1.0) * is_real_row
    for index, layer_type in enumerate(shapes.layer_types):
        layer = _decoder_layer(factory, shapes, spec, f"layers.{index}", layer_type, expert_layout)
        tensors.update({f"{decoder}layers.{index}.{name}": tensor for name, tensor in layer.items()})
    tensors[f"{decoder}norm.weight"] = factory.zero_centred_norm("norm", hidden)
    if not is_tied:
        lm_head = factory.normal("lm_head", (vocab_size, hidden), LOGIT_STD / math.sqrt(hidden))
        tensors["lm_head.weight"] = lm_head * is_real_row
    if spec.is_composite:
        tensors.update({f"model.visual.{name}": tensor for name, tensor in _vision_tower(factory, shapes).items()})
    # The MTP head: loaders must recognise these names and skip (or route) them.
    tensors["mtp.fc.weight"] = factory.linear("mtp.fc", hidden, 2 * hidden)
    tensors["mtp.pre_fc_norm_embedding.weight"] = factory.zero_centred_norm("mtp.pre_fc_norm_embedding", hidden)
    tensors["mtp.pre_fc_norm_hidden.weight"] = factory.zero_centred_norm("mtp.pre_fc_norm_hidden", hidden)
    for index in range(shapes.num_mtp_layers):
        layer = _decoder_layer(factory, shapes, spec, f"mtp.layers.{index}", "full_attention", expert_layout)
        tensors.update({f"mtp.layers.{index}.{name}": tensor for name, tensor in layer.items()})
    tensors["mtp.norm.weight"] = factory.zero_centred_norm("mtp.norm", hidden)
    return {
        name: tensor.contiguous() if name.endswith(".A_log") else tensor.to(torch.bfloat16).contiguous()
        for name, tensor in tensors.items()
    }
