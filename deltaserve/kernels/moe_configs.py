"""Launch configurations of the MoE kernels per token bucket: committed tuning tables, no run-time autotuning.

A table (`configs/moe_E{E}_I{I}_H{H}_k{k}_{dtype}_{device}.json`, written by benchmarks/tune_moe.py on the
device it names) maps each power-of-two token bucket to one configuration:

- `path`: "decode" (moe_decode_triton: the router, the routed and the shared experts of a layer in three
  launches, no alignment; for small batches) or "grouped" (moe_triton: tokens sorted by expert, grouped GEMMs).
- `block_m`: rows per expert block of the grouped path.
- `gemm1` / `gemm2`: BLOCK_N, BLOCK_K, num_warps, num_stages of the two GEMM kernels of that path; the decode
  path's gemm2 also reads CHOICES_PER_PROGRAM (0, the default and what a table without the field means: each
  program runs all k choices of its token; 1, 2, 4: the choices split over programs and summed by a combine
  launch); its gemm1 reads ROUTE_ROWS (16, the default: the in-kernel routing runs on the dot tile's max(16,
  next_pow2(T)) rows; 1: on next_pow2(T) rows). Written to the JSON only when not at their defaults. How the
  tables are tuned and what they chose: docs/kernels.md#tuned-configs.

A batch of T tokens takes the bucket next_pow2(T) (the engine's start-up warm-up runs every power of two up to
its largest step, and the decode graphs capture each of their sizes, so no bucket first compiles while
serving); above the largest bucket the largest one applies. Shapes or devices without a table get
`default_config`, a heuristic that is valid everywhere (a fixed small-batch config, BLOCK_M from the mean
rows per expert).
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from deltaserve.kernels._triton import next_pow2

CONFIG_DIR = Path(__file__).parent / "configs"
PATHS = ("decode", "grouped")
# The decode path keeps every token of the batch in one row tile (rows = tokens using an expert).
DECODE_MAX_TOKENS = 64


# GemmConfig's decode-path variant fields (tuned choices): written to a table only away from their defaults
VARIANT_FIELDS = ("CHOICES_PER_PROGRAM", "ROUTE_ROWS")


@dataclass(frozen=True)
class GemmConfig:
    """One GEMM launch: output columns and reduction step per program, warps and pipeline stages; for the
    decode path's down GEMM, how many of a token's choices one program runs (0: all, in one program); for its
    gate/up GEMM, the fewest token rows of the in-kernel routing tile (16: the dot tile's)."""

    BLOCK_N: int
    BLOCK_K: int
    num_warps: int = 4
    num_stages: int = 3
    CHOICES_PER_PROGRAM: int = 0
    ROUTE_ROWS: int = 16

    def __post_init__(self) -> None:
        if self.CHOICES_PER_PROGRAM < 0:
            raise ValueError(f"GemmConfig CHOICES_PER_PROGRAM must be >= 0, got {self.CHOICES_PER_PROGRAM}")
        if self.ROUTE_ROWS < 1 or self.ROUTE_ROWS & (self.ROUTE_ROWS - 1):
            raise ValueError(f"GemmConfig ROUTE_ROWS must be a power of two, got {self.ROUTE_ROWS}")

    def launch(self) -> dict[str, int]:
        return {"BLOCK_N": self.BLOCK_N, "BLOCK_K": self.BLOCK_K, "num_warps": self.num_warps,
                "num_stages": self.num_stages}  # fmt: skip

    def to_json(self) -> dict[str, int]:
        """The JSON form; the decode-path variant fields only when not at their defaults, so tables without
        the variants stay as they were."""
        data = asdict(self)
        for field in fields(self):
            if field.name in VARIANT_FIELDS and data[field.name] == field.default:
                del data[field.name]
        return data


@dataclass(frozen=True)
class MoEConfig:
    """What one token bucket runs: the path and each of its GEMMs' launch config."""

    path: str
    gemm1: GemmConfig
    gemm2: GemmConfig
    block_m: int = 16

    def __post_init__(self) -> None:
        if self.path not in PATHS:
            raise ValueError(f"MoE config path must be one of {PATHS}, got {self.path!r}")
        if self.block_m not in (16, 32, 64, 128):
            raise ValueError(f"MoE config block_m must be 16, 32, 64 or 128, got {self.block_m}")

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "block_m": self.block_m, "gemm1": self.gemm1.to_json(),
                "gemm2": self.gemm2.to_json()}  # fmt: skip

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MoEConfig:
        return cls(
            path=data["path"],
            block_m=int(data.get("block_m", 16)),
            gemm1=GemmConfig(**data["gemm1"]),
            gemm2=GemmConfig(**data["gemm2"]),
        )


def bucket_of(num_tokens: int) -> int:
    """The power-of-two token bucket a batch of num_tokens tokens takes its config from."""
    return next_pow2(num_tokens)


