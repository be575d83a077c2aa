"""ModelConfig: the decoder's dimensions and numerics choices, parsed once from a Hugging Face config.json.

Supports Qwen3.5/3.6 dense (`qwen3_5`, decoder under `text_config`), MoE (`qwen3_5_moe`), their text-only
forms (`qwen3_5_text`, `qwen3_5_moe_text`, `Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM`) and Qwen3-Next
(flat `qwen3_next`) (docs/ARCHITECTURE.md#configs-and-checkpoint-layout).

Every field that changes the computation is either honoured, with transformers' own default when it is absent
(TEXT_DEFAULTS, read from transformers' configuration classes), or refused with a ConfigError naming the field,
its value and the file. Where transformers and vLLM disagree the choice is stated in a comment below and, when a
checkpoint hits it, in `notes` (which the load report and the engine's log line carry).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from deltaserve.fp8_format import Fp8BlockFormat, read_fp8_format

SUPPORTED_ARCHITECTURES = {
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
    "Qwen3NextForCausalLM": "qwen3_next",
}
TEXT_ONLY_ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")
SUPPORTED_MODEL_TYPES = {
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
    "qwen3_next": "qwen3_next",
}
COMPOSITE_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")
LAYER_TYPES = ("linear_attention", "full_attention")

# transformers 5.24's dataclass defaults of Qwen3_5TextConfig, Qwen3_5MoeTextConfig and Qwen3NextConfig
# (models/{qwen3_5,qwen3_5_moe,qwen3_next}/configuration_*.py); a field absent from config.json takes these, as
# transformers does. tests/model/test_config_defaults.py checks the table against the installed classes.
_COMMON_DEFAULTS: dict[str, Any] = {
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "head_dim": 256,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    # set in each class's __post_init__: kwargs.setdefault("partial_rotary_factor", 0.25), interval 4; the theta
    # default is RotaryEmbeddingConfigMixin.default_theta
    "partial_rotary_factor": 0.25,
    "full_attention_interval": 4,
    "rope_theta": 10000.0,
}
TEXT_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_5": {
        **_COMMON_DEFAULTS,
        "vocab_size": 248320,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 32,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
    },
    "qwen3_5_moe": {
        **_COMMON_DEFAULTS,
        "vocab_size": 248320,
        "hidden_size": 2048,
        "num_hidden_layers": 40,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "num_experts_per_tok": 8,
        "num_experts": 256,
    },
    "qwen3_next": {
        **_COMMON_DEFAULTS,
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 48,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "decoder_sparse_step": 1,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "num_experts_per_tok": 10,
        "num_experts": 512,
        "norm_topk_prob": True,
        "mlp_only_layers": [],
    },
}
# transformers' Qwen3_5TextRotaryEmbedding: config.rope_parameters.get("mrope_section", [11, 11, 10])
DEFAULT_MROPE_SECTION = (11, 11, 10)
# The activations deltaserve's kernels implement. transformers applies hidden_act in every MLP and after the GDN
# conv (ACT2FN: "swish" is nn.SiLU, the same function); vLLM supports only silu here (Qwen2MoeMLP raises on
# anything else), so other activations are refused by name rather than served with SiLU.
SILU_NAMES = ("silu", "swish")
WEIGHT_DTYPES = ("float32", "float16", "bfloat16", "float64")
SSM_STATE_DTYPES = ("float32", "bfloat16", "float16")
UNSUPPORTED_ROPE_TYPES = ("linear", "dynamic", "yarn", "longrope", "llama3", "proportional")


class ConfigError(ValueError):
    """A config.json that deltaserve cannot serve; the message names the field and the file."""


class _Fields:
    """Reads fields from one (possibly nested) config dict, naming the field and file on failure, and records which
    fields were absent and took transformers' default."""

    def __init__(
        self, data: dict[str, Any], path: Path, prefix: str, defaults: dict[str, Any], defaulted: list[str]
    ) -> None:
        self.data, self.path, self.prefix = data, path, prefix
        self.defaults, self.defaulted = defaults, defaulted

    def name(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def fail(self, key: str, problem: str) -> ConfigError:
        return ConfigError(f"{self.path}: field `{self.name(key)}` {problem}")

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

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

    def tf(self, key: str, kind: type | tuple[type, ...]) -> Any:
        """The field, or transformers' default for this family when it is absent (recorded for the load report)."""
        if not self.has(key):
            self.defaulted.append(f"{self.name(key)}={self.defaults[key]!r}")
        return self.get(key, kind, default=self.defaults[key])

    def positive(self, key: str) -> int:
        value = self.tf(key, int)
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
    tie_word_embeddings: bool  # some tie flag says tied: the model is built tied; the loader unties on lm_head.weight
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
    has_attention_bias: bool = False  # q/k/v/o projection biases (transformers' attention_bias)
    dtype: str = "bfloat16"
    eos_token_ids: tuple[int, ...] = ()
    vision: VisionConfig | None = None  # the vision tower's config, when the checkpoint has a vision_config
    model_max_length: int | None = None  # config.json's own model_max_length (vLLM lets it admit longer requests)
    # (field name, value) of each tie flag the config carries, for the loader's messages
    tie_flags: tuple[tuple[str, bool], ...] = ()
    # MTP layers the checkpoint declares, as vLLM reads them: `mtp_num_hidden_layers` (Qwen3.5 / 3.6; absent: none)
    # or Qwen3-Next's `num_nextn_predict_layers` (absent: vLLM's 1). The field named is kept for messages.
    mtp_num_hidden_layers: int = 0
    mtp_field: str = "mtp_num_hidden_layers"
    # decisions a reader of the load report should see (defaults taken, fields ignored, transformers/vLLM choices)
    notes: tuple[str, ...] = ()
    # the block-FP8 format of a Qwen -FP8 release (docs/fp8.md): its projections are built as Fp8Weight
    fp8: Fp8BlockFormat | None = None

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

    @property
    def config_file(self) -> Path:
        return self.path / "config.json"

    def with_max_model_len(self, max_model_len: int) -> ModelConfig:
        """This config with a RoPE table long enough for max_model_len positions (for a max_model_len above
        max_position_embeddings, which resolve_max_model_len admits only under VLLM_ALLOW_LONG_MAX_MODEL_LEN)."""
        if max_model_len <= self.max_position_embeddings:
            return self
        return replace(self, max_position_embeddings=max_model_len)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path}: no config.json in the model folder")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: not valid JSON ({exc})") from exc
        except OSError as exc:
            raise ConfigError(f"{path}: cannot be read ({exc})") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: must hold a JSON object, got {type(data).__name__}")
        return cls.from_dict(data, path)

    @classmethod
    def from_dict(cls, data: dict[str, Any], path: Path) -> ModelConfig:
        notes: list[str] = []
        defaulted: list[str] = []
        family, architecture, model_type = _family(data, path)
        top = _Fields(data, path, "", TEXT_DEFAULTS[family], defaulted)
        is_multimodal = "text_config" in data
        if is_multimodal and not isinstance(data["text_config"], dict):
            raise top.fail("text_config", f"must be an object, got {data['text_config']!r}")
        if family == "qwen3_next" and is_multimodal:
            raise top.fail("text_config", "is not expected in a flat qwen3_next config")
        if is_multimodal and model_type in ("qwen3_5_text", "qwen3_5_moe_text"):
            raise top.fail("model_type", f"is {model_type!r} (a bare text config) but the file has a text_config")
        if not is_multimodal and model_type in COMPOSITE_MODEL_TYPES:
            # transformers would build its default (9B / 35B-A3B) decoder from a composite config without one
            raise top.fail("text_config", f"is missing, and model_type {model_type!r} keeps the decoder there")
        text = (
            _Fields(data["text_config"], path, "text_config.", TEXT_DEFAULTS[family], defaulted)
            if is_multimodal
            else top
        )
        fp8 = None
        for fields in (top, text) if is_multimodal else (top,):
            fp8 = _read_quantization(fields) or fp8

        num_layers = text.positive("num_hidden_layers")
        layer_types = _layer_types(text, num_layers, notes)
        hidden = text.positive("hidden_size")
        num_heads = text.positive("num_attention_heads")
        num_kv_heads = text.positive("num_key_value_heads")
        if num_heads % num_kv_heads:
            raise text.fail("num_key_value_heads", f"({num_kv_heads}) must divide num_attention_heads ({num_heads})")
        if "head_dim" in text.data and text.data["head_dim"] is None:
            # transformers reads getattr(config, "head_dim", ...) and gets None: its attention cannot be built
            raise text.fail("head_dim", "is null; give the per-head width (transformers' default is 256 when absent)")
        head_dim = text.positive("head_dim")
        _check_silu(text)
        attention_bias = text.tf("attention_bias", bool)
        if text.get("qkv_bias", bool, default=False) and not attention_bias:
            # vLLM's Qwen3NextAttention reads qkv_bias, transformers reads only attention_bias: the two disagree
            raise text.fail("qkv_bias", "is true but attention_bias is not: transformers would drop the q/k/v biases")
        if text.get("attn_output_gate", bool, default=True) is False:
            # transformers always gates (and ignores the flag); vLLM reads it and halves q_proj: refuse the conflict
            raise text.fail("attn_output_gate", "is false; deltaserve implements the gated attention of these models")
        rotary_dim, rope_theta, mrope_section = _rope(text, head_dim, architecture, is_multimodal, notes)
        num_k_heads = text.positive("linear_num_key_heads")
        num_v_heads = text.positive("linear_num_value_heads")
        if num_v_heads % num_k_heads:
            raise text.fail(
                "linear_num_value_heads", f"({num_v_heads}) must be a multiple of linear_num_key_heads ({num_k_heads})"
            )
        rms_norm_eps = text.tf("rms_norm_eps", float)
        if rms_norm_eps <= 0:
            raise text.fail("rms_norm_eps", f"must be positive, got {rms_norm_eps}")
        moe_kwargs, moe_layers, needs_dense = _moe(family, text, num_layers, notes)
        intermediate = text.positive("intermediate_size") if needs_dense else 0
        tied, tie_flags = _tie_flags(top, text, is_multimodal, notes)
        eos = text.get("eos_token_id", (int, list), default=top.get("eos_token_id", (int, list), default=[]))
        ssm_dtype = text.get("mamba_ssm_dtype", str, default="float32")
        if ssm_dtype not in SSM_STATE_DTYPES:
            raise text.fail("mamba_ssm_dtype", f"is {ssm_dtype!r}; expected one of {', '.join(SSM_STATE_DTYPES)}")
        if ssm_dtype != "float32":
            # vLLM copies mamba_ssm_dtype into its SSM cache dtype; transformers ignores it (fp32 state). The field
            # exists only for vLLM, so its intent is the vLLM reading.
            notes.append(
                f"`{text.name('mamba_ssm_dtype')}` is {ssm_dtype!r}: the GDN recurrent state is kept in {ssm_dtype} "
                "as vLLM does (transformers keeps it in float32)"
            )
        vocab_size = text.positive("vocab_size")
        max_positions = text.positive("max_position_embeddings")
        key_head_dim, value_head_dim = text.positive("linear_key_head_dim"), text.positive("linear_value_head_dim")
        conv_kernel = text.positive("linear_conv_kernel_dim")
        mtp_key = "num_nextn_predict_layers" if family == "qwen3_next" else "mtp_num_hidden_layers"
        num_mtp = text.get(mtp_key, int, default=1 if family == "qwen3_next" else 0)
        if num_mtp < 0:
            raise text.fail(mtp_key, f"must be 0 or more, got {num_mtp}")
        if defaulted:
            notes.insert(0, "absent from config.json, transformers' defaults used: " + ", ".join(defaulted))
        return cls(
            vision=parse_vision_config(data, path, hidden) if isinstance(data.get("vision_config"), dict) else None,
            path=path.parent,
            family=family,
            architecture=architecture or family,
            is_multimodal=is_multimodal,
            hidden_size=hidden,
            num_hidden_layers=num_layers,
            layer_types=layer_types,
            vocab_size=vocab_size,
            rms_norm_eps=rms_norm_eps,
            tie_word_embeddings=tied,
            max_position_embeddings=max_positions,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            rotary_dim=rotary_dim,
            rope_theta=rope_theta,
            mrope_section=mrope_section,
            linear_num_key_heads=num_k_heads,
            linear_num_value_heads=num_v_heads,
            linear_key_head_dim=key_head_dim,
            linear_value_head_dim=value_head_dim,
            linear_conv_kernel_dim=conv_kernel,
            is_gdn_interleaved=family == "qwen3_next",
            ssm_state_dtype=ssm_dtype,
            intermediate_size=intermediate,
            is_moe=any(moe_layers),
            moe_layers=moe_layers,
            has_attention_bias=attention_bias,
            dtype=_weight_dtype(top, text),
            eos_token_ids=tuple([eos] if isinstance(eos, int) else eos),
            model_max_length=text.get("model_max_length", int, default=top.get("model_max_length", int, default=None)),
            tie_flags=tie_flags,
            mtp_num_hidden_layers=num_mtp,
            mtp_field=text.name(mtp_key),
            notes=tuple(notes),
            fp8=fp8,
            **moe_kwargs,
        )


