"""The register GEMV (linear_triton) against F.linear, its launch rule, and the dispatcher's routing: up to
GEMV_MAX_ROWS rows without bias to the GEMV, everything else to F.linear."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from deltaserve.kernels._triton import next_pow2
from deltaserve.kernels.linear import linear_ref
from deltaserve.kernels.linear_triton import GEMV_MAX_DEPTH, GEMV_MAX_ROWS, gemv_config, gemv_triton

from ._util import DEVICE, DTYPES, assert_close, poisoned_empty, randn, tolerance

# the module, not the `linear` op that deltaserve.kernels exports under the same name
linear_module = importlib.import_module("deltaserve.kernels.linear")
linear_triton_module = importlib.import_module("deltaserve.kernels.linear_triton")


def test_dispatcher_sends_one_or_two_rows_to_the_gemv(monkeypatch: pytest.MonkeyPatch) -> None:
    """One or two rows without bias take linear_triton's GEMV (where Triton runs); more rows, a bias, a
    vocabulary-sized or too deep weight, or a column-strided x take F.linear."""
    calls: list[int] = []

    def fake(x: torch.Tensor, w: torch.Tensor, config: dict[str, int]) -> torch.Tensor:
        calls.append(x.shape[0])
        return linear_ref(x, w)

    monkeypatch.setattr(linear_module, "use_triton", lambda t: True)
    monkeypatch.setattr(linear_triton_module, "gemv_triton", fake)
    weight, bias = randn(8, 32), randn(8)
    assert GEMV_MAX_ROWS == 2
    for rows in (1, 2, 3, 16, 64):
        x = randn(rows, 32)
        assert_close("y", linear_ref(x, weight), linear_module.linear(x, weight), 1e-6)
    assert linear_module.linear(randn(0, 32), weight).shape == (0, 8)
    assert calls == [1, 2]
    x = randn(1, 32)
    assert_close("y", linear_ref(x, weight, bias), linear_module.linear(x, weight, bias), 1e-6)
    linear_module.linear(randn(1, 64)[:, ::2], weight)  # a column-strided row
    vocab = torch.zeros(linear_module.SKINNY_MAX_COLS, 4, device=DEVICE)  # an lm_head-sized weight stays on cuBLAS
    linear_module.linear(randn(1, 4), vocab)
    deep = GEMV_MAX_DEPTH + 1
    linear_module.linear(randn(1, deep), torch.zeros(4, deep, device=DEVICE))
    assert calls == [1, 2]
    # with the row limit raised (the side-by-side's candidate), rows up to it take the GEMV, more take F.linear
    monkeypatch.setattr(linear_triton_module, "GEMV_MAX_ROWS", 4)
    for rows in (2, 4, 5, 16):
        linear_module.linear(randn(rows, 32), weight)
    assert calls == [1, 2, 2, 4]


def _small_tile(depth: int, block_m: int) -> dict[str, int]:
    """A 256-element tile (several programs even at these widths; the interpreter runs them one after another) for up
    to block_m rows (the rows run one after another over the one tile)."""
    block_k = next_pow2(depth)
    return {"BLOCK_M": block_m, "BLOCK_N": max(1, 256 // block_k), "BLOCK_K": block_k, "num_warps": 8,
            "num_stages": 1}  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("num_rows", "block_m", "num_cols", "depth"), [(1, 1, 40, 64), (3, 4, 17, 96), (4, 4, 9, 300), (2, 8, 5, 2048)]
)
def test_gemv(num_rows: int, block_m: int, num_cols: int, depth: int, dtype: torch.dtype) -> None:
    """The register GEMV against F.linear: N not a multiple of BLOCK_N, K not a power of two (the tile masked past
    K), a row-strided x, 1-4 rows, fewer than the variant's BLOCK_M (its rows past num_rows neither read nor
    written); NaN-poisoned output, so an unwritten element fails."""
    x = randn(num_rows, depth + 8, dtype=dtype)[:, :depth]
    weight = randn(num_cols, depth, dtype=dtype, scale=depth**-0.5)
    with poisoned_empty():
        out = gemv_triton(x, weight, _small_tile(depth, block_m))
    assert out.shape == (num_rows, num_cols) and out.dtype == dtype
    assert_close("y", linear_ref(x, weight), out, tolerance(dtype, fp32=1e-6, low=4e-3))
    with pytest.raises(AssertionError):  # more rows than the variant holds
        gemv_triton(randn(block_m + 1, depth, dtype=dtype), weight, _small_tile(depth, block_m))


def test_gemv_with_the_served_config() -> None:
    """One row through gemv_config's tile (one program holds every row of this small weight)."""
    x, weight = randn(1, 96), randn(40, 96, scale=96**-0.5)
    with poisoned_empty():
        out = gemv_triton(x, weight, gemv_config(96))
    assert_close("y", linear_ref(x, weight), out, 1e-6)


def test_gemv_config_is_a_function_of_the_depth(monkeypatch: pytest.MonkeyPatch) -> None:
    """16384 weight elements a program at 8 warps, the whole depth (a power of two) in one tile, BLOCK_M the rows'
    power of two; None past GEMV_MAX_DEPTH or GEMV_MAX_ROWS."""
    assert gemv_config(4096) == {"BLOCK_M": 1, "BLOCK_N": 4, "BLOCK_K": 4096, "num_warps": 8, "num_stages": 1}
    assert gemv_config(4096, GEMV_MAX_ROWS + 1) is None and gemv_config(4096, 0) is None
    monkeypatch.setattr(linear_triton_module, "GEMV_MAX_ROWS", 4)
    assert [gemv_config(4096, rows)["BLOCK_M"] for rows in (1, 2, 3, 4)] == [1, 2, 4, 4]
    assert gemv_config(4096, 5) is None
    assert gemv_config(2048)["BLOCK_N"] == 8  # [12352, 2048]: 1544 programs
    assert gemv_config(300)["BLOCK_K"] == 512
    assert gemv_config(GEMV_MAX_DEPTH) is not None
    assert gemv_config(GEMV_MAX_DEPTH + 1) is None
    assert gemv_config(17408) is None  # the 27B shape's down projection stays on cuBLAS


@pytest.mark.gpu
@pytest.mark.parametrize(("num_cols", "depth"), [(2048, 4096), (12352, 2048), (9216, 2048), (2048, 512)])
@pytest.mark.parametrize("num_rows", [1, 2, 4])
def test_gemv_served_shapes(num_rows: int, num_cols: int, depth: int) -> None:
    """The GEMV at the 35B-A3B projections in bf16 under PDL as served: F.linear's accuracy, bitwise repeatable,
    the same bits from a CUDA graph replayed twice (served at GEMV_MAX_ROWS rows; 2 and 4 rows through the served
    tile with BLOCK_M = 4, the candidate limit)."""
    x = randn(num_rows, depth, dtype=torch.bfloat16)
    weight = randn(num_cols, depth, dtype=torch.bfloat16, scale=depth**-0.5)
    config = gemv_config(depth) | {"BLOCK_M": 4}
    with poisoned_empty():
        first = gemv_triton(x, weight, config)
    assert_close("y", F.linear(x, weight), first, 4e-3)
    assert torch.equal(first, gemv_triton(x, weight, config))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = gemv_triton(x, weight, config)
    for _ in range(2):
        captured.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, first)
