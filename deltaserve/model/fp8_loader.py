"""Reading block-FP8 tensors (docs/fp8.md) into Fp8Weight parameters: the loader's half of FP8 checkpoints.

A quantized `<module>.weight` is float8_e4m3fn [..., N, K] next to `<module>.weight_scale_inv`
[..., ceil(N/128), ceil(K/128)] (fp32 as transformers writes it; bf16 read too). The loader fuses and reorders
projection rows (q|k|v, Qwen3-Next's de-interleaved qkvz, per-expert gate|up) and slices them per rank with the same
row operations it applies to plain weights. So that those operations need no FP8 variant, `read_packed` returns one
uint8 tensor per slice: the weight's bytes [..., rows, K] followed by each row's scales as fp32 bytes
[..., rows, 4·ceil(K/128)]. Any row slice, concatenation or permutation keeps every row with its own scales, bit
for bit; `copy_packed` splits the result into the Fp8Weight's values and its (block or per-row) scale.

Columns are sliced only on 128-wide block boundaries (a row-parallel shard that would split a block is refused by
name). A module stored as FP8 that deltaserve keeps unquantized, or stored unquantized where the model holds an
Fp8Weight, is refused by name too.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from deltaserve.kernels.fp8 import FP8_DTYPE, GROUP, Fp8Weight
from deltaserve.model.checkpoint_files import CheckpointError

if TYPE_CHECKING:
    from deltaserve.model.checkpoint import Checkpoint

FP8_CODE = "F8_E4M3"  # safetensors' code for float8_e4m3fn
SCALE_CODES = ("F32", "BF16")
KEPT_UNQUANTIZED = (
    "lm_head, embeddings, norms, GDN in_proj_a / in_proj_b, the router (mlp.gate), shared_expert_gate, the vision "
    "tower and mtp.fc"
)


def scale_name(name: str) -> str:
    """The block-scale tensor of a quantized tensor (transformers' naming: `.weight` -> `.weight_scale_inv`)."""
    return name.removesuffix(".weight") + ".weight_scale_inv" if name.endswith(".weight") else name + "_scale_inv"


def _columns(index: tuple[slice, ...], ndim: int, cols: int) -> tuple[int, int]:
    """(start, stop) of the columns `index` selects (all when it does not reach the last dimension)."""
    if len(index) < ndim:
        return 0, cols
    start, stop, _ = index[-1].indices(cols)  # the loader's slices are contiguous
    return start, stop


def read_packed(ckpt: Checkpoint, name: str, index: tuple[slice, ...] | None) -> torch.Tensor:
    """The FP8 tensor `name` (or its slice `index`) with each row's fp32 scales appended, as uint8 bytes
    [..., rows, K + 4·ceil(K/128)] (the module docstring says why)."""
    info = ckpt.files.tensors[name]
    rows, cols = info.shape[-2], info.shape[-1]
    sname = scale_name(name)
    if not ckpt.has(sname):
        raise CheckpointError(
            f"{ckpt.files.shard_path(name)}: tensor `{name}` is float8_e4m3fn but its block scale `{sname}` is "
            "missing from the checkpoint"
        )
    scale_info = ckpt.files.tensors[sname]
    if scale_info.dtype not in SCALE_CODES:
        raise CheckpointError(
            f"{ckpt.files.shard_path(sname)}: tensor `{sname}` is stored as {scale_info.dtype}; block scales are "
            f"read as {' or '.join(SCALE_CODES)}"
        )
    ckpt.check_shape(sname, (*info.shape[:-2], math.ceil(rows / GROUP), math.ceil(cols / GROUP)))
    index = index or ()
    if ckpt.is_sharded and len(index) >= len(info.shape) - 1:
        # model/parallel.py refuses, by config field, a split that is not block-aligned; this names the tensor
        # should a layout reach here with one all the same
        row_start, row_stop, _ = index[len(info.shape) - 2].indices(rows)
        if row_start % GROUP or (row_stop % GROUP and row_stop != rows):
            raise CheckpointError(
                f"{ckpt.files.shard_path(name)}: tensor `{name}`: this rank's rows {row_start}:{row_stop} split a "
                f"{GROUP}-row block of its FP8 scales"
            )
    start, stop = _columns(index, len(info.shape), cols)
    if start % GROUP or (stop % GROUP and stop != cols):
        raise CheckpointError(
            f"{ckpt.files.shard_path(name)}: tensor `{name}`: this rank's columns {start}:{stop} split a "
            f"{GROUP}-wide block of its FP8 scales; choose a --tensor-parallel-size whose shards are multiples of "
            f"{GROUP} columns"
        )
    q = ckpt.read(name, index if index else None)  # [..., rows', cols'] float8_e4m3fn
    scale = ckpt.read(sname).float()  # [..., ceil(N/128), ceil(K/128)], small: read whole
    per_row = scale.repeat_interleave(GROUP, dim=-2)[..., :rows, :]  # [..., N, ceil(K/128)]
    scale_index = (*index[: len(info.shape) - 1], slice(start // GROUP, math.ceil(stop / GROUP)))
    per_row = per_row[scale_index].contiguous()
    return torch.cat([q.contiguous().view(torch.uint8), per_row.view(torch.uint8)], dim=-1)


def refuse_unquantized(ckpt: Checkpoint, name: str) -> None:
    """A projection the block-FP8 format quantizes, stored unquantized: refused by name."""
    dtype = ckpt.files.tensors[name].dtype
    raise CheckpointError(
        f"{ckpt.files.shard_path(name)}: tensor `{name}` is stored unquantized ({dtype}), but in a block-FP8 "
        "checkpoint deltaserve serves this projection in FP8 (a module listed in the quantization_config's "
        f"modules_to_not_convert must be one Qwen's releases keep unquantized: {KEPT_UNQUANTIZED})"
    )


def copy_packed(ckpt: Checkpoint, param: torch.Tensor | Fp8Weight, value: torch.Tensor, name: str) -> None:
    """Fills an Fp8Weight from read_packed's bytes (fused and sliced by the loader); refuses, by name, an FP8 tensor
    for a module deltaserve keeps unquantized and an unquantized one where the model holds an Fp8Weight."""
    sources, ckpt.recent = ckpt.recent, []
    where = ckpt.files.shard_path(sources[0]) if sources else ckpt.files.where
    if not isinstance(param, Fp8Weight):
        raise CheckpointError(
            f"{where}: tensor `{name}` is stored as float8_e4m3fn, but deltaserve keeps this module unquantized, as "
            f"Qwen's -FP8 releases do ({KEPT_UNQUANTIZED})"
        )
    if value.dtype != torch.uint8:
        raise CheckpointError(
            f"{where}: tensor `{name}` is stored unquantized ({str(value.dtype).removeprefix('torch.')}), but in a "
            "block-FP8 checkpoint deltaserve serves this projection in FP8 (a module listed in the "
            "quantization_config's modules_to_not_convert must be one Qwen's releases keep unquantized: "
            f"{KEPT_UNQUANTIZED})"
        )
    cols = param.weight.shape[-1]
    groups = math.ceil(cols / GROUP)
    expected = (*param.weight.shape[:-1], cols + 4 * groups)
    if tuple(value.shape) != expected:
        raise CheckpointError(
            f"tensor `{name}` gives shape {[*value.shape[:-1], cols]} after fusing, expected {list(param.weight.shape)}"
        )
    q = value[..., :cols].contiguous().view(FP8_DTYPE)  # [..., N, K]
    per_row = value[..., cols:].contiguous().view(torch.float32)  # [..., N, G]
    if bool(((q.view(torch.uint8) & 0x7F) == 0x7F).any()) or not bool(torch.isfinite(per_row).all()):
        # e4m3fn has no inf: 0x7F / 0xFF are its NaNs
        raise CheckpointError(f"{where}: tensor `{name}` holds NaN values or non-finite scales: the checkpoint is "
                              "corrupt, and would serve garbage")  # fmt: skip
    scale = per_row
    if param.block_n != 1:
        scale = per_row[..., :: param.block_n, :]  # [..., ceil(N/128), G]
        if not torch.equal(scale.repeat_interleave(param.block_n, dim=-2)[..., : q.shape[-2], :], per_row):
            raise CheckpointError(
                f"{where}: tensor `{name}`: a {param.block_n}-row block of the fused weight holds rows of different "
                "scale blocks"
            )
    param.weight.data.copy_(q)
    param.scale.data.copy_(scale)
