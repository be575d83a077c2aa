"""Triton causal depthwise conv1d + SiLU of the GDN layers over the conv-state slot pool (prefill and decode).

conv_states [num_slots, K-1, C] holds each slot's last K-1 PRE-conv rows; tap j multiplies row t-(K-1)+j,
so tap K-1 is the current token. Arithmetic as the ref (vLLM's Triton conv): each tap product rounded to
the input dtype, fp32 sum, fp32 SiLU, one rounding on store.

- prefill: grid (global token block, channel block), sized from T alone (no host sync, no idle programs
  for short sequences). Each token binary-searches query_start_loc for its sequence; a [BLOCK_T, BLOCK_C]
  tile reads K shifted row tiles of x (L1/L2 hits after the first), and rows before a sequence's start
  come from its slot's history when has_initial_state, else are zero; a block holding no token within K-1 rows
  of its sequence's start skips the history loads (a scalar branch). A second launch, grid (sequence,
  channel block), then writes each slot's new last K-1 pre-conv rows.
- update (decode, in place): grid (sequence, channel block); a [BLOCK_K, BLOCK_C] tile holds the K-1 state
  rows plus the new token, the output is one weighted column sum, and the state shifts by one row. Slots
  < 0 (CUDA-graph padding) write zeros to their output row and leave every state untouched. No host sync.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from deltaserve.kernels._dispatch import output
from deltaserve.kernels._triton import (
    i64,
    next_pow2,
    pdl_launch,
    pdl_wait,
    require_last_dim_contiguous,
    search_steps,
    silu_f32,
)


@triton.jit
def sequence_of_tokens(query_start_loc_ptr, o_t, num_seqs, NUM_SEARCH_STEPS: tl.constexpr):
    """For token indices o_t, the last sequence b with query_start_loc[b] <= t (empty sequences lose)."""
    b_lo = tl.zeros(o_t.shape, dtype=tl.int32)
    b_hi = tl.zeros(o_t.shape, dtype=tl.int32) + num_seqs
    for _ in tl.static_range(NUM_SEARCH_STEPS):
        b_mid = (b_lo + b_hi) // 2
        is_at_or_before = tl.load(query_start_loc_ptr + b_mid) <= o_t
        b_lo = tl.where(is_at_or_before, b_mid, b_lo)
        b_hi = tl.where(is_at_or_before, b_hi, b_mid)
    return b_lo


@triton.jit(do_not_specialize=["num_tokens", "num_seqs"])
def _causal_conv1d_prefill_kernel(
    x_ptr,
    weight_ptr,
    conv_states_ptr,
    out_ptr,
    query_start_loc_ptr,
    state_indices_ptr,
    has_initial_state_ptr,
    num_tokens,
    num_seqs,
    stride_x,
    stride_o,
    stride_s_slot,
    stride_s_row,
    C: tl.constexpr,
    K: tl.constexpr,
    NUM_SEARCH_STEPS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    i_tb = tl.program_id(0)
    i_cb = tl.program_id(1)
    o_t = i_tb * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T] global token rows
    m_t = o_t < num_tokens
    o_c = i_cb * BLOCK_C + tl.arange(0, BLOCK_C)  # [BLOCK_C]
    m_c = o_c < C
    # Token blocks ignore sequence boundaries; each token finds its own sequence, start and slot.
    i_seq = sequence_of_tokens(query_start_loc_ptr, o_t, num_seqs, NUM_SEARCH_STEPS)  # [BLOCK_T]
    b_start = tl.load(query_start_loc_ptr + i_seq, mask=m_t, other=0)
    b_pos = o_t - b_start  # [BLOCK_T] position in its sequence
    p_rows = x_ptr + i64(o_t) * stride_x  # [BLOCK_T]
    b_acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    # Only tokens within K-1 rows of their sequence's start read history rows. Blocks without any (all but about
    # one a sequence in a long prefill) take the x-only loop: the masked history loads and their address math cost
    # ~20 % of this kernel on the H200 (docs/kernels.md#causal-conv1d). Both loops add the same rounded tap products
    # in the same order, so the result does not depend on the branch.
    if tl.min(tl.where(m_t, b_pos, K)) < K - 1:
        b_slot = i64(tl.load(state_indices_ptr + i_seq, mask=m_t, other=-1))
        b_has_init = (tl.load(has_initial_state_ptr + i_seq, mask=m_t, other=0) != 0) & (b_slot >= 0)
        p_hist = conv_states_ptr + b_slot * stride_s_slot  # [BLOCK_T]
        for j in tl.static_range(K):
            b_w = tl.load(weight_ptr + o_c * K + j, mask=m_c, other=0.0).to(tl.float32)  # [BLOCK_C]
            # this tap reads row t-(K-1)+j; before the start means history row pos+j of the slot
            m_from_x = m_t & (b_pos >= K - 1 - j)
            m_from_hist = m_t & (b_pos < K - 1 - j) & b_has_init
            b_in = tl.load(
                (p_rows - (K - 1 - j) * stride_x)[:, None] + o_c[None, :],
                mask=m_from_x[:, None] & m_c[None, :],
                other=0.0,
            ).to(tl.float32)
            o_hist_row = i64(b_pos + j) * stride_s_row  # [BLOCK_T]
            b_hist = tl.load(
                (p_hist + o_hist_row)[:, None] + o_c[None, :], mask=m_from_hist[:, None] & m_c[None, :], other=0.0
            )
            b_in += b_hist.to(x_ptr.dtype.element_ty).to(tl.float32)
            b_acc += (b_in * b_w[None, :]).to(x_ptr.dtype.element_ty).to(tl.float32)
    else:
        for j in tl.static_range(K):
            b_w = tl.load(weight_ptr + o_c * K + j, mask=m_c, other=0.0).to(tl.float32)  # [BLOCK_C]
            b_in = tl.load(
                (p_rows - (K - 1 - j) * stride_x)[:, None] + o_c[None, :], mask=m_t[:, None] & m_c[None, :], other=0.0
            ).to(tl.float32)
            b_acc += (b_in * b_w[None, :]).to(x_ptr.dtype.element_ty).to(tl.float32)
    b_y = silu_f32(b_acc)
    tl.store(out_ptr + i64(o_t)[:, None] * stride_o + o_c[None, :], b_y, mask=m_t[:, None] & m_c[None, :])


@triton.jit
def _conv_state_writeback_kernel(
    x_ptr,
    conv_states_ptr,
    query_start_loc_ptr,
    state_indices_ptr,
    has_initial_state_ptr,
    stride_x,
    stride_s_slot,
    stride_s_row,
    C: tl.constexpr,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    i_b = tl.program_id(0)
    i_cb = tl.program_id(1)
    start = tl.load(query_start_loc_ptr + i_b)
    length = tl.load(query_start_loc_ptr + i_b + 1) - start
    i_slot = i64(tl.load(state_indices_ptr + i_b))
    if (length == 0) | (i_slot < 0):
        return
    has_init = tl.load(has_initial_state_ptr + i_b) != 0
    o_c = i_cb * BLOCK_C + tl.arange(0, BLOCK_C)  # [BLOCK_C]
    m_c = o_c < C
    # New history row r is row length + r of the concatenation [old history (K-1 rows) | x (length rows)].
    o_r = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    m_r = o_r < K - 1
    o_src = length - (K - 1) + o_r
    m_from_x = m_r & (o_src >= 0)
    m_from_hist = m_r & (o_src < 0) & has_init
    p_hist = conv_states_ptr + i_slot * stride_s_slot
    b_new = tl.load(
        x_ptr + i64(start + o_src)[:, None] * stride_x + o_c[None, :],
        mask=m_from_x[:, None] & m_c[None, :],
        other=0.0,
    )
    b_old = tl.load(
        p_hist + i64(o_src + K - 1)[:, None] * stride_s_row + o_c[None, :],
        mask=m_from_hist[:, None] & m_c[None, :],
        other=0.0,
    ).to(x_ptr.dtype.element_ty)
    b_new = tl.where(m_from_hist[:, None], b_old, b_new)  # [BLOCK_K, BLOCK_C] in the input dtype
    # A short sequence keeps some old rows, shifted: every thread's reads must land before any write.
    tl.debug_barrier()
    tl.store(p_hist + o_r[:, None] * stride_s_row + o_c[None, :], b_new, mask=m_r[:, None] & m_c[None, :])


# The prefill conv's tile: tokens x channels and warps (benchmarks/conv_prefill_sweep.py chose them on the H200).
PREFILL_BLOCK_T = 16
PREFILL_BLOCK_C = 256
PREFILL_WARPS = 4


def prefill_blocks(channels: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_C, num_warps) of the prefill conv for `channels` channels."""
    return PREFILL_BLOCK_T, min(PREFILL_BLOCK_C, next_pow2(channels)), PREFILL_WARPS


