"""Mixture-of-experts: routing (softmax → top-k → renormalise, fp32) and the routed-expert SwiGLU sum.

w13 [E, 2·I, H] holds per expert [gate (I rows) | up (I rows)]; w2 [E, H, I]. Routing weights stay fp32
(vLLM); each expert's down projection is scaled by its weight and the top-k results are summed in fp32.
"""

from __future__ import annotations

import torch

from deltaserve.kernels._dispatch import use_triton
from deltaserve.kernels.activation import silu_and_mul


def moe_route_ref(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] fp32, expert ids [T, k] int64)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids


def moe_route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(router_logits):
        from deltaserve.kernels.moe_routing_triton import moe_route_triton

        return moe_route_triton(router_logits, top_k, renormalize)
    return moe_route_ref(router_logits, top_k, renormalize)


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    shared: torch.Tensor | None = None,
    shared_gate_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, H] -> Σ_k weight_k · down_e(SiLU(gate_e x) ⊙ up_e x) [T, H], rounded. With the shared expert's output
    [T, H] and gate logits [T, 1] (model dtype): (routed + sigmoid(gate)·shared) in fp32, rounded once."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in torch.unique(topk_ids).tolist():
        token_idx, k_idx = torch.nonzero(topk_ids == expert, as_tuple=True)
        hidden = silu_and_mul(x[token_idx] @ w13[expert].T)  # [n, I]
        expert_out = (hidden @ w2[expert].T).float()  # [n, H]
        out.index_add_(0, token_idx, expert_out * topk_weights[token_idx, k_idx, None])
    routed = out.to(x.dtype)
    if shared is None or shared_gate_logits is None:
        return routed
    gate = torch.sigmoid(shared_gate_logits.float())  # [T, 1]
    return (routed.float() + gate * shared.float()).to(x.dtype)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    shared: torch.Tensor | None = None,
    shared_gate_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    if use_triton(x):
        from deltaserve.kernels.moe_triton import fused_moe_triton

        return fused_moe_triton(x, w13, w2, topk_weights, topk_ids, shared, shared_gate_logits)
    return fused_moe_ref(x, w13, w2, topk_weights, topk_ids, shared, shared_gate_logits)
