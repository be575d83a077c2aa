"""Gated full attention (docs/ARCHITECTURE.md#gated-full-attention): fused qkv GEMM, the attention preamble (q/k
RMSNorm, partial NeoX RoPE or interleaved MRoPE, gate split), paged GQA attention, sigmoid output gate, o_proj; with
`attention_bias` the qkv and o projections carry transformers' biases.

Under tensor parallelism (model/parallel.py) a rank holds its query heads and their KV heads (one replicated KV
head when there are fewer than ranks): qkv_proj is column-parallel by head, o_proj row-parallel, and the output is
all-reduced (o_proj's bias is added on rank 0 only, before the sum). Every kernel sees the rank's head counts.

--attention-backend (runner/device_setup.py resolves it into `prefill_backend`): with FLASH_ATTN or FLASHINFER a step's
prefill rows run the library's kernel through the step's plan (ForwardContext.prefill_attention), while its decode
and verify rows, which come first, keep deltaserve's kernel; both write one output (`paged_attention_rows`).

The preamble is one fused op by default; DELTASERVE_FUSE_ATTN_PREAMBLE=0 selects the four-op path, which
refuses true MRoPE positions. KV caches are bound by the runner as `k_cache` / `v_cache`.
"""

from __future__ import annotations

import torch
from torch import nn

from deltaserve import env
from deltaserve.config import ModelConfig
from deltaserve.kernels import (
    attn_preamble,
    attn_preamble_unfused,
    linear,
    paged_attention,
    sigmoid_gate_mul,
    store_kv,
)
from deltaserve.kernels.fp8 import sigmoid_gate_mul_fp8
from deltaserve.model.context import ForwardContext, get_forward_context
from deltaserve.model.labels import label
from deltaserve.model.layers.common import empty_param, projection
from deltaserve.model.parallel import TensorParallel


def paged_attention_rows(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: ForwardContext, scale: float, backend: str
) -> torch.Tensor:
    """q [T, nq, d] -> o [T, nq, d] over the paged cache, the step's rows split by kind: with backend TRITON_ATTN, or
    a step without prefill rows (decodes, verify chunks, CUDA-graph steps), deltaserve's kernel for all of them, as
    before the flag; else deltaserve's kernel for the decode and verify rows (the first ones) and the step's planned
    library call for the prefill rows, into one output."""
    if backend == "TRITON_ATTN" or ctx.num_prefill_tokens == 0:
        return paged_attention(
            q, k_cache, v_cache, ctx.query_start_loc, ctx.seq_lens, ctx.block_tables, scale, ctx.max_query_len,
            ctx.max_seq_len,
        )  # fmt: skip
    prepared = ctx.prefill_attention
    if prepared is None:
        raise RuntimeError(
            f"--attention-backend {backend}: a step with {ctx.num_prefill_tokens} prefill rows reached the attention "
            "without its plan (the runner plans each eager step, runner/attention_plan.py)"
        )
    first_row = ctx.num_decode_tokens + ctx.num_spec_tokens
    out = torch.empty_like(q)
    if first_row:
        num_seqs = ctx.num_decodes + ctx.num_spec_seqs
        # the host hint of these rows alone: 1 for decodes (the split-K decode path), else the verify width
        width = 1 if ctx.spec_token_index is None else ctx.spec_token_index.shape[1]
        out[:first_row] = paged_attention(
            q[:first_row], k_cache, v_cache, ctx.query_start_loc[: num_seqs + 1], ctx.seq_lens[:num_seqs],
            ctx.block_tables[:num_seqs], scale, width, ctx.max_seq_len,
        )  # fmt: skip
    prepared.run(q[first_row:], k_cache, v_cache, scale, out[first_row:])
    return out


