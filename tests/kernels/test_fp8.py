"""The block-FP8 kernels (kernels/fp8_triton.py) against their plain-torch twins (kernels/fp8.py, fp8_moe.py):
activation quantization bit for bit, the dense GEMM and the FP8 fused MoE to fp32 rounding, each into poisoned
outputs; the RMSNorm that quantizes its own output (kernels/norm_triton.py) bit for bit against the norm then the
quantization, and the GEMMs reading such rows' quantization instead of making one; the refs' rounding points pinned
by hand; the dispatchers' routing. Under TRITON_INTERPRET=1 on the CPU
(fp32 activations, tiny shapes: K and N multiples of 128 and not, M = 1, 3, 17); the bf16 cases at model shapes
are marked gpu and run on the H200.
"""

from __future__ import annotations

import math

import pytest
import torch

from deltaserve.kernels import fp8 as fp8_module
from deltaserve.kernels import fp8_moe as fp8_moe_module
from deltaserve.kernels.activation import sigmoid_gate_mul_ref, silu_and_mul_ref
from deltaserve.kernels.activation_triton import (
    sigmoid_gate_mul_fp8_triton,
    sigmoid_gate_mul_triton,
    silu_and_mul_fp8_triton,
    silu_and_mul_triton,
)
from deltaserve.kernels.fp8 import (
    FP8_DTYPE,
    Fp8Rows,
    Fp8Weight,
    fp8_block_rows,
    fp8_linear_ref,
    gated_rms_norm_fp8_ref,
    quantize_activation_ref,
    rms_norm_fp8_ref,
    sigmoid_gate_mul_fp8_ref,
    silu_and_mul_fp8_ref,
)
from deltaserve.kernels.fp8_moe import fused_moe_fp8_ref
from deltaserve.kernels.fp8_triton import (
    SPLIT_MAX_ROWS,
    fp8_linear_triton,
    fused_moe_fp8_triton,
    quantize_activation_triton,
    split_count,
    split_counts,
)
from deltaserve.kernels.linear import linear
from deltaserve.kernels.moe import moe_route_ref
from deltaserve.kernels.norm import gated_rms_norm_ref, rms_norm_ref
from deltaserve.kernels.norm_triton import (
    gated_rms_norm_fp8_triton,
    gated_rms_norm_triton,
    rms_norm_fp8_triton,
    rms_norm_triton,
)
from deltaserve.tiny.fp8 import quantize_block_fp8

from ._util import DEVICE, assert_close, poisoned_empty

FP32_RATIO = 1e-6  # relative RMSE: the same fp32 products summed in another order
# Hopper's 8-bit wgmma (the 64- and 128-row tiles, gemm_blocks) accumulates a 128-deep dot in fewer bits than fp32
# (docs/fp8.md#computing-it-the-rounding-points: 8.8e-5 measured at 65 rows on an H100); 16- and 32-row tiles
# (up to 32 rows) use mma.sync
WGMMA_RATIO = 5e-4 if DEVICE.type == "cuda" else FP32_RATIO


def _weight(*shape: int, parts: tuple[int, ...] | None = None, seed: int = 0) -> Fp8Weight:
    """A random block-FP8 weight [..., N, K] quantized as the checkpoint writer does, in the layout `parts` gives."""
    torch.manual_seed(seed)
    dense = torch.randn(*shape) * 0.05
    flat = dense.reshape(-1, *shape[-2:])
    quantized = [quantize_block_fp8(w) for w in flat]
    q = torch.stack([a for a, _ in quantized]).reshape(shape)
    scale = torch.stack([b for _, b in quantized]).reshape(*shape[:-2], *quantized[0][1].shape)
    block_n = fp8_block_rows(parts or (shape[-2],))
    if block_n == 1:
        scale = scale.repeat_interleave(128, dim=-2)[..., : shape[-2], :]
    return Fp8Weight.of(q.to(DEVICE), scale.contiguous().to(DEVICE), block_n)


def _x(rows: int, cols: int, seed: int = 1) -> torch.Tensor:
    torch.manual_seed(seed)
    x = torch.randn(rows, cols) * torch.logspace(-2, 1, cols)  # groups of very different ranges
    if rows > 2:
        x[1] = 0.0  # an all-zero row: the amax floor
    return x.to(DEVICE)


