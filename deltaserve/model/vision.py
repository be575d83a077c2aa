"""The Qwen3.5 / Qwen3.6 vision tower in torch ops (docs/multimodal.md#the-vision-tower): patch embedding (the Conv3d as
one GEMM), the learned 48x48 position table bilinearly resampled to each grid, 2-D axial ViT RoPE, `depth` pre-norm
blocks with full bidirectional attention inside each image / video frame group, and the 2x2 patch merger into the text
hidden size. There is no deepstack in these models: the config refuses a non-empty deepstack_visual_indexes.

Rounding follows transformers 5.x (the reference of the exactness tests): interpolation weights and their sum in
fp32, one cast to the model dtype; RoPE cos/sin and the rotation in fp32; per-segment SDPA.

forward(pixel_values [S, C·Tp·P·P], grid_thw [N, 3]) -> merged embeddings [S/4, out_hidden]; `encode` splits
them per item.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deltaserve.config import VisionConfig
from deltaserve.model.layers.common import empty_param


def to_device_async(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor onto `device` without making the host wait for the GPU: onto CUDA through pinned memory and a
    non-blocking copy. A plain `.to("cuda")` is a blocking copy: it returns once the copy has run, behind every
    kernel already queued on the stream, so the host sat until the queued step had run and the step loop's overlap
    of host and GPU was lost for the step (docs/multimodal.md#speed-under-image-traffic). The same values either
    way; other devices copy as before."""
    device = torch.device(device)
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    # the pinned block is the caching host allocator's: it is not reused until the copy has run
    return tensor.pin_memory().to(device, non_blocking=True)


