"""The files of a safetensors checkpoint, read without torch: the index, every shard's header, and the rules that
say which tensors deltaserve deliberately does not load.

CheckpointFiles resolves tensor -> shard (from model.safetensors.index.json, or from the headers of every
*.safetensors file), and checks, before any weight is read, that the index is valid JSON with a `weight_map`, that
every shard it names exists and holds the tensors it is said to hold, that no shard is truncated (its header's data
offsets run past the end of the file) and that every tensor is stored in a float dtype (or, in a block-FP8
checkpoint, as float8_e4m3fn where the format quantizes: FP8_PROJECTION). Each failure is one
CheckpointError naming the file and the tensor. Reading headers only (8 bytes + a JSON header per shard) keeps this
cheap enough to run before the server imports torch.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

INDEX_NAME = "model.safetensors.index.json"
# safetensors dtype codes -> element size in bytes
DTYPE_SIZES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2,
    "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "C64": 8,
}  # fmt: skip
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
# The projections Qwen's block-FP8 releases quantize (docs/fp8.md): full-attention q/k/v/o, GDN in_proj_qkv /
# in_proj_z (Qwen3-Next: in_proj_qkvz) / out_proj, dense-MLP, shared-expert and per-expert gate/up/down. Everything
# else (lm_head, embeddings, norms, in_proj_a/b/ba, the router, shared_expert_gate, ...) is kept unquantized.
FP8_PROJECTION = re.compile(
    r"^(.*\.)?(self_attn\.[qkvo]_proj|linear_attn\.(in_proj_qkvz|in_proj_qkv|in_proj_z|out_proj)"
    r"|mlp\.(shared_expert\.)?(gate|up|down)_proj|mlp\.experts\.\d+\.(gate|up|down)_proj)\.weight$"
)
# safetensors' own limit on the JSON header
MAX_HEADER_BYTES = 100 * 1024 * 1024


class CheckpointError(ValueError):
    """A checkpoint whose files or tensors deltaserve cannot load; the message names the file and the tensor."""


@dataclass(frozen=True)
class TensorInfo:
    shard: str  # file name relative to the checkpoint folder
    dtype: str  # safetensors code: BF16, F32, I8, ...
    shape: tuple[int, ...]


@dataclass(frozen=True)
class SkipRule:
    """Checkpoint tensors deliberately not loaded, by name prefix; the load report counts them under `name`."""

    name: str
    prefixes: tuple[str, ...]
    reason: str


# The vision tower's loader removes the "vision" rule when it builds the tower; the loader removes "mtp" when the
# model has its MTP layer (speculative decoding).
MTP_RULE = SkipRule("mtp", ("mtp.", "model.mtp."), "multi-token-prediction head, loaded for speculative decoding only")
VISION_RULE = SkipRule("vision", ("model.visual.", "visual."), "vision tower, not built (language model only)")
SKIP_RULES: tuple[SkipRule, ...] = (MTP_RULE, VISION_RULE)


def skip_rule_for(name: str, rules: tuple[SkipRule, ...]) -> SkipRule | None:
    return next((rule for rule in rules if name.startswith(rule.prefixes)), None)


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """name -> TensorInfo from one shard's header; CheckpointError naming the file if it is not a whole
    safetensors file (too short, a header that is not JSON, or tensor data that runs past the end)."""
    try:
        size = path.stat().st_size
        with path.open("rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, not even a header length)")
            header_len = int.from_bytes(prefix, "little")
            if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
                raise CheckpointError(
                    f"{path}: truncated or not a safetensors file (header length {header_len}, file size {size})"
                )
            raw = handle.read(header_len)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc.strerror or exc})") from exc
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not a safetensors file (its header is not valid JSON: {exc})") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a safetensors file (its header is not a JSON object)")
    data_len = size - 8 - header_len
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        tensors[name] = _tensor_info(path, name, entry, data_len)
    return tensors


def _tensor_info(path: Path, name: str, entry: Any, data_len: int) -> TensorInfo:
    try:
        dtype, shape, (begin, end) = entry["dtype"], tuple(int(d) for d in entry["shape"]), entry["data_offsets"]
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: header entry of tensor `{name}` is malformed ({entry!r})") from exc
    if end > data_len:
        raise CheckpointError(
            f"{path}: truncated: tensor `{name}` needs bytes {begin}..{end} of the data but the file holds {data_len}"
        )
    itemsize = DTYPE_SIZES.get(dtype)
    if itemsize is not None and end - begin != math.prod(shape) * itemsize:
        raise CheckpointError(
            f"{path}: tensor `{name}` ({dtype}, shape {list(shape)}) spans {end - begin} bytes, "
            f"not {math.prod(shape) * itemsize}"
        )
    return TensorInfo(path.name, dtype, shape)


class CheckpointFiles:
    """tensor name -> TensorInfo for a (possibly sharded) safetensors checkpoint, validated on construction."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = Path(model_dir)
        self.index_path = self.model_dir / INDEX_NAME
        self.has_index = self.index_path.is_file()
        self.tensors: dict[str, TensorInfo] = self._from_index() if self.has_index else self._from_shards()

    @property
    def weight_map(self) -> dict[str, str]:
        return {name: info.shard for name, info in self.tensors.items()}

    @property
    def where(self) -> Path:
        """The file that says which tensors exist: the index, or the folder when there is none."""
        return self.index_path if self.has_index else self.model_dir

    def shard_path(self, name: str) -> Path:
        return self.model_dir / self.tensors[name].shard

    def _from_index(self) -> dict[str, TensorInfo]:
        try:
            index = json.loads(self.index_path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{self.index_path}: not valid JSON ({exc})") from exc
        except OSError as exc:
            raise CheckpointError(f"{self.index_path}: cannot be read ({exc.strerror or exc})") from exc
        if not isinstance(index, dict) or "weight_map" not in index:
            raise CheckpointError(f"{self.index_path}: has no `weight_map` (the map from tensor name to shard file)")
        weight_map = index["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{self.index_path}: `weight_map` must map tensor names to shard file names")
        if not weight_map:
            raise CheckpointError(f"{self.index_path}: `weight_map` is empty")
        by_shard: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            by_shard.setdefault(shard, []).append(name)
        tensors = {}
        for shard, names in by_shard.items():
            path = self.model_dir / shard
            if not path.is_file():
                raise CheckpointError(
                    f"{self.index_path}: names shard {shard} (holding `{names[0]}` and {len(names) - 1} more), "
                    f"which is not in {self.model_dir}"
                )
            header = read_safetensors_header(path)
            for name in names:
                if name not in header:
                    raise CheckpointError(f"{path}: has no tensor `{name}`, which {INDEX_NAME} places in it")
                tensors[name] = header[name]
        return tensors

    def _from_shards(self) -> dict[str, TensorInfo]:
        shards = sorted(self.model_dir.glob("*.safetensors"))
        if not shards:
            others = sorted(p.name for p in self.model_dir.glob("*") if p.suffix in (".bin", ".pt", ".pth", ".gguf"))
            found = f" (found {', '.join(others[:3])}: deltaserve loads safetensors only)" if others else ""
            raise CheckpointError(f"{self.model_dir}: no *.safetensors files and no {INDEX_NAME}{found}")
        tensors: dict[str, TensorInfo] = {}
        for shard in shards:
            for name, info in read_safetensors_header(shard).items():
                if name in tensors:
                    raise CheckpointError(f"{shard}: tensor `{name}` is also in {tensors[name].shard}")
                tensors[name] = info
        return tensors

    def check_dtypes(self, skip_rules: tuple[SkipRule, ...] = SKIP_RULES, fp8: bool = False) -> None:
        """Every tensor that would be loaded is a float tensor, or with `fp8` (config.json's quantization_config is
        block FP8, docs/fp8.md) a float8_e4m3fn one, whose module the loader then checks. Integer tensors are
        quantized weights of formats config.py refuses."""
        for name, info in self.tensors.items():
            if skip_rule_for(name, skip_rules) is not None:
                continue
            if fp8 and info.dtype == "F8_E4M3" and not FP8_PROJECTION.match(name):
                raise CheckpointError(
                    f"{self.model_dir / info.shard}: tensor `{name}` is stored as F8_E4M3, but deltaserve keeps this "
                    "module unquantized, as Qwen's -FP8 releases do (lm_head, embeddings, norms, GDN in_proj_a / "
                    "in_proj_b, the router, shared_expert_gate, the vision tower, mtp.fc)"
                )
            if fp8 and info.dtype not in FLOAT_DTYPES and FP8_PROJECTION.match(name):
                continue
            if info.dtype not in FLOAT_DTYPES:
                what = (
                    "a block-FP8 checkpoint holds float tensors and F8_E4M3 projections only"
                    if fp8
                    else "config.json has no quantization_config; deltaserve loads float32 / float16 / bfloat16 "
                    "weights only"
                )
                raise CheckpointError(
                    f"{self.model_dir / info.shard}: tensor `{name}` is stored as {info.dtype}, but {what}"
                )
