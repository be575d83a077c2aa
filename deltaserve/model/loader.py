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

This module walks the model (embedding, layers, norm, head, MTP layer, vision tower) and reports what it loaded;
the tensors are read and checked by model/checkpoint.py's Checkpoint, and one decoder layer's tensors are mapped to
its fused parameters by model/layer_loader.py.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deltaserve.config import ModelConfig
from deltaserve.kernels.fp8 import FP8_DTYPE, Fp8Weight
from deltaserve.model.checkpoint import Checkpoint
from deltaserve.model.checkpoint_files import MTP_RULE, SKIP_RULES, CheckpointError, SkipRule, skip_rule_for
from deltaserve.model.layer_loader import copy_param, load_decoder_layer
from deltaserve.model.mtp import MtpLayer
from deltaserve.model.parallel import LocalShapes, Shard
from deltaserve.model.qwen3_5 import Qwen35Model
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


def _decoder_prefix(ckpt: Checkpoint) -> str:
    if any(name.startswith("model.language_model.") for name in ckpt.weight_map):
        return "model.language_model."
    return "model."


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
    copy_param(ckpt, mtp.fc, ckpt.get_shaped(prefix + "fc.weight", (hidden, 2 * hidden)), prefix + "fc.weight")
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensor = ckpt.get_shaped(f"{prefix}{name}.weight", (hidden,))
        copy_param(ckpt, getattr(mtp, name), tensor, f"{prefix}{name}.weight")
    load_decoder_layer(mtp.layer, ckpt, prefix + "layers.0.", config, shapes, config.is_moe)


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
        copy_param(ckpt, model.lm_head, head, "lm_head.weight")
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
        copy_param(ckpt, model.embed_tokens, embed, embed_name)
        for i, layer in enumerate(model.layers):
            is_moe = bool(config.moe_layers) and config.moe_layers[i]
            load_decoder_layer(layer, ckpt, f"{prefix}layers.{i}.", config, shapes, is_moe)
        copy_param(ckpt, model.norm, ckpt.get_shaped(prefix + "norm.weight", (hidden,)), prefix + "norm.weight")
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
