"""Tensor-parallel sharding, in one process (no collectives run): which slices a rank holds, the refusals by field,
and that every rank's loaded parameters are exactly its slices of the one-rank model's (fused) parameters, on
every checkpoint layout: Qwen3.5 flat GDN projections, Qwen3-Next's group-interleaved ones, fused and per-expert
experts, expert parallelism, replicated KV heads, attention biases and a vocabulary the ranks do not divide."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from deltaserve.config import ModelConfig
from deltaserve.model.loader import load_checkpoint
from deltaserve.model.parallel import LocalShapes, Shard, ShardingError, TensorParallel, kv_head_shard
from deltaserve.model.qwen3_5 import Qwen35Model
from deltaserve.tiny import make_tiny

from ._hf_tiny import build

_GROUP = object()  # stands in for a process group: loading runs no collective


def _rank_model(
    folder: Path, rank: int, size: int, expert_parallel: bool = False, build_mtp: bool = False
) -> Qwen35Model:
    config = ModelConfig.from_pretrained(folder)
    tp = TensorParallel(rank, size, rank, _GROUP, _GROUP, expert_parallel) if size > 1 else None  # type: ignore[arg-type]
    model = Qwen35Model(config, torch.float32, "cpu", tp=tp, build_mtp=build_mtp)
    report = load_checkpoint(model, config, folder)
    assert report.unexpected == []
    return model


def _rows(t: torch.Tensor, shard: Shard, unit: int, offset: int = 0, dim: int = 0) -> torch.Tensor:
    return t.narrow(dim, offset + shard.start * unit, shard.size * unit)


def expected_slice(name: str, full: torch.Tensor, config: ModelConfig, s: LocalShapes) -> torch.Tensor:
    """The oracle: rank `s`'s part of a one-rank (already fused) parameter, written from the parameter layouts."""
    leaf = name.rsplit(".", 1)[-1]
    d, dk, dv = config.head_dim, config.linear_key_head_dim, config.linear_value_head_dim
    if leaf in ("embed_tokens", "lm_head"):
        out = torch.zeros(s.vocab.size, full.shape[1])
        rows = full[s.vocab.start : s.vocab.stop]
        out[: rows.shape[0]] = rows
        return out
    if leaf in ("qkv_proj", "qkv_bias"):
        q_width, kv_width = 2 * config.num_attention_heads * d, config.num_key_value_heads * d
        return torch.cat(
            [
                _rows(full, s.q_heads, 2 * d),
                _rows(full, s.kv_heads, d, q_width),
                _rows(full, s.kv_heads, d, q_width + kv_width),
            ]
        )
    if leaf == "o_proj":
        return _rows(full, s.q_heads, d, dim=1)
    key_dim, num_v = config.linear_num_key_heads * dk, config.linear_num_value_heads
    if leaf in ("in_proj_qkvz", "conv1d"):
        parts = [
            _rows(full, s.k_heads, dk),
            _rows(full, s.k_heads, dk, key_dim),
            _rows(full, s.v_heads, dv, 2 * key_dim),
        ]
        if leaf == "in_proj_qkvz":
            parts.append(_rows(full, s.v_heads, dv, config.conv_dim))
        return torch.cat(parts)
    if leaf == "in_proj_ba":
        return torch.cat([_rows(full, s.v_heads, 1), _rows(full, s.v_heads, 1, num_v)])
    if leaf in ("A_log", "dt_bias"):
        return _rows(full, s.v_heads, 1)
    if leaf == "out_proj":
        return _rows(full, s.v_heads, dv, dim=1)
    if leaf in ("gate_up_proj", "down_proj"):
        width = s.shared_intermediate if ".shared_expert." in name else s.intermediate
        if leaf == "down_proj":
            return _rows(full, width, 1, dim=1)
        return torch.cat([_rows(full, width, 1), _rows(full, width, 1, width.total)])
    if leaf == "w13":
        experts = _rows(full, s.experts, 1)
        inter = s.moe_intermediate
        return torch.cat([_rows(experts, inter, 1, dim=1), _rows(experts, inter, 1, inter.total, dim=1)], dim=1)
    if leaf == "w2":
        return _rows(_rows(full, s.experts, 1), s.moe_intermediate, 1, dim=2)
    return full  # replicated: norms, q/k norms, the router, the shared expert's gate, the o_proj bias on rank 0


def assert_ranks_hold_their_slices(
    folder: Path, size: int, expert_parallel: bool = False, build_mtp: bool = False
) -> None:
    whole = dict(_rank_model(folder, 0, 1, build_mtp=build_mtp).named_parameters())
    config = ModelConfig.from_pretrained(folder)
    assert any(name.startswith("mtp.") for name in whole) == build_mtp
    for rank in range(size):
        model = _rank_model(folder, rank, size, expert_parallel, build_mtp)
        shapes = LocalShapes.of(config, rank, size, expert_parallel)
        params = dict(model.named_parameters())
        missing = set(whole) - set(params)
        # row-parallel: only rank 0 holds (and adds) o_proj's bias
        assert all(name.endswith(".o_bias") for name in missing) and (rank > 0 or not missing), missing
        assert set(params) <= set(whole)
        for name, param in params.items():
            expected = expected_slice(name, whole[name].data, config, shapes)
            assert torch.equal(param.data, expected), f"rank {rank}/{size}: {name}"