def _family(data: dict[str, Any], path: Path) -> tuple[str, str, str | None]:
    """(family, architecture, model_type) from `architectures` and `model_type`, which must agree."""
    top = _Fields(data, path, "", {}, [])
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
    return family, architecture, model_type


def _read_quantization(fields: _Fields) -> Fp8BlockFormat | None:
    """The block-FP8 format of Qwen's -FP8 releases when `fields` carries its quantization_config (fp8_format.py,
    docs/fp8.md); every other quantization method or FP8 variant, and a compressed-tensors compression_config, is
    refused by its field and value."""
    if fields.has("compression_config"):
        value = fields.data["compression_config"]
        method = value.get("quant_method", value.get("format")) if isinstance(value, dict) else value
        raise fields.fail(
            "compression_config", f"is present (compressed-tensors, {method!r}): deltaserve reads only the block "
            "FP8 quantization_config of Qwen's -FP8 releases (docs/fp8.md)",
        )  # fmt: skip
    if not fields.has("quantization_config"):
        return None
    key = fields.name("quantization_config")

    def fail(field: str, problem: str) -> ConfigError:
        return ConfigError(f"{fields.path}: field `{key}{'.' + field if field else ''}` {problem}")

    return read_fp8_format(fields.data["quantization_config"], fail)


