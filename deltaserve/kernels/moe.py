"""Mixture-of-experts: routing (softmax → top-k → renormalise, fp32), the routed-expert SwiGLU sum, and the
whole MoE block of a layer (router, routed experts, sigmoid-gated shared expert) as one op.

w13 [E, 2·I, H] holds per expert [gate (I rows) | up (I rows)]; w2 [E, H, I]. Routing weights stay fp32
(vLLM); each expert's down projection is scaled by its weight and the top-k results are summed in fp32.
`fused_moe_block` is the composition the model's MoE block runs today (bf16 router GEMM, routing, shared
SwiGLU, gate GEMM, fused_moe); on CUDA it takes the tuning table's path, three launches at decode sizes
(moe_decode_triton) instead of about ten.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltaserve.kernels._dispatch import triton_or_ref, use_triton
from deltaserve.kernels.activation import silu_and_mul, silu_and_mul_ref
from deltaserve.kernels.fp8 import Fp8Rows, Fp8Weight, plain
from deltaserve.kernels.fp8_moe import fused_moe_fp8


def moe_route_ref(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] fp32, expert ids [T, k] int64)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids


moe_route = triton_or_ref(moe_route_ref, "moe_routing_triton.moe_route_triton")


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
    x: torch.Tensor | Fp8Rows,
    w13: torch.Tensor | Fp8Weight,
    w2: torch.Tensor | Fp8Weight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    shared: torch.Tensor | None = None,
    shared_gate_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    if isinstance(w13, Fp8Weight) and isinstance(w2, Fp8Weight):
        return fused_moe_fp8(x, w13, w2, topk_weights, topk_ids, shared, shared_gate_logits)  # kernels/fp8_moe.py
    x = plain(x)  # bf16 experts read the rows, not a quantization a norm made for FP8 projections
    if use_triton(x):
        from deltaserve.kernels.moe_triton import fused_moe_triton

        return fused_moe_triton(x, w13, w2, topk_weights, topk_ids, shared, shared_gate_logits)
    return fused_moe_ref(x, w13, w2, topk_weights, topk_ids, shared, shared_gate_logits)


def router_logits_ref(x: torch.Tensor, router_weight: torch.Tensor, gate_weight: torch.Tensor | None) -> torch.Tensor:
    """x [T, H], W_r [E, H], w_g [1, H] or None -> [T, E (+1)] in x's dtype: the router logits and, as column E,
    the shared-expert gate logit; the twin of moe_decode_triton.router_logits_triton."""
    logits = F.linear(x, router_weight)
    return logits if gate_weight is None else torch.cat([logits, F.linear(x, gate_weight)], dim=1)


router_logits = triton_or_ref(router_logits_ref, "moe_decode_triton.router_logits_triton")


def fused_moe_block_ref(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
    shared_w13: torch.Tensor | None = None,
    shared_w2: torch.Tensor | None = None,
    shared_gate_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, H]; router W_r [E, H]; w13 [E, 2I, H]; w2 [E, H, I]; the shared expert's [gate | up] rows
    [2·I_sh, H], down [H, I_sh] and gate row [1, H] (all three or none) -> [T, H]. Router and gate logits are
    model-dtype GEMM outputs (vLLM and TF), the shared SwiGLU rounds as the dense MLP, the rest as fused_moe_ref."""
    has_shared = shared_w13 is not None
    if has_shared != (shared_w2 is not None) or has_shared != (shared_gate_weight is not None):
        raise ValueError("fused_moe_block: the shared expert needs shared_w13, shared_w2 and shared_gate_weight")
    weights, ids = moe_route_ref(F.linear(x, router_weight), top_k, renormalize)
    if not has_shared:
        return fused_moe_ref(x, w13, w2, weights, ids)
    shared = F.linear(silu_and_mul_ref(F.linear(x, shared_w13)), shared_w2)  # [T, H]
    return fused_moe_ref(x, w13, w2, weights, ids, shared, F.linear(x, shared_gate_weight))


fused_moe_block = triton_or_ref(fused_moe_block_ref, "moe_decode_triton.moe_block_triton")


# The block-FP8 MoE block as one op up to this many tokens (a decode step's; kernels/moe_decode_triton.py's FP8
# decode path); the model composes the FP8 ops itself above it (docs/fp8.md#decode)
FP8_BLOCK_MAX_TOKENS = 8


def fused_moe_block_fp8_ref(
    x: torch.Tensor | Fp8Rows,
    router_weight: torch.Tensor,
    w13: Fp8Weight,
    w2: Fp8Weight,
    top_k: int,
    renormalize: bool,
    shared_w13: Fp8Weight | None = None,
    shared_w2: Fp8Weight | None = None,
    shared_gate_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """fused_moe_block_ref with block-FP8 experts and shared expert: x [T, H] (or Fp8Rows, whose quantization the
    FP8 GEMMs read) -> [T, H]. The composition the FP8 model runs: the router and gate logits from the rows
    (router_logits_ref), routing, the shared expert as fp8_linear -> silu_and_mul_fp8 -> fp8_linear, and
    fused_moe_fp8_ref with the gated shared sum."""
    from deltaserve.kernels.fp8 import fp8_linear_ref, silu_and_mul_fp8_ref
    from deltaserve.kernels.fp8_moe import fused_moe_fp8_ref

    has_shared = shared_w13 is not None
    if has_shared != (shared_w2 is not None) or has_shared != (shared_gate_weight is not None):
        raise ValueError("fused_moe_block_fp8: the shared expert needs shared_w13, shared_w2 and shared_gate_weight")
    num_experts = w13.shape[0]
    logits = router_logits_ref(plain(x), router_weight, shared_gate_weight)  # [T, E (+1)]
    weights, ids = moe_route_ref(logits[:, :num_experts], top_k, renormalize)
    if not has_shared:
        return fused_moe_fp8_ref(x, w13, w2, weights, ids)
    shared = fp8_linear_ref(silu_and_mul_fp8_ref(fp8_linear_ref(x, shared_w13)), shared_w2)  # [T, H]
    return fused_moe_fp8_ref(x, w13, w2, weights, ids, shared, logits[:, num_experts:])


def fused_moe_block_fp8(
    x: torch.Tensor | Fp8Rows,
    router_weight: torch.Tensor,
    w13: Fp8Weight,
    w2: Fp8Weight,
    top_k: int,
    renormalize: bool,
    shared_w13: Fp8Weight | None = None,
    shared_w2: Fp8Weight | None = None,
    shared_gate_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    if use_triton(plain(x)):
        from deltaserve.kernels.moe_decode_triton import moe_block_fp8_triton

        return moe_block_fp8_triton(x, router_weight, w13, w2, top_k, renormalize, shared_w13, shared_w2,
                                    shared_gate_weight)  # fmt: skip
    return fused_moe_block_fp8_ref(x, router_weight, w13, w2, top_k, renormalize, shared_w13, shared_w2,
                                   shared_gate_weight)  # fmt: skip
