"""The gated activations' Triton kernels against their torch twins, including strided rows and widths that are not
powers of 2."""

from __future__ import annotations

import pytest
import torch

from deltaserve.kernels.activation import sigmoid_gate_mul_ref, silu_and_mul_ref
from deltaserve.kernels.activation_triton import sigmoid_gate_mul_triton, silu_and_mul_triton

from ._util import DTYPES, assert_close, poisoned_empty, randn, tolerance


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "inter", "extra_cols"), [(1, 48, 0), (63, 100, 6), (100, 1536, 0)])
def test_silu_and_mul(num_tokens: int, inter: int, extra_cols: int, dtype: torch.dtype) -> None:
    x = randn(num_tokens, 2 * inter + extra_cols, dtype=dtype, scale=3.0)[:, : 2 * inter]
    ref = silu_and_mul_ref(x)
    with poisoned_empty():
        out = silu_and_mul_triton(x)
    assert_close("out", ref, out, tolerance(dtype, fp32=2e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "width", "extra_cols"), [(1, 256, 0), (5, 4096, 4096), (37, 200, 8)])
def test_sigmoid_gate_mul(num_tokens: int, width: int, extra_cols: int, dtype: torch.dtype) -> None:
    o = randn(num_tokens, width, dtype=dtype, scale=2.0)
    # the gate is a strided column slice, as the q/gate split can hand it over
    gate = randn(num_tokens, width + extra_cols, dtype=dtype, scale=4.0)[:, extra_cols:]
    ref = sigmoid_gate_mul_ref(o, gate)
    with poisoned_empty():
        out = sigmoid_gate_mul_triton(o, gate)
    assert_close("out", ref, out, tolerance(dtype, fp32=2e-6))
