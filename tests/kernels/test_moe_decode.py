"""The small-batch MoE block (moe_decode_triton) against fused_moe_block_ref / fused_moe_ref.

Under the interpreter at fp32 (bf16 cases on the GPU): the whole block (router GEMV, in-kernel routing,
leader-gathered gate/up, per-token down + weighted sum + sigmoid-gated shared expert), the variant that
routes in its own launch, the down GEMM split over the choices with its combine launch (the ref's values
and the one-program kernel's bits), the fused_moe op's decode path on given routing, and the grouped path behind
the block op, and a NaN row routed to experts in range. Outputs come from NaN-poisoned torch.empty, so an unwritten
element fails.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from deltaserve.kernels import moe_decode_triton
from deltaserve.kernels.moe import fused_moe_block_ref, fused_moe_ref, moe_route_ref, router_logits_ref
from deltaserve.kernels.moe_configs import GemmConfig, MoEConfig
from deltaserve.kernels.moe_decode_triton import _route_tile, moe_block_triton, router_logits_triton
from deltaserve.kernels.moe_triton import fused_moe_triton

from ._util import DEVICE, DTYPES, assert_close, poisoned_empty, randn, tolerance

DECODE = MoEConfig("decode", GemmConfig(16, 32, 4, 2), GemmConfig(16, 32, 4, 1))
GROUPED = MoEConfig("grouped", GemmConfig(16, 32, 4, 2), GemmConfig(32, 32, 4, 2), block_m=16)


def _weights(num_experts: int, hidden: int, inter: int, inter_sh: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {
        "router_weight": randn(num_experts, hidden, dtype=dtype, scale=2 * hidden**-0.5),
        "w13": randn(num_experts, 2 * inter, hidden, dtype=dtype, scale=hidden**-0.5),
        "w2": randn(num_experts, hidden, inter, dtype=dtype, scale=inter**-0.5),
        "shared_w13": randn(2 * inter_sh, hidden, dtype=dtype, scale=hidden**-0.5),
        "shared_w2": randn(hidden, inter_sh, dtype=dtype, scale=inter_sh**-0.5),
        "shared_gate_weight": randn(1, hidden, dtype=dtype, scale=hidden**-0.5),
    }


def _call(
    fn: object, x: torch.Tensor, w: dict[str, torch.Tensor], top_k: int, shared: bool, **kw: object
) -> torch.Tensor:
    extra = (w["shared_w13"], w["shared_w2"], w["shared_gate_weight"]) if shared else ()
    return fn(x, w["router_weight"], w["w13"], w["w2"], top_k, True, *extra, **kw)  # type: ignore[operator]


def _ref(x: torch.Tensor, w: dict[str, torch.Tensor], top_k: int, shared: bool) -> torch.Tensor:
    """fused_moe_block_ref at fp32. In bf16 a router logit one ulp off (cuBLAS's sum order against the
    kernel's) swaps near-tied experts, so the bf16 ref routes on the kernel's own logits (checked against
    F.linear on their own below), with moe_route_triton's lowest-id tie rule."""
    if x.dtype == torch.float32:
        return _call(fused_moe_block_ref, x, w, top_k, shared)
    from deltaserve.kernels.activation import silu_and_mul_ref
    from deltaserve.kernels.moe_routing_triton import moe_route_triton

    num_experts = w["router_weight"].shape[0]
    logits = router_logits_triton(x, w["router_weight"], w["shared_gate_weight"] if shared else None)
    weights, ids = moe_route_triton(logits[:, :num_experts], top_k, True)
    if not shared:
        return fused_moe_ref(x, w["w13"], w["w2"], weights, ids)
    shared_out = torch.nn.functional.linear(silu_and_mul_ref(x @ w["shared_w13"].T), w["shared_w2"])
    return fused_moe_ref(x, w["w13"], w["w2"], weights, ids, shared_out, logits[:, num_experts:])


def _block_against_ref(
    x: torch.Tensor, w: dict[str, torch.Tensor], top_k: int, shared: bool, config: MoEConfig
) -> None:
    """moe_block_triton under `config` (outputs NaN-poisoned) equals _ref."""
    ref = _ref(x, w, top_k, shared)
    with poisoned_empty():
        out = _call(moe_block_triton, x, w, top_k, shared, config=config)
    assert_close("out", ref, out, tolerance(x.dtype, fp32=1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "hidden", "inter", "inter_sh", "shared"),
    [
        (1, 8, 2, 64, 32, 32, True),
        (3, 16, 4, 64, 32, 48, True),  # a shared expert wider than the routed ones
        (2, 8, 2, 96, 48, 16, True),  # narrower, and H not a multiple of BLOCK_K·2
        (3, 8, 3, 64, 32, 32, False),  # top-3: a choice count that is not a power of two
    ],
)
def test_moe_block_decode_path(
    num_tokens: int,
    num_experts: int,
    top_k: int,
    hidden: int,
    inter: int,
    inter_sh: int,
    shared: bool,
    dtype: torch.dtype,
) -> None:
    x = randn(num_tokens, hidden, dtype=dtype)
    w = _weights(num_experts, hidden, inter, inter_sh, dtype)
    _block_against_ref(x, w, top_k, shared, DECODE)


def _split(config: MoEConfig, choices_per_program: int) -> MoEConfig:
    """config with its down GEMM split over the choices, every other launch parameter the same."""
    g2 = config.gemm2
    gemm2 = GemmConfig(g2.BLOCK_N, g2.BLOCK_K, g2.num_warps, g2.num_stages, choices_per_program)
    return MoEConfig(config.path, config.gemm1, gemm2, config.block_m)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "inter_sh", "shared", "choices_per_program"),
    [
        (1, 8, 2, 32, True, 1),
        (3, 16, 4, 48, True, 2),  # a shared expert wider than the routed ones
        (3, 8, 3, 32, False, 2),  # k = 3 in groups of 2: the last group partial
        (8, 16, 4, 32, True, 4),  # one group a token
        (3, 16, 8, 32, True, 4),  # top-8 in two groups of 4 (the served k)
        (8, 16, 3, 32, False, 1),
    ],
)
def test_moe_block_decode_path_with_the_down_gemm_split_over_the_choices(
    num_tokens: int,
    num_experts: int,
    top_k: int,
    inter_sh: int,
    shared: bool,
    choices_per_program: int,
    dtype: torch.dtype,
) -> None:
    """C16: the split down GEMM + combine equals the ref, and bit for bit the one-program down kernel (same
    GEMV blocks, same rounding points, the same fp32 sums in choice order)."""
    x = randn(num_tokens, 64, dtype=dtype)
    w = _weights(num_experts, 64, 32, inter_sh, dtype)
    ref = _ref(x, w, top_k, shared)
    with poisoned_empty():
        one = _call(moe_block_triton, x, w, top_k, shared, config=DECODE)
        out = _call(moe_block_triton, x, w, top_k, shared, config=_split(DECODE, choices_per_program))
    assert_close("out", ref, out, tolerance(dtype, fp32=1e-5))
    assert torch.equal(out, one), f"split down GEMM differs from the one-program kernel: {(out - one).abs().max()}"


