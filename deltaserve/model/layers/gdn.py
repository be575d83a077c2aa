"""Gated DeltaNet mixer (docs/ARCHITECTURE.md#gated-deltanet-and-its-state): fused input projections, causal conv1d +
SiLU, the delta-rule core over fp32 state slots, the gated RMSNorm and out_proj.

Decode tokens (the first ctx.num_decode_tokens rows, one per sequence) take the recurrent kernels that update
their slots in place; prefill chunks take the varlen conv and the chunked core. Conv and SSM states are
bound by the runner as `conv_states` [slots, K-1, conv_dim] and `ssm_states` [slots, HV, dk, dv] (fp32).

Under tensor parallelism (model/parallel.py) a rank holds its key heads and their value heads: the projections,
conv channels, A_log / dt_bias and its state slots hold only those heads (conv_dim and HV above are the rank's),
out_proj is row-parallel and the output is all-reduced.
"""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.config import ModelConfig
from deltaserve.kernels import (
    causal_conv1d_prefill,
    causal_conv1d_update,
    causal_conv1d_verify,
    gated_rms_norm,
    gdn_decode,
    gdn_prefill,
    gdn_verify,
    linear,
)
from deltaserve.kernels.fp8 import Fp8Rows, Fp8Weight, gated_rms_norm_fp8
from deltaserve.model.context import get_forward_context
from deltaserve.model.labels import label
from deltaserve.model.layers.common import empty_param, projection
from deltaserve.model.parallel import TensorParallel


