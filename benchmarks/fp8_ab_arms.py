"""The arms of benchmarks/fp8_ab.py: deltaserve's block-FP8 GEMM and fused MoE, and each field library's kernel for
the same op, called the way vLLM 0.26 serves it (docs/fp8.md#the-h200-plan).

An arm is found by importing its library; one that does not import is kept, with its import error, so the record
names every library that was missing and why. Each arm says whether its timed call includes the activation's
per-token-group quantization (bf16 in, bf16 out: every arm here does, as served) and `prepare` turns deltaserve's
Fp8Weight (float8_e4m3fn [N, K] and fp32 scales [ceil(N/128), ceil(K/128)]) into the operands the library takes,
outside the timing, as vLLM does once at load.

Dense arms (x [M, K] bf16 -> [M, N] bf16):
- deltaserve: kernels.linear with an Fp8Weight (the served path: quantize_activation_triton, then the Triton GEMM).
- vllm-cutlass: vLLM's per_token_group_quant_fp8 with column-major scales, then `_custom_ops.cutlass_scaled_mm(q,
  w.T, scale_a=s [M, K/128], scale_b=ws.T [K/128, N/128])`; what vLLM 0.26 serves on an H200 without DeepGEMM
  (its order on SM90: FlashInfer+DeepGEMM, DeepGEMM, CUTLASS, Triton; the first two need DeepGEMM, which the
  vLLM 0.26 wheel vendors as `vllm.third_party.deep_gemm`, JIT-compiling its kernels on first use).
- vllm-triton: per_token_group_quant_fp8 with row-major scales, then `w8a8_triton_block_scaled_mm` (its tuned
  table when vLLM ships one for N, K on the H200, else its default tile).
- flashinfer: `flashinfer.gemm.fp8_blockscale_gemm_sm90(x_bf16, w, None, ws)`, which quantizes the activation
  itself (vLLM's choice for M < 32 when DeepGEMM is present; SM90 only, JIT-built by nvcc on first use).
- deepgemm: vLLM's DeepGEMM path: column-major TMA-aligned activation scales, then `deep_gemm.fp8_gemm_nt`.

MoE arms (x [T, H], top-k routing -> [T, H]):
- deltaserve: kernels.fused_moe with FP8 experts (quantization, two grouped GEMMs, the weighted sum).
- vllm-triton: vLLM's Triton `fused_experts` with `fp8_w8a8_moe_quant_config(block_shape=[128, 128])` (its shipped
  H200 table where one exists for E, N = I).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deltaserve.kernels.fp8 import GROUP, Fp8Weight

Importer = Callable[[str], Any]
BLOCK = [GROUP, GROUP]  # the checkpoints' weight_block_size


@dataclass
class Arm:
    """One implementation of an op. `error` set: the library did not import (or lacks the entry point)."""

    name: str
    op: str  # "dense" or "moe"
    library: str
    quantizes_activation: bool  # the timed call includes the activation's per-token-group quantization
    what: str
    prepare: Callable[..., Any] | None = None  # (Fp8Weight[, Fp8Weight]) -> the library's operands
    call: Callable[..., torch.Tensor] | None = None  # (inputs, prepared) -> output
    error: str | None = None

    @property
    def available(self) -> bool:
        return self.error is None

    def describe(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "library": self.library,
            "available": self.available,
            "error": self.error,
            "includes_activation_quant": self.quantizes_activation,
            "what": self.what,
        }


def _missing(arm: Arm, exc: BaseException) -> Arm:
    arm.error = f"not installed: {type(exc).__name__}: {exc}"[:300]
    arm.prepare = arm.call = None
    return arm


def _version(importer: Importer, module: str) -> str:
    try:
        return str(getattr(importer(module), "__version__", "(version unknown)"))
    except Exception:  # the arm itself records the import error
        return "(not importable)"


def dense_arms(importer: Importer = importlib.import_module) -> list[Arm]:
    """deltaserve's dense block-FP8 linear and every library arm, importable or not (in the record's order)."""
    from deltaserve.kernels import linear

    arms = [
        Arm(
            "deltaserve",
            "dense",
            "deltaserve",
            True,
            "kernels.linear(x, Fp8Weight): quantize_activation_triton + the Triton block-FP8 GEMM",
            prepare=lambda w: w,
            call=lambda x, w: linear(x, w),
        )
    ]
    vllm = _version(importer, "vllm")
    cutlass = Arm("vllm-cutlass", "dense", f"vllm {vllm}", True, "per_token_group_quant_fp8 (column-major scales) + "
                  "_custom_ops.cutlass_scaled_mm(q, w.T, scale_a, scale_b=ws.T)")  # fmt: skip
    triton = Arm("vllm-triton", "dense", f"vllm {vllm}", True, "per_token_group_quant_fp8 + "
                 "w8a8_triton_block_scaled_mm(q, w, s, ws, [128, 128])")  # fmt: skip
    try:
        ops = importer("vllm._custom_ops")
        fp8u = importer("vllm.model_executor.layers.quantization.utils.fp8_utils")
        supported = importer("vllm.model_executor.layers.quantization.utils.w8a8_utils").CUTLASS_BLOCK_FP8_SUPPORTED
    except Exception as exc:
        arms += [_missing(cutlass, exc), _missing(triton, exc)]
    else:

        def cutlass_call(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
            q, s = fp8u.per_token_group_quant_fp8(x, GROUP, column_major_scales=True, use_ue8m0=False)
            return ops.cutlass_scaled_mm(q, w.weight.T, scale_a=s, scale_b=w.scale.T, out_dtype=x.dtype)

        def triton_call(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
            q, s = fp8u.per_token_group_quant_fp8(x, GROUP, column_major_scales=False, use_ue8m0=False)
            return fp8u.w8a8_triton_block_scaled_mm(q, w.weight, s, w.scale, BLOCK, x.dtype)

        cutlass.prepare, cutlass.call = (lambda w: w), cutlass_call
        if not supported:
            cutlass.error = "vLLM reports CUTLASS_BLOCK_FP8_SUPPORTED = False on this device"
        triton.prepare, triton.call = (lambda w: w), triton_call
        arms += [cutlass, triton]
    flashinfer = Arm("flashinfer", "dense", f"flashinfer {_version(importer, 'flashinfer')}", True,
                     "flashinfer.gemm.fp8_blockscale_gemm_sm90(x_bf16, w, None, ws): quantizes x itself")  # fmt: skip
    try:
        fp8_blockscale_gemm_sm90 = importer("flashinfer.gemm").fp8_blockscale_gemm_sm90
    except Exception as exc:
        arms.append(_missing(flashinfer, exc))
    else:
        flashinfer.prepare = lambda w: w
        flashinfer.call = lambda x, w: fp8_blockscale_gemm_sm90(x, w.weight, None, w.scale, out_dtype=x.dtype)
        arms.append(flashinfer)
    arms.append(_deepgemm_arm(importer))
    return arms


def _deepgemm_arm(importer: Importer) -> Arm:
    arm = Arm("deepgemm", "dense", f"deep_gemm {_version(importer, 'deep_gemm')}", True, "vLLM's DeepGEMM path: "
              "per_token_group_quant_fp8 (column-major, TMA-aligned scales) + deep_gemm.fp8_gemm_nt")  # fmt: skip
    try:
        try:  # vLLM's own order: an installed deep_gemm first, then the copy the vLLM 0.26 wheel vendors
            importer("deep_gemm")
        except ImportError as missing:
            try:
                importer("vllm.third_party.deep_gemm")
            except ImportError:
                raise missing from None  # neither: the record names the package
            arm.library = f"deep_gemm vendored in vllm {_version(importer, 'vllm')}"
        fp8u = importer("vllm.model_executor.layers.quantization.utils.fp8_utils")
        dg = importer("vllm.utils.deep_gemm")
    except Exception as exc:
        return _missing(arm, exc)

    def prepare(w: Fp8Weight) -> tuple[torch.Tensor, torch.Tensor]:
        return fp8u.deepgemm_post_process_fp8_weight_block(w.weight, w.scale, tuple(BLOCK), use_e8m0=False)

    def call(x: torch.Tensor, w: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        q, s = fp8u.per_token_group_quant_fp8(
            x, GROUP, column_major_scales=True, tma_aligned_scales=True, use_ue8m0=False
        )
        out = torch.empty(x.shape[0], w[0].shape[0], dtype=x.dtype, device=x.device)
        dg.fp8_gemm_nt((q, s), w, out, is_deep_gemm_e8m0_used=False)
        return out

    arm.prepare, arm.call = prepare, call
    return arm


def moe_arms(importer: Importer = importlib.import_module) -> list[Arm]:
    """deltaserve's fused MoE with FP8 experts and vLLM's Triton fused_experts (fp8_w8a8, block [128, 128])."""
    from deltaserve.kernels import fused_moe

    ours = Arm(
        "deltaserve",
        "moe",
        "deltaserve",
        True,
        "kernels.fused_moe(x, w13, w2, topk_weights, topk_ids) with Fp8Weight experts",
        prepare=lambda w13, w2: (w13, w2),
        call=lambda s, w: fused_moe(s[0], w[0], w[1], s[1], s[2]),
    )
    vllm = Arm("vllm-triton", "moe", f"vllm {_version(importer, 'vllm')}", True, "fused_experts(x, w13, w2, "
               "topk_weights, topk_ids int32, fp8_w8a8_moe_quant_config(block_shape=[128, 128]))")  # fmt: skip
    try:
        fused_experts = importer("vllm.model_executor.layers.fused_moe.fused_moe").fused_experts
        quant_config = importer("vllm.model_executor.layers.fused_moe.config").fp8_w8a8_moe_quant_config
    except Exception as exc:
        return [ours, _missing(vllm, exc)]

    def prepare(w13: Fp8Weight, w2: Fp8Weight) -> tuple[torch.Tensor, torch.Tensor, Any]:
        return w13.weight, w2.weight, quant_config(w1_scale=w13.scale, w2_scale=w2.scale, block_shape=BLOCK)

    def call(s: tuple[torch.Tensor, ...], w: tuple[Any, ...]) -> torch.Tensor:
        return fused_experts(s[0], w[0], w[1], s[1], s[3], quant_config=w[2])  # s[3]: the int32 ids vLLM routes with

    vllm.prepare, vllm.call = prepare, call
    return [ours, vllm]


def moe_config_file(importer: Importer, experts: int, inter: int) -> dict[str, Any] | None:
    """The tuned table vLLM's fused MoE looks up for (E, N = I, fp8_w8a8, [128, 128]) on this device, and whether
    vLLM ships it (else it runs its default tile)."""
    try:
        module = importer("vllm.model_executor.layers.fused_moe.fused_moe")
        name = module.get_config_file_name(experts, inter, "fp8_w8a8", BLOCK)
    except Exception:
        return None
    return {"file": name, "shipped": (Path(module.__file__).parent / "configs" / name).is_file()}


def dense_config_file(importer: Importer, rows: int, cols: int) -> dict[str, Any] | None:
    """The tuned table vLLM's w8a8_triton_block_scaled_mm looks up for (N, K), and whether vLLM ships it."""
    try:
        fp8u = importer("vllm.model_executor.layers.quantization.utils.fp8_utils")
        device = fp8u.get_device_name_as_file_name()
    except Exception:
        return None
    name = f"N={rows},K={cols},device_name={device},dtype=fp8_w8a8,block_shape=[128,128].json"
    return {"file": name, "shipped": (Path(fp8u.__file__).parent / "configs" / name).is_file()}
