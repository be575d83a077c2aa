"""Issue 37: the block-FP8 `quantization_config` of Qwen's -FP8 releases is read and accepted (ModelConfig.fp8), and
every other quantization method or FP8 variant is refused at config load with a one-line error naming the field and
its value.

The format is checked against what transformers' FineGrainedFP8Config writes (its `to_dict`), so a checkpoint that
transformers' FP8 quantizer saves is accepted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import FineGrainedFP8Config

from deltaserve.config import ConfigError, ModelConfig
from deltaserve.fp8_format import Fp8BlockFormat, read_fp8_format

PATH = Path("/ckpt/config.json")
# Qwen3-Next-80B-A3B-Instruct-FP8's quantization_config (modules_to_not_convert shortened)
QWEN_FP8 = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
    "modules_to_not_convert": ["lm_head", "model.layers.0.linear_attn.in_proj_ba", "model.layers.0.mlp.gate"],
}


def _fail(field: str, problem: str) -> ConfigError:
    return ConfigError(f"`{field}` {problem}")


def _config(kind: str, quant: Any) -> dict[str, Any]:
    """A minimal config.json (the rest takes transformers' defaults) carrying `quant` where the releases put it."""
    if kind == "next":
        return {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "quantization_config": quant}
    if kind == "moe-mm":
        return {"model_type": "qwen3_5_moe", "text_config": {}, "quantization_config": quant}
    return {"model_type": "qwen3_5_text", "quantization_config": quant}


def test_reads_the_qwen_release_format() -> None:
    fmt = read_fp8_format(QWEN_FP8, _fail)
    assert fmt == Fp8BlockFormat(modules_to_not_convert=tuple(QWEN_FP8["modules_to_not_convert"]))
    assert fmt.block_size == (128, 128)


def test_reads_what_transformers_writes() -> None:
    written = FineGrainedFP8Config(modules_to_not_convert=["lm_head"]).to_dict()
    assert read_fp8_format(written, _fail).modules_to_not_convert == ("lm_head",)
    # ignored_layers: vLLM's and MiniMax's name for the same list
    assert read_fp8_format({**QWEN_FP8, "modules_to_not_convert": None, "ignored_layers": ["x"]}, _fail) == (
        Fp8BlockFormat(modules_to_not_convert=("x",))
    )


REFUSALS = [
    ("awq", {"quant_method": "awq", "bits": 4}, "quantization_config.quant_method", "'awq'"),
    ("gptq", {"quant_method": "gptq", "bits": 4}, "quantization_config.quant_method", "'gptq'"),
    (
        "compressed-tensors FP8_BLOCK",
        {"quant_method": "compressed-tensors", "format": "float-quantized"},
        "quantization_config.quant_method",
        "'compressed-tensors'",
    ),
    ("no quant_method", {"weight_block_size": [128, 128]}, "quantization_config.quant_method", "missing"),
    ("not an object", "fp8", "quantization_config", "'fp8'"),
    ("e5m2", {**QWEN_FP8, "fmt": "e5m2"}, "quantization_config.fmt", "'e5m2'"),
    (
        "static activations",
        {**QWEN_FP8, "activation_scheme": "static"},
        "quantization_config.activation_scheme",
        "'static'",
    ),  # fmt: skip
    (
        "per-tensor (null)",
        {**QWEN_FP8, "weight_block_size": None},
        "quantization_config.weight_block_size",
        "per-tensor",
    ),  # fmt: skip
    (
        "per-tensor (absent)",
        {k: v for k, v in QWEN_FP8.items() if k != "weight_block_size"},
        "quantization_config.weight_block_size",
        "per-tensor",
    ),  # fmt: skip
    (
        "64x64 blocks",
        {**QWEN_FP8, "weight_block_size": [64, 64]},
        "quantization_config.weight_block_size",
        "[64, 64]",
    ),  # fmt: skip
    (
        "128x64 blocks",
        {**QWEN_FP8, "weight_block_size": [128, 64]},
        "quantization_config.weight_block_size",
        "[128, 64]",
    ),  # fmt: skip
    ("ue8m0 scales", {**QWEN_FP8, "scale_fmt": "ue8m0"}, "quantization_config.scale_fmt", "'ue8m0'"),
    ("fp4 experts", {**QWEN_FP8, "expert_dtype": "fp4"}, "quantization_config.expert_dtype", "'fp4'"),
    (
        "fp8 embeddings",
        {**QWEN_FP8, "modules_to_convert": ["embed_tokens"]},
        "quantization_config.modules_to_convert",
        "embed_tokens",
    ),  # fmt: skip
    (
        "skip list not names",
        {**QWEN_FP8, "modules_to_not_convert": "lm_head"},
        "quantization_config.modules_to_not_convert",
        "'lm_head'",
    ),  # fmt: skip
]


@pytest.mark.parametrize("kind", ["dense", "moe-mm", "next"])
@pytest.mark.parametrize(("quant", "field", "value"), [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_refused_at_config_load_by_field_and_value(kind: str, quant: Any, field: str, value: str) -> None:
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_dict(_config(kind, quant), PATH)
    message = str(info.value)
    assert message.startswith(f"{PATH}: field `{field}` "), message
    assert value in message and "\n" not in message, message


@pytest.mark.parametrize("kind", ["dense", "moe-mm", "next"])
@pytest.mark.parametrize(
    "quant", [QWEN_FP8, FineGrainedFP8Config().to_dict()], ids=["the release format", "what transformers writes"]
)
def test_the_block_fp8_format_is_accepted(kind: str, quant: dict[str, Any]) -> None:
    config = ModelConfig.from_dict(_config(kind, quant), PATH)
    assert config.fp8 == Fp8BlockFormat(modules_to_not_convert=tuple(quant.get("modules_to_not_convert") or ()))


def test_quantization_config_inside_text_config_is_read_there() -> None:
    config = {"model_type": "qwen3_5", "text_config": {"quantization_config": QWEN_FP8}}
    assert ModelConfig.from_dict(config, PATH).fp8 is not None


def test_quantization_config_inside_text_config_is_named_there() -> None:
    config = {"model_type": "qwen3_5", "text_config": {"quantization_config": {**QWEN_FP8, "fmt": "e5m2"}}}
    with pytest.raises(ConfigError, match=r"field `text_config\.quantization_config\.fmt` is 'e5m2'"):
        ModelConfig.from_dict(config, PATH)


def test_compression_config_is_refused_by_name() -> None:
    config = {"model_type": "qwen3_5_text", "compression_config": {"format": "float-quantized"}}
    with pytest.raises(ConfigError, match=r"field `compression_config` is present \(compressed-tensors"):
        ModelConfig.from_dict(config, PATH)


def test_without_quantization_config_nothing_changes() -> None:
    config = _config("dense", None)
    assert ModelConfig.from_dict(config, PATH).family == "qwen3_5"
    assert ModelConfig.from_dict(config, PATH).fp8 is None
