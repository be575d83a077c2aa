"""Checkpoint loading: transformers' own save_pretrained output (both expert layouts, tied and untied), broken
checkpoints that must fail with errors naming the tensor or field, and the rules for tensors nothing loads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deltaserve.config import ConfigError, ModelConfig
from deltaserve.engine.llm import LLM
from deltaserve.model.checkpoint_files import MTP_RULE
from deltaserve.model.loader import CheckpointError, load_checkpoint
from deltaserve.model.qwen3_5 import Qwen35Model


def save_with_transformers(src: Path, dst: Path, tie: bool, how: str) -> torch.nn.Module:
    """Builds the transformers model for src (loaded from it, or from its config with transformers' own init),
    perturbs every weight and saves it with save_pretrained. transformers writes fused 3-D experts after
    loading a fused checkpoint and one tensor per expert for a model built from its config."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    if how == "pretrained":
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    else:
        config = AutoConfig.from_pretrained(src)
        config.tie_word_embeddings = tie
        if hasattr(config, "text_config"):
            config.text_config.tie_word_embeddings = tie
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # transformers initialises zero-centred norms to 0; perturb so every weight matters
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    model.save_pretrained(dst)
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return model.eval()


@pytest.mark.parametrize(
    ("variant", "how", "tie", "expert_key"),
    [("dense", "config", True, None), ("dense", "config", False, None),
     ("moe", "pretrained", False, "experts.gate_up_proj"), ("moe", "config", True, "experts.0.gate_proj"),
     ("next", "pretrained", False, "experts.0.gate_proj")],
)  # fmt: skip
def test_loads_transformers_save_pretrained(
    tiny_dirs: dict[str, Path], tmp_path: Path, variant: str, how: str, tie: bool, expert_key: str | None
) -> None:
    model = save_with_transformers(tiny_dirs[variant], tmp_path / "ckpt", tie, how)
    names = set()
    for shard in (tmp_path / "ckpt").glob("*.safetensors"):
        names |= set(load_file(shard))
    assert ("lm_head.weight" in names) != tie
    if expert_key is not None:
        assert any(expert_key in n for n in names)
    llm = LLM(tmp_path / "ckpt", dtype="float32")
    assert llm.engine.runner.load_report.unexpected == []
    ids = list(range(5, 80))
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].float()
    ours = llm.prefill_logits(ids)
    assert float((ours - ref).norm() / ref.norm()) < 1e-4


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def rewrite_tensor(ckpt: Path, name: str, value: torch.Tensor | None) -> None:
    """Replaces (or, with None, deletes) one tensor in whichever shard holds it, keeping the index honest."""
    index_path = ckpt / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = ckpt / index["weight_map"][name]
    tensors = load_file(shard)
    if value is None:
        del tensors[name]
        del index["weight_map"][name]
    else:
        tensors[name] = value
    save_file(tensors, shard, metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))


def test_missing_tensor_is_named(tiny_dense: Path, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(tiny_dense, tmp_path / "ckpt")
    name = "model.language_model.layers.2.linear_attn.in_proj_z.weight"
    rewrite_tensor(ckpt, name, None)
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        LLM(ckpt, dtype="float32")


def test_wrong_shape_is_named(tiny_next: Path, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(tiny_next, tmp_path / "ckpt")
    name = "model.layers.3.self_attn.k_proj.weight"
    rewrite_tensor(ckpt, name, torch.zeros(7, 64, dtype=torch.bfloat16))
    with pytest.raises(CheckpointError, match=rf"{name.replace('.', chr(92) + '.')}.*\[7, 64\]"):
        LLM(ckpt, dtype="float32")


def add_tensor(ckpt: Path, name: str, value: torch.Tensor) -> Path:
    """Puts one more tensor into the first shard and the index; returns that shard."""
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    shard = next(iter(index["weight_map"].values()))
    tensors = load_file(ckpt / shard)
    tensors[name] = value
    save_file(tensors, ckpt / shard, metadata={"format": "pt"})
    index["weight_map"][name] = shard
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    return ckpt / shard


def test_unexpected_tensor_is_an_error_naming_it_and_its_file(tiny_moe: Path, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(tiny_moe, tmp_path / "ckpt")
    name = "model.language_model.layers.0.mlp.extra_bias"
    shard = add_tensor(ckpt, name, torch.zeros(3))
    with pytest.raises(CheckpointError) as info:
        LLM(ckpt, dtype="float32")
    assert f"{shard}: unexpected tensor `{name}`" in str(info.value)
    assert "--ignore-unexpected-tensors" in str(info.value)


def test_ignore_unexpected_lists_them_and_skip_rules_count_theirs(tiny_moe: Path, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(tiny_moe, tmp_path / "ckpt")
    name = "model.language_model.layers.0.mlp.extra_bias"
    add_tensor(ckpt, name, torch.zeros(3))
    config = ModelConfig.from_pretrained(ckpt)
    model = Qwen35Model(config, torch.float32, "cpu")
    report = load_checkpoint(model, config, ckpt, ignore_unexpected=True)
    assert report.unexpected == [name]
    assert set(report.skipped_by_rule) == {"mtp", "vision"}
    assert sum(report.skipped_by_rule.values()) == len(report.skipped)
    assert all(n.startswith(("mtp.", "model.visual.")) for n in report.skipped)
    assert "1 unexpected ignored" in report.summary()


def test_a_skip_rule_removed_makes_its_tensors_unexpected(tiny_dense: Path) -> None:
    """The vision rule is one named entry: a loader that builds the tower passes the rules without it."""
    config = ModelConfig.from_pretrained(tiny_dense)
    model = Qwen35Model(config, torch.float32, "cpu")
    with pytest.raises(CheckpointError, match=r"unexpected tensor `model\.visual\."):
        load_checkpoint(model, config, tiny_dense, skip_rules=(MTP_RULE,))


def edit_config(src: Path, dst: Path, edit: callable) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    edit(config)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda c: c.update(architectures=["LlamaForCausalLM"]), "architectures"),
        (lambda c: c.update(model_type="llama", architectures=[]), "model_type"),
        (lambda c: c["text_config"].update(linear_num_value_heads="4"), "text_config.linear_num_value_heads"),
        (lambda c: c["text_config"].update(layer_types=["linear_attention"] * 3), "text_config.layer_types"),
        (lambda c: c["text_config"].update(linear_num_value_heads=3), "text_config.linear_num_value_heads"),
        (lambda c: c["text_config"].update(num_key_value_heads=3), "text_config.num_key_value_heads"),
        (lambda c: c["text_config"]["rope_parameters"].update(mrope_section=[1, 1]),
         "text_config.rope_parameters.mrope_section"),
        (lambda c: c["text_config"].update(hidden_act="gelu"), "text_config.hidden_act"),
    ],
)  # fmt: skip
def test_bad_config_names_field_and_file(tiny_dense: Path, tmp_path: Path, edit: callable, field: str) -> None:
    ckpt = edit_config(tiny_dense, tmp_path / "ckpt", edit)
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_pretrained(ckpt)
    assert f"`{field}`" in str(info.value) and str(ckpt / "config.json") in str(info.value)


def test_layer_types_derived_when_absent(tiny_next: Path) -> None:
    config = ModelConfig.from_pretrained(tiny_next)
    assert config.family == "qwen3_next" and config.is_gdn_interleaved
    assert config.full_attention_layers == [3, 7]
    assert json.loads((tiny_next / "config.json").read_text()).get("layer_types") is None
