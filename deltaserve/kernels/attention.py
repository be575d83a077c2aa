"""Paged KV cache store and paged causal GQA attention over it (prefill chunks and decodes alike).

Cache layout: k_cache, v_cache [num_blocks, block_size, nkv, d]; a token's slot is block·block_size + offset. The
block stride may exceed a block (one pool, docs/ARCHITECTURE.md: a block is a page of every layer's K and V), so
a slot is indexed as (block, offset), never through a flattened view.
A batch is varlen: sequence b owns queries query_start_loc[b]:query_start_loc[b+1], which are the LAST
q_len tokens of its seq_lens[b] tokens of context (already stored in the cache), so chunked prefill reads
earlier chunks from the cache and a decode is the case q_len = 1. Query head h reads KV head h // (nq/nkv).
"""

from __future__ import annotations

import torch

from deltaserve.kernels._dispatch import triton_or_ref


def store_kv_ref(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Writes k, v [T, nkv, d] into their cache slots; slots < 0 (CUDA-graph padding) are skipped."""
    block_size = k_cache.shape[1]
    is_valid = slot_mapping >= 0
    slots = slot_mapping[is_valid].long()
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = k[is_valid].to(k_cache.dtype)
    v_cache[blocks, offsets] = v[is_valid].to(v_cache.dtype)


store_kv = triton_or_ref(store_kv_ref, "attention_triton.store_kv_triton")


def paged_attention_ref(
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
    """q [T, nq, d] -> o [T, nq, d]; causal within each sequence, fp32 softmax, one rounding.

    max_query_len / max_seq_len are host-side hints (the runner knows them without a device sync); a kernel
    may use them to size its grid, e.g. max_query_len == 1 for an all-decode batch under a CUDA graph.
    """
    block_size = k_cache.shape[1]
    num_q_heads = q.shape[1]
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lengths = seq_lens.tolist()
    for b, seq_len in enumerate(lengths):
        q_start, q_end = starts[b], starts[b + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        positions = torch.arange(seq_len, device=q.device)
        blocks = block_tables[b, positions // block_size].long()
        offsets = positions % block_size
        keys = k_cache[blocks, offsets].float()  # [L, nkv, d]
        values = v_cache[blocks, offsets].float()  # [L, nkv, d]
        keys = keys.repeat_interleave(group, dim=1)  # [L, nq, d]
        values = values.repeat_interleave(group, dim=1)  # [L, nq, d]
        qb = q[q_start:q_end].float()  # [q_len, nq, d]
        scores = torch.einsum("qhd,khd->hqk", qb, keys) * scale  # [nq, q_len, L]
        query_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        is_masked = positions[None, :] > query_pos[:, None]  # [q_len, L]
        scores = scores.masked_fill(is_masked[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
    return out


paged_attention = triton_or_ref(paged_attention_ref, "attention_triton.paged_attention_triton")
