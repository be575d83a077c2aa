"""The block-FP8 checkpoint format of Qwen's `-FP8` releases: reads config.json's `quantization_config` and refuses,
by field and value, every quantization method and FP8 variant that is not that format (issue 37).

The format, as transformers' own FP8 integration reads and writes it (`FineGrainedFP8Config`,
`transformers.integrations.finegrained_fp8`; docs/ARCHITECTURE.md#configs-and-checkpoint-layout):
`{quant_method: "fp8", fmt: "e4m3", activation_scheme: "dynamic", weight_block_size: [128, 128],
modules_to_not_convert: [...]}`. Each quantized `<module>.weight` is float8_e4m3fn [N, K] with a
`<module>.weight_scale_inv` [ceil(N/128), ceil(K/128)] (transformers writes float32), the per-block multiplier that
dequantizes it (w ~ q * scale_inv, scale_inv = block amax / 448); activations are quantized at run time per token
in groups of 128.

This module only reads the format; config.py decides what to do with it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

FP8_METHOD = "fp8"
FP8_FMT = "e4m3"
FP8_BLOCK = (128, 128)  # (N, K): Qwen's releases, and the block vLLM's DeepGEMM / CUTLASS block GEMMs require
FP8_ACTIVATION_SCHEME = "dynamic"
# transformers' FineGrainedFP8Config fields that change the stored tensors, with the value of this format
_TRANSFORMERS_FIELDS = {"scale_fmt": "float", "expert_dtype": "fp8"}
_FORMAT = "block FP8 (quant_method 'fp8', e4m3, dynamic activations, weight_block_size [128, 128])"


@dataclass(frozen=True)
class Fp8BlockFormat:
    """A checkpoint in the block-FP8 format: which modules stay unquantized (matched by name, as
    transformers' `modules_to_not_convert` and vLLM's `ignored_layers` are)."""

    modules_to_not_convert: tuple[str, ...] = ()
    block_size: tuple[int, int] = FP8_BLOCK  # (N, K) of one scale block


Fail = Callable[[str, str], Exception]  # (field inside quantization_config, problem) -> the error to raise


def read_fp8_format(value: Any, fail: Fail) -> Fp8BlockFormat:
    """The block-FP8 format `value` (config.json's quantization_config) describes, or `fail(field, problem)` for the
    first field whose value deltaserve does not read. `fail` names the field relative to quantization_config
    ("" for the whole object)."""
    if not isinstance(value, dict):
        raise fail("", f"must be an object, got {value!r}")
    method = value.get("quant_method")
    if method is None:
        raise fail("quant_method", f"is missing; the only quantized format deltaserve reads is {_FORMAT}")
    if method != FP8_METHOD:
        # compressed-tensors (llm-compressor's FP8_BLOCK among others), AWQ, GPTQ, bitsandbytes, ...: other tensor
        # names and layouts, which no deltaserve loader reads
        raise fail("quant_method", f"is {method!r}; the only quantized format deltaserve reads is {_FORMAT}")
    fmt = value.get("fmt", FP8_FMT)  # transformers does not write fmt; Qwen's releases write "e4m3"
    if fmt != FP8_FMT:
        raise fail("fmt", f"is {fmt!r}; deltaserve reads float8_e4m3fn weights ({FP8_FMT!r}) only")
    scheme = value.get("activation_scheme", FP8_ACTIVATION_SCHEME)  # transformers' default
    if scheme != FP8_ACTIVATION_SCHEME:
        # static: one calibrated activation scale per tensor, stored as input_scale. vLLM's Fp8Config refuses it
        # with block weights too: its block GEMMs take per-token-group activation scales computed at run time
        raise fail("activation_scheme", f"is {scheme!r}; deltaserve reads {FP8_ACTIVATION_SCHEME!r} only")
    block = value.get("weight_block_size")
    if block is None:
        # vLLM's Fp8Config reads absent or null as one scale per tensor; transformers' FineGrainedFP8Config fills in
        # (128, 128) when absent. Refused either way: only an explicit [128, 128] means the same to both.
        raise fail(
            "weight_block_size", "is missing or null, which vLLM reads as per-tensor FP8 scales (transformers as "
            "[128, 128]); deltaserve reads an explicit [128, 128] only",
        )  # fmt: skip
    if not isinstance(block, (list, tuple)) or list(block) != list(FP8_BLOCK):
        raise fail("weight_block_size", f"is {block!r}; deltaserve reads [128, 128] blocks only")
    for key, expected in _TRANSFORMERS_FIELDS.items():
        given = value.get(key, expected)
        if given != expected:
            raise fail(key, f"is {given!r}; deltaserve reads {expected!r} only")
    if value.get("modules_to_convert"):
        # transformers' extra FP8 modules (embedding tables): the release keeps embeddings in bf16
        raise fail("modules_to_convert", f"is {value['modules_to_convert']!r}; deltaserve keeps embeddings in bf16")
    key = "modules_to_not_convert" if value.get("modules_to_not_convert") is not None else "ignored_layers"
    skipped = value.get(key) or []  # ignored_layers: MiniMax's and vLLM's name for the same list
    if not isinstance(skipped, list) or not all(isinstance(name, str) for name in skipped):
        raise fail(key, f"must be a list of module names, got {skipped!r}")
    return Fp8BlockFormat(modules_to_not_convert=tuple(skipped))


def check_requested_quantization(requested: str | None, declared: Fp8BlockFormat | None, config_file: Any) -> None:
    """vLLM's `--quantization` / `LLM(quantization=...)` against the checkpoint: None lets the config decide; "fp8"
    is accepted when the config declares the block-FP8 format (vLLM checks that the two agree); "fp8" on an
    unquantized checkpoint, which vLLM would quantize online to per-tensor dynamic FP8, and every other method are
    refused by name: deltaserve serves only a checkpoint's own block-FP8 weights."""
    if requested is None:
        return
    flag = f"--quantization {requested} (quantization={requested!r})"
    if requested != FP8_METHOD:
        declares = f"{config_file} declares {_FORMAT}" if declared else f"{config_file} declares no quantization"
        raise ValueError(
            f"{flag} is not supported: the only quantization deltaserve serves is {FP8_METHOD!r}, a checkpoint's own "
            f"{_FORMAT}; {declares}. Leave the flag out to let the checkpoint's config decide."
        )
    if declared is None:
        raise ValueError(
            f"{flag}: {config_file} has no quantization_config (an unquantized checkpoint). vLLM would quantize it "
            "online to per-tensor dynamic FP8; deltaserve does not: it serves only the block-FP8 weights of a "
            f"checkpoint that declares {_FORMAT} (Qwen's -FP8 releases). Serve such a checkpoint, or leave the flag "
            "out to serve this one unquantized."
        )
