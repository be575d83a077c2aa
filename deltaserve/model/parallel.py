"""Tensor parallelism inside the model: which slice of every sharded dimension a rank holds, and the collectives
the layers call.

Sharding follows vLLM's layout for these models (docs/ARCHITECTURE.md#tensor-parallel-sharding):
- column-parallel: the fused attention [q|gate|k|v] and GDN [q|k|v|z] / [b|a] projections, split by head group
  (attention query heads, KV heads, GDN key heads with their value heads), the dense MLP's [gate|up] and each
  expert's [gate|up] rows (or, with expert parallelism, whole experts);
- row-parallel, one all-reduce each: o_proj, out_proj, the MLP's down_proj, the MoE block (routed experts and
  the shared expert summed before the one all-reduce);
- KV heads are split when there are at least as many as ranks, else each rank holds one, replicated (vLLM's rule:
  the size must then be a multiple of num_key_value_heads);
- vocab-parallel embedding (each rank looks up its rows, zeros elsewhere, all-reduced) and LM head (each rank's
  logits all-gathered; rank 0, the only rank that samples, uses them; every rank uses the MTP drafter's);
- replicated: norms, q/k norms, the router, the shared-expert gate, the vision tower.

A size that does not divide a sharded dimension is refused naming the config field, as vLLM refuses it.
TensorParallel.single() is the one-rank case: no process group, every collective returns its input.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from deltaserve.config import ModelConfig


class ShardingError(ValueError):
    """A checkpoint whose dimensions the tensor-parallel size does not divide; the message names the field."""


@dataclass(frozen=True)
class Shard:
    """One rank's contiguous slice [start, start + size) of a dimension of `total` entries."""

    start: int
    size: int
    total: int

    @property
    def stop(self) -> int:
        return self.start + self.size

    @property
    def is_whole(self) -> bool:
        return self.start == 0 and self.size == self.total


def split_evenly(total: int, num_ranks: int, rank: int, field: str) -> Shard:
    """Rank `rank`'s equal share of `total`; refuses a size that does not divide it (naming the config field)."""
    if total % num_ranks:
        raise ShardingError(
            f"`{field}` ({total}) is not divisible by the tensor-parallel size ({num_ranks}); choose a "
            f"--tensor-parallel-size that divides it"
        )
    size = total // num_ranks
    return Shard(rank * size, size, total)


