"""Triton kernels for the paged KV cache: the slot store and causal GQA attention over the pages.

Cache layout as the ref: k_cache, v_cache [num_blocks, block_size, nkv, d]; a token's slot is
block·block_size + offset; sequence b's queries are the last q_len of its seq_len cached tokens.

`paged_attention_triton` has two paths:
- general (prefill, chunked prefill, mixed batches): grid (sequence, row tile, KV head). The rows of a tile
  are (query token, query head of the KV head's group) pairs flattened token-major, so one K/V tile loaded
  from the cache serves every query head that reads it and tl.dot sees M = BLOCK_M rows even at GQA
  group 6. Online softmax in fp32 (exp2 with the scale folded into log2 e), QKᵀ and PV on tensor cores
  with fp32 accumulation; P is rounded to the cache dtype for the PV dot. The grid's row-tile count comes
  from the host-side max_query_len hint (a host sync only when the hint is missing).
- decode and short queries (max_query_len · group <= SHORT_QUERY_ROWS: decodes, and the 1 + k tokens of an MTP
  verify chunk): split-K flash-decoding, grid (sequence, KV head, split) and a combine kernel, both sized from
  tensor shapes only (the split count depends on the batch size, the cache's block-table width and the SM
  count), so the path never syncs and is safe under CUDA-graph capture. Rows are (query token, query head of
  the group) pairs padded to 16 for tl.dot, so each K/V tile is read once for all of a sequence's queries;
  each row masks the keys past its own position.
  The next tile's page indices are loaded one tile ahead (carried in registers): the cp.async of a tile
  then never waits on a dependent index load, and with 3 stages the pipeliner keeps two K/V buffers, the
  next tile in flight while this one is computed (docs/kernels.md#attention).
fp32 inputs use "ieee" dots so the fp32 tests are exact-ish on GPU; the interpreter runs them as numpy.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from deltaserve.kernels._triton import autotune, dot_precision, i64, next_pow2, pdl_launch, pdl_wait, sm_count

LOG2E = 1.4426950408889634


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    NKV: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    i_t = i64(tl.program_id(0))
    i_slot = i64(tl.load(slot_mapping_ptr + i_t))  # the step's metadata: may load before the wait
    pdl_wait(USE_PDL)
    # Padded rows of a CUDA-graph batch carry slot -1: nothing to store.
    if i_slot < 0:
        return
    i_block = i_slot // PAGE
    i_off = i_slot % PAGE
    o_h = tl.arange(0, BLOCK_H)
    o_d = tl.arange(0, BLOCK_D)
    m = (o_h < NKV)[:, None] & (o_d < D)[None, :]  # [BLOCK_H, BLOCK_D]
    b_k = tl.load(k_ptr + i_t * stride_k_t + o_h[:, None] * stride_k_h + o_d[None, :], mask=m)
    b_v = tl.load(v_ptr + i_t * stride_v_t + o_h[:, None] * stride_v_h + o_d[None, :], mask=m)
    p_kc = k_cache_ptr + i_block * stride_kc_block + i_off * stride_kc_slot
    p_vc = v_cache_ptr + i_block * stride_vc_block + i_off * stride_vc_slot
    tl.store(p_kc + o_h[:, None] * stride_kc_head + o_d[None, :], b_k, mask=m)
    tl.store(p_vc + o_h[:, None] * stride_vc_head + o_d[None, :], b_v, mask=m)


def store_kv_triton(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Writes k, v [T, nkv, d] (token/head dims may be strided) into their slots; slots < 0 are skipped."""
    num_tokens = k.shape[0]
    num_kv_heads, head_dim = k_cache.shape[-2:]
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        assert t.stride(-1) == 1, f"{name}: last dim must be contiguous"
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        NKV=num_kv_heads,
        D=head_dim,
        PAGE=k_cache.shape[1],
        BLOCK_H=next_pow2(num_kv_heads),
        BLOCK_D=next_pow2(head_dim),
        num_warps=4,
        **pdl_launch(k),
    )


