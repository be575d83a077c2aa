"""The Qwen3.5 / Qwen3.6 / Qwen3-Next text decoder (docs/ARCHITECTURE.md#model-facts): embedding, layers chosen by
`layer_types` (Gated DeltaNet or gated full attention) each followed by a dense SwiGLU or an MoE block,
zero-centred RMSNorms with fused residual adds, final norm and lm_head.

forward(input_ids [T], positions [3, T]) -> hidden [T, H]; the per-step metadata comes from the runner's
ForwardContext. Positions are always 3-D (MRoPE rows T, H, W); for text the rows are equal.

Under tensor parallelism (model/parallel.py) every layer holds its rank's shard, the embedding and lm_head hold the
rank's vocabulary rows (the lookup is summed over the ranks, the logits gathered on rank 0: compute_logits returns
None on the other ranks), and the vision tower is replicated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deltaserve.config import ModelConfig
from deltaserve.kernels import linear, rms_norm, rope_cos_sin_cache, rope_cos_sin_for_positions
from deltaserve.kernels.fp8 import rms_norm_fp8
from deltaserve.kernels.preamble import mrope_axis_per_frequency
from deltaserve.model.context import get_forward_context
from deltaserve.model.labels import label
from deltaserve.model.layers.attention import GatedAttention
from deltaserve.model.layers.common import empty_param
from deltaserve.model.layers.gdn import GatedDeltaNet
from deltaserve.model.layers.mlp import DenseMLP, MoEBlock
from deltaserve.model.mtp import MtpLayer
from deltaserve.model.parallel import TensorParallel
from deltaserve.model.vision import VisionTower


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        index: int,
        dtype: torch.dtype,
        device: torch.device | str,
        tp: TensorParallel | None = None,
        layer_type: str | None = None,
        is_moe: bool | None = None,
        gdn_prefill_backend: str = "triton",
        attention_backend: str = "TRITON_ATTN",
    ) -> None:
        """layer_type / is_moe: the MTP layer's kind (model/mtp.py), which config.layer_types does not list; by
        default both come from the config at `index`. gdn_prefill_backend: a GDN layer's prefill kernel.
        attention_backend: a full-attention layer's kernel for its prefill rows (model/layers/attention.py)."""
        super().__init__()
        tp = tp or TensorParallel.single()
        self.eps = config.rms_norm_eps
        layer_type = layer_type or config.layer_types[index]
        if is_moe is None:
            is_moe = bool(config.moe_layers) and config.moe_layers[index]
        self.is_full_attention = layer_type == "full_attention"
        # FP8 projections after both norms: each norm quantizes its output in its own launch (kernels/fp8.py)
        self.rms_norm_op = rms_norm_fp8 if config.fp8 is not None else rms_norm
        self.label = f"layer.{index}.{layer_type}"  # the profiler's range (model/labels.py)
        self.input_layernorm = empty_param(config.hidden_size, dtype=dtype, device=device)
        self.post_attention_layernorm = empty_param(config.hidden_size, dtype=dtype, device=device)
        if self.is_full_attention:
            self.self_attn = GatedAttention(config, dtype, device, tp, prefill_backend=attention_backend)
        else:
            self.linear_attn = GatedDeltaNet(config, dtype, device, tp, prefill_backend=gdn_prefill_backend)
        if is_moe:
            self.mlp: nn.Module = MoEBlock(config, dtype, device, tp)
        else:
            width = tp.shapes(config).intermediate.size
            self.mlp = DenseMLP(config.hidden_size, width, dtype, device, tp, fp8=config.fp8 is not None)

    @property
    def mixer(self) -> nn.Module:
        return self.self_attn if self.is_full_attention else self.linear_attn

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        with label(self.label):
            with label("layer.rms_norm"):
                if residual is None:
                    residual = hidden
                    x, _ = self.rms_norm_op(hidden, self.input_layernorm, self.eps)
                else:
                    x, residual = self.rms_norm_op(hidden, self.input_layernorm, self.eps, residual)
            mixed = self.mixer(x, positions)
            with label("layer.rms_norm"):
                x, residual = self.rms_norm_op(mixed, self.post_attention_layernorm, self.eps, residual)
            return self.mlp(x), residual


