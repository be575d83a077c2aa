"""The skinny GEMM (linear_triton) against F.linear, and the dispatcher's routing by row count."""

from __future__ import annotations

import importlib

import pytest
import torch

from deltaserve.kernels.linear import linear_ref
from deltaserve.kernels.linear_triton import linear_triton, skinny_config

from ._util import DEVICE, DTYPES, assert_close, poisoned_empty, randn, tolerance

# the module, not the `linear` op that deltaserve.kernels exports under the same name
linear_module = importlib.import_module("deltaserve.kernels.linear")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_rows", "num_cols", "depth"), [(1, 40, 64), (3, 17, 96), (16, 48, 300)])
def test_linear_triton(num_rows: int, num_cols: int, depth: int, dtype: torch.dtype) -> None:
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


def test_dispatcher_sends_decode_rows_to_the_skinny_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to SKINNY_MAX_ROWS rows take linear_triton (where Triton runs); more rows take F.linear."""
    import deltaserve.kernels.linear_triton as linear_triton_module

    calls: list[int] = []

    def fake(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return linear_ref(x, w)

    monkeypatch.setattr(linear_module, "use_triton", lambda t: True)
    monkeypatch.setattr(linear_triton_module, "linear_triton", fake)
    weight = randn(8, 32)
    for rows in (1, 16, 17, 64):
        x = randn(rows, 32)
        assert_close("y", linear_ref(x, weight), linear_module.linear(x, weight), 1e-6)
    assert calls == [1, 16]
    vocab = torch.zeros(linear_module.SKINNY_MAX_COLS, 4, device=DEVICE)  # an lm_head-sized weight stays on cuBLAS
    linear_module.linear(randn(1, 4), vocab)
    assert calls == [1, 16]


def test_skinny_config_fills_the_h200() -> None:
    """Every projection of both shapes gets at least 128 programs, or all its columns at 16 per program."""
    for num_cols in (64, 96, 2048, 5120, 9216, 10240, 12288, 16384, 34816, 248320):
        config = skinny_config(num_cols, 2048)
        programs = -(-num_cols // config["BLOCK_N"])
        assert programs >= 128 or config["BLOCK_N"] == 16, (num_cols, config)