def _check_silu(text: _Fields) -> None:
    act = text.tf("hidden_act", str)
    if act not in SILU_NAMES:
        raise text.fail(
            "hidden_act",
            f"is {act!r}: transformers applies it in every MLP and after the GDN conv, and deltaserve's kernels "
            "implement SiLU only (as vLLM's do)",
        )
    gate_type = text.get("output_gate_type", str, default="silu")
    if gate_type not in SILU_NAMES:
        # transformers hard-codes SiLU in the GDN gated norm; vLLM reads output_gate_type (and allows sigmoid)
        raise text.fail(
            "output_gate_type", f"is {gate_type!r}; transformers and deltaserve gate the GDN norm with SiLU"
        )


def _layer_types(text: _Fields, num_layers: int, notes: list[str]) -> tuple[str, ...]:
    """transformers' rule: layer_types when given; else full attention every full_attention_interval-th layer."""
    given = text.get("layer_types", list, default=None)
    if given is None:
        interval = text.tf("full_attention_interval", int)
        if interval <= 0:
            raise text.fail("full_attention_interval", f"must be positive, got {interval}")
        return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers))
    if len(given) != num_layers:
        raise text.fail("layer_types", f"has {len(given)} entries but num_hidden_layers is {num_layers}")
    for kind in given:
        if kind not in LAYER_TYPES:
            raise text.fail("layer_types", f"contains {kind!r}; expected linear_attention or full_attention")
    interval = text.get("full_attention_interval", int, default=None)
    if interval is not None and interval > 0:
        derived = tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers))
        if tuple(given) != derived:
            # transformers (and vLLM) build the layers from layer_types and never read the interval then
            notes.append(
                f"`{text.name('layer_types')}` contradicts `{text.name('full_attention_interval')}` ({interval}): "
                "layer_types is used, as transformers and vLLM do"
            )
    return tuple(given)