def _route_rows(config: MoEConfig, route_rows: int) -> MoEConfig:
    """config with its gate/up kernel routing on max(route_rows, next_pow2(T)) token rows."""
    g1 = config.gemm1
    gemm1 = GemmConfig(g1.BLOCK_N, g1.BLOCK_K, g1.num_warps, g1.num_stages, ROUTE_ROWS=route_rows)
    return MoEConfig(config.path, gemm1, config.gemm2, config.block_m)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "route_rows"), [(1, 1), (3, 1), (8, 4), (12, 1)])
def test_moe_block_decode_path_routing_on_fewer_rows_than_the_dot_tile(
    num_tokens: int, route_rows: int, dtype: torch.dtype
) -> None:
    """C17: the in-kernel routing on a [next_pow2(T), E] tile (1, 4, 8, 16 rows) under the 16-row dot tile;
    the routing rows are mapped onto the dot rows for the leader's gather. Equals the ref."""
    x = randn(num_tokens, 64, dtype=dtype)
    w = _weights(16, 64, 32, 48, dtype)
    _block_against_ref(x, w, 4, True, _route_rows(DECODE, route_rows))


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_block_routes_in_its_own_launch_above_the_register_limit(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batches above ROUTE_IN_GEMM1_MAX_TOKENS route with moe_route_triton first; forced here at 3 tokens."""
    monkeypatch.setattr(moe_decode_triton, "ROUTE_IN_GEMM1_MAX_TOKENS", 1)
    x = randn(3, 64, dtype=dtype)
    w = _weights(8, 64, 32, 32, dtype)
    _block_against_ref(x, w, 2, True, DECODE)


@pytest.mark.parametrize("route_in_gemm1", [True, False])
def test_decode_path_routes_a_nan_row_to_experts_in_range(
    route_in_gemm1: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A verify graph's padded rows can carry NaN hidden states. Before, their routing picked expert id E (no
    expert equals NaN) and gemm1 read past w13: an illegal address on the H200. Now a NaN row routes to
    experts in range (its output stays NaN) and the finite rows equal the ref, routed in gemm1 or in their own
    launch."""
    if not route_in_gemm1:
        monkeypatch.setattr(moe_decode_triton, "ROUTE_IN_GEMM1_MAX_TOKENS", 1)
    x = randn(5, 64)
    x[1] = float("nan")
    w = _weights(8, 64, 32, 32, torch.float32)
    out = _call(moe_block_triton, x, w, 2, True, config=DECODE)
    finite = [0, 2, 3, 4]
    assert torch.isnan(out[1]).all()
    assert_close("finite rows", _ref(x[finite], w, 2, True), out[finite], 1e-5)


@triton.jit
def _route_tile_probe(logits_ptr, ids_ptr, num_tokens, E: tl.constexpr, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr,
                      BLOCK_E: tl.constexpr, BLOCK_KK: tl.constexpr):  # fmt: skip
    """Stores the in-kernel routing's ids (gemm1 keeps them in registers where the CPU cannot see an id past E)."""
    o_t = tl.arange(0, BLOCK_T)
    o_j = tl.arange(0, BLOCK_KK)
    m_t = o_t < num_tokens
    b_ids, _ = _route_tile(logits_ptr, E, o_t, m_t, E, TOP_K, True, BLOCK_T, BLOCK_E, BLOCK_KK)
    tl.store(ids_ptr + o_t[:, None] * TOP_K + o_j[None, :], b_ids, mask=m_t[:, None] & (o_j < TOP_K)[None, :])


def test_in_kernel_routing_keeps_a_nan_row_in_range() -> None:
    """gemm1's own routing tile on a NaN row: ids 0..k-1 (NaN first, lowest id first), not E; finite rows as ref."""
    logits = randn(3, 6, scale=2.0)
    logits[1] = float("nan")
    ids = torch.full((3, 2), -7, dtype=torch.int32, device=DEVICE)
    _route_tile_probe[(1,)](logits, ids, 3, E=6, TOP_K=2, BLOCK_T=4, BLOCK_E=8, BLOCK_KK=2)
    assert ids[1].tolist() == [0, 1]
    _, ref_ids = moe_route_ref(logits[[0, 2]], 2, True)
    assert torch.equal(ids[[0, 2]].long(), ref_ids)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shared", [True, False])
def test_moe_block_grouped_path(shared: bool, dtype: torch.dtype) -> None:
    """The block op's grouped path: router logits kernel, moe_route_triton, shared MLP, fused_moe_triton."""
    x = randn(5, 64, dtype=dtype)
    w = _weights(8, 64, 32, 32, dtype)
    _block_against_ref(x, w, 2, shared, GROUPED)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("shared", "choices_per_program"), [(True, 0), (False, 0), (True, 2)])
