"""The shapes `deltaserve bench kernels` times at: Qwen3.5-27B's and 35B-A3B's per-layer kernel shapes, and the ops.

ModelShapes holds one checkpoint's per-layer dimensions (the conv width follows from the GDN heads); MODELS the two
benchmarked checkpoints, by the name `--models` takes; per_rank the shapes one rank of an N-way tensor-parallel engine
runs (model/parallel.py's split, refused where it does not divide, as the engine refuses it); OPS every op `--ops`
can name, in the order the table prints them. benchmarks/*.py scripts time their kernels at MODELS' shapes too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from deltaserve.model.parallel import kv_head_shard, split_evenly


@dataclass(frozen=True)
class ModelShapes:
    """Per-layer kernel shapes of one checkpoint (docs/ARCHITECTURE.md#configs-and-checkpoint-layout)."""

    name: str
    hidden: int
    num_q_heads: int
    num_kv_heads: int
    num_v_heads: int
    mlp_inter: int  # dense SwiGLU width (27B) or the shared expert's (35B-A3B)
    head_dim: int = 256
    rotary_dim: int = 64
    num_k_heads: int = 16
    head_k_dim: int = 128
    head_v_dim: int = 128
    conv_kernel: int = 4
    num_experts: int = 0
    top_k: int = 0
    moe_inter: int = 0

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim


def per_rank(m: ModelShapes, tp: int, expert_parallel: bool = False) -> ModelShapes:
    """The kernel shapes of one rank of a tp-way tensor-parallel engine (every rank's are the same); refuses a
    size that does not divide a sharded dimension, as the engine does."""
    if tp == 1:
        return m
    num_q_heads = split_evenly(m.num_q_heads, tp, 0, "num_attention_heads").size
    num_kv_heads = kv_head_shard(m.num_kv_heads, tp, 0).size
    num_k_heads = split_evenly(m.num_k_heads, tp, 0, "linear_num_key_heads").size
    num_v_heads = split_evenly(m.num_v_heads, tp, 0, "linear_num_value_heads").size
    inter_field = "shared_expert_intermediate_size" if m.num_experts else "intermediate_size"
    mlp_inter = split_evenly(m.mlp_inter, tp, 0, inter_field).size
    experts, moe_inter = m.num_experts, m.moe_inter
    if m.num_experts and expert_parallel:
        experts = split_evenly(m.num_experts, tp, 0, "num_experts").size
    elif m.num_experts:
        moe_inter = split_evenly(m.moe_inter, tp, 0, "moe_intermediate_size").size
    return dataclasses.replace(
        m,
        name=f"{m.name}/tp{tp}" + ("-ep" if expert_parallel and m.num_experts else ""),
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        num_k_heads=num_k_heads,
        num_v_heads=num_v_heads,
        mlp_inter=mlp_inter,
        num_experts=experts,
        moe_inter=moe_inter,
    )


MODELS: dict[str, ModelShapes] = {
    "27b": ModelShapes("Qwen3.5-27B", hidden=5120, num_q_heads=24, num_kv_heads=4, num_v_heads=48, mlp_inter=17408),
    "35b-a3b": ModelShapes(
        "Qwen3.5-35B-A3B",
        hidden=2048,
        num_q_heads=16,
        num_kv_heads=2,
        num_v_heads=32,
        mlp_inter=512,
        num_experts=256,
        top_k=8,
        moe_inter=512,
    ),
}
OPS = (
    "preamble_fused",
    "preamble_unfused",
    "rotary_embedding",
    "rms_norm_residual",
    "gated_rms_norm",
    "silu_and_mul",
    "store_kv",
    "paged_attention",
    "causal_conv1d",
    "gdn",
    "gdn_verify_conv",
    "gdn_verify",
    "spec_commit",
    "fused_moe",
    "moe_block",
    "linear",
    "fp8_linear",
    "fp8_fused_moe",
)