def test_ref_rounding_points_by_hand() -> None:
    """One group: scale = amax / 448, q = round_e4m3(x / scale); the GEMM is (q_x . q_w) · s_x · s_w, rounded once."""
    x = torch.tensor([[3.0, -1.5, 0.1, 448.0 / 64]])  # amax 7: scale 1/64
    q, s = quantize_activation_ref(x)
    assert s.tolist() == [[7.0 / 448.0]]
    assert q.float().tolist() == [[192.0, -96.0, 6.5, 448.0]]  # 0.1 * 64 = 6.4 -> 6.5 (e4m3 steps of 0.5 there)
    weight = Fp8Weight.of(torch.tensor([[1.0, 2.0, 0.0, 0.5]]).to(FP8_DTYPE), torch.tensor([[0.25]]), 128)
    expected = (192.0 - 192.0 + 0.0 + 224.0) * (7.0 / 448.0) * 0.25
    assert fp8_linear_ref(x, weight).item() == pytest.approx(expected, rel=1e-7)
    zeros, zero_scale = quantize_activation_ref(torch.zeros(1, 3))
    assert zeros.float().abs().sum() == 0 and zero_scale.item() == pytest.approx(1e-10 / 448.0)


def test_ref_sums_k_blocks_with_their_own_scales() -> None:
    """K = 256: two groups with scales 1/448 and 100/448, each block's dot scaled separately (not one scale)."""
    x = torch.cat([torch.full((1, 128), 1.0), torch.full((1, 128), 100.0)], dim=1)
    q, s = quantize_activation_ref(x)
    assert torch.equal(s, torch.tensor([[1.0, 100.0]]) / 448.0) and q.float().unique().tolist() == [448.0]
    weight = Fp8Weight.of(torch.ones(1, 256).to(FP8_DTYPE), torch.tensor([[1.0, 2.0]]), 128)
    assert fp8_linear_ref(x, weight).item() == pytest.approx(128 * 1.0 + 128 * 100.0 * 2.0, rel=1e-6)