class GatedAttention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device | str,
        tp: TensorParallel | None = None,
        prefill_backend: str = "TRITON_ATTN",
    ) -> None:
        """prefill_backend: the --attention-backend value for this layer's prefill rows, TRITON_ATTN (deltaserve's
        own kernel), FLASH_ATTN or FLASHINFER (kernels/attention_prefill.py)."""
        super().__init__()
        self.prefill_backend = prefill_backend
        self.tp = tp or TensorParallel.single()
        shapes = self.tp.shapes(config)
        self.num_q_heads = shapes.q_heads.size  # this rank's heads
        self.num_kv_heads = shapes.kv_heads.size
        self.head_dim = config.head_dim
        self.rotary_dim = config.rotary_dim
        self.eps = config.rms_norm_eps
        self.scale = self.head_dim**-0.5
        q_width = 2 * self.num_q_heads * self.head_dim  # per head [query | gate]
        kv_width = self.num_kv_heads * self.head_dim
        # q_proj, k_proj and v_proj fused at load time: [q/gate | k | v] rows
        # block-FP8 in an FP8 checkpoint (docs/fp8.md), like o_proj
        is_fp8 = config.fp8 is not None
        self.qkv_proj = projection(
            q_width + 2 * kv_width, config.hidden_size, dtype=dtype, device=device, fp8=is_fp8,
            parts=(q_width, kv_width, kv_width),
        )  # fmt: skip
        self.o_proj = projection(
            config.hidden_size, self.num_q_heads * self.head_dim, dtype=dtype, device=device, fp8=is_fp8
        )
        # before an FP8 o_proj the output gate quantizes its rows in the same launch (kernels/fp8.py)
        self.gate_mul = sigmoid_gate_mul_fp8 if is_fp8 else sigmoid_gate_mul
        # transformers' attention_bias: biases on q (with its gate), k, v and o; None when the config has none
        self.qkv_bias = (
            empty_param(q_width + 2 * kv_width, dtype=dtype, device=device) if config.has_attention_bias else None
        )
        # row-parallel: the bias joins the sum once, on rank 0
        has_o_bias = config.has_attention_bias and self.tp.is_first
        self.o_bias = empty_param(config.hidden_size, dtype=dtype, device=device) if has_o_bias else None
        self.q_norm = empty_param(self.head_dim, dtype=dtype, device=device)
        self.k_norm = empty_param(self.head_dim, dtype=dtype, device=device)
        self.k_cache: torch.Tensor | None = None  # [num_blocks, block_size, nkv, d], bound by the runner
        self.v_cache: torch.Tensor | None = None
        self.cos_sin_cache: torch.Tensor | None = None  # [max_pos, r], shared, set by the model

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        num_tokens = x.shape[0]
        with label("attn.qkv_proj"):
            qkv = linear(x, self.qkv_proj, self.qkv_bias)  # [T, nq·2d + 2·nkv·d]
        if env.fuse_attn_preamble():
            with label("attn.attn_preamble"):
                q, k, gate = attn_preamble(
                    qkv,
                    self.q_norm,
                    self.k_norm,
                    ctx.cos_sin,
                    self.num_q_heads,
                    self.num_kv_heads,
                    self.head_dim,
                    self.rotary_dim,
                    self.eps,
                )
        else:
            with label("attn.attn_preamble_unfused"):
                q, k, gate = attn_preamble_unfused(
                    qkv,
                    self.q_norm,
                    self.k_norm,
                    positions,
                    self.cos_sin_cache,
                    self.num_q_heads,
                    self.num_kv_heads,
                    self.head_dim,
                    self.rotary_dim,
                    self.eps,
                )
        v_start = self.num_q_heads * 2 * self.head_dim + self.num_kv_heads * self.head_dim
        v = qkv[:, v_start:].view(num_tokens, self.num_kv_heads, self.head_dim)  # strided view: store_kv takes strides
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        with label("attn.store_kv"):
            store_kv(k, v, self.k_cache, self.v_cache, ctx.slot_mapping)
        with label("attn.paged_attention"):
            o = paged_attention_rows(
                q.reshape(num_tokens, self.num_q_heads, self.head_dim), self.k_cache, self.v_cache, ctx, self.scale,
                self.prefill_backend,
            )  # fmt: skip
        # sigmoid(gate)·o in fp32 with one rounding, as vLLM's compiled graph fuses it: one launch on the GPU
        with label("attn.sigmoid_gate_mul"):
            gated = self.gate_mul(o.reshape(num_tokens, -1), gate)  # [T, nq·d]
        with label("attn.o_proj"):
            out = linear(gated, self.o_proj, self.o_bias)
        return self.tp.all_reduce(out)
