"""Block-FP8 linear layers (docs/fp8.md): the weight type that carries a block scale, the per-token-group
activation quantization, and the block-FP8 GEMM, each with its plain-torch `*_ref` twin.

A quantized projection is an `Fp8Weight`: float8_e4m3fn values [..., N, K] and fp32 multipliers
[..., ceil(N/block_n), ceil(K/128)] (w ~ q * scale). block_n is 128, the checkpoint's block, unless the projection
fuses parts whose row counts are not multiples of 128 (the tiny checkpoints' q|k|v, or Qwen3-Next's de-interleaved
in_proj_qkvz at small head widths): a 128-row block would then straddle two parts with different scales, so such a
weight keeps one scale row per output row (block_n = 1). Both layouts give the same products.

The rounding points are vLLM's (per_token_group_quant_fp8 and its w8a8 block GEMM): an activation row is quantized
per group of 128 along K with scale = max(|x|, 1e-10) / 448 (fp32) and q = clamp(x / scale, +-448) rounded to e4m3;
the GEMM accumulates in fp32, per K block (q_x . q_w) * s_x * s_w, summed over the blocks in order, and rounds once
to the activation dtype; a bias is added after that rounding.

An activation can arrive already quantized, as `Fp8Rows` (the rows with their q and scale): the decoder's RMSNorms
of an FP8 model quantize their output in the same launch (`rms_norm_fp8`), so the projections after them, and the
shared expert and routed experts that read one normed row alike, launch no quantization of their own; so do the
SiLU-and-mul before a down projection, the attention's output gate before o_proj and the GDN's gated norm before
out_proj (`silu_and_mul_fp8`, `sigmoid_gate_mul_fp8`, `gated_rms_norm_fp8`; docs/fp8.md#decode). The quantization
is the one above applied to the rounded rows, so the products are the same.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from deltaserve.kernels._dispatch import use_triton
from deltaserve.kernels.activation import sigmoid_gate_mul_ref, silu_and_mul_ref
from deltaserve.kernels.norm import gated_rms_norm_ref, rms_norm_ref

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
GROUP = 128  # the K width of an activation group and of a weight block (quantization_config.weight_block_size)
AMAX_FLOOR = 1e-10  # vLLM's eps: an all-zero group gets a tiny scale instead of a division by zero


def fp8_block_rows(parts: tuple[int, ...]) -> int:
    """block_n of a projection fusing row counts `parts`: 128 when every part but the last is a whole number of
    128-row blocks (then the fused scale is the parts' scales stacked), else 1 (one scale row per output row)."""
    return GROUP if all(rows % GROUP == 0 for rows in parts[:-1]) else 1


class Fp8Weight(nn.Module):
    """A block-FP8 weight: `weight` float8_e4m3fn [..., N, K] and `scale` fp32 [..., ceil(N/block_n), ceil(K/128)].
    The linear ops take it wherever they take a plain weight tensor; leading dims index experts."""

    def __init__(
        self, *shape: int, device: torch.device | str, parts: tuple[int, ...] | None = None, allocate: bool = True
    ) -> None:
        super().__init__()
        rows, cols = shape[-2], shape[-1]
        self.block_n = fp8_block_rows(parts or (rows,))
        if not allocate:
            return
        scale_shape = (*shape[:-2], math.ceil(rows / self.block_n), math.ceil(cols / GROUP))
        self.weight = nn.Parameter(torch.empty(*shape, dtype=FP8_DTYPE, device=device), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(scale_shape, dtype=torch.float32, device=device), requires_grad=False)

    @classmethod
    def of(cls, weight: torch.Tensor, scale: torch.Tensor, block_n: int) -> Fp8Weight:
        """A view over existing tensors (one expert of a stacked weight, or a weight a test built)."""
        view = cls(*weight.shape, device=weight.device, allocate=False)
        view.block_n = block_n
        view.weight, view.scale = weight, scale  # plain attributes: the view registers no parameters
        return view

    def expert(self, index: int) -> Fp8Weight:
        """Expert `index` of a stacked [E, N, K] weight, sharing its storage."""
        return Fp8Weight.of(self.weight[index], self.scale[index], self.block_n)

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def row_scales(self) -> torch.Tensor:
        """The scale of every output row: [..., N, ceil(K/128)] fp32."""
        return self.scale.repeat_interleave(self.block_n, dim=-2)[..., : self.weight.shape[-2], :]

    def dequantize(self) -> torch.Tensor:
        """q * scale in fp32 [..., N, K], every element multiplied by its block's scale (what transformers'
        dequantizing loader computes)."""
        cols = self.weight.shape[-1]
        scales = self.row_scales().repeat_interleave(GROUP, dim=-1)[..., :cols]
        return self.weight.float() * scales

    def extra_repr(self) -> str:
        return f"shape={list(self.weight.shape)}, block_n={self.block_n}"


@dataclass(frozen=True)
class Fp8Rows:
    """Activation rows with their per-token-group quantization: x [M, K] in the model dtype, q float8_e4m3fn
    [M, K] and scale fp32 [M, ceil(K/128)] as quantize_activation_ref(x) gives them. Read like the rows x (shape,
    dtype, device, row indexing) by code that only routes them; FP8 projections read q / scale, every other
    consumer `plain(rows)`."""

    x: torch.Tensor  # [M, K]
    q: torch.Tensor  # [M, K] float8_e4m3fn
    scale: torch.Tensor  # [M, G] fp32

    @property
    def shape(self) -> torch.Size:
        return self.x.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.x.dtype

    @property
    def device(self) -> torch.device:
        return self.x.device

    def __getitem__(self, rows: slice | torch.Tensor) -> Fp8Rows:
        """The rows `rows` (a slice or an index tensor) of all three."""
        return Fp8Rows(self.x[rows], self.q[rows], self.scale[rows])


def plain(x: torch.Tensor | Fp8Rows) -> torch.Tensor:
    """The rows in the model dtype, whether or not they came quantized."""
    return x.x if isinstance(x, Fp8Rows) else x


def quantized(
    x: torch.Tensor | Fp8Rows, quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows [M, K], q, scale): the quantization the rows came with, else `quantize(rows)` (a ref or a kernel)."""
    if isinstance(x, Fp8Rows):
        return x.x, x.q, x.scale
    return x, *quantize(x)


def quantize_activation_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q float8_e4m3fn [M, K], scale fp32 [M, ceil(K/128)]), per token and group of 128 along K
    (vLLM's per_token_group_quant_fp8; the last group of a K that is not a multiple of 128 is partial)."""
    rows, cols = x.shape
    num_groups = math.ceil(cols / GROUP)
    padded = torch.nn.functional.pad(x.float(), (0, num_groups * GROUP - cols))  # zeros change no amax
    groups = padded.view(rows, num_groups, GROUP)
    scale = groups.abs().amax(dim=-1).clamp(min=AMAX_FLOOR) / FP8_MAX  # [M, G]
    q = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(rows, num_groups * GROUP)[:, :cols], scale


def fp8_linear_ref(x: torch.Tensor | Fp8Rows, weight: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (activation dtype, or Fp8Rows [M, K] with their quantization), weight Fp8Weight [N, K] (, bias
    [N]) -> [..., N] in x's dtype, with vLLM's rounding points (module docstring): per K block, the fp32 product of
    the quantized operands times both scales, summed over the blocks in order, one rounding."""
    cols = x.shape[-1]
    lead = x.shape[:-1]
    rows = x if isinstance(x, Fp8Rows) else x.reshape(-1, cols)  # [M, K]
    x2, qx, sx = quantized(rows, quantize_activation_ref)  # [M, K], [M, K] e4m3, [M, G]
    sw = weight.row_scales()  # [N, G]
    acc = torch.zeros(x2.shape[0], weight.shape[0], dtype=torch.float32, device=x.device)  # [M, N]
    for g in range(sx.shape[1]):
        k = slice(g * GROUP, min(cols, (g + 1) * GROUP))
        acc += (qx[:, k].float() @ weight.weight[:, k].float().T) * sx[:, g, None] * sw[None, :, g]
    out = acc.to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*lead, weight.shape[0])


def fp8_linear(x: torch.Tensor | Fp8Rows, weight: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if use_triton(plain(x)):
        from deltaserve.kernels.fp8_triton import fp8_linear_triton

        return fp8_linear_triton(x, weight, bias)
    return fp8_linear_ref(x, weight, bias)


def rms_norm_fp8_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[Fp8Rows, torch.Tensor | None]:
    """kernels/norm.py's rms_norm (x [T, H], with the optional residual add) with its rounded output quantized per
    token and group of 128 (quantize_activation_ref): (Fp8Rows of the normed rows, the rounded residual sum)."""
    y, residual_out = rms_norm_ref(x, weight, eps, residual)
    return Fp8Rows(y, *quantize_activation_ref(y)), residual_out


def rms_norm_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[Fp8Rows, torch.Tensor | None]:
    if use_triton(x):
        from deltaserve.kernels.norm_triton import rms_norm_fp8_triton

        return rms_norm_fp8_triton(x, weight, eps, residual)
    return rms_norm_fp8_ref(x, weight, eps, residual)


def silu_and_mul_fp8_ref(x: torch.Tensor) -> Fp8Rows:
    """kernels/activation.py's silu_and_mul (x [T, 2I] -> [T, I]) with its rounded output quantized per token and
    group of 128: the down projection's input."""
    y = silu_and_mul_ref(x)
    return Fp8Rows(y, *quantize_activation_ref(y))


def silu_and_mul_fp8(x: torch.Tensor) -> Fp8Rows:
    if use_triton(x):
        from deltaserve.kernels.activation_triton import silu_and_mul_fp8_triton

        return silu_and_mul_fp8_triton(x)
    return silu_and_mul_fp8_ref(x)


def sigmoid_gate_mul_fp8_ref(o: torch.Tensor, gate: torch.Tensor) -> Fp8Rows:
    """kernels/activation.py's sigmoid_gate_mul (o, gate [T, N]) with its rounded output quantized per token and
    group of 128: o_proj's input."""
    y = sigmoid_gate_mul_ref(o, gate)
    return Fp8Rows(y, *quantize_activation_ref(y))


def sigmoid_gate_mul_fp8(o: torch.Tensor, gate: torch.Tensor) -> Fp8Rows:
    if use_triton(o):
        from deltaserve.kernels.activation_triton import sigmoid_gate_mul_fp8_triton

        return sigmoid_gate_mul_fp8_triton(o, gate)
    return sigmoid_gate_mul_fp8_ref(o, gate)


def gated_rms_norm_fp8_ref(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> Fp8Rows:
    """kernels/norm.py's gated_rms_norm (x, z [T, heads, d]) as the [T, heads·d] rows out_proj reads, quantized per
    token and group of 128."""
    y = gated_rms_norm_ref(x, z, weight, eps).reshape(x.shape[0], -1)
    return Fp8Rows(y, *quantize_activation_ref(y))


def gated_rms_norm_fp8(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> Fp8Rows:
    if use_triton(x):
        from deltaserve.kernels.norm_triton import gated_rms_norm_fp8_triton

        return gated_rms_norm_fp8_triton(x, z, weight, eps)
    return gated_rms_norm_fp8_ref(x, z, weight, eps)