class GatedDeltaNet(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device | str,
        tp: TensorParallel | None = None,
        prefill_backend: str = "triton",
    ) -> None:
        """prefill_backend: the chunked prefill's kernel, one of kernels/gdn.py PREFILL_BACKENDS ("triton":
        deltaserve's own; "flashinfer", "flashinfer-large": FlashInfer's for every call or for large ones; the runner
        resolves --gdn-prefill-backend into it)."""
        super().__init__()
        self.tp = tp or TensorParallel.single()
        self.prefill_backend = prefill_backend
        shapes = self.tp.shapes(config)
        self.num_k_heads = shapes.k_heads.size  # this rank's heads
        self.num_v_heads = shapes.v_heads.size
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.eps = config.rms_norm_eps
        hidden = config.hidden_size
        # flat [q | k | v | z] rows (Qwen3-Next's group-interleaved layout is undone at load time)
        # block-FP8 in an FP8 checkpoint (docs/fp8.md), like out_proj; in_proj_ba never is
        is_fp8 = config.fp8 is not None
        parts = (self.key_dim, self.key_dim, self.value_dim, self.value_dim)
        if config.is_gdn_interleaved:
            # the rows come de-interleaved from per-key-group pieces [q_g | k_g | v_g | z_g]: the fused weight's
            # 128-row blocks are the checkpoint's only when every piece is whole blocks (kernels/fp8.py,
            # fp8_block_rows), else each row keeps its own scale
            per_group_v = self.value_dim // self.num_k_heads
            parts = (self.head_k_dim,) * (2 * self.num_k_heads) + (per_group_v,) * (2 * self.num_k_heads)
        self.in_proj_qkvz = projection(
            self.conv_dim + self.value_dim, hidden, dtype=dtype, device=device, fp8=is_fp8, parts=parts
        )
        self.in_proj_ba = empty_param(2 * self.num_v_heads, hidden, dtype=dtype, device=device)  # [b | a]
        self.conv1d = empty_param(self.conv_dim, config.linear_conv_kernel_dim, dtype=dtype, device=device)
        # kept fp32 (docs/ARCHITECTURE.md#gated-deltanet-and-its-state)
        self.A_log = empty_param(self.num_v_heads, dtype=torch.float32, device=device)
        self.dt_bias = empty_param(self.num_v_heads, dtype=dtype, device=device)
        self.norm = empty_param(self.head_v_dim, dtype=dtype, device=device)
        self.out_proj = projection(hidden, self.value_dim, dtype=dtype, device=device, fp8=is_fp8)
        # before an FP8 out_proj the gated norm quantizes its rows in the same launch (kernels/fp8.py)
        self.out_norm_op = gated_rms_norm_fp8 if is_fp8 else gated_rms_norm
        self.conv_states: torch.Tensor | None = None  # bound by the runner
        self.ssm_states: torch.Tensor | None = None
        self.in_proj: torch.Tensor | None = None  # [qkvz | ba] rows once fuse_in_proj ran
        # a verify step's conv window after each token [S_max, W_max, K-1, C] and each token's delta-rule inputs
        # [S_max, W_max, R] (kernels/gdn_spec.py), bound by the runner when speculating
        self.spec_conv_scratch: torch.Tensor | None = None
        self.spec_row_scratch: torch.Tensor | None = None

    def fuse_in_proj(self) -> None:
        """After loading: both input projections as ONE weight [conv_dim + value_dim + 2·HV, hidden], so a step
        runs one GEMM where vLLM runs two. At decode the [2·HV, hidden] ba GEMV alone was a ~5 µs launch per layer
        for 0.5 % of the layer's bytes (profile-decode records: 150 µs of a 35B-A3B B = 1 step over 30 layers).
        in_proj_qkvz / in_proj_ba stay as views of the fused rows (same values, same rank shards)."""
        if self.in_proj is not None or isinstance(self.in_proj_qkvz, Fp8Weight):
            # block-FP8 qkvz and bf16 ba stay two GEMMs, as in vLLM: one engine that quantized the fused weight
            # served garbage (docs/fp8.md)
            return
        rows = self.in_proj_qkvz.shape[0]
        fused = torch.cat([self.in_proj_qkvz.detach(), self.in_proj_ba.detach()])  # [rows + 2·HV, hidden]
        del self.in_proj_qkvz, self.in_proj_ba  # the separate parameters go; their storage is freed
        self.in_proj = nn.Parameter(fused, requires_grad=False)
        self.in_proj_qkvz = fused[:rows]
        self.in_proj_ba = fused[rows:]

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        num_tokens = x.shape[0]
        num_decodes = ctx.num_decode_tokens
        # The kernels take row and head strides, so the projections' column slices are passed as views: no
        # copies between kernels (a decode step of the 35B-A3B shape spent ~270 copy launches on them).
        qkvz_end = self.conv_dim + self.value_dim
        if self.in_proj is not None:  # fused: one GEMM, every output a column slice of it
            with label("gdn.in_proj_qkvzba"):
                proj = linear(x, self.in_proj)  # [T, conv_dim + value_dim + 2·HV]
            ba = proj[:, qkvz_end:]  # [T, 2·HV], row stride of proj
        else:
            with label("gdn.in_proj_qkvz"):
                proj = linear(x, self.in_proj_qkvz)  # [T, conv_dim + value_dim]
            with label("gdn.in_proj_ba"):
                ba = linear(x, self.in_proj_ba)  # [T, 2·HV]
        mixed = proj[:, : self.conv_dim]  # [T, conv_dim], row stride of proj
        z = proj[:, self.conv_dim : qkvz_end].view(num_tokens, self.num_v_heads, self.head_v_dim)  # [T, HV, dv]
        b = ba[:, : self.num_v_heads]  # [T, HV]
        a = ba[:, self.num_v_heads :]  # [T, HV]
        if not ctx.num_prefill_tokens and not ctx.num_spec_tokens:
            # decode-only (every CUDA-graph step): each kernel's output is used whole
            with label("gdn.causal_conv1d_update"):
                conv_out = causal_conv1d_update(mixed, self.conv1d, self.conv_states, ctx.state_indices)
            q, k, v = self._split_qkv(conv_out)
            with label("gdn.gdn_decode"):
                core = gdn_decode(q, k, v, a, b, self.A_log, self.dt_bias, self.ssm_states, ctx.state_indices)
        else:
            core = self._mixed_step(mixed, a, b, num_decodes)
        with label("gdn.gated_rms_norm"):
            y = self.out_norm_op(core, z, self.norm, self.eps)  # [T, HV, dv], or Fp8Rows [T, HV·dv]
        with label("gdn.out_proj"):
            out = linear(y if isinstance(y, Fp8Rows) else y.reshape(num_tokens, self.value_dim), self.out_proj)
        return self.tp.all_reduce(out)

    def _split_qkv(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """conv_out [T, conv_dim] -> views q, k [T, HK, dk] and v [T, HV, dv]."""
        num_tokens = conv_out.shape[0]
        q = conv_out[:, : self.key_dim].view(num_tokens, self.num_k_heads, self.head_k_dim)
        k = conv_out[:, self.key_dim : 2 * self.key_dim].view(num_tokens, self.num_k_heads, self.head_k_dim)
        v = conv_out[:, 2 * self.key_dim :].view(num_tokens, self.num_v_heads, self.head_v_dim)
        return q, k, v

    def _mixed_step(self, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, num_decodes: int) -> torch.Tensor:
        """A step with prefill or verify chunks: decode rows [0, num_decodes) take the recurrent kernels, the verify
        rows after them the multi-token recurrent kernels with per-token states (docs/speculative-decoding.md), the
        rest the varlen conv and the chunked core. Returns core [T, HV, dv]."""
        ctx = get_forward_context()
        num_tokens = mixed.shape[0]
        # The decode and prefill kernels write their halves of one buffer (`out` views), and q / k / v go to the
        # core as strided views: no copies (they were three [T, conv_dim]-or-larger copies a layer, ~4 ms of a
        # 27B 2048-token step on the H200, docs/kernels.md#gated-deltanet).
        conv_out = torch.empty(mixed.shape, dtype=mixed.dtype, device=mixed.device)  # [T, conv_dim]
        prefill_slots, prefill_has_initial_state = ctx.prefill_slots()
        d = slice(0, num_decodes)
        s = slice(num_decodes, num_decodes + ctx.num_spec_tokens)
        p = slice(s.stop, num_tokens)
        if num_decodes:
            with label("gdn.causal_conv1d_update"):
                causal_conv1d_update(mixed[d], self.conv1d, self.conv_states, ctx.state_indices[d], out=conv_out[d])
        if ctx.num_spec_tokens:
            with label("gdn.causal_conv1d_verify"):
                causal_conv1d_verify(mixed[s], self.conv1d, self.conv_states, ctx.spec_state_indices,
                                     ctx.spec_token_index, self.spec_conv_scratch, out=conv_out[s])  # fmt: skip
        if ctx.num_prefill_tokens:
            with label("gdn.causal_conv1d_prefill"):
                causal_conv1d_prefill(
                    mixed[p],
                    self.conv1d,
                    self.conv_states,
                    ctx.prefill_query_start_loc,
                    prefill_slots,
                    prefill_has_initial_state,
                    out=conv_out[p],
                )
            if ctx.checkpoint_rows is not None:
                self._save_conv_windows(mixed[p], ctx.checkpoint_rows, ctx.checkpoint_slots)
        q, k, v = self._split_qkv(conv_out)
        core = torch.empty(num_tokens, self.num_v_heads, self.head_v_dim, dtype=mixed.dtype, device=mixed.device)
        if num_decodes:
            with label("gdn.gdn_decode"):
                gdn_decode(
                    q[d], k[d], v[d], a[d], b[d], self.A_log, self.dt_bias, self.ssm_states, ctx.state_indices[d],
                    out=core[d],
                )  # fmt: skip
        if ctx.num_spec_tokens:
            with label("gdn.gdn_verify"):
                gdn_verify(
                    q[s], k[s], v[s], a[s], b[s], self.A_log, self.dt_bias, self.ssm_states, ctx.spec_state_indices,
                    ctx.spec_token_index, self.spec_row_scratch, out=core[s],
                )  # fmt: skip
        if ctx.num_prefill_tokens:
            with label("gdn.gdn_prefill"):
                gdn_prefill(
                    q[p], k[p], v[p], a[p], b[p], self.A_log, self.dt_bias, self.ssm_states,
                    ctx.prefill_query_start_loc, prefill_slots, prefill_has_initial_state, out=core[p],
                    checkpoint_chunks=ctx.prefill_checkpoint_chunks, checkpoint_slots=ctx.prefill_checkpoint_slots,
                    max_query_len=ctx.max_query_len, backend=self.prefill_backend,
                )  # fmt: skip
        return core

    def _save_conv_windows(self, mixed: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """In-step prefix-cache checkpoints (runner/step_checkpoints.py): the conv state a prefill ending at each
        saved position leaves, the conv_kernel - 1 pre-conv rows before it (all inside the step's chunk), goes to
        its slot. mixed [Tp, conv_dim] the prefill rows; rows [N] int64 the positions' rows in them; slots [N]."""
        width = self.conv1d.shape[1] - 1
        window = rows[:, None] + torch.arange(-width, 0, device=rows.device)  # [N, K-1]
        history = mixed.index_select(0, window.reshape(-1)).view(rows.shape[0], width, -1)  # [N, K-1, conv_dim]
        self.conv_states.index_copy_(0, slots, history.to(self.conv_states.dtype))