@pytest.mark.parametrize(("rows", "cols"), [(1, 64), (3, 128), (17, 200), (3, 384)])
def test_activation_quantization_is_bit_exact(rows: int, cols: int) -> None:
    x = _x(rows, cols)
    q_ref, s_ref = quantize_activation_ref(x)
    with poisoned_empty():
        q, s = quantize_activation_triton(x)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def test_activation_rounding_ties_and_binade_carries_are_bit_exact() -> None:
    """Every positive e4m3 value, every midpoint between neighbours (ties to even) and values just below each
    power of two (the rounding carries into the exponent), subnormals included, with the scale pinned to 1 by a
    leading 448 in each group."""
    grid = torch.arange(0, 127, dtype=torch.uint8).view(FP8_DTYPE).float()  # 0 .. 448
    mids = (grid[1:] + grid[:-1]) / 2
    values = torch.cat([grid, mids, mids * (1 - 2**-12), mids * (1 + 2**-12), -mids])
    groups = math.ceil(values.numel() / 127)
    x = torch.zeros(groups, 128)
    x[:, 0] = 448.0
    x.view(-1)[torch.arange(values.numel()) + torch.arange(values.numel()) // 127 + 1] = values
    x = x.view(1, -1).to(DEVICE)
    q_ref, s_ref = quantize_activation_ref(x)
    assert torch.equal(s_ref, torch.ones_like(s_ref))
    q, _ = quantize_activation_triton(x)
    # values, not bits: the interpreter's cast writes -0 as +0 (-mids[0], a tie between -0 and -2^-9, is -0)
    assert torch.equal(q.float(), q_ref.float())


GEMM_SHAPES = [  # (N, K, parts): K and N multiples of 128 and not; block scales and per-row scales
    (64, 64, None),
    (256, 128, (128, 128)),
    (96, 200, (32, 64)),
    (192, 256, (64, 64, 64)),
]


@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize(("num_cols", "depth", "parts"), GEMM_SHAPES)
def test_gemm_matches_ref(rows: int, num_cols: int, depth: int, parts: tuple[int, ...] | None) -> None:
    weight = _weight(num_cols, depth, parts=parts)
    x = _x(rows, depth)
    bias = _x(1, num_cols, seed=2)[0] if rows == 3 else None
    with poisoned_empty():
        out = fp8_linear_triton(x, weight, bias)
    assert_close("y", fp8_linear_ref(x, weight, bias), out, FP32_RATIO)


@pytest.mark.parametrize("rows", [1, 17, SPLIT_MAX_ROWS + 1])
def test_split_k_partials_sum_to_the_ref(rows: int) -> None:
    """Decode-sized launches split K (4 splits of 2 groups here: the CPU counts 4 SMs) and sum the fp32 partials in
    split order before the one rounding and the bias; past SPLIT_MAX_ROWS one program walks all of K."""
    weight = _weight(64, 1024)
    x = _x(rows, 1024)
    bias = _x(1, 64, seed=2)[0]
    assert split_count(rows, 1, 8, 4) == ((4, 2) if rows <= SPLIT_MAX_ROWS else (1, 8))
    with poisoned_empty():
        out = fp8_linear_triton(x, weight, bias)
    assert_close("y", fp8_linear_ref(x, weight, bias), out, FP32_RATIO if rows <= 32 else WGMMA_RATIO)


def test_split_tiles_are_summed_by_their_last_program_and_leave_the_counts_at_zero() -> None:
    """No second launch: each tile's last program sums the partials. Its counts go back to zero (the next launch,
    or a CUDA-graph replay, starts from there), so a repeat is bit-equal; a count left behind would be read as
    progress, and then no program would write the tile (here: NaN stays)."""
    weight, x = _weight(64, 1024), _x(1, 1024)
    with poisoned_empty():
        first = fp8_linear_triton(x, weight)
    counts = split_counts(x.device, 1)
    assert not counts.any()
    assert torch.equal(fp8_linear_triton(x, weight), first)
    counts[0] = 4  # as if a launch had been cut short: every program of the tile now sees a count past the last
    try:
        with poisoned_empty():
            assert torch.isnan(fp8_linear_triton(x, weight)).all()
    finally:
        counts.zero_()


def test_split_counts_are_powers_of_two_that_leave_no_split_empty() -> None:
    assert split_count(1, 32, 32, 132) == (16, 2)  # N = 2048 at 64 columns a tile, K = 4096: 512 programs
    assert split_count(1, 144, 16, 132) == (4, 4)
    assert split_count(1, 544, 40, 132) == (1, 40)  # enough tiles already
    assert split_count(1, 80, 136, 132) == (4, 34)
    assert split_count(1, 1, 3, 132) == (1, 3)  # fewer than two groups a split: none
    for tiles, groups in ((3, 9), (7, 25), (1, 5), (2, 64)):
        splits, per_split = split_count(1, tiles, groups, 8)
        assert (splits - 1) * per_split < groups <= splits * per_split  # every split has a group


def test_gemm_takes_a_column_strided_input() -> None:
    weight = _weight(64, 128)
    x = _x(3, 256)[:, ::2]  # [3, 128], column stride 2
    assert_close("y", fp8_linear_ref(x, weight), fp8_linear_triton(x, weight), FP32_RATIO)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


def _assert_quantizes_bitwise(rows: Fp8Rows, y: torch.Tensor) -> None:
    """On the GPU: the rows are y and their quantization is quantize_activation_triton(y), every bit (e4m3 -0
    included, which the interpreter cannot write)."""
    q, scale = quantize_activation_triton(y)
    assert torch.equal(rows.x, y) and torch.equal(rows.scale, scale) and torch.equal(_bits(rows.q), _bits(q))


def _assert_rows_equal(rows: Fp8Rows, y: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    assert torch.equal(rows.x, y)
    assert torch.equal(rows.scale, scale)
    assert torch.equal(rows.q.float(), q.float())  # values: the interpreter's cast writes -0 as +0


@pytest.mark.parametrize(("rows", "cols"), [(1, 64), (3, 200), (5, 384)])
@pytest.mark.parametrize("has_residual", [False, True])
def test_rms_norm_fp8_is_the_norm_then_the_quantization(rows: int, cols: int, has_residual: bool) -> None:
    """The norm's rows bit for bit as rms_norm_triton's, the residual sum too, and their quantization bit for bit
    as quantize_activation_triton's of those rows (one launch instead of two); the ref twin is rms_norm_ref then
    quantize_activation_ref."""
    x, weight = _x(rows, cols), _x(1, cols, seed=7)[0] * 0.1
    residual = _x(rows, cols, seed=8) if has_residual else None
    with poisoned_empty():
        normed, residual_out = rms_norm_fp8_triton(x, weight, 1e-6, residual)
    y, residual_plain = rms_norm_triton(x, weight, 1e-6, residual)
    _assert_rows_equal(normed, y, *quantize_activation_triton(y))
    if has_residual:
        assert residual_out is not None and torch.equal(residual_out, residual_plain)
    ref, ref_residual = rms_norm_fp8_ref(x, weight, 1e-6, residual)
    y_ref, residual_ref = rms_norm_ref(x, weight, 1e-6, residual)
    _assert_rows_equal(ref, y_ref, *quantize_activation_ref(y_ref))
    assert (ref_residual is None) == (residual is None)
    if residual_ref is not None:
        assert torch.equal(ref_residual, residual_ref)


@pytest.mark.parametrize("cols", [64, 200, 384, 1536])  # 1536: a 1,024-column block and a 512-column one a row
def test_gated_activations_quantize_their_rows_in_the_same_launch(cols: int) -> None:
    """SiLU-and-mul (before a down projection) and the attention output gate (before o_proj) with their rows'
    quantization: the rows bit for bit as the plain kernels', the quantization as quantize_activation_triton's of
    them; the ref twins are the plain refs then quantize_activation_ref."""
    gate_up, o, gate = _x(3, 2 * cols), _x(3, cols, seed=2), _x(3, cols, seed=3)
    cases = (
        (silu_and_mul_fp8_triton, silu_and_mul_triton, silu_and_mul_fp8_ref, silu_and_mul_ref, (gate_up,)),
        (
            sigmoid_gate_mul_fp8_triton,
            sigmoid_gate_mul_triton,
            sigmoid_gate_mul_fp8_ref,
            sigmoid_gate_mul_ref,
            (o, gate),
        ),
    )
    for fused, plain_kernel, fused_ref, plain_ref, args in cases:
        with poisoned_empty():
            rows = fused(*args)
        y = plain_kernel(*args)
        _assert_rows_equal(rows, y, *quantize_activation_triton(y))
        y_ref = plain_ref(*args)
        _assert_rows_equal(fused_ref(*args), y_ref, *quantize_activation_ref(y_ref))


@pytest.mark.parametrize(("heads", "dim"), [(3, 128), (2, 256), (4, 64)])  # d = 64: the norm, then a quantization
def test_gated_norm_quantizes_out_projs_rows(heads: int, dim: int) -> None:
    """The GDN's gated norm as the [T, heads·d] rows out_proj reads, with their quantization: rows bit for bit as
    gated_rms_norm_triton's, quantization as quantize_activation_triton's of them (one launch when d is whole
    groups); the ref twin is gated_rms_norm_ref then quantize_activation_ref."""
    x, z, weight = _x(5, heads * dim).view(5, heads, dim), _x(5, heads * dim, seed=4).view(5, heads, dim), _x(1, dim)[0]
    with poisoned_empty():
        rows = gated_rms_norm_fp8_triton(x, z, weight, 1e-6)
    y = gated_rms_norm_triton(x, z, weight, 1e-6).reshape(5, heads * dim)
    _assert_rows_equal(rows, y, *quantize_activation_triton(y))
    y_ref = gated_rms_norm_ref(x, z, weight, 1e-6).reshape(5, heads * dim)
    _assert_rows_equal(gated_rms_norm_fp8_ref(x, z, weight, 1e-6), y_ref, *quantize_activation_ref(y_ref))


def _rows_with_wrong_scale(x: torch.Tensor) -> Fp8Rows:
    """x's quantization with every scale doubled: a GEMM that reads it gives twice the product."""
    q, scale = quantize_activation_ref(x)
    return Fp8Rows(x, q, scale * 2)


@pytest.mark.parametrize("rows", [1, 17])
def test_gemm_reads_the_rows_quantization(rows: int) -> None:
    """Fp8Rows: the GEMM takes their q / scale (doubling the scales doubles the output, so it did not quantize x
    again), and with their true quantization it equals the GEMM of x; bf16 projections read the plain rows."""
    weight, x = _weight(96, 256), _x(rows, 256)
    quantized = Fp8Rows(x, *quantize_activation_triton(x))
    for gemm in (fp8_linear_triton, fp8_linear_ref):
        with poisoned_empty():
            assert torch.equal(gemm(quantized, weight), gemm(x, weight))
            assert_close("2y", 2 * gemm(x, weight), gemm(_rows_with_wrong_scale(x), weight), FP32_RATIO)
    plain_weight = _x(8, 256, seed=9)
    assert torch.equal(linear(quantized, plain_weight), linear(x, plain_weight))


def _routes(tokens: int, experts: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(3)
    return moe_route_ref(torch.randn(tokens, experts, device=DEVICE), top_k, True)


@pytest.mark.parametrize(("tokens", "hidden", "inter", "has_shared"), [(1, 64, 32, True), (5, 192, 128, False)])
def test_fused_moe_matches_ref(tokens: int, hidden: int, inter: int, has_shared: bool) -> None:
    experts, top_k = 4, 2
    w13 = _weight(experts, 2 * inter, hidden, parts=(inter, inter))
    w2 = _weight(experts, hidden, inter, seed=4)
    x = _x(tokens, hidden)
    weights, ids = _routes(tokens, experts, top_k)
    shared = (_x(tokens, hidden, seed=5), _x(tokens, 1, seed=6)) if has_shared else (None, None)
    with poisoned_empty():
        out = fused_moe_fp8_triton(x, w13, w2, weights, ids, *shared)
    assert_close("y", fused_moe_fp8_ref(x, w13, w2, weights, ids, *shared), out, FP32_RATIO)


def test_fused_moe_reads_the_rows_quantization() -> None:
    """The FP8 experts' gate/up GEMM reads Fp8Rows' quantization (kernel and ref), token chunks slicing it."""
    experts, hidden, inter, top_k, tokens = 4, 128, 64, 2, 3
    w13 = _weight(experts, 2 * inter, hidden, parts=(inter, inter))
    w2 = _weight(experts, hidden, inter, seed=4)
    x = _x(tokens, hidden)
    weights, ids = _routes(tokens, experts, top_k)
    quantized = Fp8Rows(x, *quantize_activation_ref(x))
    for moe in (fused_moe_fp8_triton, fused_moe_fp8_ref):
        with poisoned_empty():
            assert torch.equal(moe(quantized, w13, w2, weights, ids), moe(x, w13, w2, weights, ids))
            wrong = moe(_rows_with_wrong_scale(x), w13, w2, weights, ids)
        assert not torch.equal(wrong, moe(x, w13, w2, weights, ids))


def test_dispatchers_send_cuda_tensors_to_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(fp8_module, "use_triton", lambda t: True)
    monkeypatch.setattr(fp8_moe_module, "use_triton", lambda t: True)
    import deltaserve.kernels.fp8_triton as triton_module

    monkeypatch.setattr(triton_module, "fp8_linear_triton", lambda *a: calls.append("linear"))
    monkeypatch.setattr(triton_module, "fused_moe_fp8_triton", lambda *a: calls.append("moe"))
    weight = _weight(64, 64)
    fp8_module.fp8_linear(_x(1, 64), weight)
    fp8_moe_module.fused_moe_fp8(_x(1, 64), _weight(2, 64, 64), _weight(2, 64, 32), *_routes(1, 2, 1))
    assert calls == ["linear", "moe"]


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8, 64, 512])
@pytest.mark.parametrize(("num_cols", "depth"), [(4096, 2048), (2048, 4096), (12288, 5120)])
def test_gemm_bf16_model_shapes(rows: int, num_cols: int, depth: int) -> None:
    """bf16 activations at 35B-A3B / 27B projection shapes: the fp8 tensor-core dot against the fp32 ref, within
    bf16 rounding."""
    weight = _weight(num_cols, depth)
    x = _x(rows, depth).bfloat16()
    with poisoned_empty():
        out = fp8_linear_triton(x, weight)
    assert_close("y", fp8_linear_ref(x, weight), out, 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 16, 300])
