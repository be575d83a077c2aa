"""rms_norm_triton (plain and fused residual add, 2-D and strided 3-D inputs) and gated_rms_norm_triton."""

from __future__ import annotations

import pytest
import torch

from deltaserve.kernels.norm import gated_rms_norm_ref, rms_norm_ref
from deltaserve.kernels.norm_triton import gated_rms_norm_triton, rms_norm_triton

from ._util import DTYPES, assert_close, poisoned_empty, randn, tolerance

EPS = 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize(("num_tokens", "dim"), [(1, 64), (63, 96), (100, 512), (5, 4096)])
def test_rms_norm_2d(num_tokens: int, dim: int, with_residual: bool, dtype: torch.dtype) -> None:
    x = randn(num_tokens, dim, dtype=dtype, scale=3.0)
    residual = randn(num_tokens, dim, dtype=dtype) if with_residual else None
    weight = randn(dim, scale=0.1)
    ref, ref_res = rms_norm_ref(x, weight, EPS, residual)
    with poisoned_empty():
        out, out_res = rms_norm_triton(x, weight, EPS, residual)
    assert_close("y", ref, out, tolerance(dtype, fp32=2e-6))
    if with_residual:
        assert_close("residual", ref_res, out_res, tolerance(dtype, fp32=1e-7, low=1e-3))
    else:
        assert out_res is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "heads", "dim"), [(1, 2, 32), (63, 3, 64)])
def test_rms_norm_strided_heads(num_tokens: int, heads: int, dim: int, dtype: torch.dtype) -> None:
    # The four-op preamble's call: the query halves of per-head [query | gate] pairs, a strided 3-D view.
    q_gate = randn(num_tokens, heads * 2 * dim + 8, dtype=dtype)[:, : heads * 2 * dim]
    x = q_gate.reshape(num_tokens, heads, 2 * dim)[..., :dim]
    weight = randn(dim, scale=0.1)
    ref, _ = rms_norm_ref(x, weight, EPS)
    with poisoned_empty():
        out, _ = rms_norm_triton(x, weight, EPS)
    assert out.shape == x.shape and out.is_contiguous()
    assert_close("y", ref, out, tolerance(dtype, fp32=2e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "heads", "dim"), [(1, 2, 32), (63, 4, 64), (100, 2, 128)])
def test_gated_rms_norm(num_tokens: int, heads: int, dim: int, dtype: torch.dtype) -> None:
    x = randn(num_tokens, heads, dim, dtype=dtype)
    # z is a slice of a wider projection output, as it comes out of in_proj_qkvz.
    z = randn(num_tokens, heads * dim + 16, dtype=dtype)[:, : heads * dim].reshape(num_tokens, heads, dim)
    weight = randn(dim, scale=0.5) + 1.0
    ref = gated_rms_norm_ref(x, z, weight, EPS)
    with poisoned_empty():
        out = gated_rms_norm_triton(x, z, weight, EPS)
    assert_close("y", ref, out, tolerance(dtype, fp32=2e-6))
