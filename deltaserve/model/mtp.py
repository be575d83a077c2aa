"""The MTP (multi-token prediction) layer of a Qwen3.5 / 3.6 / Qwen3-Next checkpoint, served as the speculative
draft (docs/ARCHITECTURE.md#the-mtp-head).

Token t's input is (the target's final-normed hidden state at t, the token at t + 1); its output, after mtp.norm,
goes through the target's lm_head (Qwen35Model.compute_logits) and predicts token t + 2:

    u = fc( concat[ pre_fc_norm_embedding(Embed(token_{t+1})), pre_fc_norm_hidden(h_t) ] )   embedding first
    u = one full-attention decoder layer (u)                                                  own KV cache
    out = mtp.norm(u)

The embedding and lm_head are the target's (no copies: `embed` is the target's vocab-parallel lookup). The decoder
layer is the target's DecoderLayer class (full attention; MoE where the checkpoint is MoE), so under tensor
parallelism it shards exactly as the target's attention layers do, and it reads the runner's ForwardContext as they
do: its K/V cache tensors are its own (bound by runner/cache.py as one more attention layer) and are indexed by
the same block tables and slot mapping as the target's. fc and the three norms are replicated.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from deltaserve.config import ModelConfig
from deltaserve.kernels import linear, rms_norm, rope_cos_sin_for_positions
from deltaserve.model.context import get_forward_context
from deltaserve.model.labels import label
from deltaserve.model.layers.common import empty_param
from deltaserve.model.parallel import TensorParallel

MTP_PREFIX = "mtp."


class MtpError(ValueError):
    """Speculative decoding with MTP was asked for but the checkpoint cannot provide the layer; names the field or
    the tensor."""


class MtpLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device | str,
        tp: TensorParallel,
        embed: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        """embed: the target's token lookup (input_ids [T] -> [T, H], summed over the ranks under TP)."""
        super().__init__()
        if config.mtp_num_hidden_layers < 1:
            raise MtpError(
                f"{config.config_file}: speculative decoding with method mtp needs the checkpoint's MTP layer, but "
                f"`{config.mtp_field}` is {config.mtp_num_hidden_layers}"
            )
        # imported here: qwen3_5 builds this layer, and the decoder layer class lives there
        from deltaserve.model.qwen3_5 import DecoderLayer

        hidden = config.hidden_size
        self.eps = config.rms_norm_eps
        self.embed = embed
        self.fc = empty_param(hidden, 2 * hidden, dtype=dtype, device=device)  # [H, 2H]: [embedding | hidden] columns
        self.pre_fc_norm_embedding = empty_param(hidden, dtype=dtype, device=device)
        self.pre_fc_norm_hidden = empty_param(hidden, dtype=dtype, device=device)
        # vLLM numbers the MTP layer after the target's layers (its profiler label follows)
        index = config.num_hidden_layers
        self.layer = DecoderLayer(config, index, dtype, device, tp, layer_type="full_attention", is_moe=config.is_moe)
        self.norm = empty_param(hidden, dtype=dtype, device=device)
        self.cos_sin_cache: torch.Tensor | None = None  # [max_pos, r], the target's, set by the model
        self.axis_per_frequency: torch.Tensor | None = None  # [r/2], the target's

    @property
    def attention(self) -> nn.Module:
        """The GatedAttention whose k_cache / v_cache the runner binds."""
        return self.layer.self_attn

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """input_ids [T] (token t + 1), positions [T] or [3, T] (those of the target's token t), hidden [T, H] (the
        target's final-normed hidden state at t) -> mtp.norm output [T, H]; compute_logits gives the draft logits."""
        ctx = get_forward_context()
        if positions.dim() == 1:
            positions = positions.unsqueeze(0).expand(3, -1)  # text: the three MRoPE rows are equal
        with label("layer.rope_cos_sin_for_positions"):
            ctx.cos_sin = rope_cos_sin_for_positions(self.cos_sin_cache, positions, self.axis_per_frequency)  # [T, r]
        with label("lm.embed"):
            embedded = self.embed(input_ids)  # [T, H]
        with label("layer.rms_norm"):
            e, _ = rms_norm(embedded, self.pre_fc_norm_embedding, self.eps)
            h, _ = rms_norm(hidden, self.pre_fc_norm_hidden, self.eps)
        with label("mtp.fc"):
            u = linear(torch.cat([e, h], dim=-1), self.fc)  # [T, H]
        u, residual = self.layer(u, None, positions)
        with label("layer.rms_norm"):
            out, _ = rms_norm(u, self.norm, self.eps, residual)
        return out