# ---- vision tower (docs/multimodal.md#the-vision-tower); read only when the checkpoint has a vision_config ----

VISION_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")
# transformers' Qwen3_5VisionConfig defaults
VISION_DEFAULTS: dict[str, Any] = {
    "hidden_size": 1152,
    "num_heads": 16,
    "num_position_embeddings": 2304,
    "out_hidden_size": 3584,
    "depth": 27,
    "intermediate_size": 4304,
    "in_channels": 3,
    "patch_size": 16,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
}


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
    top = _Fields(data, path, "", {}, [])
    vision = _Fields(data["vision_config"], path, "vision_config.", VISION_DEFAULTS, [])
    for key in ("patch_size", "temporal_patch_size"):
        if isinstance(vision.data.get(key), list):
            raise vision.fail(key, "is a list; only square patches with one size are supported")
    hidden = vision.positive("hidden_size")
    num_heads = vision.positive("num_heads")
    if hidden % num_heads or (hidden // num_heads) % 4:
        raise vision.fail("num_heads", f"({num_heads}) must split hidden_size ({hidden}) into heads of a multiple of 4")
    num_positions = vision.positive("num_position_embeddings")
    if math.isqrt(num_positions) ** 2 != num_positions:
        raise vision.fail("num_position_embeddings", f"({num_positions}) must be a perfect square (a square grid)")
    act = vision.get("hidden_act", str, default="gelu_pytorch_tanh")
    if act not in VISION_ACTIVATIONS:
        raise vision.fail("hidden_act", f"is {act!r}; the vision tower supports {', '.join(VISION_ACTIVATIONS)}")
    out_hidden = vision.positive("out_hidden_size")
    if out_hidden != text_hidden_size:
        raise vision.fail("out_hidden_size", f"({out_hidden}) must equal the decoder's hidden_size {text_hidden_size}")
    deepstack = vision.get("deepstack_visual_indexes", list, default=[])
    if deepstack:
        # Qwen3.5/3.6 have no deepstack mergers (docs/multimodal.md#the-vision-tower): a non-empty list names tensors
        # these models lack.
        raise vision.fail("deepstack_visual_indexes", f"is {deepstack}; Qwen3.5/3.6 vision towers have no deepstack")
    rope = vision.get("rope_parameters", dict, default=None) or {}
    rope_fields = _Fields(rope, path, "vision_config.rope_parameters.", {}, [])
    rope_type = rope_fields.get("rope_type", str, default="axial")
    if rope_type not in ("axial", "default"):
        raise rope_fields.fail("rope_type", f"is {rope_type!r}; the vision tower implements axial 2-D RoPE")
    return VisionConfig(
        depth=vision.positive("depth"),
        hidden_size=hidden,
        intermediate_size=vision.positive("intermediate_size"),
        num_heads=num_heads,
        in_channels=vision.positive("in_channels"),
        patch_size=vision.positive("patch_size"),
        temporal_patch_size=vision.positive("temporal_patch_size"),
        spatial_merge_size=vision.positive("spatial_merge_size"),
        out_hidden_size=out_hidden,
        num_position_embeddings=num_positions,
        hidden_act=act,
        rope_theta=rope_fields.get("rope_theta", float, default=10000.0),
        image_token_id=top.get("image_token_id", int, default=248056),
        video_token_id=top.get("video_token_id", int, default=248057),
        vision_start_token_id=top.get("vision_start_token_id", int, default=248053),
        vision_end_token_id=top.get("vision_end_token_id", int, default=248054),
    )


def _rope(
    text: _Fields, head_dim: int, architecture: str, is_multimodal: bool, notes: list[str]
) -> tuple[int, float, tuple[int, int, int] | None]:
    """(rotary_dim, rope_theta, mrope_section) by transformers' RoPE standardisation (modeling_rope_utils
    convert_rope_params_to_dict): rope_scaling, when truthy, replaces rope_parameters; a key inside that dict wins
    over the flat field of the same name, which wins over the default (partial 0.25, theta 10000)."""
    key = "rope_scaling" if text.get("rope_scaling", dict, default=None) else "rope_parameters"
    rope = text.get(key, dict, default=None) or {}
    prefix = text.name(key + ".")
    nested = [kind for kind in LAYER_TYPES if isinstance(rope.get(kind), dict)]
    if nested:
        # rope_parameters keyed by layer type: only the full-attention layers rotate
        if "full_attention" not in nested:
            raise text.fail(key, f"is keyed by layer type ({', '.join(nested)}) but has no full_attention entry")
        rope, prefix = rope["full_attention"], prefix + "full_attention."
    fields = _Fields(rope, text.path, prefix, {}, [])
    how = ""
    if fields.has("partial_rotary_factor"):
        partial, partial_name = fields.get("partial_rotary_factor", float), fields.name("partial_rotary_factor")
    elif text.has("partial_rotary_factor"):
        partial, partial_name = text.get("partial_rotary_factor", float), text.name("partial_rotary_factor")
    else:
        partial, partial_name, how = 0.25, fields.name("partial_rotary_factor"), " (absent: transformers' default)"
        text.defaulted.append(f"{partial_name}=0.25")
    rotary_dim = int(head_dim * partial)
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        head_how = "" if text.has("head_dim") else " (absent: transformers' default)"
        raise ConfigError(
            f"{text.path}: field `{partial_name}`{how} is {partial}, which with `{text.name('head_dim')}`{head_how} "
            f"{head_dim} gives rotary_dim int({head_dim} * {partial}) = {rotary_dim}; it must be even, positive and "
            "at most head_dim"
        )
    if fields.has("rope_theta"):
        theta = fields.get("rope_theta", float)
    else:
        theta = text.tf("rope_theta", float)
    if theta <= 0:
        raise fields.fail("rope_theta", f"must be positive, got {theta}")
    rope_type = fields.get("rope_type", str, default=fields.get("type", str, default="default"))
    if rope_type in UNSUPPORTED_ROPE_TYPES or rope_type not in ("default", "mrope"):
        raise fields.fail("rope_type", f"is {rope_type!r}; deltaserve implements only default (unscaled) RoPE")
    if architecture in TEXT_ONLY_ARCHITECTURES or not is_multimodal:
        # vLLM drops MRoPE for the text-only architectures (docs/ARCHITECTURE.md#positions-and-mrope); text
        # positions are equal on all three axes, so transformers' MRoPE gives the same rotation there.
        return rotary_dim, theta, None
    section = fields.get("mrope_section", list, default=list(DEFAULT_MROPE_SECTION))
    if len(section) != 3 or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in section):
        raise fields.fail("mrope_section", f"is {section}; expected 3 non-negative frequency counts (T, H, W)")
    if fields.has("mrope_section") and sum(section) != rotary_dim // 2:
        # transformers' interleaved assignment (H if j%3==1 and j<3*s_h, W if j%3==2 and j<3*s_w, else T) is defined
        # for any counts; only image positions can tell the difference
        notes.append(
            f"`{fields.name('mrope_section')}` {section} sums to {sum(section)}, not rotary_dim/2 = {rotary_dim // 2}: "
            "frequencies are assigned to axes by transformers' interleaved rule"
        )
    if fields.get("mrope_interleaved", bool, default=True) is False:
        # transformers always interleaves (it never reads the flag); vLLM would use contiguous sections
        raise fields.fail("mrope_interleaved", "is false; transformers and deltaserve implement interleaved MRoPE")
    return rotary_dim, theta, (section[0], section[1], section[2])


