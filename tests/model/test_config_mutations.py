"""Issue 12's config-mutation suite: for each config field that changes the computation, a tiny checkpoint built
with transformers' own classes (text-only and composite), mutated as a checkpoint in the wild might be, on which
deltaserve either matches transformers STRICT (greedy tokens identical and logits within fp32 rounding) or refuses
with an error naming the field and the file. Never a third outcome: each case states which of the two it expects.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from deltaserve.config import ConfigError, ModelConfig
from deltaserve.engine.llm import LLM
from deltaserve.model.loader import CheckpointError

from ._hf_tiny import KINDS, assert_strict, build, copy_with, load_reference, text_config

Edit = Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class Case:
    id: str
    kind: str
    edit: Edit | None = None
    text: dict[str, Any] = field(default_factory=dict)  # decoder config of a fresh build (else the shared base)
    top: dict[str, Any] = field(default_factory=dict)  # composite config of a fresh build
    refuses: str | None = None  # the field the error must name; None: must match transformers
    note: str | None = None  # a phrase the load report's notes must carry


def tc(edit: Callable[[dict[str, Any]], object]) -> Edit:
    """An edit of the decoder config (text_config in composites)."""
    return lambda config: edit(text_config(config)) and None


def rope(edit: Callable[[dict[str, Any]], object]) -> Edit:
    return tc(lambda t: edit(t["rope_parameters"]))


def pop(*keys: str) -> Callable[[dict[str, Any]], None]:
    return lambda d: [d.pop(k, None) for k in keys] and None


ROPE_HALF = {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}
LEFT_OUT = ("hidden_act", "rms_norm_eps", "attention_bias", "tie_word_embeddings", "linear_conv_kernel_dim",
            "head_dim", "rope_parameters", "layer_types", "max_position_embeddings", "attention_dropout")  # fmt: skip


def to_flat_rope(config: dict[str, Any]) -> None:
    config.pop("rope_parameters")
    config.update(rope_theta=1e6, partial_rotary_factor=0.5)


def rope_scaling_wins(config: dict[str, Any]) -> None:
    config["rope_scaling"] = dict(config["rope_parameters"])
    config["rope_parameters"]["partial_rotary_factor"] = 0.25


def ties(*, top: bool | None = None, text: bool | None = None) -> Edit:
    def edit(config: dict[str, Any]) -> None:
        if top is not None:
            config["tie_word_embeddings"] = top
        if text is not None:
            text_config(config)["tie_word_embeddings"] = text

    return edit


MATCHES = [
    Case("partial_rotary_factor absent, text-only", "dense", rope(pop("partial_rotary_factor"))),
    Case("partial_rotary_factor absent, composite", "dense-mm", rope(pop("partial_rotary_factor"))),
    Case("partial_rotary_factor absent, moe composite", "moe-mm", rope(pop("partial_rotary_factor"))),
    Case("rope_parameters absent", "dense", tc(pop("rope_parameters"))),
    Case("flat rope_theta / partial_rotary_factor", "next", to_flat_rope, text={"rope_parameters": ROPE_HALF}),
    Case(
        "rope_theta only at the top level",
        "dense",
        tc(lambda t: t.update(rope_theta=t["rope_parameters"].pop("rope_theta"))),
        text={"rope_parameters": ROPE_HALF},
    ),  # fmt: skip
    Case("rope_scaling replaces rope_parameters", "next", rope_scaling_wins, text={"rope_parameters": ROPE_HALF}),
    Case("head_dim absent (transformers' 256)", "dense", tc(pop("head_dim")), text={"head_dim": 256}),
    Case("attention_bias, dense", "dense", text={"attention_bias": True}),
    Case("attention_bias, qwen3_next", "next", text={"attention_bias": True}),
    Case("attention_bias, moe composite", "moe-mm", text={"attention_bias": True}),
    Case("tie flag with a distinct lm_head.weight", "dense", ties(text=True), note="lm_head.weight is used"),
    Case(
        "composite tie flags with a distinct lm_head",
        "dense-mm",
        ties(top=True, text=True),
        note="lm_head.weight is used",
    ),  # fmt: skip
    Case("tied, no lm_head.weight", "dense", text={"tie_word_embeddings": True}),
    Case("tied, qwen3_next", "next", text={"tie_word_embeddings": True}),
    Case(
        "composite tied by the top-level flag only",
        "dense-mm",
        text={"tie_word_embeddings": False},
        top={"tie_word_embeddings": True},
        note="disagree",
    ),  # fmt: skip
    Case(
        "layer_types contradicting full_attention_interval",
        "dense",
        tc(lambda t: t.update(full_attention_interval=4)),
        text={"layer_types": ["full_attention", "linear_attention", "full_attention", "linear_attention"]},
        note="layer_types is used",
    ),  # fmt: skip
    Case(
        "layer_types absent, full_attention_interval 2",
        "dense",
        tc(lambda t: t.update(full_attention_interval=2) or t.pop("layer_types")),
        text={"layer_types": ["linear_attention", "full_attention"] * 2},
    ),  # fmt: skip
    Case("layer_types and full_attention_interval absent", "next", tc(pop("layer_types"))),
    Case("rms_norm_eps 1e-3", "moe", text={"rms_norm_eps": 1e-3}),
    Case(
        "fields at transformers' defaults left out",
        "dense",
        tc(pop(*LEFT_OUT)),
        text={"head_dim": 256, "max_position_embeddings": 32768},
        note="transformers' defaults used",
    ),  # fmt: skip
    Case(
        "mlp_only_layers / decoder_sparse_step on qwen3_5_moe",
        "moe",
        tc(lambda t: t.update(mlp_only_layers=[1], decoder_sparse_step=2)),
        note="is ignored",
    ),  # fmt: skip
    Case(
        "qwen3_next mlp_only_layers and decoder_sparse_step",
        "next",
        text={"mlp_only_layers": [0], "decoder_sparse_step": 2},
    ),  # fmt: skip
    Case("qwen3_next norm_topk_prob false", "next", text={"norm_topk_prob": False}),
    Case(
        "shared_expert_intermediate_size absent (512)",
        "moe",
        tc(pop("shared_expert_intermediate_size")),
        text={"shared_expert_intermediate_size": 512},
    ),  # fmt: skip
    Case("qwen3_next without experts", "next", text={"num_experts": 0}),
    Case("qwen3_next shared expert of width 0", "next", text={"shared_expert_intermediate_size": 0}),
    Case("hidden_act swish", "dense", text={"hidden_act": "swish"}),
    Case(
        "mrope_section not summing to rotary_dim/2",
        "dense-mm",
        rope(lambda r: r.update(mrope_section=[3, 3, 2])),
        note="mrope_section",
    ),  # fmt: skip
    Case("top-1 routing, MQA", "moe-mm", text={"num_experts_per_tok": 1, "num_key_value_heads": 1}),
]

REFUSALS = [
    Case("hidden_act gelu", "dense", tc(lambda t: t.update(hidden_act="gelu")), refuses="hidden_act"),
    Case("hidden_act relu, qwen3_next", "next", tc(lambda t: t.update(hidden_act="relu")), refuses="hidden_act"),
    Case(
        "yarn rope scaling",
        "dense",
        rope(lambda r: r.update(rope_type="yarn", factor=4.0, original_max_position_embeddings=512)),
        refuses="rope_parameters.rope_type",
    ),  # fmt: skip
    Case(
        "quantization_config",
        "dense-mm",
        lambda c: c.update(quantization_config={"quant_method": "fp8"}),
        refuses="quantization_config",
    ),  # fmt: skip
    Case(
        "attn_output_gate false", "dense", tc(lambda t: t.update(attn_output_gate=False)), refuses="attn_output_gate"
    ),  # fmt: skip
    Case(
        "mrope_interleaved false",
        "dense-mm",
        rope(lambda r: r.update(mrope_interleaved=False)),
        refuses="text_config.rope_parameters.mrope_interleaved",
    ),  # fmt: skip
    Case("qkv_bias without attention_bias", "next", tc(lambda t: t.update(qkv_bias=True)), refuses="qkv_bias"),
    Case(
        "output_gate_type sigmoid",
        "dense-mm",
        tc(lambda t: t.update(output_gate_type="sigmoid")),
        refuses="text_config.output_gate_type",
    ),  # fmt: skip
    Case(
        "norm_topk_prob false on qwen3_5_moe",
        "moe",
        tc(lambda t: t.update(norm_topk_prob=False)),
        refuses="norm_topk_prob",
    ),  # fmt: skip
    Case("head_dim absent, tensors of another width", "dense", tc(pop("head_dim")), refuses="head_dim=256"),
    Case("vocab_size absent", "next", tc(pop("vocab_size")), refuses="vocab_size=151936"),
    Case(
        "odd rotary_dim",
        "dense-mm",
        rope(lambda r: r.update(partial_rotary_factor=0.1875)),
        refuses="text_config.rope_parameters.partial_rotary_factor",
    ),  # fmt: skip
    Case("head_dim null", "moe", tc(lambda t: t.update(head_dim=None)), refuses="head_dim"),
    Case("dtype int8", "dense", lambda c: c.update(dtype="int8"), refuses="dtype"),
    Case(
        "unknown layer type",
        "next",
        tc(lambda t: t.update(layer_types=["sliding_attention"] * 4)),
        refuses="layer_types",
    ),  # fmt: skip
    Case(
        "decoder_sparse_step 0", "next", tc(lambda t: t.update(decoder_sparse_step=0)), refuses="decoder_sparse_step"
    ),  # fmt: skip
    Case(
        "mamba_ssm_dtype unknown",
        "dense-mm",
        tc(lambda t: t.update(mamba_ssm_dtype="int4")),
        refuses="text_config.mamba_ssm_dtype",
    ),  # fmt: skip
    Case("composite without text_config", "moe-mm", lambda c: c.pop("text_config"), refuses="text_config"),
]


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory, tiny_dense: Path) -> dict[str, Path]:
    """One transformers-built checkpoint per kind (default tiny dimensions), shared by the cases that only edit."""
    root = tmp_path_factory.mktemp("hf-bases")
    return {kind: build(kind, root / kind, tiny_dense) for kind in KINDS}


def checkpoint_for(case: Case, bases: dict[str, Path], tmp_path: Path, tiny_dense: Path) -> Path:
    src = bases[case.kind]
    if case.text or case.top:
        src = build(case.kind, tmp_path / "built", tiny_dense, top=case.top, **case.text)
    return copy_with(src, tmp_path / "ckpt", case.edit)


@pytest.mark.parametrize("case", MATCHES, ids=[c.id for c in MATCHES])
def test_matches_transformers(case: Case, bases: dict[str, Path], tmp_path: Path, tiny_dense: Path) -> None:
    folder = checkpoint_for(case, bases, tmp_path, tiny_dense)
    llm = assert_strict(folder)
    if case.note is not None:
        notes = llm.engine.runner.load_report.notes
        assert any(case.note in note for note in notes), notes


@pytest.mark.parametrize("case", REFUSALS, ids=[c.id for c in REFUSALS])
def test_refuses_by_name(case: Case, bases: dict[str, Path], tmp_path: Path, tiny_dense: Path) -> None:
    folder = checkpoint_for(case, bases, tmp_path, tiny_dense)
    with pytest.raises((ConfigError, CheckpointError)) as info:
        LLM(folder, dtype="float32", device="cpu")
    message = str(info.value)
    assert case.refuses in message, message
    assert str(folder) in message and "\n" not in message


def test_tied_only_in_text_config_follows_the_checkpoint(tmp_path: Path, tiny_dense: Path) -> None:
    """Top-level tie false, text_config tie true, no lm_head.weight: transformers reads the top-level flag and
    leaves lm_head random, vLLM ties. deltaserve ties (the checkpoint has no head of its own) and says so; the
    reference is the same weights loaded where both flags agree."""
    tied = build("dense-mm", tmp_path / "tied", tiny_dense, top={"tie_word_embeddings": True},
                 tie_word_embeddings=True)  # fmt: skip
    folder = copy_with(tied, tmp_path / "ckpt", ties(top=False))
    llm = assert_strict(folder, reference=load_reference(tied))
    assert any("vLLM's reading" in note for note in llm.engine.runner.load_report.notes)


def test_untied_without_lm_head_is_refused(tmp_path: Path, tiny_dense: Path) -> None:
    tied = build("dense", tmp_path / "tied", tiny_dense, tie_word_embeddings=True)
    folder = copy_with(tied, tmp_path / "ckpt", ties(text=False))
    with pytest.raises(CheckpointError, match=r"`lm_head\.weight` is missing and `tie_word_embeddings` is false"):
        LLM(folder, dtype="float32", device="cpu")


def test_bfloat16_ssm_state_follows_vllm(bases: dict[str, Path], tmp_path: Path) -> None:
    """mamba_ssm_dtype exists only for vLLM (transformers keeps an fp32 state), so its intent is vLLM's reading:
    the state is kept in bfloat16, and the load report says so."""
    folder = copy_with(bases["dense-mm"], tmp_path / "ckpt", tc(lambda t: t.update(mamba_ssm_dtype="bfloat16")))
    config = ModelConfig.from_pretrained(folder)
    assert config.ssm_state_dtype == "bfloat16"
    assert any("as vLLM does" in note for note in config.notes)
