"""The gated-attention preamble: per-head RMSNorm of q and k, partial NeoX RoPE, and the q/gate split.

Input is the fused projection output qkv [T, nq·2d + nkv·d + nkv·d] whose first nq·2d columns are per head [query (d) |
gate (d)] (docs/ARCHITECTURE.md#configs-and-checkpoint-layout). RoPE reads a per-token cos/sin table [T, r] (cos in the
first r/2 columns, sin in the last r/2) gathered from 3-D positions, so 1-D RoPE and interleaved MRoPE are one path.

Two spellings:
- `attn_preamble`: one fused op (one Triton launch on CUDA). Rounding as vLLM's fused kernel: the normed
  values are rounded to the model dtype before rotation, the rotation is fp32 with one rounding, the gate
  is copied raw.
- `attn_preamble_unfused`: four ops (gate split, RMSNorm q, RMSNorm k, 1-D RoPE over positions). It has no
  MRoPE spelling, so positions whose three rows differ are refused with an error.
"""

from __future__ import annotations

import torch

from deltaserve.kernels._dispatch import triton_or_ref
from deltaserve.kernels.norm import rms_norm


def rope_cos_sin_cache(
    rotary_dim: int, max_positions: int, theta: float, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """The [max_positions, r] table: cos(p·θ^(-2j/r)) for j < r/2, then sin; fp32 math, cast to dtype."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float() / rotary_dim))
    positions = torch.arange(max_positions, dtype=torch.float32, device=device)
    freqs = torch.outer(positions, inv_freq)  # [P, r/2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype)  # [P, r]


def mrope_axis_per_frequency(
    num_frequencies: int, mrope_section: list[int] | None, device: torch.device | str
) -> torch.Tensor:
    """Which position row (0=T, 1=H, 2=W) each rotary frequency reads, interleaved as Qwen3.5 does
    (docs/ARCHITECTURE.md#positions-and-mrope)."""
    axis = torch.zeros(num_frequencies, dtype=torch.int64, device=device)
    if mrope_section is None:
        return axis
    _, section_h, section_w = mrope_section
    for j in range(num_frequencies):
        if j % 3 == 1 and j < 3 * section_h:
            axis[j] = 1
        elif j % 3 == 2 and j < 3 * section_w:
            axis[j] = 2
    return axis


def rope_cos_sin_for_positions(
    cos_sin_cache: torch.Tensor, positions: torch.Tensor, axis_per_frequency: torch.Tensor
) -> torch.Tensor:
    """Per-token table [T, r] from positions [3, T]: frequency j is looked up at positions[axis[j]]."""
    half = cos_sin_cache.shape[-1] // 2
    freq_index = torch.arange(half, device=positions.device)
    pos = positions[axis_per_frequency].T  # [T, r/2]: the position each (token, frequency) reads
    cos = cos_sin_cache[pos, freq_index]  # [T, r/2]
    sin = cos_sin_cache[pos, freq_index + half]  # [T, r/2]
    return torch.cat([cos, sin], dim=-1)  # [T, r]


def _rotate_neox_fp32(x: torch.Tensor, cos_sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """Rotate the first r dims of x [T, h, d] in fp32 (x already fp32); the other dims pass through."""
    half = rotary_dim // 2
    cos = cos_sin[:, None, :half].float()  # [T, 1, r/2]
    sin = cos_sin[:, None, half:].float()  # [T, 1, r/2]
    x1 = x[..., :half]
    x2 = x[..., half:rotary_dim]
    out = x.clone()
    out[..., :half] = x1 * cos - x2 * sin
    out[..., half:rotary_dim] = x2 * cos + x1 * sin
    return out


def split_q_k_gate(
    qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views q [T, nq, d] and k [T, nkv, d] of the fused projection (per q head [query | gate]), and the gate
    copied out contiguous [T, nq·d]."""
    num_tokens = qkv.shape[0]
    q_gate = qkv[:, : num_q_heads * 2 * head_dim].reshape(num_tokens, num_q_heads, 2 * head_dim)
    gate = q_gate[..., head_dim:].reshape(num_tokens, num_q_heads * head_dim).contiguous()
    k_start = num_q_heads * 2 * head_dim
    k = qkv[:, k_start : k_start + num_kv_heads * head_dim].reshape(num_tokens, num_kv_heads, head_dim)
    return q_gate[..., :head_dim], k, gate


def attn_preamble_ref(
    qkv: torch.Tensor,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    cos_sin: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rotary_dim: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns contiguous q [T, nq·d], k [T, nkv·d] (normed, rotated) and gate [T, nq·d] (raw)."""
    num_tokens = qkv.shape[0]
    q, k, gate = split_q_k_gate(qkv, num_q_heads, num_kv_heads, head_dim)
    # vLLM's rounding point: the normed values are rounded to the model dtype before the rotation.
    q_normed = rms_norm(q, q_norm_weight, eps)[0].float()
    k_normed = rms_norm(k, k_norm_weight, eps)[0].float()
    q_out = _rotate_neox_fp32(q_normed, cos_sin, rotary_dim).to(qkv.dtype)
    k_out = _rotate_neox_fp32(k_normed, cos_sin, rotary_dim).to(qkv.dtype)
    return q_out.reshape(num_tokens, -1), k_out.reshape(num_tokens, -1), gate


attn_preamble = triton_or_ref(attn_preamble_ref, "preamble_triton.attn_preamble_triton")


def rotary_embedding_ref(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
    rotary_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """1-D NeoX RoPE: positions [T]; q [T, nq·d], k [T, nkv·d]; fp32 rotation, one rounding."""
    cos_sin = cos_sin_cache[positions]  # [T, r]
    num_tokens = q.shape[0]
    q_out = _rotate_neox_fp32(q.reshape(num_tokens, -1, head_dim).float(), cos_sin, rotary_dim)
    k_out = _rotate_neox_fp32(k.reshape(num_tokens, -1, head_dim).float(), cos_sin, rotary_dim)
    return q_out.to(q.dtype).reshape(num_tokens, -1), k_out.to(k.dtype).reshape(num_tokens, -1)


rotary_embedding = triton_or_ref(rotary_embedding_ref, "preamble_triton.rotary_embedding_triton", on="q")


class MRopeUnsupportedError(ValueError):
    """Raised when the four-op preamble is handed 3-D positions whose rows differ."""


def check_positions_are_1d(positions: torch.Tensor) -> torch.Tensor:
    """Returns the 1-D positions row; refuses (3, T) positions whose rows differ (true MRoPE)."""
    if positions.dim() == 1:
        return positions
    capturing = positions.is_cuda and torch.cuda.is_current_stream_capturing()
    if not capturing and not bool((positions == positions[0:1]).all()):
        raise MRopeUnsupportedError(
            "DELTASERVE_FUSE_ATTN_PREAMBLE=0 selects the four-op attention preamble, which has no MRoPE "
            "spelling: it was given 3-D positions whose T/H/W rows differ (multimodal MRoPE). Refusing rather "
            "than silently applying 1-D RoPE; use the fused preamble (DELTASERVE_FUSE_ATTN_PREAMBLE=1)."
        )
    return positions[0]


def attn_preamble_unfused(
    qkv: torch.Tensor,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rotary_dim: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The four-op path: split the gate, RMSNorm q, RMSNorm k, 1-D RoPE. Same outputs as attn_preamble."""
    positions_1d = check_positions_are_1d(positions)
    num_tokens = qkv.shape[0]
    q, k, gate = split_q_k_gate(qkv, num_q_heads, num_kv_heads, head_dim)  # op 1: gate split
    q_normed = rms_norm(q, q_norm_weight, eps)[0]  # op 2
    k_normed = rms_norm(k, k_norm_weight, eps)[0]  # op 3
    return (
        *rotary_embedding(  # op 4
            positions_1d,
            q_normed.reshape(num_tokens, -1),
            k_normed.reshape(num_tokens, -1),
            cos_sin_cache,
            head_dim,
            rotary_dim,
        ),
        gate,
    )