def test_fused_moe_bf16_model_shape(tokens: int) -> None:
    """The 35B-A3B expert shape (E = 256, I = 512, H = 2048, top-8) in bf16."""
    experts, hidden, inter, top_k = 256, 2048, 512, 8
    w13 = _weight(experts, 2 * inter, hidden, parts=(inter, inter))
    w2 = _weight(experts, hidden, inter, seed=4)
    x = _x(tokens, hidden).bfloat16()
    weights, ids = _routes(tokens, experts, top_k)
    with poisoned_empty():
        out = fused_moe_fp8_triton(x, w13, w2, weights, ids)
    assert_close("y", fused_moe_fp8_ref(x, w13, w2, weights, ids), out, 1e-2)
    assert math.isfinite(float(out.float().abs().max()))


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [2048, 5120])
@pytest.mark.parametrize("rows", [1, 8, 300])
def test_rms_norm_fp8_bf16_model_shapes(hidden: int, rows: int) -> None:
    """bf16 at the 35B-A3B / 27B widths: the fused norm's rows, residual and quantization bit for bit as the two
    launches it replaces."""
    x, residual, weight = _x(rows, hidden).bfloat16(), _x(rows, hidden, seed=8).bfloat16(), _x(1, hidden)[0].bfloat16()
    with poisoned_empty():
        normed, residual_out = rms_norm_fp8_triton(x, weight, 1e-6, residual)
    y, residual_plain = rms_norm_triton(x, weight, 1e-6, residual)
    assert torch.equal(residual_out, residual_plain)
    _assert_quantizes_bitwise(normed, y)


