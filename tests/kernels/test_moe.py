"""fused_moe_triton against fused_moe_ref, with routing from moe_route_ref, plus the expert alignment."""

from __future__ import annotations

import pytest
import torch

from deltaserve.kernels import moe_triton
from deltaserve.kernels.moe import fused_moe_ref, moe_route_ref
from deltaserve.kernels.moe_triton import fused_moe_triton, moe_align

from ._util import DEVICE, DTYPES, assert_close, poisoned_empty, randn, tolerance


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "hidden", "inter"),
    [(1, 8, 2, 64, 32), (63, 8, 2, 96, 48), (100, 16, 4, 64, 32)],
)
def test_fused_moe(num_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype) -> None:
    x = randn(num_tokens, hidden, dtype=dtype)
    w13 = randn(num_experts, 2 * inter, hidden, dtype=dtype, scale=hidden**-0.5)
    w2 = randn(num_experts, hidden, inter, dtype=dtype, scale=inter**-0.5)
    weights, ids = moe_route_ref(randn(num_tokens, num_experts), top_k, renormalize=True)
    ref = fused_moe_ref(x, w13, w2, weights, ids)
    with poisoned_empty():
        out = fused_moe_triton(x, w13, w2, weights, ids)
    assert_close("out", ref, out, tolerance(dtype, fp32=1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_moe_tuned_and_chunked(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """The autotuned (prefill) kernels and the token chunking, forced at a tiny size."""
    monkeypatch.setattr(moe_triton, "SMALL_ENTRIES", 0)
    monkeypatch.setattr(moe_triton, "CHUNK_TOKENS", 24)
    num_tokens, num_experts, top_k, hidden, inter = 50, 4, 2, 64, 32
    x = randn(num_tokens, hidden, dtype=dtype)
    w13 = randn(num_experts, 2 * inter, hidden, dtype=dtype, scale=hidden**-0.5)
    w2 = randn(num_experts, hidden, inter, dtype=dtype, scale=inter**-0.5)
    weights, ids = moe_route_ref(randn(num_tokens, num_experts), top_k, renormalize=True)
    ref = fused_moe_ref(x, w13, w2, weights, ids)
    with poisoned_empty():
        out = fused_moe_triton(x, w13, w2, weights, ids)
    assert_close("out", ref, out, tolerance(dtype, fp32=1e-5))


def test_moe_align() -> None:
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [2, 3]], device=DEVICE)
    sorted_ids, block_expert = moe_align(ids, num_experts=5, block_m=2)
    pad = ids.numel()
    # expert 0: entries 1, 4; expert 1: entry 3 (+pad); expert 2: entry 6 (+pad); expert 3: entries 0, 2, 5, 7
    expected = [1, 4, 3, pad, 6, pad, 0, 2, 5, 7]
    assert sorted_ids[: len(expected)].tolist() == expected
    assert (sorted_ids[len(expected) :] == pad).all()
    assert block_expert.tolist()[:5] == [0, 1, 2, 3, 3]
    assert (block_expert[5:] == -1).all()


def test_block_m_follows_the_autotune_bucket() -> None:
    """BLOCK_M is a constexpr: if it varied within one power-of-two bucket (the autotune key), a batch of a new
    size would compile a kernel in the middle of serving although its bucket was tuned at start-up."""
    from deltaserve.kernels._triton import next_pow2
    from deltaserve.kernels.moe_triton import block_m_for

    for num_experts in (8, 60, 256):
        for num_entries in range(1, 40000, 37):
            assert block_m_for(num_entries, num_experts) == block_m_for(next_pow2(num_entries), num_experts)
            assert 16 <= block_m_for(num_entries, num_experts) <= 64
