"""Issue 37, tensor parallelism: block-FP8 weights shard on 128-aligned boundaries. In one process (no collectives
run, as tests/model/test_sharding.py): on FP8 checkpoints whose every split is a whole number of scale blocks at
two ranks (dense, MoE, Qwen3-Next's interleaved GDN), each rank's Fp8Weights hold exactly its slices of the
one-rank model's values and scales; a split that would cut a scale block is refused by the config field."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from deltaserve.config import ModelConfig
from deltaserve.kernels.fp8 import Fp8Weight
from deltaserve.model.checkpoint_files import CheckpointError
from deltaserve.model.loader import Checkpoint
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
        kind: write_fp8_checkpoint(build(kind, root / f"{kind}-bf16", tiny_dense, **ALIGNED), root / kind)
        for kind in ("dense", "moe", "next")
    }


def _fp8_weights(model: torch.nn.Module) -> dict[str, Fp8Weight]:
    return {name: m for name, m in model.named_modules() if isinstance(m, Fp8Weight)}


@pytest.mark.parametrize("kind", ["dense", "moe", "next"])
def test_every_rank_holds_its_blocks(kind: str, aligned_fp8: dict[str, Path]) -> None:
    folder = aligned_fp8[kind]
    config = ModelConfig.from_pretrained(folder)
    whole = _fp8_weights(_rank_model(folder, 0, 1))
    assert len(whole) >= 4 * config.num_hidden_layers
    for rank in range(2):
        ranked = _fp8_weights(_rank_model(folder, rank, 2))
        shapes = LocalShapes.of(config, rank, 2)
        assert set(ranked) == set(whole)
        for name, weight in ranked.items():
            # the block layout survives the split: every part of every rank is whole blocks
            assert weight.block_n == 128, name
            expected = expected_slice(name, whole[name].dequantize(), config, shapes)
            assert torch.equal(weight.dequantize(), expected), f"rank {rank}: {name}"


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
