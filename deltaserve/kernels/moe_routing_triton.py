"""Triton MoE routing for decode-sized batches: top-k routing in one launch, the expert alignment in another.

On the 35B-A3B shape a decode step launched about 2,700 kernels, and routing plus alignment in torch ops
(softmax, top-k sorts, renormalisation, then counts, scans, a radix sort, searchsorted, index puts) were
about 22 launches per MoE layer (docs/kernels.md#moe-routing-and-alignment). Here:

- `moe_route_triton` (twin: `moe.moe_route_ref`): one program per token; softmax in fp32, top-k by repeated
  argmax (descending, lowest expert id first on ties), optional renormalisation, weights fp32.
- `moe_align_triton` (twin: `moe_align.moe_align_ref`, equal output): one program for the whole batch, in
  O(log N) parallel steps. All N entries are loaded at once (a power-of-two block NP);
  per-expert counts by `tl.histogram`; block-padded run ends by `tl.cumsum`; each block's expert
  (searchsorted, right) as the cumsum of a histogram of the runs' end blocks; and the stable order from ONE
  bitonic `tl.sort` of the keys expert·NP + entry: an entry's rank within its expert is its sorted position
  minus the expert's unpadded start, so its slot is that position plus the expert's (padded − unpadded) start,
  fetched from the [E] register vector by `tl.gather`. The padding fill is stored first; a barrier orders it
  before the entries are stored over it. Earlier versions held [entries, 64] compare tiles (spilling 3 KiB a
  thread at 257-512 entries: a decode-step cliff at B = 48-64), then walked 32-entry tiles (~26 serial
  steps of cross-warp reductions at 256 entries, 28 µs a layer at B = 32 and 144 µs at B = 256). Registers
  stay ≤ 125 with no spills for N ≤ 8192, E ≤ 512, any BLOCK_M (benchmarks/kernel_resources.py --align);
  the sort is O(N log² N / threads) work, so the fused MoE calls it up to ALIGN_DISPATCH_MAX_ENTRIES (128
  tokens at top-8; the chunked kernels below measured faster from 2048 entries).
- `moe_align_chunked_triton` (twin: `moe_align.moe_align_ref`, equal output): the same
  alignment for prefill-sized batches as a counting sort in three launches: per-chunk expert counts (and the
  padding fill), one scan program (padded run ends; per chunk and expert the slot base = padded run start +
  the expert's entries in earlier chunks − the chunk's entries of smaller experts), and the scatter (each
  chunk's one sort of expert·CHUNK + entry keys gives an entry's position in the chunk's stable order, so its
  slot is base + position; each program also resolves the experts of a share of the blocks). It serves above
  ALIGN_DISPATCH_MAX_ENTRIES, where the torch ops ran before: 14-17 µs at 2048-32768 entries against their
  83-131, and on the 35B-A3B shape an eager prefill step is host-bound and those ops cost ~15 launches and
  13.5-16.5 ms of host a step (docs/kernels.md#moe-routing-and-alignment).
All are CUDA-graph safe: grids from shapes, no host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.kernels._triton import i64, next_pow2, pdl_launch, pdl_wait

# One program sorts every entry (O(N log² N) over at most 16 warps): larger batches take the chunked kernels below.
ALIGN_MAX_ENTRIES = 8192
# Where the fused MoE calls this launch rather than the chunked kernels below: measured on the H200 in CUDA graphs
# (µs a call at E = 256, BLOCK_M 16; docs/kernels.md#moe-routing-and-alignment): 1024 entries 9.7 against the
# chunked 20.9, 2048 23.5 against 17.2, 4096 67.7 against 15.7 (the torch ops took 83-88 µs beyond 4096). So one
# program serves up to 1024 entries (128 tokens at top-8); it still takes up to
# ALIGN_MAX_ENTRIES (the tests and the bench reach that far).
ALIGN_DISPATCH_MAX_ENTRIES = 1024
# The top-k key of a NaN probability: above every probability (<= 1), so NaNs are picked first, as torch.topk ranks
# them (moe.moe_route_ref; among NaNs lowest id first, an order torch leaves unspecified), and their weight stays NaN.
NAN_KEY: tl.constexpr = tl.constexpr(2.0)


@triton.jit
def _moe_route_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    stride_l,
    E: tl.constexpr,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)
    i_t = i64(tl.program_id(0))
    o_e = tl.arange(0, BLOCK_E)
    m_e = o_e < E
    b_l = tl.load(logits_ptr + i_t * stride_l + o_e, mask=m_e, other=-float("inf")).to(tl.float32)
    b_p = tl.exp(b_l - tl.max(b_l, axis=0))
    b_p = b_p / tl.sum(b_p, axis=0)  # [BLOCK_E] softmax, fp32
    b_p = tl.where(m_e, b_p, -1.0)  # padding never wins
    # A NaN ranks above every probability (as in torch.topk): a NaN row (a CUDA graph's padded row reads no real
    # state) still picks ids in [0, E); with `==` alone it picked BLOCK_E and the expert GEMM read past w13.
    b_p = tl.where(b_p != b_p, NAN_KEY, b_p)
    o_k = tl.arange(0, BLOCK_K)
    b_w = tl.zeros([BLOCK_K], dtype=tl.float32)
    b_id = tl.zeros([BLOCK_K], dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        p_max = tl.max(b_p, axis=0)
        i_max = tl.min(tl.where(b_p == p_max, o_e, BLOCK_E), axis=0)  # lowest expert id among ties
        b_w = tl.where(o_k == j, tl.where(p_max == NAN_KEY, float("nan"), p_max), b_w)
        b_id = tl.where(o_k == j, i_max, b_id)
        b_p = tl.where(o_e == i_max, -1.0, b_p)
    if RENORMALIZE:
        b_w = b_w / tl.sum(tl.where(o_k < TOP_K, b_w, 0.0), axis=0)
    tl.store(weights_ptr + i_t * TOP_K + o_k, b_w, mask=o_k < TOP_K)
    tl.store(ids_ptr + i_t * TOP_K + o_k, b_id, mask=o_k < TOP_K)


def moe_route_triton(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] fp32, expert ids [T, k] int64), as moe_route_ref."""
    assert router_logits.stride(-1) == 1
    num_tokens, num_experts = router_logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=router_logits.device)
    if num_tokens:
        _moe_route_kernel[(num_tokens,)](
            router_logits,
            weights,
            ids,
            router_logits.stride(0),
            E=num_experts,
            TOP_K=top_k,
            RENORMALIZE=renormalize,
            BLOCK_E=next_pow2(num_experts),
            BLOCK_K=next_pow2(top_k),
            num_warps=4 if num_experts <= 512 else 8,
            **pdl_launch(router_logits),
        )
    return weights, ids