def test_fused_moe_decode_path_on_given_routing(shared: bool, choices_per_program: int, dtype: torch.dtype) -> None:
    """fused_moe's decode path (the model's call today): given weights and ids, given shared output and gate;
    also with the down GEMM split over the choices (the combine reads the given shared output)."""
    num_tokens, num_experts, top_k, hidden, inter = 4, 8, 3, 64, 32
    x = randn(num_tokens, hidden, dtype=dtype)
    w13 = randn(num_experts, 2 * inter, hidden, dtype=dtype, scale=hidden**-0.5)
    w2 = randn(num_experts, hidden, inter, dtype=dtype, scale=inter**-0.5)
    weights, ids = moe_route_ref(randn(num_tokens, num_experts), top_k, renormalize=True)
    extra = (randn(num_tokens, hidden, dtype=dtype), randn(num_tokens, 1, dtype=dtype, scale=2.0)) if shared else ()
    ref = fused_moe_ref(x, w13, w2, weights, ids, *extra)
    with poisoned_empty():
        # the split case also loads the given routing on a 4-row tile (C17's ROUTE_ROWS, the non-routing path)
        config = _split(DECODE, choices_per_program)
        config = _route_rows(config, 1) if choices_per_program else config
        out = fused_moe_triton(x, w13, w2, weights, ids, *extra, config=config)
    assert_close("out", ref, out, tolerance(dtype, fp32=1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "hidden"),
    [(1, 20, 96), (3, 21, 1100), (4, 20, 96), (5, 20, 96), (20, 21, 1100), (64, 20, 96), (65, 20, 96)],
)
def test_router_logits_kernel_holds_the_gate_logit_in_its_last_column(
    num_tokens: int, num_experts: int, hidden: int, dtype: torch.dtype
) -> None:
    """The router equals F.linear (to an ulp in bf16); the gate logit is column E. Up to 4 tokens the GEMV
    kernel one token a program (an odd row count: the gate row shares a program with an expert row, or sits
    alone; H = 1100: two reduction steps, the second partial), up to 64 tokens 8 a program, then the tl.dot
    kernel (65 tokens: five tiles); with and without the gate. test_moe_align_router.py covers every switch."""
    from deltaserve.kernels.moe_decode_triton import ROUTER_GEMV_MAX_TOKENS, ROUTER_GEMV_SINGLE_MAX_TOKENS

    assert (ROUTER_GEMV_SINGLE_MAX_TOKENS, ROUTER_GEMV_MAX_TOKENS) == (4, 64)  # the parametrisation straddles both
    torch.manual_seed(num_tokens * 7 + num_experts)
    x = randn(num_tokens, hidden, dtype=dtype)
    router, gate = randn(num_experts, hidden, dtype=dtype), randn(1, hidden, dtype=dtype)
    with poisoned_empty():
        logits = router_logits_triton(x, router, gate)
        plain = router_logits_triton(x, router, None)
    assert (
        logits.shape == (num_tokens, num_experts + 1)
        and logits.dtype == dtype
        and plain.shape == (num_tokens, num_experts)
    )
    ref = router_logits_ref(x, router, gate)
    e = num_experts
    # fp32: 1e-5, not 1e-6: over H = 1100 products the two sum orders differ by ~1e-5 absolute. The gate column is
    # checked with the router rows, at their scale: alone, a few tokens' gate logits can sum to near 0 and their
    # relative error be any size (relative RMSE 1.2e-6 seen at 8.97 against 1.05e-5)
    assert_close("router and gate", ref, logits, tolerance(dtype, 1e-5, 4e-3))
    assert_close("router without the gate", ref[:, :e], plain, tolerance(dtype, 1e-5, 4e-3))
    assert torch.equal(router_logits_ref(x, router, None), ref[:, :e])


