"""fused_moe_triton against fused_moe_ref, with routing from moe_route_ref, plus the expert alignment."""

from __future__ import annotations

import pytest
import torch

from deltaserve.kernels import moe_triton
from deltaserve.kernels.moe import fused_moe_ref, moe_route_ref
from deltaserve.kernels.moe_align import moe_align_ref
from deltaserve.kernels.moe_configs import GemmConfig, MoEConfig
from deltaserve.kernels.moe_triton import fused_moe_triton

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
@pytest.mark.parametrize("block_m", [16, 64])
def test_fused_moe_grouped_path_and_chunking(block_m: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """The grouped path at a prefill-style config (BLOCK_M 16 and 64) and the token chunking, at a tiny size."""
    monkeypatch.setattr(moe_triton, "CHUNK_TOKENS", 24)
    num_tokens, num_experts, top_k, hidden, inter = 50, 4, 2, 64, 32
    x = randn(num_tokens, hidden, dtype=dtype)
    w13 = randn(num_experts, 2 * inter, hidden, dtype=dtype, scale=hidden**-0.5)
    w2 = randn(num_experts, hidden, inter, dtype=dtype, scale=inter**-0.5)
    weights, ids = moe_route_ref(randn(num_tokens, num_experts), top_k, renormalize=True)
    config = MoEConfig("grouped", GemmConfig(32, 32, 4, 2), GemmConfig(64, 16, 4, 2), block_m=block_m)
    ref = fused_moe_ref(x, w13, w2, weights, ids)
    with poisoned_empty():
        out = fused_moe_triton(x, w13, w2, weights, ids, config=config)
    assert_close("out", ref, out, tolerance(dtype, fp32=1e-5))


def test_moe_align() -> None:
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [2, 3]], device=DEVICE)
    sorted_ids, block_expert = moe_align_ref(ids, num_experts=5, block_m=2)
    pad = ids.numel()
    # expert 0: entries 1, 4; expert 1: entry 3 (+pad); expert 2: entry 6 (+pad); expert 3: entries 0, 2, 5, 7
    expected = [1, 4, 3, pad, 6, pad, 0, 2, 5, 7]
    assert sorted_ids[: len(expected)].tolist() == expected
    assert (sorted_ids[len(expected) :] == pad).all()
    assert block_expert.tolist()[:5] == [0, 1, 2, 3, 3]
    assert (block_expert[5:] == -1).all()


@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "block_m"),
    [
        (1, 256, 8, 16),
        (3, 8, 2, 16),
        (8, 256, 8, 16),
        (17, 60, 4, 32),
        (64, 256, 8, 16),  # 512 entries: the size whose [entries, 64] tiles spilled (the B = 48-64 cliff)
        (65, 256, 8, 16),  # past the old 512-entry limit of the one-program align
        (100, 16, 5, 64),
        (40, 512, 10, 16),  # Qwen3-Next's 512 experts, top-10
        pytest.param(256, 256, 8, 16, marks=pytest.mark.gpu),  # 2048 entries: the largest decode graph at top-8
    ],
)
def test_moe_align_triton_equals_the_torch_align(num_tokens: int, num_experts: int, top_k: int, block_m: int) -> None:
    """Entry for entry: the one-program kernel reproduces the stable sort, the padding and the block experts."""
    from deltaserve.kernels.moe_routing_triton import ALIGN_MAX_ENTRIES, moe_align_triton

    generator = torch.Generator(device=DEVICE).manual_seed(num_tokens)
    # top-k ids are distinct per token; skewed so some experts get many entries and most get none
    scores = torch.rand(num_tokens, num_experts, device=DEVICE, generator=generator) ** 4
    ids = torch.topk(scores, top_k, dim=-1).indices  # [T, k] int64
    assert ids.numel() <= ALIGN_MAX_ENTRIES
    ref_sorted, ref_blocks = moe_align_ref(ids, num_experts, block_m)
    with poisoned_empty():
        sorted_ids, block_expert = moe_align_triton(ids, num_experts, block_m)
    assert torch.equal(sorted_ids, ref_sorted)
    assert torch.equal(block_expert, ref_blocks)


