"""The FP8 gate's checkpoints (dense-w128, moe-w128, next-w128; docs/fp8.md, "The FP8 gate's checkpoints"), here
untrained (the conftest's `wide_dirs`: the trained ones are made on the H200 at gate time; widths, format, loading
and fp32 exactness do not depend on training): every FP8 projection of their FP8 copies, the MTP layer's included,
has both sides multiples of 128 (so vLLM's block-FP8 kernels, which need N a multiple of 64 and K of 128 and every
merged part but the last a multiple of 128, take them all); deltaserve serves the bf16 checkpoints exactly as
transformers does (the fp32 token gate) and loads the FP8 copies, whose projections keep the checkpoint's 128-row
blocks except Qwen3-Next's de-interleaved in_proj_qkvz (per-group pieces of 64 rows: per-row scales). The FP8
projections' bit-equality with the dequantized checkpoint and the comparison with transformers' dequantized model
run in test_fp8_loading.py on these variants."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from deltaserve.engine.llm import LLM
from deltaserve.gates import tokens
from deltaserve.kernels.fp8 import Fp8Weight
from deltaserve.tiny.fp8 import write_fp8_checkpoint
from deltaserve.tiny.spec import WIDE_VARIANTS

WIDE = tuple(WIDE_VARIANTS)


@pytest.fixture(scope="module")
def fp8_dirs(tmp_path_factory: pytest.TempPathFactory, wide_dirs: dict[str, Path]) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8-wide")
    return {v: write_fp8_checkpoint(wide_dirs[v], root / v) for v in WIDE}


@pytest.mark.parametrize("variant", WIDE)
def test_every_fp8_projection_has_sides_vllm_takes(variant: str, fp8_dirs: dict[str, Path]) -> None:
    folder = fp8_dirs[variant]
    with safe_open(folder / "model.safetensors", framework="pt") as handle:
        shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}  # noqa: SIM118
        dtypes = {name: handle.get_slice(name).get_dtype() for name in handle.keys()}  # noqa: SIM118
    quantized = [name for name, dtype in dtypes.items() if dtype == "F8_E4M3"]
    assert len(quantized) >= 4 * 4 and any(name.startswith("mtp.") for name in quantized)
    for name in quantized:
        rows, cols = shapes[name]
        assert rows % 128 == 0 and cols % 128 == 0, (name, rows, cols)
    config = json.loads((folder / "config.json").read_text())
    text = config.get("text_config", config)
    assert text["hidden_size"] == 128 and text["num_hidden_layers"] == 4
    # the parts vLLM merges: q (with its gate) | k | v, GDN keys | keys | values | values, gate | up
    parts = [
        2 * text["num_attention_heads"] * text["head_dim"],
        text["num_key_value_heads"] * text["head_dim"],
        text["linear_num_key_heads"] * text["linear_key_head_dim"],
        text["linear_num_value_heads"] * text["linear_value_head_dim"],
        text.get("moe_intermediate_size") or text["intermediate_size"],
    ]
    assert all(p % 128 == 0 for p in parts), parts


@pytest.mark.parametrize("variant", WIDE)
def test_deltaserve_serves_the_bf16_checkpoint_as_transformers_does(
    variant: str, wide_dirs: dict[str, Path], capsys: pytest.CaptureFixture
) -> None:
    code = tokens.run_gate(wide_dirs[variant], num_prompts=2, max_tokens=4, max_prompt_len=32)
    assert code == 0, capsys.readouterr().out
    assert capsys.readouterr().out.startswith("STRICT 2/2 against transformers")


@pytest.mark.parametrize("variant", WIDE)
def test_deltaserve_loads_the_fp8_copy_in_whole_blocks(variant: str, fp8_dirs: dict[str, Path]) -> None:
    model = LLM(fp8_dirs[variant], dtype="float32", device="cpu").engine.runner.model
    weights = {name: m for name, m in model.named_modules() if isinstance(m, Fp8Weight)}
    assert len(weights) >= 4 * len(model.layers)
    for name, weight in weights.items():
        assert weight.weight.dtype == torch.float8_e4m3fn
        is_next_qkvz = variant == "next-w128" and name.endswith("in_proj_qkvz")
        assert weight.block_n == (1 if is_next_qkvz else 128), name