def device_tag(name: str) -> str:
    """A file-name-safe device name: 'NVIDIA H200' -> 'NVIDIA_H200'."""
    return "".join(c if c.isalnum() else "_" for c in name).strip("_")


def table_name(num_experts: int, inter: int, hidden: int, top_k: int, dtype: torch.dtype, device_name: str) -> str:
    dtype_name = str(dtype).removeprefix("torch.")
    return f"moe_E{num_experts}_I{inter}_H{hidden}_k{top_k}_{dtype_name}_{device_tag(device_name)}.json"


@functools.cache
def _load(path: Path) -> dict[int, MoEConfig] | None:
    if not path.is_file():
        return None
    return parse_table(json.loads(path.read_text()), str(path))


def parse_table(data: dict[str, Any], where: str = "table") -> dict[int, MoEConfig]:
    """{"buckets": {"1": {...}, "2": {...}}} -> {1: MoEConfig, ...}; buckets must be powers of two."""
    buckets: dict[int, MoEConfig] = {}
    for key, value in data["buckets"].items():
        bucket = int(key)
        if bucket < 1 or bucket & (bucket - 1):
            raise ValueError(f"{where}: bucket {key} is not a power of two")
        config = MoEConfig.from_json(value)
        if config.path == "decode" and bucket > DECODE_MAX_TOKENS:
            raise ValueError(f"{where}: bucket {key} takes the decode path, which holds at most {DECODE_MAX_TOKENS}")
        buckets[bucket] = config
    if not buckets:
        raise ValueError(f"{where}: no buckets")
    return dict(sorted(buckets.items()))


def load_table(
    num_experts: int, inter: int, hidden: int, top_k: int, dtype: torch.dtype, device_name: str
) -> dict[int, MoEConfig] | None:
    """The committed table for this shape and device, or None."""
    return _load(CONFIG_DIR / table_name(num_experts, inter, hidden, top_k, dtype, device_name))


def lookup(table: dict[int, MoEConfig], num_tokens: int) -> MoEConfig:
    """The config of num_tokens' bucket; above the largest bucket, the largest one's."""
    bucket = bucket_of(num_tokens)
    if bucket in table:
        return table[bucket]
    larger = [b for b in table if b >= bucket]
    return table[min(larger)] if larger else table[max(table)]


def default_config(num_tokens: int, num_experts: int, top_k: int) -> MoEConfig:
    """Valid at every shape: the decode path up to 8 tokens; above, the grouped path with BLOCK_M about the
    mean rows per expert and the small-batch GEMM config up to 512 entries (one prefill config beyond)."""
    bucket = bucket_of(num_tokens)
    if bucket <= 8:
        return MoEConfig("decode", GemmConfig(32, 128, 4, 4), GemmConfig(16, 128, 4, 1))
    num_entries = bucket * top_k
    block_m = int(min(64, max(16, next_pow2(num_entries // max(num_experts, 1)))))  # a power of two: tl.arange
    if num_entries <= 512:
        small = GemmConfig(32, 128, 4, 4)
        return MoEConfig("grouped", small, small, block_m)
    return MoEConfig("grouped", GemmConfig(128, 64, 8, 4), GemmConfig(128, 64, 8, 4), block_m)


# Tables installed in-process (the tuner and benchmarks/decode_step.py --moe-table) win over committed files.
_INSTALLED: dict[tuple[int, int, int, int, str], dict[int, MoEConfig]] = {}


def shape_key(
    num_experts: int, inter: int, hidden: int, top_k: int, dtype: torch.dtype
) -> tuple[int, int, int, int, str]:
    return (num_experts, inter, hidden, top_k, str(dtype).removeprefix("torch."))


def install_table(data: dict[str, Any] | None, where: str = "installed table") -> tuple[int, int, int, int, str] | None:
    """Make a table (the JSON form, with its "shape") the one every device uses for its shape in this
    process; None clears every installed table. Returns the shape key."""
    if data is None:
        _INSTALLED.clear()
        return None
    shape = data["shape"]
    dtype = getattr(torch, shape["dtype"])
    key = shape_key(shape["num_experts"], shape["inter"], shape["hidden"], shape["top_k"], dtype)
    _INSTALLED[key] = parse_table(data, where)
    return key


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def config_for(
    num_tokens: int, num_experts: int, inter: int, hidden: int, top_k: int, dtype: torch.dtype, device: torch.device
) -> MoEConfig:
    """The config the MoE launchers use: an installed table's, else the committed table's when one exists for
    this shape and device, else the default."""
    installed = _INSTALLED.get(shape_key(num_experts, inter, hidden, top_k, dtype))
    if installed is not None:
        return lookup(installed, num_tokens)
    if device.type == "cuda":
        name = _device_name(device.index if device.index is not None else torch.cuda.current_device())
        table = load_table(num_experts, inter, hidden, top_k, dtype, name)
        if table is not None:
            return lookup(table, num_tokens)
    return default_config(num_tokens, num_experts, top_k)
