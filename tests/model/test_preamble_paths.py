"""The two attention-preamble spellings: fused (1-D RoPE and MRoPE alike) and the four-op path, which must
refuse true MRoPE positions rather than silently apply 1-D RoPE."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deltaserve.engine.llm import LLM
from deltaserve.kernels import attn_preamble_ref, attn_preamble_unfused, rope_cos_sin_cache, rope_cos_sin_for_positions
from deltaserve.kernels.preamble import MRopeUnsupportedError, mrope_axis_per_frequency
from deltaserve.sampling_params import SamplingParams

NUM_Q, NUM_KV, HEAD_DIM, ROTARY = 4, 2, 32, 8


def inputs(num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    qkv = torch.randn(num_tokens, NUM_Q * 2 * HEAD_DIM + 2 * NUM_KV * HEAD_DIM)
    return (
        qkv,
        torch.randn(HEAD_DIM) * 0.1,
        torch.randn(HEAD_DIM) * 0.1,
        rope_cos_sin_cache(ROTARY, 256, 1e7, torch.float32, "cpu"),
    )


def test_fused_equals_four_op_path_on_text_positions() -> None:
    qkv, qw, kw, cache = inputs(37)
    positions = torch.arange(5, 42).expand(3, -1)
    axis = mrope_axis_per_frequency(ROTARY // 2, [2, 1, 1], "cpu")
    fused = attn_preamble_ref(qkv, qw, kw, rope_cos_sin_for_positions(cache, positions, axis), NUM_Q, NUM_KV, HEAD_DIM,
                              ROTARY, 1e-6)  # fmt: skip
    unfused = attn_preamble_unfused(qkv, qw, kw, positions, cache, NUM_Q, NUM_KV, HEAD_DIM, ROTARY, 1e-6)
    for a, b in zip(fused, unfused, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_four_op_path_refuses_mrope_positions() -> None:
    qkv, qw, kw, cache = inputs(6)
    positions = torch.tensor([[3, 3, 3, 3, 7, 8], [3, 4, 3, 4, 7, 8], [3, 3, 4, 4, 7, 8]])
    with pytest.raises(MRopeUnsupportedError, match="no MRoPE"):
        attn_preamble_unfused(qkv, qw, kw, positions, cache, NUM_Q, NUM_KV, HEAD_DIM, ROTARY, 1e-6)


def test_fused_mrope_reads_each_frequency_from_its_axis() -> None:
    """Interleaved MRoPE (architecture doc §4): frequency j reads H if j%3==1 and j<3·s_h, W if j%3==2 and
    j<3·s_w, else T; checked against a direct angle computation."""
    cache = rope_cos_sin_cache(64, 64, 1e7, torch.float64, "cpu")
    positions = torch.tensor([[6, 6, 6], [6, 7, 8], [6, 9, 11]])
    axis = mrope_axis_per_frequency(32, [11, 11, 10], "cpu")
    table = rope_cos_sin_for_positions(cache, positions, axis)
    inv_freq = 1.0 / (1e7 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    for t in range(3):
        for j in range(32):
            row = 1 if (j % 3 == 1 and j < 33) else 2 if (j % 3 == 2 and j < 30) else 0
            angle = positions[row, t].double() * inv_freq[j]
            assert torch.isclose(table[t, j], angle.cos()) and torch.isclose(table[t, 32 + j], angle.sin())


def test_engine_unfused_refuses_mrope_and_fused_accepts(tiny_dense: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(tiny_dense, dtype="float32")
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    prompt = [11, 12, 13, 14, 15, 16]
    mrope = [[0, 1, 2, 2, 2, 5], [0, 1, 2, 3, 2, 5], [0, 1, 2, 2, 3, 5]]

    def add_mrope_request(request_id: str) -> None:
        engine.add_request(request_id, prompt, params)
        seq = engine.core.sequences[request_id]
        seq.mrope_positions, seq.mrope_delta = tuple(tuple(row) for row in mrope), 0

    add_mrope_request("fused")
    while engine.has_unfinished():
        engine.step()
    monkeypatch.setenv("DELTASERVE_FUSE_ATTN_PREAMBLE", "0")
    add_mrope_request("unfused")
    with pytest.raises(MRopeUnsupportedError):
        engine.step()