@triton.jit
def _attend_block(
    b_q,
    b_acc,
    b_m,
    b_l,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    o_n,
    m_n,
    m_valid,
    i_kvh,
    o_d,
    m_d,
    scale_log2,
    stride_c_block,
    stride_c_slot,
    stride_c_head,
    PAGE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One BLOCK_N step of online softmax over keys o_n (m_n: in range); m_valid [BLOCK_M, BLOCK_N] masks."""
    i_page = i64(tl.load(block_tables_ptr + o_n // PAGE, mask=m_n, other=0))
    o_slot = i_page * stride_c_block + (o_n % PAGE) * stride_c_slot + i_kvh * stride_c_head  # [BLOCK_N]
    return _attend_tile(
        b_q, b_acc, b_m, b_l, k_cache_ptr, v_cache_ptr, o_slot, m_n, m_valid, o_d, m_d, scale_log2, DOT_PRECISION
    )


@triton.jit
def _attend_tile(
    b_q,
    b_acc,
    b_m,
    b_l,
    k_cache_ptr,
    v_cache_ptr,
    o_slot,
    m_n,
    m_valid,
    o_d,
    m_d,
    scale_log2,
    DOT_PRECISION: tl.constexpr,
):
    """The online-softmax step of `_attend_block` on keys whose cache row offsets o_slot [BLOCK_N] are known."""
    m_kv = m_n[:, None] & m_d[None, :]
    b_k = tl.load(k_cache_ptr + o_slot[:, None] + o_d[None, :], mask=m_kv, other=0.0)  # [BLOCK_N, BLOCK_D]
    b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
    b_s = tl.where(m_valid, b_s, float("-inf"))
    b_m_new = tl.maximum(b_m, tl.max(b_s, axis=1))
    # A row with no visible key yet keeps m = -inf; shift it by 0 so exp2 gives 0 instead of NaN.
    b_shift = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
    b_p = tl.exp2(b_s - b_shift[:, None])
    b_alpha = tl.exp2(b_m - b_shift)
    b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
    b_v = tl.load(v_cache_ptr + o_slot[:, None] + o_d[None, :], mask=m_kv, other=0.0)  # [BLOCK_N, BLOCK_D]
    b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision=DOT_PRECISION)
    return b_acc, b_m_new, b_l


# The first config is the one kept where nothing can be benchmarked (the interpreter): valid at every shape.
# At d = 256 on sm_90 all of these compile to wgmma without register spills and fit in shared memory.
_PREFILL_CONFIGS = [
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=8, num_stages=2),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=8, num_stages=2),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 32}, num_warps=8, num_stages=2),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 32}, num_warps=8, num_stages=3),
]


@autotune(configs=_PREFILL_CONFIGS, key=["GROUP", "D", "ROWS_BUCKET"])
@triton.jit(do_not_specialize=["stride_bt", "ROWS_BUCKET"])
def _paged_attn_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    scale_log2,
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_c_block,
    stride_c_slot,
    stride_c_head,
    stride_bt,
    ROWS_BUCKET,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    i_b = tl.program_id(0)
    i_m = tl.program_id(1)
    i_kvh = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + i_b)
    q_len = tl.load(query_start_loc_ptr + i_b + 1) - q_start
    if i_m * BLOCK_M >= q_len * GROUP:
        return
    seq_len = tl.load(seq_lens_ptr + i_b)
    ctx_start = seq_len - q_len

    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] flattened (token, head in group)
    m_m = o_m < q_len * GROUP
    i_tok = o_m // GROUP
    i_qh = i_kvh * GROUP + o_m % GROUP
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    o_row_q = i64(q_start + i_tok) * stride_q_t + i64(i_qh) * stride_q_h
    b_q = tl.load(q_ptr + o_row_q[:, None] + o_d[None, :], mask=m_m[:, None] & m_d[None, :], other=0.0)
    q_pos = ctx_start + i_tok  # [BLOCK_M]
    # Keys up to the tile's last query position: later ones are masked for every row of the tile.
    kv_end = ctx_start + tl.minimum(q_len - 1, (i_m * BLOCK_M + BLOCK_M - 1) // GROUP) + 1

    b_m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    p_bt = block_tables_ptr + i64(i_b) * stride_bt
    for start_n in range(0, kv_end, BLOCK_N):
        o_n = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        m_n = o_n < kv_end
        m_valid = (o_n[None, :] <= q_pos[:, None]) & m_n[None, :] & m_m[:, None]
        b_acc, b_m, b_l = _attend_block(
            b_q,
            b_acc,
            b_m,
            b_l,
            k_cache_ptr,
            v_cache_ptr,
            p_bt,
            o_n,
            m_n,
            m_valid,
            i_kvh,
            o_d,
            m_d,
            scale_log2,
            stride_c_block,
            stride_c_slot,
            stride_c_head,
            PAGE,
            DOT_PRECISION,
        )
    b_o = b_acc / tl.where(b_l == 0.0, 1.0, b_l)[:, None]
    o_row_o = i64(q_start + i_tok) * stride_o_t + i64(i_qh) * stride_o_h
    tl.store(out_ptr + o_row_o[:, None] + o_d[None, :], b_o, mask=m_m[:, None] & m_d[None, :])


@triton.jit(do_not_specialize=["stride_bt", "num_splits"])
def _paged_attn_decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    scale_log2,
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_c_block,
    stride_c_slot,
    stride_c_head,
    stride_bt,
    num_splits,
    NQ: tl.constexpr,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    CAUSAL: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,
):
    i_b = tl.program_id(0)
    i_kvh = tl.program_id(1)
    i_s = tl.program_id(2)
    # Above the wait (_triton.pdl_wait): the step's metadata, the page indices and q (the preamble's output, two
    # launches back); the K/V cache below holds this step's token, which store_kv, the launch before, writes.
    q_start = tl.load(query_start_loc_ptr + i_b)
    q_len = tl.load(query_start_loc_ptr + i_b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + i_b)
    # The sequence's BLOCK_N tiles spread evenly over the splits (their counts differ by at most one); a split
    # comes out empty only when the sequence has fewer tiles than splits.
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    lo = (i_s * num_tiles // num_splits) * BLOCK_N
    hi = tl.minimum(((i_s + 1) * num_tiles // num_splits) * BLOCK_N, seq_len)

    # Rows: (query token, query head of the group) flattened token-major; BLOCK_G covers the step's longest query
    # (one token and no causal mask for a decode, CAUSAL for short queries).
    o_g = tl.arange(0, BLOCK_G)
    i_tok = o_g // GROUP
    m_g = i_tok < q_len
    i_qh = i_kvh * GROUP + o_g % GROUP  # [BLOCK_G]
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    o_row_q = i64(q_start + i_tok) * stride_q_t + i64(i_qh) * stride_q_h
    m_q = m_g[:, None] & m_d[None, :]
    b_q = tl.load(q_ptr + o_row_q[:, None] + o_d[None, :], mask=m_q, other=0.0)
    q_pos = seq_len - q_len + i_tok  # [BLOCK_G] each row's own position: its last visible key

    b_m = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_G], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    p_bt = block_tables_ptr + i64(i_b) * stride_bt
    o_tile = tl.arange(0, BLOCK_N)
    o_head = i_kvh * stride_c_head
    # Page indices one tile ahead: the loop carries the next tile's, so its K/V copies never wait on them.
    b_page = tl.load(p_bt + (lo + o_tile) // PAGE, mask=lo + o_tile < hi, other=0)  # [BLOCK_N]
    pdl_wait(USE_PDL)
    if q_len == 0:
        return
    for start_n in range(lo, hi, BLOCK_N):
        o_n = start_n + o_tile
        m_n = o_n < hi
        o_slot = i64(b_page) * stride_c_block + (o_n % PAGE) * stride_c_slot + o_head  # [BLOCK_N]
        o_next = o_n + BLOCK_N
        b_page = tl.load(p_bt + o_next // PAGE, mask=o_next < hi, other=0)
        if CAUSAL:
            m_valid = m_g[:, None] & m_n[None, :] & (o_n[None, :] <= q_pos[:, None])
        else:
            m_valid = m_g[:, None] & m_n[None, :]  # a decode row sees every cached key
        b_acc, b_m, b_l = _attend_tile(
            b_q,
            b_acc,
            b_m,
            b_l,
            k_cache_ptr,
            v_cache_ptr,
            o_slot,
            m_n,
            m_valid,
            o_d,
            m_d,
            scale_log2,
            DOT_PRECISION,
        )
    if not IS_SPLIT:
        b_o = b_acc / tl.where(b_l == 0.0, 1.0, b_l)[:, None]
        o_row_o = i64(q_start + i_tok) * stride_o_t + i64(i_qh) * stride_o_h
        tl.store(out_ptr + o_row_o[:, None] + o_d[None, :], b_o, mask=m_g[:, None] & m_d[None, :])
    else:
        # Partials [T, nq, num_splits, D] (unnormalised) and [T, nq, num_splits, 2] (running max, sum), by query row.
        o_part = (i64(q_start + i_tok) * NQ + i_qh) * num_splits + i_s  # [BLOCK_G]
        tl.store(part_acc_ptr + o_part[:, None] * D + o_d[None, :], b_acc, mask=m_g[:, None] & m_d[None, :])
        tl.store(part_ml_ptr + o_part * 2, b_m, mask=m_g)
        tl.store(part_ml_ptr + o_part * 2 + 1, b_l, mask=m_g)


@triton.jit(do_not_specialize=["query_width", "num_splits"])
def _paged_attn_combine_kernel(
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    query_start_loc_ptr,
    stride_o_t,
    stride_o_h,
    query_width,
    num_splits,
    NQ: tl.constexpr,
    D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CHUNK_D: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    # grid (B·query_width, nq): axis 0 is (sequence, query token of the sequence)
    i_b = tl.program_id(0) // query_width
    i_tok = tl.program_id(0) % query_width
    i_h = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + i_b)  # the step's metadata: may load before the wait
    q_len = tl.load(query_start_loc_ptr + i_b + 1) - q_start
    pdl_wait(USE_PDL)
    if i_tok >= q_len:
        return
    # BLOCK_S = MAX_DECODE_SPLITS lanes, the first num_splits live: one compiled variant for every split count
    o_s = tl.arange(0, BLOCK_S)
    m_s = o_s < num_splits
    o_part = (i64(q_start + i_tok) * NQ + i_h) * num_splits + o_s  # [BLOCK_S]
    b_m = tl.load(part_ml_ptr + o_part * 2, mask=m_s, other=float("-inf"))
    b_l = tl.load(part_ml_ptr + o_part * 2 + 1, mask=m_s, other=0.0)
    m_max = tl.max(b_m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    b_w = tl.exp2(b_m - m_max)  # [BLOCK_S]; empty splits (m = -inf) and dead lanes weigh 0
    b_den = tl.sum(b_l * b_w, axis=0)
    b_den = tl.where(b_den == 0.0, 1.0, b_den)
    o_out = i64(q_start + i_tok) * stride_o_t + i64(i_h) * stride_o_h
    # the head dimension in CHUNK_D columns: a [BLOCK_S, CHUNK_D] fp32 tile stays in registers at 64 lanes
    for d0 in tl.static_range(0, BLOCK_D, CHUNK_D):
        o_d = d0 + tl.arange(0, CHUNK_D)
        m_d = o_d < D
        b_acc = tl.load(part_acc_ptr + o_part[:, None] * D + o_d[None, :], mask=m_s[:, None] & m_d[None, :], other=0.0)
        b_num = tl.sum(b_acc * b_w[:, None], axis=0)  # [CHUNK_D]
        tl.store(out_ptr + o_out + o_d, b_num / b_den, mask=m_d)


# Decode programs resident on one SM at once (sm_90, d = 256, 4 warps, 3 stages: 168 registers a thread and
# 73 KB of shared memory, so 3 fit); tests/kernels/test_kernel_resources.py compiles the kernel and checks it.
DECODE_PROGRAMS_PER_SM = 3
DECODE_NUM_WARPS = 4
DECODE_NUM_STAGES = 3
# The split count is a runtime argument of both split-K kernels (not specialised), so every count compiles to the
# one variant: as a constexpr each count 1..64 compiled its own on first use, ~0.5 s each, and eager verify and
# plain-decode steps (batch sizes no graph bucket had) compiled them while serving
# (docs/kernels.md#compiles-while-serving). The combine holds MAX_DECODE_SPLITS lanes and walks the head dimension
# COMBINE_CHUNK_D columns a time.
MAX_DECODE_SPLITS = 64
COMBINE_CHUNK_D = 64
# Short queries on the split-K path: at most this many (token, head) rows a program (1 + k = 4 tokens at the
# 35B-A3B's group of 8). Past 16 rows the program holds twice the accumulator: 202 registers a thread and 82 KB
# of shared memory at d = 256, so 2 programs fit a SM, not 3 (8 warps would hold 1); the split count follows.
SHORT_QUERY_ROWS = 32
WIDE_PROGRAMS_PER_SM = 2


def decode_num_splits(
    batch: int, num_kv_heads: int, max_context: int, device: torch.device, programs_per_sm: int = DECODE_PROGRAMS_PER_SM
) -> int:
    """Splits per (sequence, KV head) for the decode path, from shapes only: as many as keep the whole grid
    resident in one wave (programs_per_sm a SM: DECODE_PROGRAMS_PER_SM, or WIDE_PROGRAMS_PER_SM for programs of
    more than 16 query rows), at least 1, at most 64 and one per 256 keys of the
    block table's capacity. Each program is latency-bound on its own, so the SMs' full residency is what
    saturates DRAM at mid batch sizes; past one wave a single split already does, without the combine, unless
    the second wave is less than half full: then two splits (on the H200 512 programs over 396 slots, a second
    wave 29 % full, ran at 3.3 TB/s, 164 µs a 27B layer at B = 128, where 768 and 1024 programs, 1.94 and 2.59
    waves, ran at 4.05-4.1 TB/s; docs/kernels.md#attention)."""
    num_programs = max(batch * num_kv_heads, 1)
    resident = programs_per_sm * sm_count(device)
    want = resident // num_programs
    if resident < num_programs <= resident * 3 // 2:
        want = 2
    return int(max(1, min(MAX_DECODE_SPLITS, want, triton.cdiv(max_context, 256))))


def _paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    num_splits: int,
    query_width: int = 1,
) -> None:
    """The split-K path for queries of at most `query_width` tokens a sequence (1: decode; up to
    SHORT_QUERY_ROWS // group: a verify chunk of 1 + k tokens): no host syncs, grids from shapes only (CUDA-graph
    safe)."""
    assert 1 <= num_splits <= MAX_DECODE_SPLITS, num_splits  # the combine's lanes
    batch = seq_lens.shape[0]
    num_rows, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    block_d = next_pow2(head_dim)
    block_g = max(16, next_pow2(group * query_width))
    if num_splits > 1:
        part_acc = torch.empty(num_rows, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(num_rows, num_q_heads, num_splits, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out
    _paged_attn_decode_kernel[(batch, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        out,
        part_acc,
        part_ml,
        query_start_loc,
        seq_lens,
        block_tables,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        *k_cache.stride()[:3],
        block_tables.stride(0),
        num_splits,
        NQ=num_q_heads,
        GROUP=group,
        D=head_dim,
        PAGE=k_cache.shape[1],
        IS_SPLIT=num_splits > 1,
        BLOCK_G=block_g,
        BLOCK_N=64 if head_dim <= 128 else 32,
        BLOCK_D=block_d,
        DOT_PRECISION=dot_precision(q.dtype),
        CAUSAL=query_width > 1,
        num_warps=DECODE_NUM_WARPS,
        num_stages=DECODE_NUM_STAGES,
        **pdl_launch(q),
    )
    if num_splits > 1:
        _paged_attn_combine_kernel[(batch * query_width, num_q_heads)](
            out,
            part_acc,
            part_ml,
            query_start_loc,
            out.stride(0),
            out.stride(1),
            query_width,
            num_splits,
            NQ=num_q_heads,
            D=head_dim,
            BLOCK_S=MAX_DECODE_SPLITS,
            BLOCK_D=block_d,
            CHUNK_D=min(block_d, COMBINE_CHUNK_D),
            num_warps=4,
            **pdl_launch(out),
        )


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """q [T, nq, d] -> o [T, nq, d]; causal GQA over the paged cache (see the module docstring)."""
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride(), "k_cache and v_cache must share one layout"
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    batch = seq_lens.shape[0]
    if q.shape[0] == 0 or batch == 0:
        return out
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, page = k_cache.shape[2], k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    if max_query_len is not None and max_query_len * group <= SHORT_QUERY_ROWS:
        # decode (1 token a sequence) and short queries (verify chunks of 1 + k tokens) take the split-K path
        per_sm = DECODE_PROGRAMS_PER_SM if max_query_len * group <= 16 else WIDE_PROGRAMS_PER_SM
        num_splits = decode_num_splits(batch, num_kv_heads, block_tables.shape[1] * page, q.device, per_sm)
        _paged_attention_decode(
            q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, scale, num_splits, max_query_len
        )
        return out
    if max_query_len is None:
        # Host sync: callers that know the longest query (the runner does) pass it instead.
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max().item())
    rows = max_query_len * group

    def grid(meta: dict) -> tuple[int, int, int]:
        return (batch, triton.cdiv(rows, meta["BLOCK_M"]), num_kv_heads)

    _paged_attn_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        query_start_loc,
        seq_lens,
        block_tables,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        *k_cache.stride()[:3],
        block_tables.stride(0),
        2 ** math.ceil(math.log2(max(rows, 1))),
        GROUP=group,
        D=head_dim,
        PAGE=page,
        BLOCK_D=next_pow2(head_dim),
        DOT_PRECISION=dot_precision(q.dtype),
    )
    return out
