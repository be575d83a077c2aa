"""Shapes and config.json contents of the tiny checkpoints, one description per variant.

The three variants mirror the three released checkpoint families (see
docs/ARCHITECTURE.md#configs-and-checkpoint-layout):
`dense` is a Qwen3.5 dense composite checkpoint, `moe` a Qwen3.5/3.6 MoE composite checkpoint and `next` a flat
Qwen3-Next checkpoint. Everything is scaled down so that a checkpoint is a few MB, but every structural feature
(hybrid layer pattern, GQA, partial MRoPE, HV > HK, shared experts, MTP, vision tower) is kept.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

VARIANTS: tuple[str, ...] = ("dense", "moe", "next", "dense-vl", "moe-vl", "dense-w128", "moe-w128", "next-w128")
EXPERT_LAYOUTS: tuple[str, ...] = ("fused", "per_expert")


@dataclass(frozen=True)
class TinyShapes:
    """Every size of the tiny decoder, MTP head and vision tower."""

    num_hidden_layers: int = 8
    full_attention_interval: int = 4
    hidden_size: int = 64
    head_dim: int = 32
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    partial_rotary_factor: float = 0.25
    rope_theta: float = 1e7
    # Frequency counts per (T, H, W) axis; they must sum to rotary_dim / 2.
    mrope_section: tuple[int, int, int] = (2, 1, 1)
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 16
    linear_value_head_dim: int = 16
    linear_conv_kernel_dim: int = 4
    intermediate_size: int = 128
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32
    shared_expert_intermediate_size: int = 64
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    num_mtp_layers: int = 1
    vision_depth: int = 1
    vision_hidden_size: int = 32
    vision_intermediate_size: int = 64
    vision_num_heads: int = 2
    vision_in_channels: int = 3
    vision_patch_size: int = 16
    vision_temporal_patch_size: int = 2
    vision_spatial_merge_size: int = 2
    # A perfect square: the learned table is a 16 x 16 grid that transformers resamples to each image.
    vision_num_position_embeddings: int = 256

    @property
    def layer_types(self) -> list[str]:
        """Layer i is full attention iff (i + 1) is a multiple of the interval, as transformers derives it."""
        return [
            "full_attention" if (index + 1) % self.full_attention_interval == 0 else "linear_attention"
            for index in range(self.num_hidden_layers)
        ]

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim


@dataclass(frozen=True)
class VariantSpec:
    """What distinguishes one checkpoint family from another, apart from the shared shapes."""

    name: str
    model_type: str
    architecture: str
    text_model_type: str | None  # None for flat (non-composite) configs
    is_moe: bool
    is_tied_by_default: bool
    default_expert_layout: str | None  # None for dense
    # "flat" = separate in_proj_qkv/z/b/a (Qwen3.5); "interleaved" = fused in_proj_qkvz/ba grouped by key head.
    gdn_layout: str
    tokenizer_class: str

    @property
    def is_composite(self) -> bool:
        return self.text_model_type is not None

    @property
    def decoder_prefix(self) -> str:
        return "model.language_model." if self.is_composite else "model."


VARIANT_SPECS: dict[str, VariantSpec] = {
    "dense": VariantSpec(
        name="dense",
        model_type="qwen3_5",
        architecture="Qwen3_5ForConditionalGeneration",
        text_model_type="qwen3_5_text",
        is_moe=False,
        is_tied_by_default=True,
        default_expert_layout=None,
        gdn_layout="flat",
        tokenizer_class="Qwen3_5Tokenizer",
    ),
    "moe": VariantSpec(
        name="moe",
        model_type="qwen3_5_moe",
        architecture="Qwen3_5MoeForConditionalGeneration",
        text_model_type="qwen3_5_moe_text",
        is_moe=True,
        is_tied_by_default=False,
        default_expert_layout="fused",
        gdn_layout="flat",
        tokenizer_class="Qwen3_5Tokenizer",
    ),
    "next": VariantSpec(
        name="next",
        model_type="qwen3_next",
        architecture="Qwen3NextForCausalLM",
        text_model_type=None,
        is_moe=True,
        is_tied_by_default=False,
        default_expert_layout="per_expert",
        gdn_layout="interleaved",
        tokenizer_class="Qwen2Tokenizer",
    ),
}


# Vision variants (deltaserve/tiny/vision.py): the text variant's spec under the vision variant's name.
VARIANT_SPECS["dense-vl"] = replace(VARIANT_SPECS["dense"], name="dense-vl")
VARIANT_SPECS["moe-vl"] = replace(VARIANT_SPECS["moe"], name="moe-vl")

# The FP8 gate's variants: the text variants' families at WIDE_SHAPES; trained on the H200 at gate time, not shipped
# (docs/fp8.md#the-fp8-gates-checkpoints-dense-w128-moe-w128-next-w128).
WIDE_VARIANTS: dict[str, str] = {"dense-w128": "dense", "moe-w128": "moe", "next-w128": "next"}  # -> text variant
for _wide, _base in WIDE_VARIANTS.items():
    VARIANT_SPECS[_wide] = replace(VARIANT_SPECS[_base], name=_wide)

# Widths at which every FP8 projection, fused or not, has N and K multiples of 128, as vLLM's block-FP8 kernels
# need (N a multiple of 64, K of 128; a merged projection's parts other than the last a multiple of 128): hidden
# 128; attention q with its gate 4 x 64 x 2 = 512, k = v = 2 x 64 = 128, o K = 256; GDN keys 2 x 64 = 128, values
# 4 x 64 = 256 (in_proj_qkv 512, in_proj_z 256, Next's in_proj_qkvz 768, out_proj K = 256); MLP 256; experts and
# shared expert 128. Four layers (three GDN, one attention) and four experts (top-2) keep the hybrid pattern and
# the routing while keeping the shipped bytes small.
WIDE_SHAPES = TinyShapes(
    num_hidden_layers=4,
    hidden_size=128,
    head_dim=64,
    # rotary_dim 16: 8 frequencies over (T, H, W)
    mrope_section=(3, 3, 2),
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    intermediate_size=256,
    num_experts=4,
    moe_intermediate_size=128,
    shared_expert_intermediate_size=128,
)


def variant_spec(variant: str) -> VariantSpec:
    """The spec of a variant name, with an error that lists the valid names."""
    if variant not in VARIANT_SPECS:
        raise ValueError(f"unknown tiny variant {variant!r}; choose one of {', '.join(VARIANTS)}")
    return VARIANT_SPECS[variant]


def _decoder_fields(shapes: TinyShapes, spec: VariantSpec, vocab_size: int, is_tied: bool) -> dict[str, Any]:
    """Config fields shared by the Qwen3.5 text_config and the flat Qwen3-Next config."""
    fields: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": shapes.hidden_size,
        "num_hidden_layers": shapes.num_hidden_layers,
        "num_attention_heads": shapes.num_attention_heads,
        "num_key_value_heads": shapes.num_key_value_heads,
        "head_dim": shapes.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "full_attention_interval": shapes.full_attention_interval,
        "linear_conv_kernel_dim": shapes.linear_conv_kernel_dim,
        "linear_key_head_dim": shapes.linear_key_head_dim,
        "linear_value_head_dim": shapes.linear_value_head_dim,
        "linear_num_key_heads": shapes.linear_num_key_heads,
        "linear_num_value_heads": shapes.linear_num_value_heads,
        "max_position_embeddings": shapes.max_position_embeddings,
        "rms_norm_eps": shapes.rms_norm_eps,
        "initializer_range": 0.02,
        "use_cache": True,
        "tie_word_embeddings": is_tied,
        "dtype": "bfloat16",
    }
    if spec.is_moe:
        fields.update(
            {
                "num_experts": shapes.num_experts,
                "num_experts_per_tok": shapes.num_experts_per_tok,
                "moe_intermediate_size": shapes.moe_intermediate_size,
                "shared_expert_intermediate_size": shapes.shared_expert_intermediate_size,
                "router_aux_loss_coef": 0.001,
                "output_router_logits": False,
            }
        )
    # Qwen3.5-MoE has no dense MLP anywhere, so (like the release) it carries no intermediate_size; Qwen3-Next
    # carries an unused one.
    if not (spec.is_moe and spec.is_composite):
        fields["intermediate_size"] = shapes.intermediate_size
    return fields


def build_config(
    spec: VariantSpec, shapes: TinyShapes, vocab_size: int, token_ids: dict[str, int], is_tied: bool
) -> dict[str, Any]:
    """The config.json dictionary of one variant; token_ids maps special-token strings to their ids."""
    decoder = _decoder_fields(shapes, spec, vocab_size, is_tied)
    end_of_text_id = token_ids["<|endoftext|>"]
    if not spec.is_composite:
        # Qwen3-Next: flat config, flat RoPE fields, layer_types left for the loader to derive.
        return {
            "architectures": [spec.architecture],
            "model_type": spec.model_type,
            **decoder,
            "rope_theta": shapes.rope_theta,
            "partial_rotary_factor": shapes.partial_rotary_factor,
            "rope_scaling": None,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": True,
            "bos_token_id": end_of_text_id,
            "eos_token_id": token_ids["<|im_end|>"],
        }
    text_config = {
        "model_type": spec.text_model_type,
        **decoder,
        "layer_types": shapes.layer_types,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": shapes.rope_theta,
            "partial_rotary_factor": shapes.partial_rotary_factor,
            "mrope_section": list(shapes.mrope_section),
            "mrope_interleaved": True,
        },
        "mamba_ssm_dtype": "float32",
        "mtp_num_hidden_layers": shapes.num_mtp_layers,
        "mtp_use_dedicated_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": end_of_text_id,
    }
    vision_config = {
        "model_type": "qwen3_5_vision" if spec.model_type == "qwen3_5" else "qwen3_5_moe_vision",
        "depth": shapes.vision_depth,
        "hidden_size": shapes.vision_hidden_size,
        "hidden_act": "gelu_pytorch_tanh",
        "intermediate_size": shapes.vision_intermediate_size,
        "num_heads": shapes.vision_num_heads,
        "in_channels": shapes.vision_in_channels,
        "patch_size": shapes.vision_patch_size,
        "spatial_merge_size": shapes.vision_spatial_merge_size,
        "temporal_patch_size": shapes.vision_temporal_patch_size,
        "out_hidden_size": shapes.hidden_size,
        "num_position_embeddings": shapes.vision_num_position_embeddings,
        "deepstack_visual_indexes": [],
        "initializer_range": 0.02,
    }
    return {
        "architectures": [spec.architecture],
        "model_type": spec.model_type,
        "text_config": text_config,
        "vision_config": vision_config,
        "image_token_id": token_ids["<|image_pad|>"],
        "video_token_id": token_ids["<|video_pad|>"],
        "vision_start_token_id": token_ids["<|vision_start|>"],
        "vision_end_token_id": token_ids["<|vision_end|>"],
        "tie_word_embeddings": is_tied,
        "dtype": "bfloat16",
    }


def build_generation_config(token_ids: dict[str, int]) -> dict[str, Any]:
    """generation_config.json with Qwen's recommended sampling defaults and both stop tokens."""
    end_of_text_id = token_ids["<|endoftext|>"]
    return {
        "bos_token_id": end_of_text_id,
        "pad_token_id": end_of_text_id,
        "eos_token_id": [token_ids["<|im_end|>"], end_of_text_id],
        "do_sample": True,
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
    }