def test_in_kernel_routing_breaks_ties_to_the_lowest_expert() -> None:
    """Experts 1, 3 and 5 have equal router rows (equal logits): the in-kernel top-k takes them lowest id first,
    as moe_route_triton (and vLLM's topk_softmax), so the block equals fused_moe_ref on that routing."""
    from deltaserve.kernels.moe_routing_triton import moe_route_triton

    x = randn(2, 64).abs()
    w = _weights(8, 64, 32, 32, torch.float32)
    w["router_weight"][[1, 3, 5]] = w["router_weight"][1].abs() + 0.5  # one row three times: tied, and the largest
    logits = router_logits_triton(x, w["router_weight"], None)
    assert torch.equal(logits[:, 1], logits[:, 3]) and torch.equal(logits[:, 1], logits[:, 5])
    weights, ids = moe_route_triton(logits, 2, True)
    assert ids[:, :2].tolist() == [[1, 3], [1, 3]]
    ref = fused_moe_ref(x, w["w13"], w["w2"], weights, ids)
    out = _call(moe_block_triton, x, w, 2, False, config=DECODE)
    assert_close("out", ref, out, 1e-5)


def test_decode_path_refuses_a_batch_past_its_tile() -> None:
    from deltaserve.kernels.moe_configs import DECODE_MAX_TOKENS
    from deltaserve.kernels.moe_decode_triton import decode_gemms

    x = torch.zeros(DECODE_MAX_TOKENS + 1, 16, device=DEVICE)
    w13, w2 = torch.zeros(4, 32, 16, device=DEVICE), torch.zeros(4, 16, 16, device=DEVICE)
    with pytest.raises(ValueError, match="at most 64 tokens"):
        decode_gemms(x, w13, w2, DECODE.gemm1, DECODE.gemm2, logits=torch.zeros(65, 4, device=DEVICE), top_k=2)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 2, 4, 8])