def gather_mm_embeds(
    pieces: list[tuple[int, torch.Tensor]], device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The model's mm_embeds for one step from (first row in the step's flattened token batch, encoder-output
    rows [n, H]) pieces: (rows [M] int64, embeddings [M, H]), or None when the step has none (text-only steps
    pay nothing)."""
    pieces = [(row, rows) for row, rows in pieces if rows.shape[0]]
    if not pieces:
        return None
    index = to_device_async(torch.cat([torch.arange(row, row + rows.shape[0]) for row, rows in pieces]), device)
    return index, torch.cat([to_device_async(rows, device) for _, rows in pieces])


def _linear_with_bias(
    num_out: int, num_in: int, dtype: torch.dtype, device: torch.device | str
) -> tuple[nn.Parameter, nn.Parameter]:
    return empty_param(num_out, num_in, dtype=dtype, device=device), empty_param(num_out, dtype=dtype, device=device)


def patch_coordinates(grid_thw: list[tuple[int, int, int]], merge_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) of every patch in pixel_values' block order (block row, block col, in-row, in-col), repeated
    for each temporal group: [S] int64 each."""
    rows, cols = [], []
    for t, h, w in grid_thw:
        r = torch.arange(h).view(h // merge_size, merge_size, 1, 1).expand(-1, -1, w // merge_size, merge_size)
        c = torch.arange(w).view(1, 1, w // merge_size, merge_size).expand(h // merge_size, merge_size, -1, -1)
        rows.append(r.permute(0, 2, 1, 3).reshape(-1).repeat(t))
        cols.append(c.permute(0, 2, 1, 3).reshape(-1).repeat(t))
    return torch.cat(rows), torch.cat(cols)


def interpolation_taps(
    grid_thw: list[tuple[int, int, int]], side: int, merge_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear, align_corners=True resampling of the [side, side] table at each patch
    (docs/multimodal.md#the-vision-tower): indices
    [S, 4] into the flat table and fp32 weights [S, 4], as transformers 5.x computes them (source coordinate
    r·(side-1)/(n-1) in fp32, per-axis hat weights, outer product)."""
    rows, cols = patch_coordinates(grid_thw, merge_size)
    heights = torch.cat([torch.full((t * h * w,), h) for t, h, w in grid_thw])
    widths = torch.cat([torch.full((t * h * w,), w) for t, h, w in grid_thw])

    def axis(index: torch.Tensor, size: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        src = index.to(torch.float32) * (side - 1) / torch.clamp(size - 1, min=1)
        floor = torch.floor(src)
        offsets = torch.arange(0, 2)
        taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
        weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
        return taps, weights

    h_taps, h_weights = axis(rows, heights)
    w_taps, w_weights = axis(cols, widths)
    indices = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    weights = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
    return indices, weights


def vision_rope(
    grid_thw: list[tuple[int, int, int]], head_dim: int, theta: float, merge_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [S, head_dim] fp32: [row freqs, col freqs, row freqs, col freqs] (NeoX halves,
    docs/multimodal.md#the-vision-tower)."""
    spatial = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))  # [head_dim/4]
    rows, cols = patch_coordinates(grid_thw, merge_size)
    freqs_h = rows[:, None].float() * inv_freq
    freqs_w = cols[:, None].float() * inv_freq
    freqs = torch.cat([freqs_h, freqs_w], dim=-1)  # [S, head_dim/2]
    freqs = torch.cat([freqs, freqs], dim=-1)  # [S, head_dim]
    return freqs.cos(), freqs.sin()


def attention_segments(grid_thw: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """(start, length, count) runs of `count` consecutive attention segments of one length: one segment per image
    and per temporal group of a video (docs/multimodal.md#the-vision-tower). Neighbouring items of one size share a
    run, so a step's images of one size take one batched attention call a block instead of one each; each batch
    entry is computed on its own, so the values are those of separate calls."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for t, h, w in grid_thw:
        if runs and runs[-1][1] == h * w:
            first, length, count = runs[-1]
            runs[-1] = (first, length, count + t)
        else:
            runs.append((start, h * w, t))
        start += t * h * w
    return runs


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        width = config.hidden_size
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.approximate = "tanh" if config.hidden_act == "gelu_pytorch_tanh" else "none"
        self.norm1_weight, self.norm1_bias = (empty_param(width, dtype=dtype, device=device) for _ in range(2))
        self.norm2_weight, self.norm2_bias = (empty_param(width, dtype=dtype, device=device) for _ in range(2))
        self.qkv_weight, self.qkv_bias = _linear_with_bias(3 * width, width, dtype, device)
        self.proj_weight, self.proj_bias = _linear_with_bias(width, width, dtype, device)
        self.fc1_weight, self.fc1_bias = _linear_with_bias(config.intermediate_size, width, dtype, device)
        self.fc2_weight, self.fc2_bias = _linear_with_bias(width, config.intermediate_size, dtype, device)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: list[tuple[int, int, int]]
    ) -> torch.Tensor:
        """x [S, Hv]; segments: (start, length, count) runs of `count` equal-length attention segments."""
        num_tokens, width = x.shape
        h = F.layer_norm(x, (width,), self.norm1_weight, self.norm1_bias, 1e-6)
        qkv = F.linear(h, self.qkv_weight, self.qkv_bias).view(num_tokens, 3, self.num_heads, self.head_dim)
        # q and k rotated together, each element by the same fp32 ops as apart: one set of launches instead of two
        # (the eager tower is launch-bound on a GPU, docs/multimodal.md#speed-under-image-traffic)
        qk = qkv[:, :2].float()  # [S, 2, heads, d]
        cos_f, sin_f = cos[:, None, None, :], sin[:, None, None, :]
        q, k = (qk * cos_f + _rotate_half(qk) * sin_f).to(x.dtype).unbind(1)  # [S, heads, d] each
        v = qkv[:, 2]
        out = torch.empty(num_tokens, self.num_heads, self.head_dim, dtype=x.dtype, device=x.device)
        for start, length, count in segments:
            # `count` consecutive segments of one length (a video's frame groups, a step's same-size images) run as
            # one batched call
            end = start + length * count
            qs = q[start:end].view(count, length, self.num_heads, self.head_dim).transpose(1, 2)
            ks = k[start:end].view(count, length, self.num_heads, self.head_dim).transpose(1, 2)
            vs = v[start:end].view(count, length, self.num_heads, self.head_dim).transpose(1, 2)
            o = F.scaled_dot_product_attention(qs, ks, vs, scale=self.head_dim**-0.5)  # [count, heads, L, d]
            out[start:end] = o.transpose(1, 2).reshape(count * length, self.num_heads, self.head_dim)
        x = x + F.linear(out.reshape(num_tokens, width), self.proj_weight, self.proj_bias)
        h = F.layer_norm(x, (width,), self.norm2_weight, self.norm2_bias, 1e-6)
        h = F.gelu(F.linear(h, self.fc1_weight, self.fc1_bias), approximate=self.approximate)
        return x + F.linear(h, self.fc2_weight, self.fc2_bias)


class VisionTower(nn.Module):
    """model.visual.* of a Qwen3.5 / Qwen3.6 checkpoint."""

    def __init__(self, config: VisionConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.config = config
        width = config.hidden_size
        merged = width * config.spatial_merge_size**2
        # Conv3d(kernel = stride = (Tp, P, P)) over a [C, Tp, P, P] patch is one GEMM with the flattened kernel
        self.patch_weight, self.patch_bias = _linear_with_bias(width, config.patch_dim, dtype, device)
        self.pos_embed = empty_param(config.num_position_embeddings, width, dtype=dtype, device=device)
        self.blocks = nn.ModuleList(VisionBlock(config, dtype, device) for _ in range(config.depth))
        self.merger_norm_weight, self.merger_norm_bias = (empty_param(width, dtype=dtype, device=device)
                                                          for _ in range(2))  # fmt: skip
        self.merger_fc1_weight, self.merger_fc1_bias = _linear_with_bias(merged, merged, dtype, device)
        self.merger_fc2_weight, self.merger_fc2_bias = _linear_with_bias(config.out_hidden_size, merged, dtype, device)

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_weight.dtype

    def embed_patches(self, pixels: torch.Tensor) -> torch.Tensor:
        """[S, C·Tp·P·P] -> [S, Hv]. The Conv3d and the GEMM are the same sum in a different order: the CPU
        runs transformers' Conv3d (its reference here, bit for bit), CUDA the GEMM, as vLLM does
        (docs/multimodal.md#the-vision-tower)."""
        if pixels.is_cuda:
            return F.linear(pixels, self.patch_weight, self.patch_bias)
        config = self.config
        kernel = (config.in_channels, config.temporal_patch_size, config.patch_size, config.patch_size)
        weight = self.patch_weight.view(-1, *kernel)
        out = F.conv3d(pixels.view(-1, *kernel), weight, self.patch_bias, stride=kernel[1:])
        return out.view(pixels.shape[0], -1)

    def forward(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        """pixel_values [S, C·Tp·P·P] (any float dtype; cast to the tower's) -> [S/4, out_hidden]."""
        config = self.config
        grids = [tuple(int(v) for v in grid) for grid in grid_thw]
        device = self.patch_weight.device
        if pixel_values.shape[0] != sum(t * h * w for t, h, w in grids) or pixel_values.shape[1] != config.patch_dim:
            raise ValueError(f"pixel_values {list(pixel_values.shape)} do not match grids {grids}")
        # host tensors go over without a host-GPU sync (to_device_async); the cast to the tower's dtype rounds to
        # nearest even on either side, so casting after the copy gives the same values
        x = self.embed_patches(to_device_async(pixel_values, device).to(self.dtype))  # [S, Hv]
        indices, weights = interpolation_taps(grids, config.num_grid_per_side, config.spatial_merge_size)
        indices, weights = to_device_async(indices, device), to_device_async(weights, device)
        pos = (self.pos_embed[indices] * weights[:, :, None]).sum(1)  # fp32 [S, Hv]
        x = x + pos.to(x.dtype)
        cos, sin = vision_rope(grids, config.head_dim, config.rope_theta, config.spatial_merge_size)
        cos, sin = to_device_async(cos, device), to_device_async(sin, device)
        segments = attention_segments(grids)
        for block in self.blocks:
            x = block(x, cos, sin, segments)
        x = F.layer_norm(x, (config.hidden_size,), self.merger_norm_weight, self.merger_norm_bias, 1e-6)
        x = x.view(-1, self.merger_fc1_weight.shape[1])  # [S/4, 4Hv]: one 2x2 block per row
        x = F.gelu(F.linear(x, self.merger_fc1_weight, self.merger_fc1_bias))
        return F.linear(x, self.merger_fc2_weight, self.merger_fc2_bias)

    def encode(self, items: list[tuple[torch.Tensor, tuple[int, int, int]]]) -> list[torch.Tensor]:
        """Several items in one call (concatenated rows, separate attention segments) -> one [n_i, out] each."""
        if not items:
            return []
        pixels = torch.cat([torch.as_tensor(p) for p, _ in items])
        grids = [tuple(g) for _, g in items]
        merged = self.forward(pixels, grids)
        sizes = [t * h * w // self.config.spatial_merge_size**2 for t, h, w in grids]
        return list(torch.split(merged, sizes))
