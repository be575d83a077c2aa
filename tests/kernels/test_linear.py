"""The skinny GEMM (linear_triton) against F.linear, its split-K reduction (KERNEL_NOTES C18), and the dispatcher's
routing by row count."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from deltaserve.kernels.linear import linear_ref
from deltaserve.kernels.linear_triton import (
    SPLITK_MAX_PROGRAMS,
    SPLITK_TARGET_PROGRAMS,
    linear_triton,
    skinny_config,
    split_counters,
)

from ._util import DEVICE, DTYPES, assert_close, poisoned_empty, randn, tolerance

# the module, not the `linear` op that deltaserve.kernels exports under the same name
linear_module = importlib.import_module("deltaserve.kernels.linear")


@pytest.fixture
def skinny(monkeypatch: pytest.MonkeyPatch) -> None:
    """linear_triton without the one-row GEMV (C29), so one-row cases reach the tensor-core skinny GEMM."""
    import deltaserve.kernels.linear_triton as linear_triton_module

    monkeypatch.setattr(linear_triton_module, "USE_GEMV", False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_rows", "num_cols", "depth"), [(1, 40, 64), (3, 17, 96), (16, 48, 300)])
def test_linear_triton(num_rows: int, num_cols: int, depth: int, dtype: torch.dtype, skinny: None) -> None:
    """Odd widths: N not a multiple of BLOCK_N, K not a multiple of BLOCK_K; up to the 16-row tile."""
    x = randn(num_rows, depth + 8, dtype=dtype)[:, :depth]  # a row-strided input is accepted
    weight = randn(num_cols, depth, dtype=dtype, scale=depth**-0.5)
    with poisoned_empty():
        out = linear_triton(x, weight)
    assert out.shape == (num_rows, num_cols) and out.dtype == dtype
    assert_close("y", linear_ref(x, weight), out, tolerance(dtype, fp32=1e-6, low=4e-3))


def test_linear_triton_refuses_more_than_16_rows() -> None:
    with pytest.raises(ValueError, match="at most 16 rows"):
        linear_triton(torch.zeros(17, 8, device=DEVICE), torch.zeros(4, 8, device=DEVICE))


def test_dispatcher_sends_one_row_to_the_gemv(monkeypatch: pytest.MonkeyPatch) -> None:
    """One row without bias takes linear_triton's GEMV (where Triton runs, USE_GEMV on); more rows, a bias, a
    vocabulary-sized or too deep weight, a column-strided x, or USE_GEMV off take F.linear."""
    import deltaserve.kernels.linear_triton as linear_triton_module

    calls: list[int] = []

    def fake(x: torch.Tensor, w: torch.Tensor, config: dict[str, int]) -> torch.Tensor:
        calls.append(x.shape[0])
        return linear_ref(x, w)

    monkeypatch.setattr(linear_module, "use_triton", lambda t: True)
    monkeypatch.setattr(linear_triton_module, "gemv_triton", fake)
    assert linear_triton_module.USE_GEMV and linear_triton_module.GEMV_MAX_ROWS == 1
    weight, bias = randn(8, 32), randn(8)
    for rows in (1, 2, 16, 64):
        x = randn(rows, 32)
        assert_close("y", linear_ref(x, weight), linear_module.linear(x, weight), 1e-6)
    assert calls == [1]
    x = randn(1, 32)
    assert_close("y", linear_ref(x, weight, bias), linear_module.linear(x, weight, bias), 1e-6)
    linear_module.linear(randn(1, 64)[:, ::2], weight)  # a column-strided row
    vocab = torch.zeros(linear_module.SKINNY_MAX_COLS, 4, device=DEVICE)  # an lm_head-sized weight stays on cuBLAS
    linear_module.linear(randn(1, 4), vocab)
    deep = linear_triton_module.GEMV_MAX_DEPTH + 1
    linear_module.linear(randn(1, deep), torch.zeros(4, deep, device=DEVICE))
    assert calls == [1]
    monkeypatch.setattr(linear_triton_module, "USE_GEMV", False)
    linear_module.linear(x, weight)
    assert calls == [1]


def test_skinny_config_fills_the_h200() -> None:
    """Every projection of both shapes gets at least 128 programs, or all its columns at 16 per program."""
    for num_cols in (64, 96, 2048, 5120, 9216, 10240, 12288, 16384, 34816, 248320):
        config = skinny_config(num_cols, 2048)
        programs = -(-num_cols // config["BLOCK_N"])
        assert programs >= 128 or config["BLOCK_N"] == 16, (num_cols, config)


def test_skinny_config_splits_the_2048_output_projections() -> None:
    """The 2048-output projections reach ~4 programs per SM (C18); weights with >= ~3 per SM keep SPLIT_K = 1."""
    assert skinny_config(2048, 4096)["SPLIT_K"] == 4  # out_proj / o_proj: 128 column blocks x 4
    assert skinny_config(12352, 2048)["SPLIT_K"] == 1  # in_proj: 386 column blocks, ~3 per SM already
    assert skinny_config(248320, 2048)["SPLIT_K"] == 1
    assert skinny_config(2048, 512)["SPLIT_K"] == 1  # too shallow to split
    for num_cols, depth in ((2048, 4096), (9216, 2048), (5120, 6144), (5120, 17408)):
        config = skinny_config(num_cols, depth)
        programs = -(-num_cols // config["BLOCK_N"]) * config["SPLIT_K"]
        # ~4 per SM: 512 for [2048, 4096], 576 for [9216, 2048], 640 for the 27B shape's 5120-output weights
        assert 0.9 * SPLITK_TARGET_PROGRAMS <= programs <= SPLITK_MAX_PROGRAMS, (num_cols, depth, config)


def _force_config(monkeypatch: pytest.MonkeyPatch, split_k: int, block_k: int = 64) -> None:
    """Small tiles, the given SPLIT_K, whatever the shape (the interpreter runs programs one after another)."""
    import deltaserve.kernels.linear_triton as linear_triton_module

    config = {"BLOCK_N": 16, "BLOCK_K": block_k, "SPLIT_K": split_k, "num_warps": 4, "num_stages": 2}
    monkeypatch.setattr(linear_triton_module, "skinny_config", lambda num_cols, depth: config)


@pytest.mark.parametrize("split_k", [1, 2, 4])
@pytest.mark.parametrize("num_rows", [1, 3, 16])
def test_linear_triton_split_k(monkeypatch: pytest.MonkeyPatch, split_k: int, num_rows: int, skinny: None) -> None:
    """K = 300 is no multiple of SPLIT_K x BLOCK_K (at 4 the last split lies wholly past K); N = 40 leaves a
    partial column block. Three calls in a row: equal bits (fixed split order) and the counters back at 0."""
    _force_config(monkeypatch, split_k)
    x = randn(num_rows, 300)
    weight = randn(40, 300, scale=300**-0.5)
    outs = []
    for _ in range(3):
        with poisoned_empty():  # the output and the partials workspace start as NaN
            outs.append(linear_triton(x, weight))
    assert_close("y", F.linear(x, weight), outs[0], 1e-6)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2])
    assert not split_counters(x.device).any()


def test_linear_triton_split_k_needs_clean_counters(monkeypatch: pytest.MonkeyPatch, skinny: None) -> None:
    """A counter left non-zero makes a program of that column block reduce before all partials are in:
    the test's guard against a missing reset (NaN-poisoned partials show up in y)."""
    _force_config(monkeypatch, 2)
    x, weight = randn(3, 256), randn(32, 256, scale=256**-0.5)
    counters = split_counters(x.device)
    counters[1] = 1
    try:
        with poisoned_empty():
            out = linear_triton(x, weight)
        with pytest.raises(AssertionError):
            assert_close("y", F.linear(x, weight), out, 1e-6)
    finally:
        counters.zero_()