def test_split_down_gemm_is_bitwise_the_one_program_kernel_at_the_served_shape(num_tokens: int) -> None:
    """C16 on the H200 in bf16 at the 35B-A3B shape (E 256, top-8, I 512, H 2048, shared I 512): for the
    committed table's down configs and each choices-per-program the tuner may pick, the block's output equals
    the one-program down kernel's bit for bit (gate/up and routing are the same launches)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    dtype = torch.bfloat16
    x = randn(num_tokens, 2048, dtype=dtype)
    w = _weights(256, 2048, 512, 512, dtype)
    gemm1 = GemmConfig(32, 256, 4, 3)
    for gemm2 in (GemmConfig(32, 256, 8, 1), GemmConfig(16, 128, 4, 1), GemmConfig(8, 128, 4, 1)):
        one = _call(moe_block_triton, x, w, 8, True, config=MoEConfig("decode", gemm1, gemm2))
        for choices_per_program in (1, 2, 4):
            out = _call(moe_block_triton, x, w, 8, True, config=_split(MoEConfig("decode", gemm1, gemm2),
                                                                       choices_per_program))  # fmt: skip
            diff = (out.float() - one.float()).abs().max().item()
            assert torch.equal(out, one), f"{gemm2}, {choices_per_program} choices a program: max diff {diff}"


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 2, 4, 8])
def test_gate_up_with_one_and_two_warps_matches_four_at_the_served_shape(num_tokens: int) -> None:
    """C26 on the H200 in bf16 at the 35B-A3B shape: the committed B = 1 gate/up config with 1 or 2 warps instead of
    4 (the tuner's new candidates: a one-warp program routes with warp shuffles alone, no cross-warp barriers)
    picks the same experts and computes the same GEMMs; warps split the tile, not the K order, so any difference is
    the dot's fragment order (an expert swap would move the output by whole values)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(100 + num_tokens)
    x = randn(num_tokens, 2048, dtype=torch.bfloat16)
    w = _weights(256, 2048, 512, 512, torch.bfloat16)
    gemm2 = GemmConfig(16, 128, 4, 1, CHOICES_PER_PROGRAM=1)
    base = _call(
        moe_block_triton, x, w, 8, True, config=MoEConfig("decode", GemmConfig(32, 64, 4, 8, ROUTE_ROWS=1), gemm2)
    )
    for num_warps, block_n in ((1, 32), (2, 32), (1, 16)):
        gemm1 = GemmConfig(block_n, 64, num_warps, 8, ROUTE_ROWS=1)
        out = _call(moe_block_triton, x, w, 8, True, config=MoEConfig("decode", gemm1, gemm2))
        assert_close(f"{num_warps} warps, BLOCK_N {block_n}", base, out, 1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 2, 4, 8])
def test_routing_on_fewer_rows_matches_the_16_row_tile_at_the_served_shape(num_tokens: int) -> None:
    """C17 on the H200 in bf16 at the 35B-A3B shape: the routing on next_pow2(T) rows picks the same experts
    (an expert swap would move the output by whole values); weights may differ by fp32 sum order only."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    x = randn(num_tokens, 2048, dtype=torch.bfloat16)
    w = _weights(256, 2048, 512, 512, torch.bfloat16)
    base = MoEConfig("decode", GemmConfig(32, 256, 4, 3), GemmConfig(32, 256, 8, 1))
    ref = _call(moe_block_triton, x, w, 8, True, config=base)
    out = _call(moe_block_triton, x, w, 8, True, config=_route_rows(base, 1))
    assert_close("out", ref, out, 1e-3)
