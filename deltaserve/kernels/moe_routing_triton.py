"""Triton MoE routing for decode-sized batches: top-k routing in one launch, the expert alignment in another.

On the 35B-A3B shape a decode step launched about 2,700 kernels, and routing plus alignment in torch ops
(softmax, top-k sorts, renormalisation, then counts, scans, a radix sort, searchsorted, index puts) were
about 22 launches per MoE layer (benchmarks/results/profile-decode-35b-a3b-h200-20261129.json). Here:

- `moe_route_triton` (twin: `moe.moe_route_ref`): one program per token; softmax in fp32, top-k by repeated
  argmax (descending, lowest expert id first on ties), optional renormalisation, weights fp32.
- `moe_align_triton` (twin: `moe_align.moe_align_ref`, equal output): one program for the whole batch, in
  TILE-entry steps so its registers do not grow with the batch: per expert counts, block-padded offsets
  (cumsum), each block's expert (searchsorted as a count), then the scatter in entry order with a running
  next-slot per expert and the rank within the step (so the order is the stable sort's). An earlier version
  held [entries, 64] compare tiles in registers: at 257-512 entries (35B-A3B decode at B = 33-64) it spilled
  3 KiB a thread to local memory (11,000 spill instructions; benchmarks/kernel_resources.py), the decode-step
  cliff of issue 11. Sized for at most ALIGN_MAX_ENTRIES entries (every decode batch up to 512 tokens at
  top-8); larger (prefill) batches keep the torch path, where launch counts do not matter.
Both are CUDA-graph safe: grids from shapes, no host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.kernels._triton import i64, next_pow2

# One program walks the entries in steps: its time grows linearly, so prefill-sized batches use torch ops.
ALIGN_MAX_ENTRIES = 4096


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
):
    i_t = i64(tl.program_id(0))
    o_e = tl.arange(0, BLOCK_E)
    m_e = o_e < E
    b_l = tl.load(logits_ptr + i_t * stride_l + o_e, mask=m_e, other=-float("inf")).to(tl.float32)
    b_p = tl.exp(b_l - tl.max(b_l, axis=0))
    b_p = b_p / tl.sum(b_p, axis=0)  # [BLOCK_E] softmax, fp32
    b_p = tl.where(m_e, b_p, -1.0)  # padding never wins
    o_k = tl.arange(0, BLOCK_K)
    b_w = tl.zeros([BLOCK_K], dtype=tl.float32)
    b_id = tl.zeros([BLOCK_K], dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        p_max = tl.max(b_p, axis=0)
        i_max = tl.min(tl.where(b_p == p_max, o_e, BLOCK_E), axis=0)  # lowest expert id among ties
        b_w = tl.where(o_k == j, p_max, b_w)
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
        )
    return weights, ids


@triton.jit(do_not_specialize=["num_entries", "num_blocks"])
def _moe_align_kernel(
    ids_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    num_entries,
    num_blocks,
    E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    TILE: tl.constexpr,
):
    o_e = tl.arange(0, BLOCK_E)
    o_i = tl.arange(0, TILE)
    # Pass 1: per expert counts, TILE entries at a time ([BLOCK_E, TILE] compares: registers do not grow with N).
    b_counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for m0 in range(0, num_entries, TILE):
        o_m = m0 + o_i
        b_ids = tl.load(ids_ptr + o_m, mask=o_m < num_entries, other=BLOCK_E).to(tl.int32)  # padding: no expert
        b_counts += tl.sum((b_ids[None, :] == o_e[:, None]).to(tl.int32), axis=1)
    b_padded = (b_counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    b_ends = tl.cumsum(b_padded, axis=0)  # [BLOCK_E] block-padded run ends
    total = tl.sum(b_padded, axis=0)
    # Every slot starts as padding (num_entries); pass 2 scatters the entries over it.
    num_slots = num_blocks * BLOCK_M
    b_pad = tl.zeros([TILE], dtype=tl.int32) + num_entries
    for s0 in range(0, num_slots, TILE):
        tl.store(sorted_ids_ptr + s0 + o_i, b_pad, mask=s0 + o_i < num_slots)
    # Each block's expert: the number of run ends at or before its first row, -1 past the last run.
    for b0 in range(0, num_blocks, TILE):
        o_b = b0 + o_i
        b_start = o_b * BLOCK_M
        b_expert = tl.sum((b_ends[None, :] <= b_start[:, None]).to(tl.int32), axis=1)
        b_expert = tl.where(b_start < total, b_expert, -1)
        tl.store(block_expert_ptr + o_b, b_expert, mask=o_b < num_blocks)
    tl.debug_barrier()  # the padding fill is complete before any entry is scattered over it
    # Pass 2, in entry order: each entry goes to its expert's next free slot (the running count starts at the
    # run's start), then the rank among earlier entries of the same chunk; so the order is the stable sort's.
    b_next = b_ends - b_padded  # [BLOCK_E]
    for m0 in range(0, num_entries, TILE):
        o_m = m0 + o_i
        m_m = o_m < num_entries
        b_ids = tl.load(ids_ptr + o_m, mask=m_m, other=BLOCK_E).to(tl.int32)  # [TILE]
        is_mine = b_ids[:, None] == o_e[None, :]  # [TILE, BLOCK_E]
        b_base = tl.sum(tl.where(is_mine, b_next[None, :], 0), axis=1)  # [TILE]
        is_earlier_same = (b_ids[:, None] == b_ids[None, :]) & (o_i[None, :] < o_i[:, None])  # [TILE, TILE]
        b_rank = tl.sum(is_earlier_same.to(tl.int32), axis=1)
        tl.store(sorted_ids_ptr + b_base + b_rank, o_m, mask=m_m)
        b_next += tl.sum(is_mine.to(tl.int32), axis=0)


def moe_align_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] -> (sorted_ids [num_blocks·BLOCK_M] entry ids, T·k = padding; block_expert [num_blocks]),
    equal to moe_align.moe_align_ref. At most ALIGN_MAX_ENTRIES entries."""
    flat = topk_ids.reshape(-1)  # [N] int64 (int32 also accepted)
    num_entries = flat.numel()
    if num_entries > ALIGN_MAX_ENTRIES:
        raise ValueError(f"moe_align_triton takes at most {ALIGN_MAX_ENTRIES} entries, got {num_entries}")
    device = flat.device
    num_blocks = triton.cdiv(num_entries, block_m) + min(num_experts, num_entries)
    sorted_ids = torch.empty(num_blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=device)
    if num_entries == 0:
        return sorted_ids, block_expert
    block_e = next_pow2(num_experts)
    _moe_align_kernel[(1,)](
        flat,
        sorted_ids,
        block_expert,
        num_entries,
        num_blocks,
        E=num_experts,
        BLOCK_M=block_m,
        BLOCK_E=block_e,
        TILE=align_tile(block_e),
        num_warps=8,
    )
    return sorted_ids, block_expert


def align_tile(block_e: int) -> int:
    """Entries per step of the align kernel: [BLOCK_E, TILE] compare tiles of at most 8K elements, 56-110
    registers a thread at 8 warps and no spills for E = 64-512 on sm_90 (benchmarks/kernel_resources.py)."""
    return max(16, min(64, 8192 // block_e))