class Qwen35Model(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device | str,
        build_vision: bool = False,
        tp: TensorParallel | None = None,
        build_mtp: bool = False,
        gdn_prefill_backend: str = "triton",
        attention_backend: str = "TRITON_ATTN",
    ) -> None:
        """build_mtp: also build the checkpoint's MTP layer (speculative decoding with method mtp).
        gdn_prefill_backend: the GDN layers' prefill kernel, one of kernels/gdn.py PREFILL_BACKENDS
        (runner/device_setup.py resolves --gdn-prefill-backend into it). attention_backend: the
        full-attention layers' kernel for prefill rows (--attention-backend, resolved likewise); the MTP layer keeps
        deltaserve's (docs/attention-backends.md)."""
        super().__init__()
        self.config = config
        self.eps = config.rms_norm_eps
        self.tp = tp or TensorParallel.single()
        self.shapes = self.tp.shapes(config)  # refuses, by field, a size that does not divide a sharded dimension
        vocab_rows = self.shapes.vocab.size  # this rank's rows (all of them on one rank)
        self.embed_tokens = empty_param(vocab_rows, config.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            DecoderLayer(
                config,
                i,
                dtype,
                device,
                self.tp,
                gdn_prefill_backend=gdn_prefill_backend,
                attention_backend=attention_backend,
            )  # fmt: skip
            for i in range(config.num_hidden_layers)
        )
        self.norm = empty_param(config.hidden_size, dtype=dtype, device=device)
        if config.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = empty_param(vocab_rows, config.hidden_size, dtype=dtype, device=device)
        # cos/sin table [max_pos, r] in the model dtype (vLLM's precomputed fp32 -> dtype cache,
        # docs/ARCHITECTURE.md#positions-and-mrope)
        self.register_buffer(
            "cos_sin_cache",
            rope_cos_sin_cache(config.rotary_dim, config.max_position_embeddings, config.rope_theta, dtype, device),
            persistent=False,
        )
        self.register_buffer(
            "axis_per_frequency",
            mrope_axis_per_frequency(config.rotary_dim // 2, list(config.mrope_section or []) or None, device),
            persistent=False,
        )
        for layer in self.layers:
            if layer.is_full_attention:
                layer.self_attn.cos_sin_cache = self.cos_sin_cache
        # The vision tower (model.visual.*), built only when asked and the checkpoint has one
        # (docs/multimodal.md#the-vision-tower).
        self.visual = VisionTower(config.vision, dtype, device) if build_vision and config.vision else None
        # The MTP layer (model/mtp.py) shares the embedding, the lm_head and the RoPE table; None unless speculative
        # decoding with method mtp is configured.
        self.mtp: MtpLayer | None = None
        if build_mtp:
            self.mtp = MtpLayer(config, dtype, device, self.tp, self._embed)
            self.mtp.cos_sin_cache = self.cos_sin_cache
            self.mtp.axis_per_frequency = self.axis_per_frequency
            self.mtp.attention.cos_sin_cache = self.cos_sin_cache

    def fuse_projections(self) -> None:
        """After the weights are in: the load-time fusions the serving path runs with (GDN in_proj_qkvz + in_proj_ba
        as one GEMM). The loader and the training code see the checkpoint's separate tensors."""
        for layer in self.layers:
            if not layer.is_full_attention:
                layer.linear_attn.fuse_in_proj()

    def untie_lm_head(self) -> None:
        """Gives lm_head its own storage (the loader found a checkpoint lm_head.weight that differs from the
        embedding, which transformers uses untied)."""
        self.lm_head = empty_param(
            *self.embed_tokens.shape, dtype=self.embed_tokens.dtype, device=self.embed_tokens.device
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """input_ids [T], positions [3, T] -> final-normed hidden states [T, H]. mm_embeds: (rows [M] int64 of
        this step's tokens, vision embeddings [M, H]) replacing those rows' token embeddings
        (docs/multimodal.md#placeholders-and-prompt-expansion)."""
        ctx = get_forward_context()
        with label("layer.rope_cos_sin_for_positions"):
            ctx.cos_sin = rope_cos_sin_for_positions(self.cos_sin_cache, positions, self.axis_per_frequency)  # [T, r]
        with label("lm.embed"):
            hidden = self._embed(input_ids)
            if mm_embeds is not None:
                hidden = hidden.index_copy(0, mm_embeds[0], mm_embeds[1].to(hidden.dtype))
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, positions)
        with label("layer.rms_norm"):
            hidden, _ = rms_norm(hidden, self.norm, self.eps, residual)
        return hidden

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> [T, H]. Vocab-parallel: each rank looks up the ids in its rows (zeros for the others'),
        and the sum over the ranks (one nonzero term per token, so exact) is every token's row."""
        if not self.tp.is_parallel:
            return F.embedding(input_ids, self.embed_tokens)
        local = input_ids - self.shapes.vocab.start
        is_elsewhere = (local < 0) | (local >= self.shapes.vocab.size)
        rows = F.embedding(local.masked_fill(is_elsewhere, 0), self.embed_tokens)
        return self.tp.all_reduce(rows.masked_fill(is_elsewhere.unsqueeze(-1), 0))

    def compute_logits(
        self, hidden: torch.Tensor, out: torch.Tensor | None = None, on_all_ranks: bool = False
    ) -> torch.Tensor | None:
        """hidden [B, H] -> logits [B, V] in fp32 (lm_head output in the model dtype, then upcast), written into
        `out` [B, V] fp32 when given (the decode graphs share one such buffer). Vocab-parallel: each rank's
        [B, V/size] is gathered on rank 0; the other ranks return None, unless on_all_ranks (the MTP drafter's
        logits: every rank drafts the same tokens from them)."""
        with label("lm"):
            with label("lm.lm_head"):
                logits = linear(hidden, self.lm_head)
            if self.tp.is_parallel:
                # [B, size·rows] on rank 0 (on every rank with on_all_ranks), None elsewhere
                logits = self.tp.gather_columns(logits, to_all=on_all_ranks)
                if logits is None:
                    return None
                logits = logits[:, : self.config.vocab_size]
            if out is None:
                return logits.float()
            return out.copy_(logits)