@pytest.mark.parametrize("variant", ["dense", "moe", "next"])
def test_every_rank_loads_exactly_its_slices(variant: str, tiny_dirs: dict[str, Path]) -> None:
    assert_ranks_hold_their_slices(tiny_dirs[variant], 2)


@pytest.mark.parametrize("variant", ["dense", "moe", "next"])
def test_every_rank_loads_exactly_its_slices_of_the_mtp_layer(variant: str, tiny_dirs: dict[str, Path]) -> None:
    """The MTP layer (model/mtp.py) shards as the target's attention layers: its decoder layer column / row
    parallel by head and width (fused and per-expert experts), fc and its norms replicated."""
    assert_ranks_hold_their_slices(tiny_dirs[variant], 2, build_mtp=True)
    if variant == "moe":
        assert_ranks_hold_their_slices(tiny_dirs[variant], 2, expert_parallel=True, build_mtp=True)


def test_expert_parallel_ranks_hold_whole_experts(tiny_moe: Path, tiny_next: Path, tmp_path: Path) -> None:
    assert_ranks_hold_their_slices(tiny_moe, 2, expert_parallel=True)  # fused 3-D experts
    assert_ranks_hold_their_slices(tiny_next, 2, expert_parallel=True)  # one tensor per expert


def test_replicated_kv_heads_biases_and_a_padded_vocabulary(tmp_path: Path, tiny_dense: Path) -> None:
    """One KV head for 2 and 4 ranks (replicated), attention biases (o_proj's on rank 0 only), and 1301 rows that
    neither 2 nor 4 ranks divide, on a checkpoint transformers itself wrote."""
    folder = build(
        "next", tmp_path / "mqa", tiny_dense, num_key_value_heads=1, attention_bias=True, vocab_size=1301,
        linear_num_key_heads=4, linear_num_value_heads=8, intermediate_size=96,
    )  # fmt: skip
    config = ModelConfig.from_pretrained(folder)
    assert LocalShapes.of(config, 3, 4).kv_heads == Shard(0, 1, 1)
    assert LocalShapes.of(config, 3, 4).vocab == Shard(978, 326, 1301)  # 3 padding rows past 1301
    for size in (2, 4):
        assert_ranks_hold_their_slices(folder, size)


def test_kv_heads_are_replicated_in_groups_of_ranks() -> None:
    assert [kv_head_shard(2, 4, r).start for r in range(4)] == [0, 0, 1, 1]  # ranks 0-1 hold head 0, 2-3 head 1
    assert [kv_head_shard(2, 8, r).start for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [kv_head_shard(4, 2, r) for r in range(2)] == [Shard(0, 2, 4), Shard(2, 2, 4)]


@pytest.mark.parametrize(
    ("edit", "size", "expert_parallel", "field"),
    [
        ({}, 3, False, "`num_attention_heads` (4)"),
        ({"num_attention_heads": 6, "num_key_value_heads": 2}, 3, False, "`num_key_value_heads` (2)"),
        ({"num_attention_heads": 8, "num_key_value_heads": 3}, 4, False, "not a multiple"),
        ({}, 4, False, "`linear_num_key_heads` (2)"),
        ({"linear_num_key_heads": 4, "linear_num_value_heads": 6}, 4, False, "`linear_num_value_heads` (6)"),
        ({"moe_intermediate_size": 30}, 4, False, None),
        ({"num_experts": 6}, 4, True, None),
    ],
)
def test_sizes_that_do_not_divide_are_refused_by_field(
    edit: dict, size: int, expert_parallel: bool, field: str | None, tiny_moe: Path
) -> None:
    config = ModelConfig.from_pretrained(tiny_moe)
    if field is None:  # the MoE widths: heads that 4 ranks divide, so the MoE field is the one refused
        edit = {**edit, "num_attention_heads": 8, "linear_num_key_heads": 4, "linear_num_value_heads": 8}
        field = "`num_experts` (6)" if expert_parallel else "`moe_intermediate_size` (30)"
    config = dataclasses.replace(config, **edit)
    with pytest.raises(ShardingError, match=field.replace("(", r"\(").replace(")", r"\)")):
        LocalShapes.of(config, 0, size, expert_parallel)


def test_one_rank_holds_everything(tiny_moe: Path) -> None:
    config = ModelConfig.from_pretrained(tiny_moe)
    shapes = LocalShapes.of(config)
    assert all(getattr(shapes, f.name).is_whole for f in dataclasses.fields(shapes))
    assert TensorParallel.single().gather_columns(torch.ones(2, 3)).shape == (2, 3)


def test_a_checkpoint_written_with_other_seeds_still_reassembles(tmp_path: Path) -> None:
    """Two shards per file and tied embeddings (the dense default), per-expert MoE with untied head: the slices
    come from the right files whatever the shard split."""
    folder = make_tiny(tmp_path / "d", "dense", seed=3, num_shards=3)
    assert_ranks_hold_their_slices(folder, 2)
    folder = make_tiny(tmp_path / "m", "moe", seed=4, expert_layout="per_expert", tie_word_embeddings=True)
    assert_ranks_hold_their_slices(folder, 2)
