"""store_kv_triton and paged_attention_triton (general varlen path, and the split-K path of decodes and short
queries: MTP verify chunks)."""

from __future__ import annotations

import pytest
import torch

from deltaserve.kernels import attention_triton
from deltaserve.kernels.attention import paged_attention_ref, store_kv_ref
from deltaserve.kernels.attention_triton import (
    _paged_attention_decode,
    decode_num_splits,
    paged_attention_triton,
    store_kv_triton,
)

from ._util import DEVICE, DTYPES, assert_close, poisoned_empty, randn, tolerance, varlen_starts


def _paged_cache(
    seq_lens: list[int],
    page: int,
    nkv: int,
    d: int,
    dtype: torch.dtype,
    spare_blocks: int = 3,
    width: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random k/v caches and a block table whose pages are shuffled across the pool; `width` pages per row
    (default: the longest sequence's plus one) sets the capacity the decode split count is bounded by."""
    pages_per_seq = [max(1, -(-n // page)) for n in seq_lens]
    width = width or max(pages_per_seq) + 1
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


# Decode lengths (d = 32: BLOCK_N 64; pages of 8): several tiles per split (300, 200), fewer tiles than splits
# (1, 63), a tile boundary exactly (128), a page boundary off the tile grid (65), and a CUDA-graph padding row
# (seq_len 0: its output must be zeros).
DECODE_SEQ_LENS = [300, 1, 63, 128, 0, 65, 200]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("nq", "nkv"), [(2, 2), (12, 2), (8, 1)], ids=["group1", "group6", "group8"])
@pytest.mark.parametrize("num_splits", [1, 2, 5])
def test_paged_attention_decode_splits(nq: int, nkv: int, num_splits: int, dtype: torch.dtype) -> None:
    seq_lens, d, page = DECODE_SEQ_LENS, 32, 8
    k_cache, v_cache, block_tables = _paged_cache(seq_lens, page, nkv, d, dtype)
    q = randn(len(seq_lens), nq, d, dtype=dtype)
    qsl = varlen_starts([1] * len(seq_lens))
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    ref = paged_attention_ref(q, k_cache, v_cache, qsl, seq, block_tables, d**-0.5)
    with poisoned_empty():
        out = torch.empty_like(q)
        _paged_attention_decode(q, k_cache, v_cache, out, qsl, seq, block_tables, d**-0.5, num_splits)
    assert_close("o", ref, out, tolerance(dtype, fp32=2e-6))
    assert torch.equal(out[4], torch.zeros_like(out[4])), "a padding row (seq_len 0) must come out zero"


@pytest.mark.parametrize("batch", [1, 2, 3, 4, 7])
def test_paged_attention_decode_launcher_across_split_counts(batch: int) -> None:
    """The launcher's own split count (12 resident programs on the interpreter's 4 SMs, nkv 2: 6, 3, 2, 1, 2
    splits at B = 1, 2, 3, 4, 7; at 7, 14 programs would leave a second wave under half full) against the
    ref; a wide block table so the capacity bound does not cap it."""
    nq, nkv, d, page = 6, 2, 32, 8
    seq_lens = [(37 * i + 290) % 311 + 1 for i in range(batch)]
    k_cache, v_cache, block_tables = _paged_cache(seq_lens, page, nkv, d, torch.float32, width=384)
    splits = decode_num_splits(batch, nkv, block_tables.shape[1] * page, DEVICE)
    if DEVICE.type == "cpu":
        assert splits == {1: 6, 2: 3, 3: 2, 4: 1, 7: 2}[batch]
    q = randn(batch, nq, d)
    qsl = varlen_starts([1] * batch)
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    ref = paged_attention_ref(q, k_cache, v_cache, qsl, seq, block_tables, d**-0.5)
    with poisoned_empty():
        out = paged_attention_triton(q, k_cache, v_cache, qsl, seq, block_tables, d**-0.5, 1, max(seq_lens))
    assert_close(f"o (B={batch}, {splits} splits)", ref, out, 2e-6)


# Short queries on the split-K path (verify chunks of 1 + k tokens, eager varlen steps of a few tokens): several
# tiles per split, a chunk that starts a sequence (q_len == seq_len), widths 1..4 in one step, fewer tiles than
# splits, and a padding sequence (q_len 0).
SHORT_SEQ_LENS = [300, 4, 63, 128, 0, 66, 9]
SHORT_Q_LENS = [4, 4, 2, 1, 0, 3, 4]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("nq", "nkv"), [(2, 2), (12, 2), (8, 1)], ids=["group1", "group6", "group8"])
@pytest.mark.parametrize("num_splits", [1, 2, 5])
def test_paged_attention_short_queries_on_the_split_path(
    nq: int, nkv: int, num_splits: int, dtype: torch.dtype
) -> None:
    seq_lens, q_lens, d, page = SHORT_SEQ_LENS, SHORT_Q_LENS, 32, 8
    k_cache, v_cache, block_tables = _paged_cache(seq_lens, page, nkv, d, dtype)
    q = randn(sum(q_lens), nq, d, dtype=dtype)
    qsl = varlen_starts(q_lens)
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    ref = paged_attention_ref(q, k_cache, v_cache, qsl, seq, block_tables, d**-0.5)
    with poisoned_empty():
        out = torch.empty_like(q)
        _paged_attention_decode(q, k_cache, v_cache, out, qsl, seq, block_tables, d**-0.5, num_splits, max(q_lens))
    assert_close("o", ref, out, tolerance(dtype, fp32=2e-6))


@pytest.mark.parametrize(("nq", "nkv", "width", "split_path"), [(24, 2, 4, False), (6, 2, 4, True), (16, 2, 4, True)])
def test_paged_attention_launcher_routes_short_queries_by_rows(nq: int, nkv: int, width: int, split_path: bool) -> None:
    """The launcher takes the split-K path while max_query_len · group fits SHORT_QUERY_ROWS (group 3 and 8 at
    width 4, as the 27B's group 6 and the 35B-A3B's 8 at 1 + k = 4) and the tiled path past it (group 12); both agree
    with the ref, the split path at the split count it picks for a wide block table."""
    seq_lens, d, page = [290, 37, 5], 32, 8
    group = nq // nkv
    assert (width * group <= attention_triton.SHORT_QUERY_ROWS) == split_path
    k_cache, v_cache, block_tables = _paged_cache(seq_lens, page, nkv, d, torch.float32, width=96)
    q = randn(width * len(seq_lens), nq, d)
    qsl = varlen_starts([width] * len(seq_lens))
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    ref = paged_attention_ref(q, k_cache, v_cache, qsl, seq, block_tables, d**-0.5)
    calls: list[int] = []
    original = attention_triton._paged_attention_decode

    def spy(*args: object) -> None:
        calls.append(int(args[-1]))  # type: ignore[call-overload]
        original(*args)  # type: ignore[arg-type]

    attention_triton._paged_attention_decode = spy  # type: ignore[assignment]
    try:
        with poisoned_empty():
            out = paged_attention_triton(q, k_cache, v_cache, qsl, seq, block_tables, d**-0.5, width, max(seq_lens))
    finally:
        attention_triton._paged_attention_decode = original  # type: ignore[assignment]
    assert calls == ([width] if split_path else []), calls
    assert_close("o", ref, out, 2e-6)


# Splits the decode path picks per CUDA-graph bucket on the H200 (132 SMs, 3 resident programs each: 396) at
# max_model_len 4096 (at most 16 splits), for the two served shapes' KV heads; two splits where one split's
# grid would leave a second wave under half full (397-594 programs). docs/kernels.md#attention.
H200_DECODE_SPLITS = {
    4: {1: 16, 2: 16, 4: 16, 8: 12, 16: 6, 24: 4, 32: 3, 48: 2, 64: 1, 96: 1, 128: 2, 192: 1, 256: 1},  # 27B
    2: {1: 16, 2: 16, 4: 16, 8: 16, 16: 12, 24: 8, 32: 6, 48: 4, 64: 3, 96: 2, 128: 1, 256: 2, 512: 1},  # 35B-A3B
}


def test_decode_num_splits_per_bucket_on_h200(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention_triton, "sm_count", lambda device: 132)
    cuda = torch.device("cuda", 0)
    for nkv, table in H200_DECODE_SPLITS.items():
        got = {b: decode_num_splits(b, nkv, 4096, cuda) for b in table}
        assert got == table, f"nkv {nkv}: {got}"
    # The capacity bound: one split per 256 keys of the block table.
    assert decode_num_splits(1, 4, 1024, cuda) == 4
    assert decode_num_splits(1, 4, 100, cuda) == 1


@pytest.mark.gpu
@pytest.mark.parametrize(("nq", "nkv"), [(24, 4), (16, 2)], ids=["27b", "35b-a3b"])
@pytest.mark.parametrize("batch", [1, 16, 32, 64, 128])
def test_paged_attention_decode_served_shapes(nq: int, nkv: int, batch: int) -> None:
    """bf16 at the served shapes (d 256, pages of 16, a 4096-token block table), 1025 and odd lengths, on
    either side of every split count the H200 picks for these buckets."""
    d, page = 256, 16
    seq_lens = [1025 - 7 * (i % 5) for i in range(batch)]
    k_cache, v_cache, block_tables = _paged_cache(seq_lens, page, nkv, d, torch.bfloat16, width=256)
    q = randn(batch, nq, d, dtype=torch.bfloat16)
    qsl = varlen_starts([1] * batch)
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    ref = paged_attention_ref(q, k_cache, v_cache, qsl, seq, block_tables, d**-0.5)
    with poisoned_empty():
        out = paged_attention_triton(q, k_cache, v_cache, qsl, seq, block_tables, d**-0.5, 1, 4096)
    assert_close("o", ref, out, 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize(("nq", "nkv"), [(24, 4), (16, 2)], ids=["27b", "35b-a3b"])
@pytest.mark.parametrize("batch", [1, 16, 64])
def test_paged_attention_verify_chunks_served_shapes(nq: int, nkv: int, batch: int) -> None:
    """bf16 at the served shapes, MTP verify chunks of 1 + k = 4 tokens (the split-K path), 1025 and odd lengths."""
    d, page, width = 256, 16, 4
    seq_lens = [1025 - 7 * (i % 5) for i in range(batch)]
    k_cache, v_cache, block_tables = _paged_cache(seq_lens, page, nkv, d, torch.bfloat16, width=256)
    q = randn(batch * width, nq, d, dtype=torch.bfloat16)
    qsl = varlen_starts([width] * batch)
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    ref = paged_attention_ref(q, k_cache, v_cache, qsl, seq, block_tables, d**-0.5)
    with poisoned_empty():
        out = paged_attention_triton(q, k_cache, v_cache, qsl, seq, block_tables, d**-0.5, width, 4096)
    assert_close("o", ref, out, 1e-2)


def _blocks_first(cache_k: torch.Tensor, cache_v: torch.Tensor, seq_lens: list[int], block_tables: torch.Tensor,
                  pad: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The caches' values in one pool's layout (docs/ARCHITECTURE.md, "One pool"): a page per block holding its K,
    its V and `pad` more elements (the other layers' K and V), the views a page apart; NaN in every position no
    sequence's context covers (a page that held a state slot's bytes before) and in the padding."""
    num_blocks, page, nkv, d = cache_k.shape
    block = page * nkv * d
    pool = torch.full((num_blocks, 2 * block + pad), float("nan"), dtype=cache_k.dtype, device=DEVICE)
    views = [torch.as_strided(pool, cache_k.shape, (2 * block + pad, nkv * d, d, 1), i * block) for i in range(2)]
    for b, n in enumerate(seq_lens):
        for position in range(n):
            block_id, offset = int(block_tables[b, position // page]), position % page
            views[0][block_id, offset] = cache_k[block_id, offset]
            views[1][block_id, offset] = cache_v[block_id, offset]
    return views[0], views[1]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("decode", [False, True], ids=["varlen", "decode-split"])
def test_paged_attention_on_blocks_first_views(dtype: torch.dtype, decode: bool) -> None:
    """On one pool's blocks-first views (a block stride of a page, K and V of a block adjacent) and with NaN in every
    cache position past a sequence's context, the kernels give the ref's output on contiguous caches: they take the
    block stride from the view and read nothing a context does not cover."""
    seq_lens, nq, nkv, d, page = [100, 7, 40, 1], 6, 2, 32, 8
    q_lens = [1] * len(seq_lens) if decode else [37, 7, 1, 1]
    k_cache, v_cache, block_tables = _paged_cache(seq_lens, page, nkv, d, dtype)
    k_view, v_view = _blocks_first(k_cache, v_cache, seq_lens, block_tables, pad=2 * page * nkv * d)
    q = randn(sum(q_lens), nq, d, dtype=dtype)
    qsl = varlen_starts(q_lens)
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    ref = paged_attention_ref(q, k_cache, v_cache, qsl, seq, block_tables, d**-0.5)
    out = paged_attention_triton(q, k_view, v_view, qsl, seq, block_tables, d**-0.5, max(q_lens), max(seq_lens))
    assert not out.isnan().any(), "read a position past a context"
    assert_close("o", ref, out, tolerance(dtype, fp32=2e-6))


def test_store_kv_on_blocks_first_views() -> None:
    """store_kv writes a token's K and V into its block of the pool's views and nothing else of the page."""
    num_tokens, nkv, d, page, num_blocks = 21, 2, 32, 8, 5
    block = page * nkv * d
    pool = torch.full((num_blocks, 3 * block), float("nan"), device=DEVICE)
    k_view, v_view = (torch.as_strided(pool, (num_blocks, page, nkv, d), (3 * block, nkv * d, d, 1), i * block)
                      for i in range(2))  # fmt: skip
    k, v = randn(num_tokens, nkv, d), randn(num_tokens, nkv, d)
    slots = torch.randperm(num_blocks * page, device=DEVICE)[:num_tokens]
    store_kv_triton(k, v, k_view, v_view, slots)
    blocks, offsets = (slots // page).long(), (slots % page).long()
    assert torch.equal(k_view[blocks, offsets], k) and torch.equal(v_view[blocks, offsets], v)
    assert pool[:, 2 * block :].isnan().all(), "wrote into the page's other layers"
    assert int((~pool.isnan()).sum()) == 2 * num_tokens * nkv * d
