"""Issue 37, the MTP layer of a block-FP8 checkpoint: Qwen's -FP8 releases quantize the MTP layer's attention and
experts (mtp.fc, its norms and everything the trunk keeps unquantized stay plain). On FP8 copies of the trained
dense, MoE and Next checkpoints (deltaserve/tiny/fp8.py quantizes mtp.* as the releases do), with the MTP layer
built (speculative decoding):

- structure: every projection of the MTP decoder layer is an Fp8Weight whose dequantized value equals, bit for bit,
  the same projection of the checkpoint dequantized to fp32 and loaded as a plain one; fc and the norms are plain
  and equal;
- numerics: the MTP layer's output (the draft's hidden state) equals, within fp32 rounding, the plain model's on
  the dequantized checkpoint when the activation quantization is switched off (x times the dequantized weight), and
  the definition (fake-quantized activations times dequantized weights) within the trunk's SPEC_TOLERANCE with it
  on; switching it off moves the output by more, so the comparison can fail;
- the engine: LLM(speculative_config=mtp) on the FP8 checkpoint serves with its FP8 MTP layer.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deltaserve.config import ModelConfig
from deltaserve.engine.llm import LLM
from deltaserve.kernels.fp8 import Fp8Weight
from deltaserve.model.loader import load_checkpoint
from deltaserve.model.qwen3_5 import Qwen35Model
from deltaserve.runner.cache import CacheLayout, allocate_and_bind
from deltaserve.sampling_params import SamplingParams
from deltaserve.tiny.fp8 import write_fp8_checkpoint
from deltaserve.tiny.trained import trained_model_dir

from .test_fp8_loading import (
    SPEC_TOLERANCE,
    _dequantized_copy,
    _relative,
    _spec_linear,
    _unquantized_linear,
    _with_linear,
)
from .test_mtp import BLOCK_SIZE, NUM_BLOCKS, PROMPT, Served, _mtp, _target_hidden

LOGIT_TOLERANCE = 1e-5  # fp32: the same products summed in another order


def _served(folder: Path) -> Served:
    config = ModelConfig.from_pretrained(folder)
    model = Qwen35Model(config, torch.float32, "cpu", build_mtp=True)
    load_checkpoint(model, config, folder)
    model.fuse_projections()
    allocate_and_bind(model, config, CacheLayout(NUM_BLOCKS, BLOCK_SIZE, 1, 0, 0), torch.float32, torch.device("cpu"))
    return Served(config, model.eval(), list(reversed(range(NUM_BLOCKS))))


@pytest.fixture(scope="module", params=["dense", "moe", "next"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Served, Served, Path]:
    """(the FP8 checkpoint served with its MTP layer, its dequantized copy served the same way, the FP8 folder)."""
    root = tmp_path_factory.mktemp(f"fp8-mtp-{request.param}")
    folder = write_fp8_checkpoint(trained_model_dir(request.param), root / "fp8")
    return _served(folder), _served(_dequantized_copy(folder, root / "plain")), folder


def test_mtp_projections_hold_fp8_equal_to_the_dequantized_checkpoint(pair: tuple[Served, Served, Path]) -> None:
    fp8, plain, _ = pair
    plain_modules = dict(plain.model.mtp.named_modules())
    plain_params = dict(plain.model.mtp.named_parameters())
    quantized = {name: m for name, m in fp8.model.mtp.named_modules() if isinstance(m, Fp8Weight)}
    # attention qkv / o, and the MLP (dense gate_up / down; MoE w13 / w2 and the shared expert's two)
    assert len(quantized) >= 4, sorted(quantized)
    for name, weight in quantized.items():
        assert weight.weight.dtype == torch.float8_e4m3fn and weight.scale.dtype == torch.float32, name
        expected = plain_modules.get(name)
        expected = plain_params[name] if expected is None else expected
        assert torch.equal(weight.dequantize(), expected), name
    for name in ("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        kept = getattr(fp8.model.mtp, name)
        assert not isinstance(kept, Fp8Weight) and kept.dtype == torch.float32, name
        assert torch.equal(kept, getattr(plain.model.mtp, name)), name


def test_mtp_output_is_the_dequantized_layer_and_the_definition(
    pair: tuple[Served, Served, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    fp8, plain, _ = pair
    num = len(PROMPT) - 1
    hidden = _target_hidden(fp8)  # [T, H]: the FP8 target's, given to both MTP layers
    ours = _mtp(fp8, hidden, 0, num)  # [T-1, H]
    reference = _mtp(plain, hidden, 0, num)
    with monkeypatch.context() as patch:
        _with_linear(patch, _unquantized_linear)
        unquantized = _mtp(fp8, hidden, 0, num)
    with monkeypatch.context() as patch:
        _with_linear(patch, _spec_linear)
        spec = _mtp(fp8, hidden, 0, num)
    assert _relative(unquantized, reference) < LOGIT_TOLERANCE
    assert _relative(ours, spec) < SPEC_TOLERANCE
    assert _relative(ours, reference) > 3 * _relative(ours, spec)  # the activation quantization is in the output


def test_engine_serves_the_fp8_mtp_layer(tmp_path: Path) -> None:
    folder = write_fp8_checkpoint(trained_model_dir("dense"), tmp_path / "fp8")
    llm = LLM(folder, dtype="float32", device="cpu", speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    mtp = llm.engine.runner.model.mtp
    assert isinstance(mtp.layer.self_attn.qkv_proj, Fp8Weight) and isinstance(mtp.layer.self_attn.o_proj, Fp8Weight)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4
