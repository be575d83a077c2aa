"""Feed-forward blocks: the dense SwiGLU MLP and the MoE block (routed experts + sigmoid-gated shared expert)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deltaserve.config import ModelConfig
from deltaserve.kernels import fused_moe_block, silu_and_mul
from deltaserve.model.layers.common import empty_param


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.gate_up_proj = empty_param(2 * intermediate, hidden, dtype=dtype, device=device)  # [gate | up]
        self.down_proj = empty_param(hidden, intermediate, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(silu_and_mul(F.linear(x, self.gate_up_proj)), self.down_proj)


class MoEBlock(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        hidden, num_experts, width = config.hidden_size, config.num_experts, config.moe_intermediate_size
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.gate = empty_param(num_experts, hidden, dtype=dtype, device=device)  # router
        self.w13 = empty_param(num_experts, 2 * width, hidden, dtype=dtype, device=device)  # per expert [gate | up]
        self.w2 = empty_param(num_experts, hidden, width, dtype=dtype, device=device)
        self.has_shared_expert = config.shared_expert_intermediate_size > 0
        if self.has_shared_expert:
            self.shared_expert = DenseMLP(hidden, config.shared_expert_intermediate_size, dtype, device)
            self.shared_expert_gate = empty_param(1, hidden, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # router (model-dtype logits, fp32 routing), routed experts and the sigmoid-gated shared expert as one op:
        # at decode sizes three launches, each expert's weights read once per step (kernels/moe.py; its ref twin is
        # the plain composition: router GEMM, route, fused_moe, shared MLP, (routed + sigmoid(gate)·shared) in fp32)
        shared = ()
        if self.has_shared_expert:
            shared = (self.shared_expert.gate_up_proj, self.shared_expert.down_proj, self.shared_expert_gate)
        return fused_moe_block(x, self.gate, self.w13, self.w2, self.top_k, self.renormalize, *shared)