def kv_head_shard(num_kv_heads: int, num_ranks: int, rank: int) -> Shard:
    """KV heads: split when there are at least as many as ranks, else one per rank, replicated across
    num_ranks / num_kv_heads consecutive ranks (vLLM's QKVParallelLinear)."""
    if num_kv_heads >= num_ranks:
        return split_evenly(num_kv_heads, num_ranks, rank, "num_key_value_heads")
    if num_ranks % num_kv_heads:
        raise ShardingError(
            f"--tensor-parallel-size {num_ranks} is above `num_key_value_heads` ({num_kv_heads}) and not a "
            f"multiple of it, so the KV heads cannot be replicated evenly"
        )
    return Shard(rank // (num_ranks // num_kv_heads), 1, num_kv_heads)


@dataclass(frozen=True)
class LocalShapes:
    """The slices of one rank (all whole for a single rank)."""

    q_heads: Shard  # num_attention_heads
    kv_heads: Shard  # num_key_value_heads (a replicated single head when there are fewer than ranks)
    k_heads: Shard  # GDN linear_num_key_heads
    v_heads: Shard  # GDN linear_num_value_heads (those of the rank's key heads)
    intermediate: Shard  # dense MLP width
    moe_intermediate: Shard  # each routed expert's width (whole under expert parallelism)
    experts: Shard  # routed experts held (all of them unless expert parallelism)
    shared_intermediate: Shard  # the shared expert's width
    vocab: Shard  # embedding / lm_head rows; `size` is per rank, the last rank's tail past vocab_size is padding

    @classmethod
    def of(cls, config: ModelConfig, rank: int = 0, num_ranks: int = 1, expert_parallel: bool = False) -> LocalShapes:
        """Every slice of rank `rank` out of num_ranks; ShardingError names a field the size does not divide."""
        whole = lambda total: Shard(0, total, total)  # noqa: E731
        has_attention = bool(config.full_attention_layers)
        has_gdn = bool(config.linear_attention_layers)
        has_dense = not config.moe_layers or not all(config.moe_layers)
        has_moe = bool(config.moe_layers) and any(config.moe_layers)
        q_heads = (
            split_evenly(config.num_attention_heads, num_ranks, rank, "num_attention_heads")
            if has_attention
            else whole(config.num_attention_heads)
        )
        kv_heads = (
            kv_head_shard(config.num_key_value_heads, num_ranks, rank)
            if has_attention
            else whole(config.num_key_value_heads)
        )
        if has_gdn:
            k_heads = split_evenly(config.linear_num_key_heads, num_ranks, rank, "linear_num_key_heads")
            v_heads = split_evenly(config.linear_num_value_heads, num_ranks, rank, "linear_num_value_heads")
        else:
            k_heads, v_heads = whole(config.linear_num_key_heads), whole(config.linear_num_value_heads)
        intermediate = (
            split_evenly(config.intermediate_size, num_ranks, rank, "intermediate_size")
            if has_dense
            else whole(config.intermediate_size)
        )
        moe_intermediate, experts = whole(config.moe_intermediate_size), whole(config.num_experts)
        shared = whole(config.shared_expert_intermediate_size)
        if has_moe and expert_parallel:
            experts = split_evenly(config.num_experts, num_ranks, rank, "num_experts")
        elif has_moe:
            moe_intermediate = split_evenly(config.moe_intermediate_size, num_ranks, rank, "moe_intermediate_size")
        if has_moe and config.shared_expert_intermediate_size:
            shared = split_evenly(
                config.shared_expert_intermediate_size, num_ranks, rank, "shared_expert_intermediate_size"
            )
        per_rank = -(-config.vocab_size // num_ranks)
        vocab = Shard(rank * per_rank, per_rank, config.vocab_size)
        shapes = cls(q_heads, kv_heads, k_heads, v_heads, intermediate, moe_intermediate, experts, shared, vocab)
        check_fp8_blocks(config, shapes, num_ranks)
        return shapes


def check_fp8_blocks(config: ModelConfig, shapes: LocalShapes, num_ranks: int) -> None:
    """Block-FP8 weights (docs/fp8.md#tensor-parallel-sharding): every split dimension must give each rank a whole
    number of 128-wide scale blocks, or one rank's shard would split a block whose single scale both ranks need.
    Refused by the config field that is split, as vLLM refuses such a partition of a block-quantized weight."""
    if config.fp8 is None:
        return
    block = config.fp8.block_size[0]
    d, dk, dv = config.head_dim, config.linear_key_head_dim, config.linear_value_head_dim
    splits = (
        (shapes.q_heads, 2 * d, "num_attention_heads", "q_proj rows"),
        (shapes.q_heads, d, "num_attention_heads", "o_proj columns"),
        (shapes.kv_heads, d, "num_key_value_heads", "k_proj / v_proj rows"),
        (shapes.k_heads, dk, "linear_num_key_heads", "GDN q / k rows"),
        (shapes.v_heads, dv, "linear_num_value_heads", "GDN v / z rows and out_proj columns"),
        (shapes.intermediate, 1, "intermediate_size", "MLP gate / up rows and down_proj columns"),
        (shapes.moe_intermediate, 1, "moe_intermediate_size", "expert gate / up rows and down_proj columns"),
        (shapes.shared_intermediate, 1, "shared_expert_intermediate_size", "shared-expert rows and columns"),
    )
    for shard, unit, field, what in splits:
        width = shard.size * unit
        if not shard.is_whole and width % block:
            raise ShardingError(
                f"`{field}` ({shard.total}) split over --tensor-parallel-size {num_ranks} gives each rank {width} "
                f"{what}, not a multiple of the FP8 scale block ({block}): a rank's shard would split a block; "
                "choose a tensor-parallel size that keeps each share a multiple of it"
            )


class TensorParallel:
    """One rank's view of its tensor-parallel group: its rank, the group's size, the device group (NCCL on GPUs,
    gloo on the CPU) the layers' collectives run on, and the gloo group for host-side agreement."""

    def __init__(
        self,
        rank: int = 0,
        size: int = 1,
        local_rank: int = 0,
        group: dist.ProcessGroup | None = None,
        cpu_group: dist.ProcessGroup | None = None,
        is_expert_parallel: bool = False,
    ) -> None:
        if size > 1 and (group is None or cpu_group is None):
            raise ValueError("a tensor-parallel group of several ranks needs its process groups")
        self.rank = rank
        self.size = size
        self.local_rank = local_rank
        self.group = group
        self.cpu_group = cpu_group
        self.is_expert_parallel = is_expert_parallel

    @classmethod
    def single(cls) -> TensorParallel:
        return cls()

    @property
    def is_parallel(self) -> bool:
        return self.size > 1

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def shapes(self, config: ModelConfig) -> LocalShapes:
        return LocalShapes.of(config, self.rank, self.size, self.is_expert_parallel)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums x over the ranks in place (the output of a row-parallel projection); returns x."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_columns(self, x: torch.Tensor, to_all: bool = False) -> torch.Tensor | None:
        """x [B, N] on every rank -> [B, size·N] (rank-major columns) on rank 0, None on the others (on every rank
        with to_all: the drafts, which every rank takes the same argmax of). An all-gather (one ring collective, as
        vLLM gathers its logits), not a gather: NCCL runs it as one captured kernel in the decode graphs, where a
        gather would be point-to-point sends; at two ranks each link carries the same bytes."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = torch.empty((self.size, *x.shape), dtype=x.dtype, device=x.device)  # [size, B, N]
        dist.all_gather_into_tensor(parts.view(-1, x.shape[1]), x, group=self.group)
        if self.rank != 0 and not to_all:
            return None
        return parts.permute(1, 0, 2).reshape(x.shape[0], -1)

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x on every rank (in place); returns x."""
        if self.size > 1:
            dist.broadcast(x, src=0, group=self.group)
        return x

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's value (host-side agreement, e.g. on the cache budget)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())
