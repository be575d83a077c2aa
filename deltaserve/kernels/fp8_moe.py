"""The routed experts with block-FP8 weights (docs/fp8.md): fused_moe's FP8 twin.

w13 is an Fp8Weight [E, 2·I, H] (per expert [gate | up] rows), w2 an Fp8Weight [E, H, I]. Every expert GEMM is the
block-FP8 linear of kernels/fp8.py (its input quantized per token and group of 128, fp32 accumulation, one rounding
to the activation dtype), and the rest rounds as the bf16 fused_moe_ref does: SiLU-and-mul on the rounded gate/up
output, each expert's down output scaled by its routing weight and summed over the top-k in fp32, rounded once,
with the sigmoid-gated shared expert added in the same fp32 sum.
"""

from __future__ import annotations

import torch

from deltaserve.kernels._dispatch import use_triton
from deltaserve.kernels.activation import silu_and_mul_ref
from deltaserve.kernels.fp8 import Fp8Rows, Fp8Weight, fp8_linear_ref, plain


def fused_moe_fp8_ref(
    x: torch.Tensor | Fp8Rows,
    w13: Fp8Weight,
    w2: Fp8Weight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    shared: torch.Tensor | None = None,
    shared_gate_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, H] (or Fp8Rows: the experts' GEMMs read their quantization), topk_weights [T, k] fp32, topk_ids
    [T, k] -> Σ_k weight_k · down_e(SiLU(gate_e x) ⊙ up_e x) [T, H] in x's dtype; with the shared expert's output
    [T, H] and gate logits [T, 1]: (routed + sigmoid(gate)·shared) in fp32, rounded once."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, H]
    for expert in torch.unique(topk_ids).tolist():
        token_idx, k_idx = torch.nonzero(topk_ids == expert, as_tuple=True)
        hidden = silu_and_mul_ref(fp8_linear_ref(x[token_idx], w13.expert(expert)))  # [n, I]
        expert_out = fp8_linear_ref(hidden, w2.expert(expert)).float()  # [n, H]
        out.index_add_(0, token_idx, expert_out * topk_weights[token_idx, k_idx, None])
    if shared is None or shared_gate_logits is None:
        return out.to(x.dtype)
    gate = torch.sigmoid(shared_gate_logits.float())  # [T, 1]
    return (out.to(x.dtype).float() + gate * shared.float()).to(x.dtype)


def fused_moe_fp8(
    x: torch.Tensor | Fp8Rows,
    w13: Fp8Weight,
    w2: Fp8Weight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    shared: torch.Tensor | None = None,
    shared_gate_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    if use_triton(plain(x)):
        from deltaserve.kernels.fp8_triton import fused_moe_fp8_triton

        return fused_moe_fp8_triton(x, w13, w2, topk_weights, topk_ids, shared, shared_gate_logits)
    return fused_moe_fp8_ref(x, w13, w2, topk_weights, topk_ids, shared, shared_gate_logits)