@pytest.mark.gpu
@pytest.mark.parametrize(("num_cols", "depth"), [(2048, 4096), (12352, 2048)])
@pytest.mark.parametrize("num_rows", [1, 4, 16])
def test_linear_triton_split_k_served_shapes(num_rows: int, num_cols: int, depth: int, skinny: None) -> None:
    """The 35B-A3B projections (bf16; SPLIT_K 4 for [2048, 4096], 1 for [12352, 2048]): F.linear's accuracy,
    bitwise repeatable, and the same bits from a captured CUDA graph replayed twice (the counters reset inside
    the graph)."""
    assert skinny_config(num_cols, depth)["SPLIT_K"] == (4 if num_cols == 2048 else 1)
    x = randn(num_rows, depth, dtype=torch.bfloat16)
    weight = randn(num_cols, depth, dtype=torch.bfloat16, scale=depth**-0.5)
    with poisoned_empty():
        first = linear_triton(x, weight)
    second = linear_triton(x, weight)
    assert_close("y", F.linear(x, weight), first, 4e-3)
    assert torch.equal(first, second)
    _assert_graph_replays_equal(x, weight, first)
    assert not split_counters(x.device).any()


def _assert_graph_replays_equal(x: torch.Tensor, weight: torch.Tensor, eager: torch.Tensor) -> None:
    """linear_triton captured into a CUDA graph and replayed twice (output NaN-filled before each) gives eager's
    bits."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = linear_triton(x, weight)
    for _ in range(2):
        captured.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_rows", "num_cols", "depth"), [(1, 40, 64), (3, 17, 96), (4, 9, 300), (2, 5, 2048)])
def test_gemv(monkeypatch: pytest.MonkeyPatch, num_rows: int, num_cols: int, depth: int, dtype: torch.dtype) -> None:
    """C29's register GEMV (USE_GEMV) against F.linear: N not a multiple of BLOCK_N, K not a power of two (the
    tile masked past K), a row-strided x, 1-4 rows; NaN-poisoned output, so an unwritten element fails."""
    import deltaserve.kernels.linear_triton as linear_triton_module

    monkeypatch.setattr(linear_triton_module, "USE_GEMV", True)
    monkeypatch.setattr(linear_triton_module, "GEMV_MAX_ROWS", 4)  # served at one row; the kernel takes up to 4
    monkeypatch.setattr(linear_triton_module, "GEMV_TILE_ELEMS", 256)  # several programs even at these widths
    calls = []
    kernel = linear_triton_module._gemv_kernel
    monkeypatch.setattr(linear_triton_module, "_gemv_kernel", _Recording(kernel, calls))
    x = randn(num_rows, depth + 8, dtype=dtype)[:, :depth]
    weight = randn(num_cols, depth, dtype=dtype, scale=depth**-0.5)
    with poisoned_empty():
        out = linear_triton(x, weight)
    assert calls, "the GEMV kernel did not run"
    assert out.shape == (num_rows, num_cols) and out.dtype == dtype
    assert_close("y", linear_ref(x, weight), out, tolerance(dtype, fp32=1e-6, low=4e-3))


class _Recording:
    """Stands in for a @triton.jit kernel: records each launch's grid, then launches the kernel."""

    def __init__(self, kernel: object, calls: list) -> None:
        self._kernel, self._calls = kernel, calls

    def __getitem__(self, grid: tuple) -> object:
        self._calls.append(grid)
        return self._kernel[grid]  # type: ignore[index]


