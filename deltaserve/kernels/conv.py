"""Causal depthwise conv1d + SiLU of the Gated DeltaNet layers, with conv states kept in a slot pool.

conv_states [num_slots, K-1, C] holds, per slot, the last K-1 PRE-conv input rows of its sequence (the
"SD" layout: one contiguous row of channels per step). Tap K-1 multiplies the current token. A sequence
whose has_initial_state is False starts from zeros whatever its slot holds
(docs/ARCHITECTURE.md#gated-deltanet-and-its-state).
Rounding as vLLM's Triton kernels: each tap product is rounded to the input dtype, the sum is fp32, SiLU
in fp32, one rounding on store.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltaserve.kernels._dispatch import output, triton_or_ref


def _conv_rows(rows: torch.Tensor, weight: torch.Tensor, num_out: int) -> torch.Tensor:
    """rows [K-1+n, C] (pre-conv, oldest first) -> SiLU(conv) [n, C] in fp32."""
    kernel_size = weight.shape[1]
    acc = torch.zeros(num_out, rows.shape[1], dtype=torch.float32, device=rows.device)
    for j in range(kernel_size):
        acc += (rows[j : j + num_out] * weight[:, j]).to(rows.dtype).float()
    return F.silu(acc)


def causal_conv1d_prefill_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, C] varlen by query_start_loc [B+1]; weight [C, K]. Returns y [T, C] (into `out` when given); updates
    conv_states in place."""
    kernel_size = weight.shape[1]
    out = output(out, tuple(x.shape), x)
    starts = query_start_loc.tolist()
    for b, slot in enumerate(state_indices.tolist()):
        start, end = starts[b], starts[b + 1]
        if end == start:
            continue
        if bool(has_initial_state[b]):
            history = conv_states[slot].to(x.dtype)  # [K-1, C]
        else:
            history = torch.zeros(kernel_size - 1, x.shape[1], dtype=x.dtype, device=x.device)
        rows = torch.cat([history, x[start:end]], dim=0)  # [K-1+n, C]
        out[start:end] = _conv_rows(rows, weight, end - start).to(x.dtype)
        conv_states[slot] = rows[-(kernel_size - 1) :].to(conv_states.dtype)
    return out


causal_conv1d_prefill = triton_or_ref(causal_conv1d_prefill_ref, "conv_triton.causal_conv1d_prefill_triton")


def causal_conv1d_update_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_states: torch.Tensor,
    state_indices: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode token per sequence: x [B, C] -> y [B, C]; shifts each slot's state in place.

    Slots < 0 (CUDA-graph padding) are skipped and their outputs are left as zeros.
    """
    out = output(out, tuple(x.shape), x).zero_()
    for b, slot in enumerate(state_indices.tolist()):
        if slot < 0:
            continue
        rows = torch.cat([conv_states[slot].to(x.dtype), x[b : b + 1]], dim=0)  # [K, C]
        out[b] = _conv_rows(rows, weight, 1)[0].to(x.dtype)
        conv_states[slot] = rows[1:].to(conv_states.dtype)
    return out


causal_conv1d_update = triton_or_ref(causal_conv1d_update_ref, "conv_triton.causal_conv1d_update_triton")
