"""silu_and_mul_triton against its torch twin, including strided rows and widths that are not powers of 2."""

from __future__ import annotations

import pytest
import torch

from deltaserve.kernels.activation import silu_and_mul_ref
from deltaserve.kernels.activation_triton import silu_and_mul_triton

from ._util import DTYPES, assert_close, poisoned_empty, randn, tolerance


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "inter", "extra_cols"), [(1, 48, 0), (63, 100, 6), (100, 1536, 0)])
def test_silu_and_mul(num_tokens: int, inter: int, extra_cols: int, dtype: torch.dtype) -> None:
    x = randn(num_tokens, 2 * inter + extra_cols, dtype=dtype, scale=3.0)[:, : 2 * inter]
    ref = silu_and_mul_ref(x)
    with poisoned_empty():
        out = silu_and_mul_triton(x)
    assert_close("out", ref, out, tolerance(dtype, fp32=2e-6))