def test_gemv_takes_only_its_rows_and_depths(monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to GEMV_MAX_ROWS rows and depths up to GEMV_MAX_DEPTH take the GEMV with USE_GEMV; more rows, deeper
    weights, or USE_GEMV off take the skinny GEMM."""
    import deltaserve.kernels.linear_triton as linear_triton_module

    calls: list = []
    monkeypatch.setattr(linear_triton_module, "GEMV_MAX_ROWS", 4)
    monkeypatch.setattr(linear_triton_module, "_gemv_kernel", _Recording(linear_triton_module._gemv_kernel, calls))
    weight = randn(8, 64)
    for is_on, num_rows, depth, is_gemv in [(True, 4, 64, True), (True, 5, 64, False), (False, 1, 64, False),
                                             (True, 1, linear_triton_module.GEMV_MAX_DEPTH + 1, False)]:  # fmt: skip
        monkeypatch.setattr(linear_triton_module, "USE_GEMV", is_on)
        calls.clear()
        w = weight if depth == 64 else randn(8, depth)
        linear_triton(randn(num_rows, depth), w)
        assert bool(calls) == is_gemv, (is_on, num_rows, depth)
    assert linear_triton_module.gemv_config(2048, 4096) == {"BLOCK_N": 4, "BLOCK_K": 4096, "num_warps": 8,
                                                            "num_stages": 1}  # fmt: skip
    assert linear_triton_module.gemv_config(12352, 2048)["BLOCK_N"] == 8
    assert linear_triton_module.gemv_config(12352, 2048, num_rows=3)["BLOCK_N"] == 2  # the tile shrinks with rows
    assert linear_triton_module.gemv_config(5120, 17408) is None


@pytest.mark.gpu
@pytest.mark.parametrize(("num_cols", "depth"), [(2048, 4096), (12352, 2048), (9216, 2048), (2048, 512)])
@pytest.mark.parametrize("num_rows", [1, 2, 4])
def test_gemv_served_shapes(monkeypatch: pytest.MonkeyPatch, num_rows: int, num_cols: int, depth: int) -> None:
    """C29 at the 35B-A3B projections in bf16 under PDL as served: F.linear's accuracy, bitwise repeatable, the same
    bits from a CUDA graph replayed twice (served at one row; 2 and 4 rows as the kernel takes them)."""
    import deltaserve.kernels.linear_triton as linear_triton_module

    monkeypatch.setattr(linear_triton_module, "USE_GEMV", True)
    monkeypatch.setattr(linear_triton_module, "GEMV_MAX_ROWS", 4)
    x = randn(num_rows, depth, dtype=torch.bfloat16)
    weight = randn(num_cols, depth, dtype=torch.bfloat16, scale=depth**-0.5)
    with poisoned_empty():
        first = linear_triton(x, weight)
    assert_close("y", F.linear(x, weight), first, 4e-3)
    assert torch.equal(first, linear_triton(x, weight))
    _assert_graph_replays_equal(x, weight, first)
