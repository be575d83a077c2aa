"""The fused MoE's expert alignment in plain torch: the twin of `moe_routing_triton.moe_align_triton` and the CPU path.

Its own module so that both `moe.py` and `moe_triton.py` import it without importing each other.
"""

from __future__ import annotations

import torch


def moe_align_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused MoE's expert alignment: topk_ids [T, k] -> (sorted_ids [num_blocks·BLOCK_M] entry ids, T·k =
    padding; block_expert [num_blocks], -1 past the end). Entries sorted stably by expert, each expert's run
    padded to a multiple of block_m; num_blocks = cdiv(T·k, block_m) + min(E, T·k)."""
    flat = topk_ids.reshape(-1).long()  # [N]
    num_entries = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    padded_end = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)  # [N] entries by expert, in entry order within an expert
    expert_of_sorted = flat[order]
    rank = torch.arange(num_entries, device=device) - (counts.cumsum(0) - counts)[expert_of_sorted]
    dest = (padded_end - padded)[expert_of_sorted] + rank
    num_blocks = -(-num_entries // block_m) + min(num_experts, num_entries)
    sorted_ids = torch.full((num_blocks * block_m,), num_entries, dtype=torch.int32, device=device)
    sorted_ids[dest] = order.int()
    block_start = torch.arange(num_blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_start < padded_end[-1], block_expert, -1).int()
    return sorted_ids, block_expert
