"""Checkpoint loading: sharded safetensors in Hugging Face layout -> the model's (fused) parameters.

Handles the prefixes and layouts of docs/ARCHITECTURE.md#configs-and-checkpoint-layout: `model.language_model.*` with a
top-level `lm_head` (Qwen3.5/3.6) or `model.*` (Qwen3-Next and text-only forms); q/k/v projections fused into one qkv
weight (and their biases when `attention_bias`); Qwen3.5's flat `in_proj_qkv/z/b/a` versus Qwen3-Next's
group-interleaved `in_proj_qkvz/ba`; fused 3-D experts versus one tensor per expert; tied embeddings decided by the
tie flags and by whether the checkpoint holds its own `lm_head.weight`; `A_log` kept in fp32. A block-FP8 checkpoint
(docs/fp8.md) fills the model's Fp8Weight projections from its float8 tensors and their scales (model/fp8_loader.py)
through the same row operations.

Every tensor of the checkpoint is consumed or skipped by a named SkipRule (`mtp.*`, `model.visual.*`); any other
tensor is an error naming it and its file unless `ignore_unexpected` is set. A model built with its MTP layer
(speculative decoding, model/mtp.py) consumes `mtp.*` instead, and a checkpoint without those tensors is refused.
A missing, mis-shaped or non-float tensor raises CheckpointError naming the tensor and its file, and so does one
holding NaN or inf (vLLM loads such a checkpoint and serves garbage; the check costs ~3 ms per GB on the GPU).
`load_format="dummy"` fills every parameter with vLLM's dummy values instead (init_dummy_weights: U(-1e-3, 1e-3),
re-seeded per tensor).

Under tensor parallelism the loader shards while it reads: each rank reads only its slices of every sharded tensor
(safetensors slicing, model/parallel.py says which), so no rank holds the whole checkpoint. A tensor a rank needs
none of (o_proj's bias off rank 0, another rank's experts) is checked for its shape and counted as consumed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from deltaserve.config import ModelConfig
from deltaserve.kernels.fp8 import FP8_DTYPE, Fp8Weight
from deltaserve.model.checkpoint_files import (
    FP8_PROJECTION,
    MTP_RULE,
    SKIP_RULES,
    CheckpointError,
    CheckpointFiles,
    SkipRule,
    skip_rule_for,
)
from deltaserve.model.fp8_loader import FP8_CODE, copy_packed, read_packed, refuse_unquantized, scale_name
from deltaserve.model.mtp import MtpLayer
from deltaserve.model.parallel import LocalShapes, Shard
from deltaserve.model.qwen3_5 import DecoderLayer, Qwen35Model
from deltaserve.model.vision_loader import load_vision_tower

logger = logging.getLogger(__name__)

__all__ = ["CheckpointError", "LoadReport", "load_checkpoint", "init_dummy_weights"]
IGNORE_UNEXPECTED_FLAG = "--ignore-unexpected-tensors"


@dataclass
class LoadReport:
    num_tensors_loaded: int = 0
    skipped: list[str] = field(default_factory=list)  # recognised and deliberately not loaded (mtp, vision)
    skipped_by_rule: dict[str, int] = field(default_factory=dict)  # SkipRule.name -> number of tensors
    unexpected: list[str] = field(default_factory=list)  # neither loaded nor skipped (only with ignore_unexpected)
    notes: list[str] = field(default_factory=list)  # config and tie decisions (ModelConfig.notes + the loader's)

    def summary(self) -> str:
        """One line for the engine's start-up log."""
        parts = [f"{self.num_tensors_loaded} tensors loaded"]
        if self.skipped_by_rule:
            parts.append("skipped " + ", ".join(f"{n} {rule}" for rule, n in sorted(self.skipped_by_rule.items())))
        if self.unexpected:
            parts.append(f"{len(self.unexpected)} unexpected ignored ({', '.join(self.unexpected[:3])})")
        return "; ".join(parts + self.notes)