@triton.jit(do_not_specialize=["num_entries", "num_blocks"])
def _moe_align_kernel(
    ids_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    num_entries,
    num_blocks,
    stride_ids,
    E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_N: tl.constexpr,
    LOG_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_S: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)
    # All entries at once (padding past num_entries, and any id outside [0, E), is no expert's).
    o_n = tl.arange(0, BLOCK_N)
    m_n = o_n < num_entries
    b_ids = tl.load(ids_ptr + o_n * stride_ids, mask=m_n, other=-1).to(tl.int32)  # [BLOCK_N]
    m_n = m_n & (b_ids >= 0) & (b_ids < E)
    b_ids = tl.where(m_n, b_ids, BLOCK_E)  # padding keys sort after every real one
    b_counts = tl.histogram(b_ids, BLOCK_E, mask=m_n)  # [BLOCK_E] entries per expert
    b_padded = (b_counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    b_ends = tl.cumsum(b_padded, axis=0)  # [BLOCK_E] block-padded run ends
    total = tl.sum(b_padded, axis=0)
    # Padded run start minus unpadded run start: added to an entry's sorted position it gives its slot.
    b_shift = (b_ends - b_padded) - (tl.cumsum(b_counts, axis=0) - b_counts)  # [BLOCK_E]
    # Every slot starts as padding (num_entries); the entries are scattered over it after the barrier.
    num_slots = num_blocks * BLOCK_M
    o_s = tl.arange(0, BLOCK_S)
    b_pad = tl.zeros([BLOCK_S], dtype=tl.int32) + num_entries
    for s0 in range(0, num_slots, BLOCK_S):
        tl.store(sorted_ids_ptr + s0 + o_s, b_pad, mask=s0 + o_s < num_slots)
    # Each block's expert = the number of runs ending at or before its first row (searchsorted, right), as a
    # histogram of the runs' end blocks and its cumsum; -1 past the last run.
    o_e = tl.arange(0, BLOCK_E)
    b_end_block = b_ends // BLOCK_M
    b_ended = tl.cumsum(tl.histogram(b_end_block, BLOCK_B, mask=(o_e < E) & (b_end_block < BLOCK_B)), axis=0)
    o_b = tl.arange(0, BLOCK_B)
    b_expert = tl.where(o_b * BLOCK_M < total, b_ended, -1)  # [BLOCK_B]
    tl.store(block_expert_ptr + o_b, b_expert, mask=o_b < num_blocks)
    # The stable order: one sort of (expert, entry) keys; the rank of an entry within its expert is its sorted
    # position minus the expert's unpadded start, so its slot is the position plus the expert's shift.
    b_keys = tl.sort((b_ids << LOG_N) | o_n)  # [BLOCK_N]
    b_expert_of = b_keys >> LOG_N
    m_sorted = b_expert_of < E
    b_slot = o_n + tl.gather(b_shift, tl.where(m_sorted, b_expert_of, 0), 0)
    tl.debug_barrier()  # the padding fill is complete before any entry is stored over it
    tl.store(sorted_ids_ptr + b_slot, b_keys & (BLOCK_N - 1), mask=m_sorted)


def _align_outputs(flat: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The alignment's outputs, sized from shapes: sorted_ids [num_blocks·BLOCK_M], block_expert [num_blocks] with
    num_blocks = cdiv(N, BLOCK_M) + min(E, N) (every run padded to whole blocks), int32 on flat's device."""
    num_entries = flat.numel()
    num_blocks = triton.cdiv(num_entries, block_m) + min(num_experts, num_entries)
    sorted_ids = torch.empty(num_blocks * block_m, dtype=torch.int32, device=flat.device)
    return sorted_ids, torch.empty(num_blocks, dtype=torch.int32, device=flat.device)


def moe_align_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] -> (sorted_ids [num_blocks·BLOCK_M] entry ids, T·k = padding; block_expert [num_blocks]),
    equal to moe_align.moe_align_ref. At most ALIGN_MAX_ENTRIES entries."""
    flat = topk_ids.reshape(-1)  # [N] int64 (int32 also accepted); a view may keep a stride
    num_entries = flat.numel()
    if num_entries > ALIGN_MAX_ENTRIES:
        raise ValueError(f"moe_align_triton takes at most {ALIGN_MAX_ENTRIES} entries, got {num_entries}")
    sorted_ids, block_expert = _align_outputs(flat, num_experts, block_m)
    if num_entries == 0:
        return sorted_ids, block_expert
    _moe_align_kernel[(1,)](
        flat,
        sorted_ids,
        block_expert,
        num_entries,
        block_expert.shape[0],
        flat.stride(0),
        **align_launch(num_entries, num_experts, block_m),
        **pdl_launch(flat),
    )
    return sorted_ids, block_expert


def align_launch(num_entries: int, num_experts: int, block_m: int) -> dict[str, int]:
    """Constexprs and warps of the align kernel, functions of N's power of two (one compiled variant each).

    The entry and expert blocks hold at least one element per thread: Triton's histogram lowering counts each
    thread's elements with warp ballots, and a tensor smaller than the program would be replicated across
    threads and only corrected by a division afterwards; not relying on that costs nothing at these sizes."""
    block_n = next_pow2(num_entries)
    num_warps = 4 if block_n <= 512 else (8 if block_n <= 4096 else 16)
    num_threads = 32 * num_warps
    block_n = max(block_n, num_threads)
    block_e = max(next_pow2(num_experts), num_threads)
    # the largest block count any N of this power of two needs (bins of the block-expert histogram)
    block_b = max(32, next_pow2(triton.cdiv(block_n, block_m) + min(num_experts, block_n)))
    if 2 * block_e * block_n >= 2**31:
        raise ValueError(f"moe_align_triton: {num_experts} experts x {num_entries} entries overflow its int32 keys")
    return {
        "E": num_experts,
        "BLOCK_M": block_m,
        "BLOCK_E": block_e,
        "BLOCK_N": block_n,
        "LOG_N": block_n.bit_length() - 1,
        "BLOCK_B": block_b,
        "BLOCK_S": min(4096, block_b * block_m),
        "num_warps": num_warps,
    }


# ------------------------------------------------------------------------------------------------------------
# The multi-program alignment for prefill-sized batches: a counting sort in three launches.
# Chunks of ALIGN_CHUNK_MIN entries or more, at most ALIGN_CHUNKED_MAX_PROGRAMS of them (the scan holds every
# chunk's counts in one [programs, E] tile), each chunk at most ALIGN_MAX_ENTRIES (one program's sort).
ALIGN_CHUNK_MIN = 1024
ALIGN_CHUNKED_MAX_PROGRAMS = 64
ALIGN_CHUNKED_MAX_ENTRIES = ALIGN_CHUNKED_MAX_PROGRAMS * ALIGN_MAX_ENTRIES  # 65536 tokens at top-8
# The padding fill's store block (a loop over it covers a program's share of sorted_ids).
ALIGN_FILL_BLOCK = 1024
# Blocks whose expert one step of the scatter kernel resolves ([ALIGN_BLOCK_TILE, BLOCK_E] compares).
ALIGN_BLOCK_TILE = 32


@triton.jit(do_not_specialize=["num_entries", "num_slots", "slots_per_program"])
def _moe_align_count_kernel(
    ids_ptr,
    counts_ptr,
    sorted_ids_ptr,
    num_entries,
    num_slots,
    slots_per_program,
    stride_ids,
    E: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_F: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """Program p: the per-expert counts of entries [p·CHUNK, (p+1)·CHUNK) into counts [P, BLOCK_E], and its share
    of the padding fill (every slot = num_entries; the scatter kernel, launched after, stores over it)."""
    pdl_wait(USE_PDL)
    i_p = tl.program_id(0)
    o_n = i_p * CHUNK + tl.arange(0, CHUNK)
    m_n = o_n < num_entries
    b_ids = tl.load(ids_ptr + i64(o_n) * stride_ids, mask=m_n, other=-1).to(tl.int32)  # [CHUNK]
    m_n = m_n & (b_ids >= 0) & (b_ids < E)
    b_counts = tl.histogram(tl.where(m_n, b_ids, 0), BLOCK_E, mask=m_n)  # [BLOCK_E]
    tl.store(counts_ptr + i_p * BLOCK_E + tl.arange(0, BLOCK_E), b_counts)
    o_f = tl.arange(0, BLOCK_F)
    b_pad = tl.zeros([BLOCK_F], dtype=tl.int32) + num_entries
    first = i64(i_p) * slots_per_program
    for f0 in range(0, slots_per_program, BLOCK_F):
        o_s = first + f0 + o_f
        tl.store(sorted_ids_ptr + o_s, b_pad, mask=(f0 + o_f < slots_per_program) & (o_s < num_slots))


@triton.jit(do_not_specialize=["num_chunks"])
def _moe_align_scan_kernel(
    counts_ptr,
    base_ptr,
    ends_ptr,
    num_chunks,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_P: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """One program: from counts [P, E], each expert's block-padded run end (ends [BLOCK_E]) and, per (chunk,
    expert), base = padded run start + the expert's entries in earlier chunks − the chunk's entries of smaller
    experts, so that an entry's slot is base[its chunk, its expert] + its position in the chunk's sorted order."""
    pdl_wait(USE_PDL)
    o_p = tl.arange(0, BLOCK_P)
    o_e = tl.arange(0, BLOCK_E)
    m_pe = (o_p < num_chunks)[:, None] & (o_e < BLOCK_E)[None, :]
    o_pe = o_p[:, None] * BLOCK_E + o_e[None, :]  # [BLOCK_P, BLOCK_E]
    b_counts = tl.load(counts_ptr + o_pe, mask=m_pe, other=0)
    b_total = tl.sum(b_counts, axis=0)  # [BLOCK_E]
    b_padded = (b_total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    b_ends = tl.cumsum(b_padded, axis=0)
    b_earlier = tl.cumsum(b_counts, axis=0) - b_counts  # same expert, earlier chunks
    b_smaller = tl.cumsum(b_counts, axis=1) - b_counts  # same chunk, smaller experts
    tl.store(base_ptr + o_pe, (b_ends - b_padded)[None, :] + b_earlier - b_smaller, mask=m_pe)
    tl.store(ends_ptr + o_e, b_ends)


@triton.jit(do_not_specialize=["num_entries", "num_blocks", "blocks_per_program"])
def _moe_align_scatter_kernel(
    ids_ptr,
    base_ptr,
    ends_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    num_entries,
    num_blocks,
    blocks_per_program,
    stride_ids,
    E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
    LOG_CHUNK: tl.constexpr,
    BLOCK_BT: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """Program p: its chunk's entries to their slots (one sort of the keys expert·CHUNK + entry gives each its
    position in the chunk's stable expert order), and the experts of its share of the blocks (searchsorted,
    right, over the run ends; −1 past the last run)."""
    pdl_wait(USE_PDL)
    i_p = tl.program_id(0)
    o_c = tl.arange(0, CHUNK)
    o_n = i_p * CHUNK + o_c
    m_n = o_n < num_entries
    b_ids = tl.load(ids_ptr + i64(o_n) * stride_ids, mask=m_n, other=-1).to(tl.int32)  # [CHUNK]
    m_n = m_n & (b_ids >= 0) & (b_ids < E)
    b_keys = tl.sort((tl.where(m_n, b_ids, BLOCK_E) << LOG_CHUNK) | o_c)  # padding sorts last
    b_expert_of = b_keys >> LOG_CHUNK
    m_sorted = b_expert_of < E
    b_slot = tl.load(base_ptr + i_p * BLOCK_E + b_expert_of, mask=m_sorted, other=0) + o_c
    tl.store(sorted_ids_ptr + b_slot, i_p * CHUNK + (b_keys & (CHUNK - 1)), mask=m_sorted)
    b_ends = tl.load(ends_ptr + tl.arange(0, BLOCK_E))  # [BLOCK_E]; experts ≥ E end at the total
    total = tl.max(b_ends, axis=0)
    o_bt = tl.arange(0, BLOCK_BT)
    for b0 in range(0, blocks_per_program, BLOCK_BT):
        o_b = i_p * blocks_per_program + b0 + o_bt
        b_start = o_b * BLOCK_M
        b_ended = tl.sum((b_ends[None, :] <= b_start[:, None]).to(tl.int32), axis=1)  # [BLOCK_BT]
        tl.store(
            block_expert_ptr + o_b,
            tl.where(b_start < total, b_ended, -1),
            mask=(b0 + o_bt < blocks_per_program) & (o_b < num_blocks),
        )


def align_chunked_launch(num_entries: int, num_experts: int) -> dict[str, int]:
    """Chunk, programs and warps of the multi-program alignment: the chunk is the smallest power of two ≥
    ALIGN_CHUNK_MIN that keeps the programs ≤ ALIGN_CHUNKED_MAX_PROGRAMS (a function of N's power of two)."""
    chunk = max(ALIGN_CHUNK_MIN, next_pow2(triton.cdiv(max(num_entries, 1), ALIGN_CHUNKED_MAX_PROGRAMS)))
    num_warps = 4 if chunk <= 512 else (8 if chunk <= 4096 else 16)
    return {
        "CHUNK": chunk,
        "LOG_CHUNK": chunk.bit_length() - 1,
        "BLOCK_E": max(next_pow2(num_experts), 32 * num_warps),
        "num_programs": triton.cdiv(num_entries, chunk),
        "num_warps": num_warps,
    }


def moe_align_chunked_triton(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] -> (sorted_ids, block_expert), equal to moe_align.moe_align_ref, for prefill-sized batches:
    counts per chunk (parallel), one scan program, the scatter (parallel). At most ALIGN_CHUNKED_MAX_ENTRIES."""
    flat = topk_ids.reshape(-1)  # [N]
    num_entries = flat.numel()
    if num_entries > ALIGN_CHUNKED_MAX_ENTRIES:
        raise ValueError(
            f"moe_align_chunked_triton takes at most {ALIGN_CHUNKED_MAX_ENTRIES} entries, got {num_entries}"
        )
    sorted_ids, block_expert = _align_outputs(flat, num_experts, block_m)
    if num_entries == 0:
        return sorted_ids, block_expert
    launch = align_chunked_launch(num_entries, num_experts)
    num_programs, block_e = launch["num_programs"], launch["BLOCK_E"]
    work = torch.empty((2 * num_programs + 1) * block_e, dtype=torch.int32, device=flat.device)
    counts, base, ends = work[: num_programs * block_e], work[num_programs * block_e : -block_e], work[-block_e:]
    num_blocks, num_slots = block_expert.shape[0], sorted_ids.shape[0]
    common = {"E": num_experts, "BLOCK_E": block_e, "CHUNK": launch["CHUNK"], "num_warps": launch["num_warps"]}
    _moe_align_count_kernel[(num_programs,)](
        flat, counts, sorted_ids, num_entries, num_slots, triton.cdiv(num_slots, num_programs), flat.stride(0),
        BLOCK_F=ALIGN_FILL_BLOCK, **common,
        **pdl_launch(flat),
    )  # fmt: skip
    _moe_align_scan_kernel[(1,)](
        counts, base, ends, num_programs, BLOCK_M=block_m, BLOCK_E=block_e,
        BLOCK_P=max(2, next_pow2(ALIGN_CHUNKED_MAX_PROGRAMS)), num_warps=8,
        **pdl_launch(counts),
    )  # fmt: skip
    _moe_align_scatter_kernel[(num_programs,)](
        flat, base, ends, sorted_ids, block_expert, num_entries, num_blocks, triton.cdiv(num_blocks, num_programs),
        flat.stride(0), BLOCK_M=block_m, LOG_CHUNK=launch["LOG_CHUNK"], BLOCK_BT=ALIGN_BLOCK_TILE, **common,
        **pdl_launch(flat),
    )  # fmt: skip
    return sorted_ids, block_expert
