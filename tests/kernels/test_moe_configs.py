"""The MoE tuning tables: every committed table parses, each bucket's config is the one the table (the tuning)
chose, every decode-step batch size resolves, and malformed tables are refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from deltaserve.kernels import moe_configs
from deltaserve.kernels.moe_configs import CONFIG_DIR, GemmConfig, MoEConfig

TABLES = sorted(CONFIG_DIR.glob("moe_*.json"))
# The decode-step benchmark's batch sizes (benchmarks/decode_step.py) and prefill-sized steps.
BATCHES = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 300, 512, 1000, 2048, 8192]


def test_a_table_is_committed_for_the_35b_a3b_shape_on_the_h200() -> None:
    names = {p.name for p in TABLES}
    assert "moe_E256_I512_H2048_k8_bfloat16_NVIDIA_H200.json" in names, names


@pytest.mark.parametrize("path", TABLES, ids=lambda p: p.name)
def test_each_bucket_resolves_to_the_config_the_table_chose(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = json.loads(path.read_text())
    shape = data["shape"]
    dtype = getattr(torch, shape["dtype"])
    assert path.name == moe_configs.table_name(
        shape["num_experts"], shape["inter"], shape["hidden"], shape["top_k"], dtype, shape["device"]
    ), "the file name must be the one moe_configs looks up for its shape and device"
    monkeypatch.setattr(moe_configs, "_device_name", lambda index: shape["device"])
    device = torch.device("cuda", 0)  # only its type and index are read

    def chosen(num_tokens: int) -> MoEConfig:
        return moe_configs.config_for(
            num_tokens, shape["num_experts"], shape["inter"], shape["hidden"], shape["top_k"], dtype, device
        )

    buckets = {int(k): MoEConfig.from_json(v) for k, v in data["buckets"].items()}
    for bucket, config in buckets.items():
        assert chosen(bucket) == config, f"bucket {bucket}"
    for num_tokens in BATCHES:
        bucket = moe_configs.bucket_of(num_tokens)
        expected = buckets[bucket] if bucket in buckets else buckets[max(buckets)]
        assert chosen(num_tokens) == expected, f"{num_tokens} tokens: expected bucket {bucket}"
        if chosen(num_tokens).path == "decode":
            assert num_tokens <= moe_configs.DECODE_MAX_TOKENS
    # a bucket is the whole power-of-two range: no batch size inside it picks another (constexpr) config
    for num_tokens in range(1, max(buckets) + 1, 7):
        assert chosen(num_tokens) == chosen(moe_configs.bucket_of(num_tokens))


def test_other_devices_and_shapes_take_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(moe_configs, "_device_name", lambda index: "Some Other GPU")
    cuda = torch.device("cuda", 0)
    for num_tokens in BATCHES:
        config = moe_configs.config_for(num_tokens, 256, 512, 2048, 8, torch.bfloat16, cuda)
        assert config == moe_configs.default_config(num_tokens, 256, 8)
        assert moe_configs.config_for(num_tokens, 256, 512, 2048, 8, torch.float32, torch.device("cpu")) == config


def test_an_installed_table_wins_and_can_be_cleared() -> None:
    data = json.loads(TABLES[0].read_text())
    data["buckets"] = {"1": {"path": "grouped", "block_m": 32, "gemm1": GemmConfig(64, 32).__dict__,
                             "gemm2": GemmConfig(16, 16).__dict__}}  # fmt: skip
    shape = data["shape"]
    dtype = getattr(torch, shape["dtype"])
    args = (shape["num_experts"], shape["inter"], shape["hidden"], shape["top_k"], dtype, torch.device("cpu"))
    try:
        moe_configs.install_table(data)
        assert moe_configs.config_for(5, *args) == MoEConfig("grouped", GemmConfig(64, 32), GemmConfig(16, 16), 32)
    finally:
        moe_configs.install_table(None)
    assert moe_configs.config_for(5, *args) == moe_configs.default_config(5, shape["num_experts"], shape["top_k"])


def test_default_block_m_is_constant_within_a_bucket() -> None:
    """block_m is a constexpr: if it changed inside a power-of-two bucket, a batch of a new size would compile a
    kernel while serving although the warm-up ran its bucket."""
    for num_experts in (8, 60, 256, 512):
        for num_tokens in range(1, 9000, 37):
            config = moe_configs.default_config(num_tokens, num_experts, 8)
            assert config == moe_configs.default_config(moe_configs.bucket_of(num_tokens), num_experts, 8)
            assert 16 <= config.block_m <= 64


def test_decode_variant_fields_round_trip_and_default_when_absent() -> None:
    """The tuned decode variants: CHOICES_PER_PROGRAM and ROUTE_ROWS survive the JSON form, are left out of it at their
    defaults (so a table without them reads as the kernels before the variants), and bad values are refused."""
    plain = {"BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 8, "num_stages": 1}
    variant = MoEConfig("decode", GemmConfig(32, 256, 4, 3, ROUTE_ROWS=1), GemmConfig(16, 128, 4, 1, 2))
    assert MoEConfig.from_json(variant.to_json()) == variant
    old = MoEConfig.from_json({"path": "decode", "gemm1": plain, "gemm2": plain})
    assert (old.gemm2.CHOICES_PER_PROGRAM, old.gemm1.ROUTE_ROWS) == (0, 16)
    assert old.to_json()["gemm2"] == plain and old.to_json()["gemm1"] == plain
    for bad in ({"CHOICES_PER_PROGRAM": -1}, {"ROUTE_ROWS": 3}, {"ROUTE_ROWS": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            GemmConfig(32, 256, **bad)


@pytest.mark.parametrize(
    ("buckets", "message"),
    [
        ({"3": {"path": "grouped"}}, "not a power of two"),
        ({"128": {"path": "decode"}}, "decode path, which holds at most 64"),
        ({"1": {"path": "sideways"}}, "path must be one of"),
        ({"1": {"path": "grouped", "block_m": 24}}, "block_m must be"),
        ({}, "no buckets"),
    ],
)
def test_malformed_tables_are_refused(buckets: dict, message: str) -> None:
    gemm = {"BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}
    full = {k: {"gemm1": gemm, "gemm2": gemm, **v} for k, v in buckets.items()}
    with pytest.raises(ValueError, match=message):
        moe_configs.parse_table({"buckets": full}, "bad.json")
