"""store_kv_triton and paged_attention_triton (general varlen path and the split-K decode path)."""

from __future__ import annotations

import pytest
import torch

from deltaserve.kernels.attention import paged_attention_ref, store_kv_ref
from deltaserve.kernels.attention_triton import _paged_attention_decode, paged_attention_triton, store_kv_triton

from ._util import DEVICE, DTYPES, assert_close, poisoned_empty, randn, tolerance, varlen_starts


def _paged_cache(
    seq_lens: list[int], page: int, nkv: int, d: int, dtype: torch.dtype, spare_blocks: int = 3
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random k/v caches and a block table whose pages are shuffled across the pool."""
    pages_per_seq = [max(1, -(-n // page)) for n in seq_lens]
    width = max(pages_per_seq) + 1
    num_blocks = sum(pages_per_seq) + spare_blocks
    k_cache = randn(num_blocks, page, nkv, d, dtype=dtype)
    v_cache = randn(num_blocks, page, nkv, d, dtype=dtype)
    perm = torch.randperm(num_blocks, device=DEVICE)
    block_tables = torch.zeros(len(seq_lens), width, dtype=torch.int32, device=DEVICE)
    used = 0
    for b, n in enumerate(pages_per_seq):
        block_tables[b, :n] = perm[used : used + n].int()
        used += n
    return k_cache, v_cache, block_tables


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv(dtype: torch.dtype) -> None:
    num_tokens, nkv, d, page, num_blocks = 37, 2, 32, 8, 6
    qkv = randn(num_tokens, 4 * nkv * d, dtype=dtype)
    # k contiguous (as the preamble returns it), v a strided slice of the qkv rows.
    k = randn(num_tokens, nkv, d, dtype=dtype)
    v = qkv[:, 2 * nkv * d : 3 * nkv * d].reshape(num_tokens, nkv, d)
    slots = torch.randperm(num_blocks * page, device=DEVICE)[:num_tokens]
    slots[::5] = -1  # CUDA-graph padding rows
    caches = [randn(num_blocks, page, nkv, d, dtype=dtype) for _ in range(2)]
    ref_k, ref_v = (c.clone() for c in caches)
    store_kv_ref(k, v, ref_k, ref_v, slots)
    store_kv_triton(k, v, caches[0], caches[1], slots)
    assert torch.equal(ref_k, caches[0]) and torch.equal(ref_v, caches[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("seq_lens", "q_lens", "nq", "nkv", "d", "page"),
    [
        ([1], [1], 2, 1, 32, 4),
        ([63], [63], 4, 2, 64, 16),
        ([100, 7, 40], [37, 7, 1], 6, 2, 32, 8),  # chunked prefill, a fresh prompt and a decode in one batch
    ],
)
def test_paged_attention_varlen(
    seq_lens: list[int], q_lens: list[int], nq: int, nkv: int, d: int, page: int, dtype: torch.dtype
) -> None:
    k_cache, v_cache, block_tables = _paged_cache(seq_lens, page, nkv, d, dtype)
    q = randn(sum(q_lens), nq, d, dtype=dtype)
    qsl = varlen_starts(q_lens)
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = d**-0.5
    ref = paged_attention_ref(q, k_cache, v_cache, qsl, seq, block_tables, scale)
    with poisoned_empty():
        out = paged_attention_triton(q, k_cache, v_cache, qsl, seq, block_tables, scale, max(q_lens), max(seq_lens))
    assert_close("o", ref, out, tolerance(dtype, fp32=2e-6))
    with poisoned_empty():
        out_no_hint = paged_attention_triton(q, k_cache, v_cache, qsl, seq, block_tables, scale)
    assert_close("o (no hints)", ref, out_no_hint, tolerance(dtype, fp32=2e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_attention_decode(num_splits: int, dtype: torch.dtype) -> None:
    # A decode bucket: three live sequences and one CUDA-graph padding row (seq_len 0, zeros out).
    seq_lens, nq, nkv, d, page = [1, 70, 33, 0], 6, 2, 64, 8
    k_cache, v_cache, block_tables = _paged_cache(seq_lens, page, nkv, d, dtype)
    q = randn(len(seq_lens), nq, d, dtype=dtype)
    qsl = varlen_starts([1] * len(seq_lens))
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = d**-0.5
    ref = paged_attention_ref(q, k_cache, v_cache, qsl, seq, block_tables, scale)
    with poisoned_empty():
        out = torch.empty_like(q)
        _paged_attention_decode(q, k_cache, v_cache, out, qsl, seq, block_tables, scale, num_splits)
    assert_close("o", ref, out, tolerance(dtype, fp32=2e-6))
    with poisoned_empty():
        out = paged_attention_triton(q, k_cache, v_cache, qsl, seq, block_tables, scale, 1, max(seq_lens))
    assert_close("o (launcher)", ref, out, tolerance(dtype, fp32=2e-6))
