"""attn_preamble_triton and rotary_embedding_triton against their torch twins, plus the four-op path."""

from __future__ import annotations

import pytest
import torch

from deltaserve.kernels.preamble import (
    attn_preamble_ref,
    mrope_axis_per_frequency,
    rope_cos_sin_cache,
    rope_cos_sin_for_positions,
    rotary_embedding_ref,
)
from deltaserve.kernels.preamble_triton import attn_preamble_triton, rotary_embedding_triton

from ._util import DEVICE, DTYPES, assert_close, poisoned_empty, randn, tolerance

EPS = 1e-6


def _qkv(num_tokens: int, nq: int, nkv: int, d: int, dtype: torch.dtype, extra_cols: int) -> torch.Tensor:
    """A fused projection output; extra_cols > 0 makes it a strided view (v and more follow in each row)."""
    width = nq * 2 * d + 2 * nkv * d
    full = randn(num_tokens, width + extra_cols, dtype=dtype, scale=2.0)
    return full[:, :width]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("num_tokens", "nq", "nkv", "d", "rot", "extra_cols"),
    [(1, 2, 1, 32, 16, 0), (63, 4, 2, 64, 16, 8), (100, 3, 1, 48, 32, 0), (7, 6, 1, 256, 64, 0)],
)
def test_attn_preamble(
    num_tokens: int, nq: int, nkv: int, d: int, rot: int, extra_cols: int, dtype: torch.dtype
) -> None:
    qkv = _qkv(num_tokens, nq, nkv, d, dtype, extra_cols)
    q_w, k_w = randn(d, scale=0.1), randn(d, scale=0.1)
    cache = rope_cos_sin_cache(rot, 4096, 1e7, dtype, DEVICE)
    positions = torch.randint(0, 4096, (3, num_tokens), device=DEVICE)
    cos_sin = rope_cos_sin_for_positions(cache, positions, mrope_axis_per_frequency(rot // 2, [2, 3, 3], DEVICE))
    ref = attn_preamble_ref(qkv, q_w, k_w, cos_sin, nq, nkv, d, rot, EPS)
    with poisoned_empty():
        out = attn_preamble_triton(qkv, q_w, k_w, cos_sin, nq, nkv, d, rot, EPS)
    for name, r, o in zip(("q", "k", "gate"), ref, out, strict=True):
        assert o.is_contiguous()
        assert_close(name, r, o, tolerance(dtype, fp32=2e-6, low=4e-3))
    assert torch.equal(ref[2], out[2]), "the gate is a raw copy"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "nq", "nkv", "d", "rot"), [(1, 2, 1, 32, 16), (63, 4, 2, 64, 32)])
def test_rotary_embedding(num_tokens: int, nq: int, nkv: int, d: int, rot: int, dtype: torch.dtype) -> None:
    q_full = randn(num_tokens, nq * d + 16, dtype=dtype)
    q, k = q_full[:, : nq * d], randn(num_tokens, nkv * d, dtype=dtype)
    cache = rope_cos_sin_cache(rot, 512, 1e7, dtype, DEVICE)
    positions = torch.randint(0, 512, (num_tokens,), device=DEVICE)
    ref = rotary_embedding_ref(positions, q, k, cache, d, rot)
    with poisoned_empty():
        out = rotary_embedding_triton(positions, q, k, cache, d, rot)
    for name, r, o in zip(("q", "k"), ref, out, strict=True):
        assert_close(name, r, o, tolerance(dtype, fp32=2e-6, low=4e-3))


@pytest.mark.parametrize("dtype", DTYPES)
def test_unfused_path_matches_fused(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """The four-op path with every op on Triton (as on CUDA) against the fused kernel, for 1-D positions."""
    from deltaserve.kernels import _dispatch, preamble

    monkeypatch.setattr(_dispatch, "use_triton", lambda t: True)
    num_tokens, nq, nkv, d, rot = 33, 4, 2, 64, 16
    qkv = _qkv(num_tokens, nq, nkv, d, dtype, extra_cols=0)
    q_w, k_w = randn(d, scale=0.1), randn(d, scale=0.1)
    cache = rope_cos_sin_cache(rot, 1024, 1e7, dtype, DEVICE)
    positions = torch.randint(0, 1024, (num_tokens,), device=DEVICE).expand(3, num_tokens)
    fused = attn_preamble_triton(qkv, q_w, k_w, cache[positions[0]], nq, nkv, d, rot, EPS)
    with poisoned_empty():
        unfused = preamble.attn_preamble_unfused(qkv, q_w, k_w, positions, cache, nq, nkv, d, rot, EPS)
    for name, f, u in zip(("q", "k", "gate"), fused, unfused, strict=True):
        assert_close(name, f, u, tolerance(dtype, fp32=2e-6, low=2e-3))
