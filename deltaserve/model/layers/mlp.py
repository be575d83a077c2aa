"""Feed-forward blocks: the dense SwiGLU MLP and the MoE block (routed experts + sigmoid-gated shared expert).

Under tensor parallelism (model/parallel.py) the dense MLP holds its slice of the intermediate width
(column-parallel [gate|up], row-parallel down) and all-reduces its output; the MoE block holds every expert's slice
of the intermediate width, or with expert parallelism whole experts (a token's weight for another rank's expert is
0 here), plus its slice of the shared expert, and all-reduces once after the fused sum. The router and the shared
expert's gate are replicated, so every rank routes alike.
"""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.config import ModelConfig
from deltaserve.kernels import (
    fused_moe,
    fused_moe_block,
    fused_moe_block_fp8,
    linear,
    moe_route,
    router_logits,
    silu_and_mul,
)
from deltaserve.kernels.fp8 import plain, silu_and_mul_fp8
from deltaserve.kernels.moe import FP8_BLOCK_MAX_TOKENS
from deltaserve.model.labels import label
from deltaserve.model.layers.common import empty_param, projection
from deltaserve.model.parallel import TensorParallel


class DenseMLP(nn.Module):
    def __init__(
        self,
        hidden: int,
        intermediate: int,
        dtype: torch.dtype,
        device: torch.device | str,
        tp: TensorParallel | None = None,
        is_reduced: bool = True,
        label_prefix: str = "mlp.",
        fp8: bool = False,
    ) -> None:
        """intermediate: this rank's width. is_reduced=False leaves the rank's partial sum to the caller (the
        shared expert, summed with the routed experts before the MoE block's one all-reduce). label_prefix starts
        its projections' profiler labels (model/labels.py): mlp.gate_up, or mlp.shared_gate_up for the shared
        expert. fp8: block-FP8 projections (docs/fp8.md)."""
        super().__init__()
        self.tp = tp or TensorParallel.single()
        self.is_reduced = is_reduced
        self.labels = (f"{label_prefix}gate_up", f"{label_prefix}down")
        self.gate_up_proj = projection(
            2 * intermediate, hidden, dtype=dtype, device=device, fp8=fp8, parts=(intermediate, intermediate)
        )  # [gate | up]
        self.down_proj = projection(hidden, intermediate, dtype=dtype, device=device, fp8=fp8)
        # before an FP8 down projection SiLU-and-mul quantizes its rows in the same launch (kernels/fp8.py)
        self.act = silu_and_mul_fp8 if fp8 else silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with label(self.labels[0]):
            gate_up = linear(x, self.gate_up_proj)
        with label("mlp.silu_and_mul"):
            act = self.act(gate_up)
        with label(self.labels[1]):
            out = linear(act, self.down_proj)
        return self.tp.all_reduce(out) if self.is_reduced else out


class MoEBlock(nn.Module):
    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str, tp: TensorParallel | None = None
    ) -> None:
        super().__init__()
        self.tp = tp or TensorParallel.single()
        shapes = self.tp.shapes(config)
        self.experts = shapes.experts
        hidden, num_experts, width = config.hidden_size, shapes.experts.size, shapes.moe_intermediate.size
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.gate = empty_param(config.num_experts, hidden, dtype=dtype, device=device)  # router, every expert
        # block-FP8 experts in an FP8 checkpoint (docs/fp8.md); the router and the shared-expert gate never are
        self.is_fp8 = config.fp8 is not None
        self.w13 = projection(
            num_experts, 2 * width, hidden, dtype=dtype, device=device, fp8=self.is_fp8, parts=(width, width)
        )  # per expert [gate | up]
        self.w2 = projection(num_experts, hidden, width, dtype=dtype, device=device, fp8=self.is_fp8)
        self.has_shared_expert = config.shared_expert_intermediate_size > 0
        if self.has_shared_expert:
            self.shared_expert = DenseMLP(
                hidden, shapes.shared_intermediate.size, dtype, device, self.tp, is_reduced=False,
                label_prefix="mlp.shared_", fp8=self.is_fp8,
            )  # fmt: skip
            self.shared_expert_gate = empty_param(1, hidden, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.experts.is_whole and (not self.is_fp8 or x.shape[0] <= FP8_BLOCK_MAX_TOKENS):
            # router (model-dtype logits, fp32 routing), routed experts and the sigmoid-gated shared expert as one
            # op: at decode sizes three launches, each expert's weights read once per step (kernels/moe.py; its ref
            # twin is the plain composition: router GEMM, route, fused_moe, shared MLP, (routed + sigmoid(gate)·
            # shared) in fp32). Under TP every expert's and the shared expert's widths are this rank's slice, so
            # the op's output is this rank's partial sum (the gate is a per-token scalar: it distributes).
            # Block-FP8 experts take their op at decode sizes only (its twin is the composition below).
            shared = ()
            if self.has_shared_expert:
                shared = (self.shared_expert.gate_up_proj, self.shared_expert.down_proj, self.shared_expert_gate)
            block = fused_moe_block_fp8 if self.is_fp8 else fused_moe_block
            with label("mlp.fused_moe_block"):
                out = block(x, self.gate, self.w13, self.w2, self.top_k, self.renormalize, *shared)
            return self.tp.all_reduce(out)
        # Expert parallelism: the fused op routes over the experts it holds, and this rank holds a subset, so the
        # composition runs here with the global routes mapped to local ids (the same ops as the fused op's ref
        # twin). Block-FP8 experts take it too above the decode sizes: their fused_moe is the FP8 one
        # (kernels/fp8_moe.py).
        num_experts = self.gate.shape[0]
        with label("mlp.moe_router"):
            # the router and the shared-expert gate rows in one pass (the bf16 block's first kernel), each logit
            # rounded to the model dtype as its own F.linear would (vLLM and TF)
            shared_gate = self.shared_expert_gate if self.has_shared_expert else None
            logits = router_logits(plain(x), self.gate, shared_gate)  # [T, E (+1)]
        with label("mlp.moe_route"):
            topk_weights, topk_ids = moe_route(logits[:, :num_experts], self.top_k, self.renormalize)
            if not self.experts.is_whole:  # whole experts (block FP8 on one rank): the ids are already local
                topk_weights, topk_ids = self._local_routes(topk_weights, topk_ids)
        if not self.has_shared_expert:
            with label("mlp.fused_moe"):
                out = fused_moe(x, self.w13, self.w2, topk_weights, topk_ids)
            return self.tp.all_reduce(out)
        shared_out = self.shared_expert(x)  # [T, H], this rank's partial sum
        shared_gate_logits = logits[:, num_experts:]  # [T, 1]
        # (routed + sigmoid(gate)·shared) in fp32, rounded once: fused into the routed experts' last kernel
        with label("mlp.fused_moe"):
            out = fused_moe(x, self.w13, self.w2, topk_weights, topk_ids, shared_out, shared_gate_logits)
        return self.tp.all_reduce(out)

    def _local_routes(self, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert parallelism: global expert ids [T, k] -> this rank's local ids, with weight 0 for experts held
        elsewhere (mapped to local expert 0, whose output that weight cancels exactly). The fused MoE kernels have
        no skip id, so such slots cost compute; the sum stays exact."""
        local = topk_ids - self.experts.start
        is_here = (local >= 0) & (local < self.experts.size)
        return torch.where(is_here, topk_weights, 0.0), torch.where(is_here, local, 0)
