"""ModelConfig: the decoder's dimensions, parsed once from a Hugging Face config.json.

Supports Qwen3.5/3.6 dense (`qwen3_5`, decoder under `text_config`), MoE (`qwen3_5_moe`), their text-only
forms (`qwen3_5_text`, `qwen3_5_moe_text`, `Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM`) and Qwen3-Next
(flat `qwen3_next`). An unsupported architecture, a missing field or contradictory fields raise ConfigError
naming the field and the file (architecture doc §1).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
    "Qwen3NextForCausalLM": "qwen3_next",
}
SUPPORTED_MODEL_TYPES = {
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
    "qwen3_next": "qwen3_next",
}
LAYER_TYPES = ("linear_attention", "full_attention")


class ConfigError(ValueError):
    """A config.json that deltaserve cannot serve; the message names the field and the file."""


class _Fields:
    """Reads fields from one (possibly nested) config dict, naming the field and file on failure."""

    def __init__(self, data: dict[str, Any], path: Path, prefix: str) -> None:
        self.data, self.path, self.prefix = data, path, prefix

    def name(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def fail(self, key: str, problem: str) -> ConfigError:
        return ConfigError(f"{self.path}: field `{self.name(key)}` {problem}")

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
        if key not in self.data or self.data[key] is None:
            if default is ...:
                raise self.fail(key, "is missing")
            return default
        value = self.data[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise self.fail(key, f"must be {' or '.join(k.__name__ for k in kinds)}, got {value!r}")
        return value

    def positive(self, key: str, default: Any = ...) -> int:
        value = self.get(key, int, default)
        if value <= 0:
            raise self.fail(key, f"must be positive, got {value}")
        return value


@dataclass(frozen=True)
class ModelConfig:
    path: Path
    family: str  # qwen3_5, qwen3_5_moe or qwen3_next
    architecture: str
    is_multimodal: bool
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    # gated full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    mrope_section: tuple[int, int, int] | None
    # Gated DeltaNet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    is_gdn_interleaved: bool  # Qwen3-Next's group-interleaved in_proj_qkvz / in_proj_ba
    ssm_state_dtype: str
    # MLP / MoE
    intermediate_size: int
    is_moe: bool
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[bool, ...] = field(default=())
    dtype: str = "bfloat16"
    eos_token_ids: tuple[int, ...] = ()
    vision: VisionConfig | None = None  # the vision tower's config, when the checkpoint has a vision_config

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.value_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def full_attention_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_types) if kind == "full_attention"]

    @property
    def linear_attention_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_types) if kind == "linear_attention"]

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path}: no config.json in the model folder")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON ({exc})") from exc
        return cls.from_dict(data, path)

    @classmethod
    def from_dict(cls, data: dict[str, Any], path: Path) -> ModelConfig:
        top = _Fields(data, path, "")
        architectures = top.get("architectures", list, default=[])
        model_type = top.get("model_type", str, default=None)
        family = None
        architecture = architectures[0] if architectures else ""
        if architectures:
            if architecture not in SUPPORTED_ARCHITECTURES:
                raise top.fail(
                    "architectures",
                    f"names {architecture!r}, which deltaserve does not support "
                    f"(supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))})",
                )
            family = SUPPORTED_ARCHITECTURES[architecture]
        if model_type is not None:
            if model_type not in SUPPORTED_MODEL_TYPES:
                raise top.fail(
                    "model_type",
                    f"is {model_type!r}, which deltaserve does not support "
                    f"(supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))})",
                )
            if family is not None and SUPPORTED_MODEL_TYPES[model_type] != family:
                raise top.fail("model_type", f"is {model_type!r}, which contradicts architectures {architecture!r}")
            family = SUPPORTED_MODEL_TYPES[model_type]
        if family is None:
            raise top.fail("architectures", "and `model_type` are both missing")

        is_multimodal = "text_config" in data
        text = _Fields(data["text_config"], path, "text_config.") if is_multimodal else top
        if is_multimodal and not isinstance(data["text_config"], dict):
            raise top.fail("text_config", "must be an object")
        if family == "qwen3_next" and is_multimodal:
            raise top.fail("text_config", "is not expected in a flat qwen3_next config")
        if is_multimodal and model_type in ("qwen3_5_text", "qwen3_5_moe_text"):
            raise top.fail("model_type", f"is {model_type!r} (a bare text config) but the file has a text_config")

        num_layers = text.positive("num_hidden_layers")
        layer_types = _layer_types(text, num_layers)
        hidden = text.positive("hidden_size")
        num_heads = text.positive("num_attention_heads")
        num_kv_heads = text.positive("num_key_value_heads")
        if num_heads % num_kv_heads:
            raise text.fail("num_key_value_heads", f"({num_kv_heads}) must divide num_attention_heads ({num_heads})")
        head_dim = text.positive("head_dim", default=hidden // num_heads)
        rope = text.get("rope_parameters", dict, default=None) or text.get("rope_scaling", dict, default=None) or {}
        rope_fields = _Fields(rope, path, text.name("rope_parameters."))
        partial = rope_fields.get("partial_rotary_factor", float, default=text.get("partial_rotary_factor", float, 1.0))
        rotary_dim = int(head_dim * partial)
        if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
            raise text.fail(
                "partial_rotary_factor", f"gives rotary_dim {rotary_dim}, which must be even and <= head_dim"
            )
        rope_theta = rope_fields.get("rope_theta", float, default=text.get("rope_theta", float, 10000.0))
        rope_type = rope_fields.get("rope_type", str, default=rope_fields.get("type", str, "default"))
        if rope_type not in ("default", "mrope"):
            raise rope_fields.fail("rope_type", f"is {rope_type!r}; only default RoPE is supported")
        mrope_section = rope_fields.get("mrope_section", list, default=None)
        if mrope_section is not None:
            if len(mrope_section) != 3 or sum(mrope_section) != rotary_dim // 2:
                raise rope_fields.fail(
                    "mrope_section", f"{mrope_section} must have 3 entries summing to rotary_dim/2 = {rotary_dim // 2}"
                )
            if rope_fields.get("mrope_interleaved", bool, default=True) is False:
                raise rope_fields.fail("mrope_interleaved", "is false; only interleaved MRoPE is supported")
            if architecture in ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"):
                # vLLM drops MRoPE for the text-only architectures: plain 1-D RoPE (architecture doc §1.1).
                mrope_section = None
        num_k_heads = text.positive("linear_num_key_heads")
        num_v_heads = text.positive("linear_num_value_heads")
        if num_v_heads % num_k_heads:
            raise text.fail(
                "linear_num_value_heads", f"({num_v_heads}) must be a multiple of linear_num_key_heads ({num_k_heads})"
            )
        if text.get("attn_output_gate", bool, default=True) is False:
            raise text.fail("attn_output_gate", "is false; deltaserve implements the gated attention of these models")

        is_moe = family != "qwen3_5"
        moe_kwargs: dict[str, Any] = {}
        moe_layers = tuple(False for _ in range(num_layers))
        if is_moe:
            num_experts = text.positive("num_experts")
            top_k = text.positive("num_experts_per_tok")
            if top_k > num_experts:
                raise text.fail("num_experts_per_tok", f"({top_k}) exceeds num_experts ({num_experts})")
            step = text.positive("decoder_sparse_step", default=1)
            mlp_only = set(text.get("mlp_only_layers", list, default=[]))
            moe_layers = tuple(i not in mlp_only and (i + 1) % step == 0 for i in range(num_layers))
            moe_kwargs = {
                "num_experts": num_experts,
                "num_experts_per_tok": top_k,
                "moe_intermediate_size": text.positive("moe_intermediate_size"),
                "shared_expert_intermediate_size": text.get("shared_expert_intermediate_size", int, 0),
                "norm_topk_prob": text.get("norm_topk_prob", bool, default=True),
            }
        needs_dense = not is_moe or not all(moe_layers)
        intermediate = text.positive("intermediate_size") if needs_dense else text.get("intermediate_size", int, 0)
        tied = bool(data.get("tie_word_embeddings", text.get("tie_word_embeddings", bool, False)))
        eos = text.get("eos_token_id", (int, list), default=top.get("eos_token_id", (int, list), default=[]))
        ssm_dtype = text.get("mamba_ssm_dtype", str, default="float32")
        return cls(
            vision=parse_vision_config(data, path, hidden) if isinstance(data.get("vision_config"), dict) else None,
            path=path.parent,
            family=family,
            architecture=architecture or family,
            is_multimodal=is_multimodal,
            hidden_size=hidden,
            num_hidden_layers=num_layers,
            layer_types=layer_types,
            vocab_size=text.positive("vocab_size"),
            rms_norm_eps=text.get("rms_norm_eps", float, default=1e-6),
            tie_word_embeddings=tied,
            max_position_embeddings=text.positive("max_position_embeddings"),
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            rotary_dim=rotary_dim,
            rope_theta=rope_theta,
            mrope_section=tuple(mrope_section) if mrope_section else None,
            linear_num_key_heads=num_k_heads,
            linear_num_value_heads=num_v_heads,
            linear_key_head_dim=text.positive("linear_key_head_dim"),
            linear_value_head_dim=text.positive("linear_value_head_dim"),
            linear_conv_kernel_dim=text.positive("linear_conv_kernel_dim"),
            is_gdn_interleaved=family == "qwen3_next",
            ssm_state_dtype=ssm_dtype,
            intermediate_size=intermediate,
            is_moe=is_moe,
            moe_layers=moe_layers,
            dtype=str(text.get("dtype", str, default=top.get("torch_dtype", str, default="bfloat16"))),
            eos_token_ids=tuple([eos] if isinstance(eos, int) else eos),
            **moe_kwargs,
        )


def _layer_types(text: _Fields, num_layers: int) -> tuple[str, ...]:
    interval = text.get("full_attention_interval", int, default=None)
    derived = None
    if interval is not None:
        if interval <= 0:
            raise text.fail("full_attention_interval", f"must be positive, got {interval}")
        derived = tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers))
    given = text.get("layer_types", list, default=None)
    if given is None:
        return derived or tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers))
    if len(given) != num_layers:
        raise text.fail("layer_types", f"has {len(given)} entries but num_hidden_layers is {num_layers}")
    for kind in given:
        if kind not in LAYER_TYPES:
            raise text.fail("layer_types", f"contains {kind!r}; expected linear_attention or full_attention")
    if derived is not None and tuple(given) != derived:
        raise text.fail("layer_types", f"contradicts full_attention_interval ({interval})")
    return tuple(given)


# ---- vision tower (multimodal doc §4.1); read only when the checkpoint has a vision_config ----

VISION_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    hidden_act: str
    rope_theta: float
    # placeholder and delimiter token ids (top level of config.json; transformers' defaults are Qwen3.5's)
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size

    @property
    def num_grid_per_side(self) -> int:
        return math.isqrt(self.num_position_embeddings)


def parse_vision_config(data: dict[str, Any], path: Path, text_hidden_size: int) -> VisionConfig:
    """VisionConfig from config.json's vision_config, with transformers' Qwen3_5VisionConfig defaults; a field
    deltaserve cannot honour is refused by name."""
    top = _Fields(data, path, "")
    vision = _Fields(data["vision_config"], path, "vision_config.")
    for key in ("patch_size", "temporal_patch_size"):
        if isinstance(vision.data.get(key), list):
            raise vision.fail(key, "is a list; only square patches with one size are supported")
    hidden = vision.positive("hidden_size", default=1152)
    num_heads = vision.positive("num_heads", default=16)
    if hidden % num_heads or (hidden // num_heads) % 4:
        raise vision.fail("num_heads", f"({num_heads}) must split hidden_size ({hidden}) into heads of a multiple of 4")
    num_positions = vision.positive("num_position_embeddings", default=2304)
    if math.isqrt(num_positions) ** 2 != num_positions:
        raise vision.fail("num_position_embeddings", f"({num_positions}) must be a perfect square (a square grid)")
    act = vision.get("hidden_act", str, default="gelu_pytorch_tanh")
    if act not in VISION_ACTIVATIONS:
        raise vision.fail("hidden_act", f"is {act!r}; the vision tower supports {', '.join(VISION_ACTIVATIONS)}")
    out_hidden = vision.positive("out_hidden_size", default=3584)
    if out_hidden != text_hidden_size:
        raise vision.fail("out_hidden_size", f"({out_hidden}) must equal the decoder's hidden_size {text_hidden_size}")
    deepstack = vision.get("deepstack_visual_indexes", list, default=[])
    if deepstack:
        # Qwen3.5/3.6 have no deepstack mergers (doc §4.7): a non-empty list names tensors these models lack.
        raise vision.fail("deepstack_visual_indexes", f"is {deepstack}; Qwen3.5/3.6 vision towers have no deepstack")
    rope = vision.get("rope_parameters", dict, default=None) or {}
    rope_fields = _Fields(rope, path, "vision_config.rope_parameters.")
    rope_type = rope_fields.get("rope_type", str, default="axial")
    if rope_type not in ("axial", "default"):
        raise rope_fields.fail("rope_type", f"is {rope_type!r}; the vision tower implements axial 2-D RoPE")
    return VisionConfig(
        depth=vision.positive("depth", default=27),
        hidden_size=hidden,
        intermediate_size=vision.positive("intermediate_size", default=4304),
        num_heads=num_heads,
        in_channels=vision.positive("in_channels", default=3),
        patch_size=vision.positive("patch_size", default=16),
        temporal_patch_size=vision.positive("temporal_patch_size", default=2),
        spatial_merge_size=vision.positive("spatial_merge_size", default=2),
        out_hidden_size=out_hidden,
        num_position_embeddings=num_positions,
        hidden_act=act,
        rope_theta=rope_fields.get("rope_theta", float, default=10000.0),
        image_token_id=top.get("image_token_id", int, default=248056),
        video_token_id=top.get("video_token_id", int, default=248057),
        vision_start_token_id=top.get("vision_start_token_id", int, default=248053),
        vision_end_token_id=top.get("vision_end_token_id", int, default=248054),
    )