@pytest.mark.gpu
def test_split_gemm_replays_in_a_cuda_graph() -> None:
    """A split launch captured in a CUDA graph and replayed on new inputs gives the eager launch's bits every time:
    each replay finds the tile counts at zero (the last program of every tile resets its count)."""
    weight = _weight(2048, 4096)
    static_x = _x(1, 4096).bfloat16()
    assert split_count(1, 32, 32, torch.cuda.get_device_properties(0).multi_processor_count)[0] > 1
    fp8_linear_triton(static_x, weight)  # compile and make the counts outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = fp8_linear_triton(static_x, weight)
    for seed in range(5):
        static_x.copy_(_x(1, 4096, seed=10 + seed).bfloat16())
        graph.replay()
        assert torch.equal(static_y, fp8_linear_triton(static_x, weight))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 300])
def test_gated_activations_fp8_bf16_model_shapes(rows: int) -> None:
    """bf16 at the 35B-A3B shared expert's and the 27B MLP's widths (512, 17,408) and the attention gates' (4,096,
    6,144): rows and quantization bit for bit as the two launches each replaces."""
    for cols in (512, 17408):
        gate_up = _x(rows, 2 * cols).bfloat16()
        _assert_quantizes_bitwise(silu_and_mul_fp8_triton(gate_up), silu_and_mul_triton(gate_up))
    for cols in (4096, 6144):
        o, gate = _x(rows, cols).bfloat16(), _x(rows, cols, seed=3).bfloat16()
        _assert_quantizes_bitwise(sigmoid_gate_mul_fp8_triton(o, gate), sigmoid_gate_mul_triton(o, gate))


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [32, 48])  # the 35B-A3B's and the 27B's value heads, d = 128
def test_gated_norm_fp8_bf16_model_shapes(heads: int) -> None:
    for tokens in (1, 300):
        x = _x(tokens, heads * 128).bfloat16().view(tokens, heads, 128)
        z = _x(tokens, heads * 128, seed=4).bfloat16().view(tokens, heads, 128)
        weight = _x(1, 128)[0].bfloat16()
        y = gated_rms_norm_triton(x, z, weight, 1e-6).reshape(tokens, heads * 128)
        _assert_quantizes_bitwise(gated_rms_norm_fp8_triton(x, z, weight, 1e-6), y)