def _moe(
    family: str, text: _Fields, num_layers: int, notes: list[str]
) -> tuple[dict[str, Any], tuple[bool, ...], bool]:
    """(MoE fields, which layers are MoE, whether some layer needs the dense intermediate_size)."""
    if family == "qwen3_5":
        return {}, tuple(False for _ in range(num_layers)), True
    if family == "qwen3_next":
        num_experts = text.tf("num_experts", int)
        if num_experts < 0:
            raise text.fail("num_experts", f"must be non-negative, got {num_experts}")
        step = text.positive("decoder_sparse_step")
        mlp_only = text.tf("mlp_only_layers", list)
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in mlp_only):
            raise text.fail("mlp_only_layers", f"must be a list of layer indices, got {mlp_only}")
        # Qwen3NextDecoderLayer: MoE iff i not in mlp_only_layers and num_experts > 0 and (i + 1) % step == 0
        moe_layers = tuple(i not in mlp_only and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers))
        norm_topk_prob = text.tf("norm_topk_prob", bool)
    else:
        num_experts = text.positive("num_experts")
        # Qwen3_5MoeDecoderLayer makes every layer MoE and never reads these (vLLM's Qwen3.5 layer neither)
        for key, trivial in (("mlp_only_layers", []), ("decoder_sparse_step", 1)):
            if text.has(key) and text.data[key] != trivial:
                notes.append(f"`{text.name(key)}` ({text.data[key]!r}) is ignored: every Qwen3.5-MoE layer is MoE, "
                             "as in transformers and vLLM")  # fmt: skip
        moe_layers = tuple(True for _ in range(num_layers))
        if text.get("norm_topk_prob", bool, default=True) is False:
            # transformers' Qwen3_5MoeTopKRouter always renormalises; vLLM would honour false: refuse the conflict
            raise text.fail("norm_topk_prob", "is false; transformers' Qwen3.5-MoE router always renormalises top-k")
        norm_topk_prob = True
    if not any(moe_layers):
        return {}, moe_layers, True
    top_k = text.positive("num_experts_per_tok")
    if top_k > num_experts:
        raise text.fail("num_experts_per_tok", f"({top_k}) exceeds num_experts ({num_experts})")
    shared = text.tf("shared_expert_intermediate_size", int)
    if shared < 0:
        raise text.fail("shared_expert_intermediate_size", f"must be non-negative, got {shared}")
    kwargs = {
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": text.positive("moe_intermediate_size"),
        # 0: transformers' zero-width shared expert adds exactly 0; vLLM builds none
        "shared_expert_intermediate_size": shared,
        "norm_topk_prob": norm_topk_prob,
    }
    return kwargs, moe_layers, not all(moe_layers)


