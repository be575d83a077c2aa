"""Gated DeltaNet mixer (architecture doc §5): fused input projections, causal conv1d + SiLU, the
delta-rule core over fp32 state slots, the gated RMSNorm and out_proj.

Decode tokens (the first ctx.num_decode_tokens rows, one per sequence) take the recurrent kernels that update
their slots in place; prefill chunks take the varlen conv and the chunked core. Conv and SSM states are
bound by the runner as `conv_states` [slots, K-1, conv_dim] and `ssm_states` [slots, HV, dk, dv] (fp32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deltaserve.config import ModelConfig
from deltaserve.kernels import (
    causal_conv1d_prefill,
    causal_conv1d_update,
    gated_rms_norm,
    gdn_decode,
    gdn_prefill,
)
from deltaserve.model.layers.common import empty_param
from deltaserve.runner.context import get_forward_context


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.num_k_heads = config.linear_num_key_heads
        self.num_v_heads = config.linear_num_value_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = config.value_dim
        self.conv_dim = config.conv_dim
        self.eps = config.rms_norm_eps
        hidden = config.hidden_size
        # flat [q | k | v | z] rows (Qwen3-Next's group-interleaved layout is undone at load time)
        self.in_proj_qkvz = empty_param(self.conv_dim + self.value_dim, hidden, dtype=dtype, device=device)
        self.in_proj_ba = empty_param(2 * self.num_v_heads, hidden, dtype=dtype, device=device)  # [b | a]
        self.conv1d = empty_param(self.conv_dim, config.linear_conv_kernel_dim, dtype=dtype, device=device)
        self.A_log = empty_param(self.num_v_heads, dtype=torch.float32, device=device)  # kept fp32 (§8.5)
        self.dt_bias = empty_param(self.num_v_heads, dtype=dtype, device=device)
        self.norm = empty_param(self.head_v_dim, dtype=dtype, device=device)
        self.out_proj = empty_param(hidden, self.value_dim, dtype=dtype, device=device)
        self.conv_states: torch.Tensor | None = None  # bound by the runner
        self.ssm_states: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        num_tokens = x.shape[0]
        num_decodes = ctx.num_decode_tokens
        proj = F.linear(x, self.in_proj_qkvz)  # [T, conv_dim + value_dim]
        mixed = proj[:, : self.conv_dim].contiguous()
        z = proj[:, self.conv_dim :].reshape(num_tokens * self.num_v_heads, self.head_v_dim)
        ba = F.linear(x, self.in_proj_ba)  # [T, 2·HV]
        b = ba[:, : self.num_v_heads].contiguous()
        a = ba[:, self.num_v_heads :].contiguous()
        conv_out = torch.empty_like(mixed)
        if num_decodes:
            conv_out[:num_decodes] = causal_conv1d_update(
                mixed[:num_decodes], self.conv1d, self.conv_states, ctx.state_indices[:num_decodes]
            )
        if ctx.num_prefill_tokens:
            conv_out[num_decodes:] = causal_conv1d_prefill(
                mixed[num_decodes:],
                self.conv1d,
                self.conv_states,
                ctx.prefill_query_start_loc,
                ctx.state_indices[num_decodes:],
                ctx.has_initial_state[num_decodes:],
            )
        q = conv_out[:, : self.key_dim].reshape(num_tokens, self.num_k_heads, self.head_k_dim)
        k = conv_out[:, self.key_dim : 2 * self.key_dim].reshape(num_tokens, self.num_k_heads, self.head_k_dim)
        v = conv_out[:, 2 * self.key_dim :].reshape(num_tokens, self.num_v_heads, self.head_v_dim)
        core = torch.empty(num_tokens, self.num_v_heads, self.head_v_dim, dtype=x.dtype, device=x.device)
        if num_decodes:
            d = slice(0, num_decodes)
            core[d] = gdn_decode(
                q[d].contiguous(),
                k[d].contiguous(),
                v[d].contiguous(),
                a[d],
                b[d],
                self.A_log,
                self.dt_bias,
                self.ssm_states,
                ctx.state_indices[d],
            )
        if ctx.num_prefill_tokens:
            p = slice(num_decodes, num_tokens)
            core[p] = gdn_prefill(
                q[p].contiguous(),
                k[p].contiguous(),
                v[p].contiguous(),
                a[p],
                b[p],
                self.A_log,
                self.dt_bias,
                self.ssm_states,
                ctx.prefill_query_start_loc,
                ctx.state_indices[num_decodes:],
                ctx.has_initial_state[num_decodes:],
            )
        y = gated_rms_norm(core.reshape(-1, self.head_v_dim), z, self.norm, self.eps)  # [T·HV, dv]
        return F.linear(y.reshape(num_tokens, self.value_dim), self.out_proj)