class Checkpoint:
    """Lazy access to the tensors of a validated (possibly sharded) safetensors checkpoint."""

    def __init__(self, model_dir: Path, hint: str = "") -> None:
        self.files = CheckpointFiles(model_dir)
        self.model_dir = Path(model_dir)
        self.weight_map = self.files.weight_map
        # appended to shape / missing-tensor errors: the config defaults that shaped the expected shapes
        self.hint = hint
        self._handles: dict[str, object] = {}
        self.consumed: set[str] = set()
        self.recent: list[str] = []  # tensors read since the last check_finite: the sources of the next parameter
        self.is_fp8 = False  # a block-FP8 checkpoint: its projections must be stored as FP8 (docs/fp8.md)
        self.is_sharded = False  # tensor-parallel: FP8 row slices must be whole scale blocks (model/fp8_loader.py)

    def has(self, name: str) -> bool:
        return name in self.weight_map

    def get(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The tensor, or only its slice `index` (read from the file without the rest). A block-FP8 weight comes
        packed with its per-row scales as bytes (model/fp8_loader.py), so fusing and slicing rows treat it as any
        other weight."""
        if name in self.weight_map and self.files.tensors[name].dtype == FP8_CODE:
            return read_packed(self, name, index)
        if self.is_fp8 and name in self.weight_map and FP8_PROJECTION.match(name):
            # refused before a fused projection joins it with FP8 parts
            refuse_unquantized(self, name)
        return self.read(name, index)

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The stored tensor (or its slice `index`) as it is in the file."""
        if name not in self.weight_map:
            raise CheckpointError(f"{self.files.where}: tensor `{name}` is missing from the checkpoint{self.hint}")
        path = self.files.shard_path(name)
        try:
            if path.name not in self._handles:
                self._handles[path.name] = safe_open(path, framework="pt")
            handle = self._handles[path.name]
            if index is None:
                tensor = handle.get_tensor(name)  # type: ignore[attr-defined]
            else:
                tensor = handle.get_slice(name)[index]  # type: ignore[attr-defined]
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise CheckpointError(f"{path}: cannot read tensor `{name}` ({' '.join(str(exc).split())})") from exc
        self.consumed.add(name)
        self.recent.append(name)
        return tensor

    def check_finite(self, param: torch.Tensor, label: str) -> None:
        """Refuses NaN / inf in a parameter just filled from the tensors read since the last check, naming the one
        that holds them. The scan runs where the parameter lives: ~3 ms per GB on an H200 (0.2 s for a 70 GB
        checkpoint, against ~9 s for its host-to-device copy alone), so it is always on (docs/ARCHITECTURE.md)."""
        sources, self.recent = self.recent, []
        if bool(torch.isfinite(param).all()):
            return
        for name in sources:
            # the failure path only: the whole tensor again, on the CPU (a rank may have read a slice of it)
            tensor = self.get(name).float()
            self.recent.clear()
            bad = int((~torch.isfinite(tensor)).sum())
            if bad:
                raise CheckpointError(
                    f"{self.files.shard_path(name)}: tensor `{name}` holds {bad} NaN or inf values (of "
                    f"{tensor.numel()}): the checkpoint is corrupt, and would serve garbage"
                )
        raise CheckpointError(
            f"{self.files.where}: tensor `{label}` overflows to inf as {str(param.dtype).removeprefix('torch.')}: "
            "load it in a wider --dtype"
        )

    def check_shape(self, name: str, shape: tuple[int, ...]) -> None:
        info = self.files.tensors.get(name)
        if info is not None and tuple(info.shape) != tuple(shape):
            raise CheckpointError(
                f"{self.files.shard_path(name)}: tensor `{name}` has shape {list(info.shape)}, "
                f"expected {list(shape)}{self.hint}"
            )

    def get_shaped(self, name: str, shape: tuple[int, ...], index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The tensor (or its slice `index`) after checking that the whole tensor has `shape`."""
        self.check_shape(name, shape)
        return self.get(name, index)

    def touch(self, name: str, shape: tuple[int, ...]) -> None:
        """A tensor this rank needs none of: its presence and shape are checked and it counts as consumed."""
        if name not in self.weight_map:
            raise CheckpointError(f"{self.files.where}: tensor `{name}` is missing from the checkpoint{self.hint}")
        self.check_shape(name, shape)
        self.consumed.add(name)
        if self.files.tensors[name].dtype == FP8_CODE and self.has(scale_name(name)):
            self.consumed.add(scale_name(name))  # its block scale goes with it


def _rows(shard: Shard, unit: int, offset: int = 0) -> slice:
    """The rows (or columns) of a shard of heads / channels that are `unit` wide, after `offset` leading ones."""
    return slice(offset + shard.start * unit, offset + shard.stop * unit)


ALL = slice(None)


def _decoder_prefix(ckpt: Checkpoint) -> str:
    if any(name.startswith("model.language_model.") for name in ckpt.weight_map):
        return "model.language_model."
    return "model."


def _copy(ckpt: Checkpoint, param: torch.Tensor | Fp8Weight, value: torch.Tensor, name: str) -> None:
    if isinstance(param, Fp8Weight) or value.dtype == torch.uint8:
        copy_packed(ckpt, param, value, name)  # block FP8 (model/fp8_loader.py)
        return
    if tuple(param.shape) != tuple(value.shape):
        raise CheckpointError(f"tensor `{name}` gives shape {list(value.shape)}, expected {list(param.shape)}")
    param.data.copy_(value.to(dtype=param.dtype))
    ckpt.check_finite(param, name)


def _load_attention(layer: DecoderLayer, ckpt: Checkpoint, p: str, config: ModelConfig, shapes: LocalShapes) -> None:
    attn = layer.self_attn
    hidden, d = config.hidden_size, config.head_dim
    nq, nkv = config.num_attention_heads, config.num_key_value_heads
    # this rank's heads: 2·d rows each in q_proj (per head [query | gate]), d rows in k/v_proj, d columns in o_proj
    q_rows, kv_rows = _rows(shapes.q_heads, 2 * d), _rows(shapes.kv_heads, d)
    q = ckpt.get_shaped(p + "q_proj.weight", (2 * nq * d, hidden), (q_rows,))
    k = ckpt.get_shaped(p + "k_proj.weight", (nkv * d, hidden), (kv_rows,))
    v = ckpt.get_shaped(p + "v_proj.weight", (nkv * d, hidden), (kv_rows,))
    _copy(ckpt, attn.qkv_proj, torch.cat([q, k, v]), p + "q_proj/k_proj/v_proj")
    o = ckpt.get_shaped(p + "o_proj.weight", (hidden, nq * d), (ALL, _rows(shapes.q_heads, d)))
    _copy(ckpt, attn.o_proj, o, p + "o_proj.weight")
    if config.has_attention_bias:
        # transformers' attention_bias puts a bias on all four projections (Qwen3_5Attention, bias=attention_bias)
        q_b = ckpt.get_shaped(p + "q_proj.bias", (2 * nq * d,), (q_rows,))
        k_b = ckpt.get_shaped(p + "k_proj.bias", (nkv * d,), (kv_rows,))
        v_b = ckpt.get_shaped(p + "v_proj.bias", (nkv * d,), (kv_rows,))
        _copy(ckpt, attn.qkv_bias, torch.cat([q_b, k_b, v_b]), p + "q_proj/k_proj/v_proj.bias")
        if attn.o_bias is None:
            ckpt.touch(p + "o_proj.bias", (hidden,))  # row-parallel: only rank 0 adds it
        else:
            _copy(ckpt, attn.o_bias, ckpt.get_shaped(p + "o_proj.bias", (hidden,)), p + "o_proj.bias")
    _copy(ckpt, attn.q_norm, ckpt.get_shaped(p + "q_norm.weight", (d,)), p + "q_norm.weight")
    _copy(ckpt, attn.k_norm, ckpt.get_shaped(p + "k_norm.weight", (d,)), p + "k_norm.weight")


def _load_gdn(layer: DecoderLayer, ckpt: Checkpoint, p: str, config: ModelConfig, shapes: LocalShapes) -> None:
    gdn = layer.linear_attn
    hidden = config.hidden_size
    num_k, num_v = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    key_dim = num_k * dk
    ratio = num_v // num_k
    heads_k, heads_v = shapes.k_heads, shapes.v_heads  # this rank's key heads and their value heads
    # the flat [q | k | v] channels of this rank's heads (in_proj_qkv rows and conv1d channels)
    qkv_parts = (_rows(heads_k, dk), _rows(heads_k, dk, key_dim), _rows(heads_v, dv, 2 * key_dim))
    if config.is_gdn_interleaved:
        # Per key head g: [q_g (dk) | k_g (dk) | v of its ρ value heads (ρ·dv) | z of the same (ρ·dv)]
        # (docs/ARCHITECTURE.md#configs-and-checkpoint-layout); a rank's key heads are consecutive groups of rows.
        group = 2 * dk + 2 * ratio * dv
        w = ckpt.get_shaped(p + "in_proj_qkvz.weight", (num_k * group, hidden), (_rows(heads_k, group),))
        w = w.reshape(heads_k.size, group, -1)  # -1: hidden, or FP8 bytes with their scales (fp8_loader.py)
        q, k = w[:, :dk], w[:, dk : 2 * dk]
        v, z = w[:, 2 * dk : 2 * dk + ratio * dv], w[:, 2 * dk + ratio * dv :]
        flat = [t.reshape(-1, t.shape[-1]) for t in (q, k, v, z)]
        _copy(ckpt, gdn.in_proj_qkvz, torch.cat(flat), p + "in_proj_qkvz.weight")
        ba = ckpt.get_shaped(p + "in_proj_ba.weight", (2 * num_v, hidden), (_rows(heads_k, 2 * ratio),))
        ba = ba.reshape(heads_k.size, 2 * ratio, hidden)
        b, a = ba[:, :ratio].reshape(heads_v.size, hidden), ba[:, ratio:].reshape(heads_v.size, hidden)
        _copy(ckpt, gdn.in_proj_ba, torch.cat([b, a]), p + "in_proj_ba.weight")
    else:
        name = p + "in_proj_qkv.weight"
        qkv = [ckpt.get_shaped(name, (config.conv_dim, hidden), (rows,)) for rows in qkv_parts]
        z = ckpt.get_shaped(p + "in_proj_z.weight", (config.value_dim, hidden), (_rows(heads_v, dv),))
        _copy(ckpt, gdn.in_proj_qkvz, torch.cat([*qkv, z]), p + "in_proj_qkv/in_proj_z")
        b = ckpt.get_shaped(p + "in_proj_b.weight", (num_v, hidden), (_rows(heads_v, 1),))
        a = ckpt.get_shaped(p + "in_proj_a.weight", (num_v, hidden), (_rows(heads_v, 1),))
        _copy(ckpt, gdn.in_proj_ba, torch.cat([b, a]), p + "in_proj_b/in_proj_a")
    conv_shape = (config.conv_dim, 1, config.linear_conv_kernel_dim)
    conv = torch.cat([ckpt.get_shaped(p + "conv1d.weight", conv_shape, (rows,)) for rows in qkv_parts])
    _copy(ckpt, gdn.conv1d, conv[:, 0], p + "conv1d.weight")
    heads = (_rows(heads_v, 1),)
    _copy(ckpt, gdn.A_log, ckpt.get_shaped(p + "A_log", (num_v,), heads).float(), p + "A_log")
    _copy(ckpt, gdn.dt_bias, ckpt.get_shaped(p + "dt_bias", (num_v,), heads), p + "dt_bias")
    _copy(ckpt, gdn.norm, ckpt.get_shaped(p + "norm.weight", (dv,)), p + "norm.weight")
    out = ckpt.get_shaped(p + "out_proj.weight", (hidden, config.value_dim), (ALL, _rows(heads_v, dv)))
    _copy(ckpt, gdn.out_proj, out, p + "out_proj.weight")


def _load_dense_mlp(mlp: torch.nn.Module, ckpt: Checkpoint, p: str, hidden: int, width: Shard) -> None:
    """width: this rank's slice of the intermediate width (column-parallel gate/up rows, row-parallel down)."""
    rows = (_rows(width, 1),)
    gate = ckpt.get_shaped(p + "gate_proj.weight", (width.total, hidden), rows)
    up = ckpt.get_shaped(p + "up_proj.weight", (width.total, hidden), rows)
    _copy(ckpt, mlp.gate_up_proj, torch.cat([gate, up]), p + "gate_proj/up_proj")
    down = ckpt.get_shaped(p + "down_proj.weight", (hidden, width.total), (ALL, _rows(width, 1)))
    _copy(ckpt, mlp.down_proj, down, p + "down_proj.weight")


def _expert(weights: torch.Tensor | Fp8Weight, index: int) -> torch.Tensor | Fp8Weight:
    """Expert `index` of a stacked [E, N, K] weight, plain or block-FP8, sharing its storage."""
    return weights.expert(index) if isinstance(weights, Fp8Weight) else weights[index]


def _load_moe(layer: DecoderLayer, ckpt: Checkpoint, p: str, config: ModelConfig, shapes: LocalShapes) -> None:
    moe = layer.mlp
    hidden, num_experts, width = config.hidden_size, config.num_experts, config.moe_intermediate_size
    # this rank's experts (all but under expert parallelism) and its slice of each one's width (all under it)
    experts, inter = shapes.experts, shapes.moe_intermediate
    _copy(ckpt, moe.gate, ckpt.get_shaped(p + "gate.weight", (num_experts, hidden)), p + "gate.weight")
    if ckpt.has(p + "experts.gate_up_proj"):
        name = p + "experts.gate_up_proj"
        shape = (num_experts, 2 * width, hidden)
        gate = ckpt.get_shaped(name, shape, (_rows(experts, 1), _rows(inter, 1)))
        up = ckpt.get_shaped(name, shape, (_rows(experts, 1), _rows(inter, 1, width)))
        _copy(ckpt, moe.w13, torch.cat([gate, up], dim=1), name)
        down_index = (_rows(experts, 1), ALL, _rows(inter, 1))
        down = ckpt.get_shaped(p + "experts.down_proj", (num_experts, hidden, width), down_index)
        _copy(ckpt, moe.w2, down, p + "experts.down_proj")
    else:
        for e in range(num_experts):
            ep = f"{p}experts.{e}."
            if not experts.start <= e < experts.stop:
                for leaf, shape in (("gate_proj", (width, hidden)), ("up_proj", (width, hidden)),
                                    ("down_proj", (hidden, width))):  # fmt: skip
                    ckpt.touch(f"{ep}{leaf}.weight", shape)  # held by another rank
                continue
            rows = (_rows(inter, 1),)
            gate = ckpt.get_shaped(ep + "gate_proj.weight", (width, hidden), rows)
            up = ckpt.get_shaped(ep + "up_proj.weight", (width, hidden), rows)
            local = e - experts.start
            _copy(ckpt, _expert(moe.w13, local), torch.cat([gate, up]), ep + "gate_proj/up_proj")
            down = ckpt.get_shaped(ep + "down_proj.weight", (hidden, width), (ALL, _rows(inter, 1)))
            _copy(ckpt, _expert(moe.w2, local), down, ep + "down_proj.weight")
    if moe.has_shared_expert:
        _load_dense_mlp(moe.shared_expert, ckpt, p + "shared_expert.", hidden, shapes.shared_intermediate)
        gate_w = ckpt.get_shaped(p + "shared_expert_gate.weight", (1, hidden))
        _copy(ckpt, moe.shared_expert_gate, gate_w, p + "shared_expert_gate.weight")
    else:
        # Width 0: transformers' zero-width shared expert adds exactly 0, so its (empty) tensors and its gate are
        # read for their shapes and not used.
        for name, shape in (("gate_proj.weight", (0, hidden)), ("up_proj.weight", (0, hidden)),
                            ("down_proj.weight", (hidden, 0))):  # fmt: skip
            if ckpt.has(p + "shared_expert." + name):
                ckpt.get_shaped(p + "shared_expert." + name, shape)
        if ckpt.has(p + "shared_expert_gate.weight"):
            ckpt.get_shaped(p + "shared_expert_gate.weight", (1, hidden))


def _load_decoder_layer(
    layer: DecoderLayer, ckpt: Checkpoint, p: str, config: ModelConfig, shapes: LocalShapes, is_moe: bool
) -> None:
    """One decoder layer under prefix p (`…layers.{i}.`): its two norms, its mixer and its MLP or MoE block."""
    hidden = config.hidden_size
    pre = ckpt.get_shaped(p + "input_layernorm.weight", (hidden,))
    _copy(ckpt, layer.input_layernorm, pre, p + "input_layernorm")
    post = ckpt.get_shaped(p + "post_attention_layernorm.weight", (hidden,))
    _copy(ckpt, layer.post_attention_layernorm, post, p + "post_attention_layernorm.weight")
    if layer.is_full_attention:
        _load_attention(layer, ckpt, p + "self_attn.", config, shapes)
    else:
        _load_gdn(layer, ckpt, p + "linear_attn.", config, shapes)
    if is_moe:
        _load_moe(layer, ckpt, p + "mlp.", config, shapes)
    else:
        _load_dense_mlp(layer.mlp, ckpt, p + "mlp.", hidden, shapes.intermediate)


def load_mtp_layer(mtp: MtpLayer, ckpt: Checkpoint, config: ModelConfig, shapes: LocalShapes) -> None:
    """The checkpoint's MTP layer (`mtp.*`, or `model.mtp.*`): fc [H, 2H] and the three norms replicated, the
    decoder layer `mtp.layers.0.` sharded as the target's attention layers (docs/ARCHITECTURE.md#the-mtp-head).
    A checkpoint without the tensors is refused by name: speculative decoding was asked for and cannot run."""
    prefix = next((p for p in MTP_RULE.prefixes if ckpt.has(p + "fc.weight")), None)
    if prefix is None:
        has_any = any(name.startswith(MTP_RULE.prefixes) for name in ckpt.weight_map)
        found = "its mtp.* tensors lack `mtp.fc.weight`" if has_any else "it has no mtp.* tensors"
        raise CheckpointError(
            f"{ckpt.files.where}: speculative decoding with method mtp needs the checkpoint's MTP layer, but {found} "
            f"(`{config.mtp_field}` is {config.mtp_num_hidden_layers})"
        )
    hidden = config.hidden_size
    _copy(ckpt, mtp.fc, ckpt.get_shaped(prefix + "fc.weight", (hidden, 2 * hidden)), prefix + "fc.weight")
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensor = ckpt.get_shaped(f"{prefix}{name}.weight", (hidden,))
        _copy(ckpt, getattr(mtp, name), tensor, f"{prefix}{name}.weight")
    _load_decoder_layer(mtp.layer, ckpt, prefix + "layers.0.", config, shapes, config.is_moe)


def _vocab_rows(ckpt: Checkpoint, name: str, config: ModelConfig, vocab: Shard) -> torch.Tensor:
    """This rank's rows [vocab.size, H] of an embedding-shaped tensor; rows past vocab_size (the last rank's
    padding) are zeros."""
    shape = (config.vocab_size, config.hidden_size)
    if vocab.is_whole:
        return ckpt.get_shaped(name, shape)
    stop = min(vocab.stop, config.vocab_size)
    rows = ckpt.get_shaped(name, shape, (slice(vocab.start, stop),))
    if stop - vocab.start == vocab.size:
        return rows
    padded = rows.new_zeros(vocab.size, config.hidden_size)
    padded[: stop - vocab.start] = rows
    return padded


def _load_head(model: Qwen35Model, ckpt: Checkpoint, config: ModelConfig, embed: torch.Tensor | None) -> list[str]:
    """lm_head as transformers ties it (PreTrainedModel.tie_weights): a distinct lm_head.weight is used even when a
    tie flag is set (transformers warns and does not tie); without one, the head is the embedding if any tie flag
    says so. Returns the notes for the load report. Under tensor parallelism `embed` and the head are this rank's
    vocabulary rows."""
    said_tied = [name for name, value in config.tie_flags if value]
    if ckpt.has("lm_head.weight"):
        head = _vocab_rows(ckpt, "lm_head.weight", config, model.shapes.vocab)
        if said_tied and embed is not None and torch.equal(head, embed):
            return []
        if model.lm_head is model.embed_tokens:
            model.untie_lm_head()
        _copy(ckpt, model.lm_head, head, "lm_head.weight")
        if not said_tied:
            return []
        note = (f"`{said_tied[0]}` is true but lm_head.weight differs from the embedding: lm_head.weight is used, as "
                "transformers does (it warns and leaves the two untied)")  # fmt: skip
        logger.warning("%s: %s", ckpt.model_dir, note)
        return [note]
    if not said_tied:
        flags = ", ".join(f"`{name}` is false" for name, _ in config.tie_flags)
        raise CheckpointError(f"{ckpt.files.where}: tensor `lm_head.weight` is missing and {flags}{ckpt.hint}")
    if config.tie_flags[0][1] is False:
        # composite checkpoint: transformers reads the top-level flag (false) and would leave lm_head random
        return [f"lm_head tied to the embedding as `{said_tied[0]}` says (vLLM's reading; transformers reads "
                f"`{config.tie_flags[0][0]}`, which is false)"]  # fmt: skip
    return []


def load_checkpoint(
    model: Qwen35Model,
    config: ModelConfig,
    model_dir: Path,
    ignore_unexpected: bool = False,
    skip_rules: tuple[SkipRule, ...] = SKIP_RULES,
) -> LoadReport:
    """Fills model from the checkpoint in model_dir. Tensors that nothing consumed and no skip rule names are an
    error (the first is named with its file) unless ignore_unexpected, which lists them in the report instead."""
    defaults = [note for note in config.notes if note.startswith("absent from config.json")]
    hint = f" ({defaults[0]})" if defaults else ""
    ckpt = Checkpoint(model_dir, hint)
    if getattr(model, "mtp", None) is not None:
        # the MTP layer was built (speculative decoding): mtp.* is consumed, no longer a skipped prefix
        skip_rules = tuple(rule for rule in skip_rules if rule.name != MTP_RULE.name)
    ckpt.files.check_dtypes(skip_rules, fp8=config.fp8 is not None)
    ckpt.is_fp8 = config.fp8 is not None
    ckpt.is_sharded = model.tp.is_parallel
    prefix = _decoder_prefix(ckpt)
    hidden = config.hidden_size
    shapes = model.shapes  # this rank's slices (everything on one rank)
    with torch.no_grad():
        embed_name = prefix + "embed_tokens.weight"
        embed = None
        if ckpt.has(embed_name) or not (config.tie_word_embeddings and ckpt.has("lm_head.weight")):
            embed = _vocab_rows(ckpt, embed_name, config, shapes.vocab)
        else:
            # tied with only lm_head.weight stored: transformers swaps source and target and ties to it
            embed = _vocab_rows(ckpt, "lm_head.weight", config, shapes.vocab)
        _copy(ckpt, model.embed_tokens, embed, embed_name)
        for i, layer in enumerate(model.layers):
            is_moe = bool(config.moe_layers) and config.moe_layers[i]
            _load_decoder_layer(layer, ckpt, f"{prefix}layers.{i}.", config, shapes, is_moe)
        _copy(ckpt, model.norm, ckpt.get_shaped(prefix + "norm.weight", (hidden,)), prefix + "norm.weight")
        head_notes = _load_head(model, ckpt, config, embed)
        if getattr(model, "mtp", None) is not None:
            load_mtp_layer(model.mtp, ckpt, config, shapes)
        if getattr(model, "visual", None) is not None:
            # the vision tower was built: model.visual.* is consumed (else it stays a skipped prefix)
            load_vision_tower(model.visual, config.vision, ckpt)
    fp8_notes = []
    if config.fp8 is not None:
        count = sum(isinstance(m, Fp8Weight) for m in model.modules())
        fp8_notes = [f"block FP8: {count} projections in float8_e4m3fn with 128x128 scales, activations quantized "
                     "per token in groups of 128 (docs/fp8.md)"]  # fmt: skip
    report = LoadReport(num_tensors_loaded=len(ckpt.consumed), notes=[*config.notes, *fp8_notes, *head_notes])
    for name in sorted(set(ckpt.weight_map) - ckpt.consumed):
        rule = skip_rule_for(name, skip_rules)
        if rule is None:
            report.unexpected.append(name)
        else:
            report.skipped.append(name)
            report.skipped_by_rule[rule.name] = report.skipped_by_rule.get(rule.name, 0) + 1
    if report.unexpected and not ignore_unexpected:
        first = report.unexpected[0]
        more = f" (and {len(report.unexpected) - 1} more)" if len(report.unexpected) > 1 else ""
        raise CheckpointError(
            f"{ckpt.files.shard_path(first)}: unexpected tensor `{first}`{more}: the {config.architecture} model "
            f"has no parameter for it; {IGNORE_UNEXPECTED_FLAG} loads the checkpoint without it"
        )
    if report.unexpected:
        logger.warning(
            "%d unexpected tensors ignored in %s: %s", len(report.unexpected), model_dir, report.unexpected[:20]
        )
    for note in config.notes:
        # transformers' defaults are routine; a field ignored or read as vLLM reads it deserves attention
        level = logging.INFO if note.startswith("absent from config.json") else logging.WARNING
        logger.log(level, "%s: %s", model_dir, note)
    return report


# vLLM's dummy-weight constants (initialize_dummy_weights' defaults: low=-1e-3, high=1e-3, seed=1234)
DUMMY_WEIGHT_BOUND = 1e-3
VLLM_DUMMY_SEED = 1234


def init_dummy_weights(model: Qwen35Model, seed: int = VLLM_DUMMY_SEED) -> None:
    """vLLM's dummy weights (vllm/model_executor/model_loader/weight_utils.py, initialize_dummy_weights): every
    floating-point parameter drawn from U(-1e-3, 1e-3) by a generator on its device re-seeded with `seed` (vLLM's
    1234, whatever --seed says) for each tensor, so the values depend only on a tensor's shape and dtype.

    Why vLLM's scheme and not a "realistic" one: a benchmark against vLLM's `--load-format dummy` must run the
    same kind of model. Weights this small leave a greedy decode depending on little more than the current token,
    so prompts with a common ending (every chat template's) decode identical tokens and route every batch row to
    the same experts; under deltaserve's former N(0, 0.02) matrices the same prompts decoded diverse tokens and
    touched 6.5x more experts per MoE decode step (64 experts, 16 sequences; more with 256 and 32;
    benchmarks/dummy_routing.py and its CPU record benchmarks/results/kernels/dummy-routing-cpu-20261201.txt).
    Tensor-parallel ranks get equal values for equally shaped shards, so replicated parameters (the router above
    all) agree across ranks, as in vLLM."""
    with torch.no_grad():
        for param in model.parameters():
            if not torch.is_floating_point(param):
                continue
            generator = torch.Generator(device=param.device).manual_seed(seed)
            if param.dtype == FP8_DTYPE:
                # vLLM's route for dtypes uniform_ lacks: drawn in fp16, then cast (block scales are fp32
                # parameters and draw from the same U(-1e-3, 1e-3), as in vLLM)
                drawn = torch.empty(param.shape, dtype=torch.float16, device=param.device)
                param.copy_(drawn.uniform_(-DUMMY_WEIGHT_BOUND, DUMMY_WEIGHT_BOUND, generator=generator))
                continue
            param.uniform_(-DUMMY_WEIGHT_BOUND, DUMMY_WEIGHT_BOUND, generator=generator)