def _tie_flags(
    top: _Fields, text: _Fields, is_multimodal: bool, notes: list[str]
) -> tuple[bool, tuple[tuple[str, bool], ...]]:
    """(build tied, the flags). transformers ties by the loaded class's config: the top-level flag for the
    composite (Qwen3_5Config default False), the text config's for the text-only classes; vLLM reads the text
    config's. When they disagree the loader decides by what the checkpoint holds (lm_head.weight or not)."""
    if not is_multimodal:
        flag = top.tf("tie_word_embeddings", bool)
        return flag, (("tie_word_embeddings", flag),)
    outer = top.get("tie_word_embeddings", bool, default=False)
    inner = text.get("tie_word_embeddings", bool, default=False)
    flags = (("tie_word_embeddings", outer), ("text_config.tie_word_embeddings", inner))
    if outer != inner:
        notes.append(
            f"`tie_word_embeddings` ({outer}) and `text_config.tie_word_embeddings` ({inner}) disagree: "
            "transformers reads the first, vLLM the second; deltaserve follows the checkpoint (tied unless it holds "
            "its own lm_head.weight)"
        )
    return outer or inner, flags


def _weight_dtype(top: _Fields, text: _Fields) -> str:
    for fields in (top, text):
        for key in ("dtype", "torch_dtype"):
            if fields.has(key):
                value = fields.get(key, str)
                if value == "auto":
                    continue
                if value not in WEIGHT_DTYPES:
                    raise fields.fail(key, f"is {value!r}; deltaserve loads {', '.join(WEIGHT_DTYPES)} weights")
                return value
    return "bfloat16"
