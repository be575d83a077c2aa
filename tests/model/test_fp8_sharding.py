"""Issue 37, tensor parallelism: block-FP8 weights shard on 128-aligned boundaries. In one process (no collectives
run, as tests/model/test_sharding.py): on FP8 checkpoints whose every split is a whole number of scale blocks at
two ranks (dense, MoE, Qwen3-Next's interleaved GDN), each rank's Fp8Weights hold exactly its slices of the
one-rank model's values and scales; a split that would cut a scale block is refused by the config field."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deltaserve.config import ModelConfig
from deltaserve.kernels.fp8 import Fp8Weight
from deltaserve.model.checkpoint import Checkpoint
from deltaserve.model.checkpoint_files import CheckpointError
from deltaserve.model.mtp import MTP_PREFIX
from deltaserve.model.parallel import LocalShapes, ShardingError
from deltaserve.tiny.fp8 import write_fp8_checkpoint

from ._hf_tiny import build
from .test_sharding import _rank_model, expected_slice

# widths whose halves are multiples of 128: heads of 128, two KV heads, two GDN key heads, four value heads
ALIGNED = {
    "hidden_size": 256,
    "head_dim": 128,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 256,
    "shared_expert_intermediate_size": 256,
    "num_hidden_layers": 4,
}


@pytest.fixture(scope="module")
def aligned_fp8(tmp_path_factory: pytest.TempPathFactory, tiny_dense: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8-aligned")
    return {
        kind: write_fp8_checkpoint(
            _with_mtp_layer(build(kind, root / f"{kind}-bf16", tiny_dense, **ALIGNED)), root / kind
        )
        for kind in ("dense", "moe", "next")
    }


def _with_mtp_layer(folder: Path) -> Path:
    """The bf16 checkpoint with an MTP layer as the releases store it: `mtp.layers.0.*` a copy of the last (full
    attention) decoder layer's tensors, fc [H, 2H] and the three norms new, and one MTP layer declared (Qwen3-Next:
    num_nextn_predict_layers). Served only when built (speculative decoding); skipped otherwise."""
    path = folder / "model.safetensors"
    tensors = load_file(path)
    config = json.loads((folder / "config.json").read_text())
    last = f"model.layers.{config['num_hidden_layers'] - 1}."
    tensors |= {MTP_PREFIX + "layers.0." + n.removeprefix(last): t.clone() for n, t in tensors.items() if last in n}
    hidden = config["hidden_size"]
    generator = torch.Generator().manual_seed(0)
    tensors[MTP_PREFIX + "fc.weight"] = torch.randn(hidden, 2 * hidden, generator=generator) * 0.05
    for norm in ("norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden"):
        tensors[f"{MTP_PREFIX}{norm}.weight"] = torch.randn(hidden, generator=generator) * 0.1
    save_file(tensors, str(path), metadata={"format": "pt"})
    field = "num_nextn_predict_layers" if config["model_type"] == "qwen3_next" else "mtp_num_hidden_layers"
    (folder / "config.json").write_text(json.dumps({**config, field: 1}))
    return folder


def _fp8_weights(model: torch.nn.Module) -> dict[str, Fp8Weight]:
    return {name: m for name, m in model.named_modules() if isinstance(m, Fp8Weight)}


def _assert_rank_slices(
    ranked: dict[str, Fp8Weight], whole: dict[str, Fp8Weight], config: ModelConfig, rank: int
) -> None:
    """Rank `rank` of 2 holds every weight of the one-rank model, each its block-aligned slice: the block layout
    survives the split (every part of every rank is whole blocks)."""
    shapes = LocalShapes.of(config, rank, 2)
    assert set(ranked) == set(whole)
    for name, weight in ranked.items():
        assert weight.block_n == 128, name
        expected = expected_slice(name, whole[name].dequantize(), config, shapes)
        assert torch.equal(weight.dequantize(), expected), f"rank {rank}: {name}"


@pytest.mark.parametrize("kind", ["dense", "moe", "next"])
def test_every_rank_holds_its_blocks(kind: str, aligned_fp8: dict[str, Path]) -> None:
    folder = aligned_fp8[kind]
    config = ModelConfig.from_pretrained(folder)
    whole = _fp8_weights(_rank_model(folder, 0, 1))
    assert len(whole) >= 4 * config.num_hidden_layers
    for rank in range(2):
        _assert_rank_slices(_fp8_weights(_rank_model(folder, rank, 2)), whole, config, rank)


@pytest.mark.parametrize("kind", ["dense", "moe", "next"])
def test_every_rank_holds_its_blocks_of_the_mtp_layer(kind: str, aligned_fp8: dict[str, Path]) -> None:
    """The MTP layer of an FP8 checkpoint (attention and MLP / experts in FP8, fc plain) shards as the target's
    attention layers: every rank's MTP Fp8Weights are its block-aligned slices of the one-rank model's."""
    folder = aligned_fp8[kind]
    config = ModelConfig.from_pretrained(folder)
    whole = {n: w for n, w in _fp8_weights(_rank_model(folder, 0, 1, build_mtp=True)).items() if n.startswith("mtp.")}
    assert len(whole) >= 4, sorted(whole)
    for rank in range(2):
        model = _rank_model(folder, rank, 2, build_mtp=True)
        assert not isinstance(model.mtp.fc, Fp8Weight)
        _assert_rank_slices({n: w for n, w in _fp8_weights(model).items() if n.startswith("mtp.")}, whole, config, rank)


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        ({"head_dim": 32}, "`num_attention_heads` (4) split over --tensor-parallel-size 2 gives each rank 64 o_proj"),
        ({"head_dim": 64}, "`num_key_value_heads` (2) split over --tensor-parallel-size 2 gives each rank 64 k_proj"),
        ({"moe_intermediate_size": 128}, "`moe_intermediate_size` (128) split over --tensor-parallel-size 2"),
        ({"linear_value_head_dim": 32}, "`linear_num_value_heads` (4)"),
    ],
)
def test_a_split_that_cuts_a_scale_block_is_refused_by_field(
    edit: dict[str, int], field: str, aligned_fp8: dict[str, Path]
) -> None:
    config = dataclasses.replace(ModelConfig.from_pretrained(aligned_fp8["moe"]), **edit)
    LocalShapes.of(config, 0, 1)  # one rank splits nothing
    with pytest.raises(ShardingError) as info:
        LocalShapes.of(config, 1, 2)
    assert str(info.value).startswith(field) and "FP8 scale block (128)" in str(info.value), str(info.value)
    plain = dataclasses.replace(config, fp8=None)
    LocalShapes.of(plain, 1, 2)  # the same split of bf16 weights is served


def test_the_loader_names_a_rank_slice_that_splits_a_block(aligned_fp8: dict[str, Path]) -> None:
    """The loader's own check (behind parallel.py's, for a layout that reaches it all the same), by tensor name."""
    ckpt = Checkpoint(aligned_fp8["dense"])
    ckpt.is_sharded = True
    name = next(n for n in sorted(ckpt.weight_map) if n.endswith("o_proj.weight"))  # [256, 512]
    assert ckpt.get(name, (slice(128, 256),)).shape == (128, 512 + 4 * 4)  # whole blocks: values + scale bytes
    with pytest.raises(CheckpointError, match=rf"`{name}`: this rank's rows 64:192 split a 128-row block"):
        ckpt.get(name, (slice(64, 192),))
    with pytest.raises(CheckpointError, match=rf"`{name}`: this rank's columns 0:320 split a 128-wide block"):
        ckpt.get(name, (slice(None), slice(0, 320)))