def launch_prefill_conv(
    kernel: Any,
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    out: torch.Tensor,
    block_t: int,
    block_c: int,
    num_warps: int,
) -> None:
    """The conv launch alone (no history write-back) at one tile. `kernel` is `_causal_conv1d_prefill_kernel`, or
    an earlier version of it with the same arguments (benchmarks/conv_prefill_sweep.py's before / after)."""
    num_tokens, channels = x.shape
    num_seqs = state_indices.shape[0]
    kernel[(triton.cdiv(num_tokens, block_t), triton.cdiv(channels, block_c))](
        x,
        weight,
        conv_states,
        out,
        query_start_loc,
        state_indices,
        has_initial_state,
        num_tokens,
        num_seqs,
        x.stride(0),
        out.stride(0),
        conv_states.stride(0),
        conv_states.stride(1),
        C=channels,
        K=weight.shape[1],
        NUM_SEARCH_STEPS=search_steps(num_seqs),
        BLOCK_T=block_t,
        BLOCK_C=block_c,
        num_warps=num_warps,
    )


def causal_conv1d_prefill_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, C] varlen; weight [C, K]; conv_states [S, K-1, C] updated in place -> y [T, C] (into `out` if given).

    Two launches, both sized from shapes (no host sync): the conv over global token blocks, then the
    per-sequence history write-back, which stream order keeps after every read of the old history.
    """
    require_last_dim_contiguous("x", x)
    assert weight.is_contiguous() and conv_states.stride(-1) == 1
    num_tokens, channels = x.shape
    kernel_size = weight.shape[1]
    out = output(out, tuple(x.shape), x)
    num_seqs = state_indices.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_t, block_c, num_warps = prefill_blocks(channels)
    launch_prefill_conv(
        _causal_conv1d_prefill_kernel, x, weight, conv_states, query_start_loc, state_indices, has_initial_state, out,
        block_t, block_c, num_warps,
    )  # fmt: skip
    _conv_state_writeback_kernel[(num_seqs, triton.cdiv(channels, block_c))](
        x,
        conv_states,
        query_start_loc,
        state_indices,
        has_initial_state,
        x.stride(0),
        conv_states.stride(0),
        conv_states.stride(1),
        C=channels,
        K=kernel_size,
        BLOCK_K=next_pow2(kernel_size - 1),
        BLOCK_C=block_c,
        num_warps=4,
    )
    return out


@triton.jit
def _causal_conv1d_update_kernel(
    x_ptr,
    weight_ptr,
    conv_states_ptr,
    out_ptr,
    state_indices_ptr,
    stride_x,
    stride_o,
    stride_s_slot,
    stride_s_row,
    C: tl.constexpr,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_C: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    i_b = i64(tl.program_id(0))
    i_cb = tl.program_id(1)
    o_c = i_cb * BLOCK_C + tl.arange(0, BLOCK_C)  # [BLOCK_C]
    m_c = o_c < C
    # The step's slot may load before the wait (_triton.pdl_wait). The weights stay below the branch: loaded above
    # it they made this kernel 5-8x slower at every B, PDL or not (docs/kernels.md#causal-conv1d).
    i_slot = i64(tl.load(state_indices_ptr + i_b))
    pdl_wait(USE_PDL)
    if i_slot < 0:
        tl.store(out_ptr + i_b * stride_o + o_c, tl.zeros([BLOCK_C], dtype=tl.float32), mask=m_c)
        return
    o_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]: rows 0..K-2 are the state, row K-1 the new token
    m_state = o_k < K - 1
    m_new = o_k == K - 1
    p_state = conv_states_ptr + i_slot * stride_s_slot
    b_rows = tl.load(
        p_state + o_k[:, None] * stride_s_row + o_c[None, :], mask=m_state[:, None] & m_c[None, :], other=0.0
    ).to(x_ptr.dtype.element_ty)
    b_x = tl.load(x_ptr + i_b * stride_x + o_c, mask=m_c, other=0.0)  # [BLOCK_C]
    b_rows = tl.where(m_new[:, None], b_x[None, :], b_rows)  # [BLOCK_K, BLOCK_C]
    b_w = tl.load(weight_ptr + o_c[None, :] * K + o_k[:, None], mask=(o_k < K)[:, None] & m_c[None, :], other=0.0)
    b_prod = (b_rows.to(tl.float32) * b_w.to(tl.float32)).to(x_ptr.dtype.element_ty).to(tl.float32)
    b_y = silu_f32(tl.sum(b_prod, axis=0))
    tl.store(out_ptr + i_b * stride_o + o_c, b_y, mask=m_c)
    # Shift: row k of the tile becomes state row k-1; all state reads above must finish first.
    tl.debug_barrier()
    m_shift = (o_k >= 1) & (o_k < K)
    tl.store(p_state + (o_k - 1)[:, None] * stride_s_row + o_c[None, :], b_rows, mask=m_shift[:, None] & m_c[None, :])


def causal_conv1d_update_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_states: torch.Tensor,
    state_indices: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per sequence: x [B, C] -> y [B, C] (zeros where slot < 0); conv_states shift in place."""
    require_last_dim_contiguous("x", x)
    assert weight.is_contiguous() and conv_states.stride(-1) == 1
    batch, channels = x.shape
    kernel_size = weight.shape[1]
    out = output(out, tuple(x.shape), x)
    if batch == 0:
        return out
    block_c = min(256, next_pow2(channels))
    _causal_conv1d_update_kernel[(batch, triton.cdiv(channels, block_c))](
        x,
        weight,
        conv_states,
        out,
        state_indices,
        x.stride(0),
        out.stride(0),
        conv_states.stride(0),
        conv_states.stride(1),
        C=channels,
        K=kernel_size,
        BLOCK_K=next_pow2(kernel_size),
        BLOCK_C=block_c,
        num_warps=4,
        **pdl_launch(x),
    )
    return out