def test_moe_align_triton_refuses_a_prefill_sized_batch() -> None:
    from deltaserve.kernels.moe_routing_triton import ALIGN_MAX_ENTRIES, moe_align_triton

    ids = torch.zeros(ALIGN_MAX_ENTRIES + 1, 1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match=f"at most {ALIGN_MAX_ENTRIES} entries"):
        moe_align_triton(ids, 8, 16)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k"), [(1, 256, 8), (5, 60, 4), (9, 8, 2)])
def test_moe_route_triton(num_tokens: int, num_experts: int, top_k: int, renormalize: bool) -> None:
    from deltaserve.kernels.moe_routing_triton import moe_route_triton

    logits = randn(num_tokens, num_experts, scale=2.0)  # fp32: no ties, so torch.topk's order is the only one
    ref_weights, ref_ids = moe_route_ref(logits, top_k, renormalize)
    weights, ids = moe_route_triton(logits, top_k, renormalize)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids, ref_ids)  # descending, as torch.topk
    assert_close("weights", ref_weights, weights, 1e-6)


def test_moe_route_triton_breaks_ties_to_the_lowest_expert() -> None:
    """bf16 router logits tie often; torch.topk leaves the order of ties unspecified, the kernel takes the lowest
    expert id first (as vLLM's topk_softmax does), so a tie never makes routing depend on the batch."""
    from deltaserve.kernels.moe_routing_triton import moe_route_triton

    logits = torch.tensor([[0.5, 2.0, 1.0, 2.0, 1.0, 2.0]], device=DEVICE)
    weights, ids = moe_route_triton(logits, 4, renormalize=False)
    assert ids.tolist() == [[1, 3, 5, 2]]
    probs = torch.softmax(logits, dim=-1)[0]
    assert_close("weights", probs[[1, 3, 5, 2]][None], weights, 1e-6)


def test_moe_route_triton_picks_experts_in_range_on_a_nan_row() -> None:
    """A CUDA graph's padded rows read no real state and can hold NaN logits: their softmax is all NaN, and the
    argmax by `==` matched no expert, so the kernel stored id E and the expert GEMM read past w13 (an illegal
    address on the H200, MTP verify at 5-16 sequences). NaN ranks first, as in torch.topk: ids in [0, E), distinct,
    weights NaN; the finite rows beside it are untouched."""
    from deltaserve.kernels.moe_routing_triton import moe_route_triton

    logits = randn(4, 60, scale=2.0)
    logits[1] = float("nan")
    logits[2, 7] = float("nan")  # one NaN logit makes the whole softmax row NaN
    logits[3, :5] = float("inf")
    weights, ids = moe_route_triton(logits, 4, renormalize=True)
    for row in (1, 2, 3):
        assert ids[row].tolist() == [0, 1, 2, 3], ids[row]  # NaN first, lowest id first among NaNs
        assert torch.isnan(weights[row]).all()
    ref_weights, ref_ids = moe_route_ref(logits, 4, renormalize=True)
    assert torch.isnan(ref_weights[1:]).all()  # torch ranks them first too (in an order it leaves unspecified)
    assert torch.equal(ids[0], ref_ids[0])
    assert_close("finite row", ref_weights[:1], weights[:1], 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 37])
def test_fused_moe_with_the_shared_expert(num_tokens: int, dtype: torch.dtype) -> None:
    """The sigmoid-gated shared expert folded into the routed sum's epilogue equals the ref's combination."""
    num_experts, top_k, hidden, inter = 8, 2, 64, 32
    x = randn(num_tokens, hidden, dtype=dtype)
    w13 = randn(num_experts, 2 * inter, hidden, dtype=dtype, scale=hidden**-0.5)
    w2 = randn(num_experts, hidden, inter, dtype=dtype, scale=inter**-0.5)
    weights, ids = moe_route_ref(randn(num_tokens, num_experts), top_k, renormalize=True)
    shared = randn(num_tokens, hidden + 8, dtype=dtype)[:, :hidden]  # a strided view is accepted
    gate_logits = randn(num_tokens, 1, dtype=dtype, scale=2.0)
    ref = fused_moe_ref(x, w13, w2, weights, ids, shared, gate_logits)
    routed_only = fused_moe_ref(x, w13, w2, weights, ids)
    assert not torch.allclose(ref, routed_only)  # the shared expert changes the output
    with poisoned_empty():
        out = fused_moe_triton(x, w13, w2, weights, ids, shared, gate_logits)
    assert_close("out", ref, out, tolerance(dtype, fp32=1e-5))
