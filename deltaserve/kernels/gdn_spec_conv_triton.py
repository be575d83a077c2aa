"""Triton kernel of the verify step's causal conv1d + SiLU (kernels/gdn_spec.py: `causal_conv1d_verify_ref` is its
twin), one launch a GDN layer.

Grid (verify sequence, channel block), from shapes only: no host sync, so it captures in a CUDA graph. A sequence's
rows form one line: the K-1 pre-conv rows of its live slot (rows 0 .. K-2), then its chunk's tokens in column
order (row K-1 + j is x[token_index[s, j]]). Token j's output reads rows j .. j+K-1, tap t on row j+t, and the
window after it (scratch_conv[s, j]) is rows j+1 .. j+K-1: the kernel loads each row straight from the slot or from
x (L1 / L2 hits after the first), so no window shifts through registers and nothing written is read back.

Arithmetic as the twin and as causal_conv1d_update: each tap product rounded to the input dtype, summed in fp32 in
tap order (the twin's order, so fp32 results are bit-equal), SiLU in fp32, one rounding on store. token_index lists
a sequence's real columns first and -1 after them (runner/spec_layout.py builds it so); a padded column stores the
last real window again, as the twin, and no output row. A sequence with slot < 0 (CUDA-graph padding) reads no
slot, writes no scratch and zeros to its tokens' output rows. The live slots are never written: the commit
(spec_state_commit) copies the accepted window into them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.kernels._dispatch import output
from deltaserve.kernels._triton import i64, next_pow2, require_last_dim_contiguous, silu_f32


# width and token_index's row stride (= width) change with the step's widest chunk: unspecialised, so a step whose
# chunks are all one token (width 1) compiles no variant of its own while serving.
@triton.jit(do_not_specialize=["width", "stride_ti_seq"])
def _causal_conv1d_verify_kernel(
    x_ptr,
    weight_ptr,
    conv_states_ptr,
    state_indices_ptr,
    token_index_ptr,
    scratch_ptr,
    out_ptr,
    width,
    stride_x,
    stride_o,
    stride_s_slot,
    stride_s_row,
    stride_ti_seq,
    stride_w_seq,
    stride_w_col,
    stride_w_row,
    C: tl.constexpr,
    K: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    i_s = i64(tl.program_id(0))
    i_cb = tl.program_id(1)
    o_c = i_cb * BLOCK_C + tl.arange(0, BLOCK_C)  # [BLOCK_C]
    m_c = o_c < C
    i_slot = i64(tl.load(state_indices_ptr + i_s))
    is_live = i_slot >= 0  # masks, not a branch: a padded sequence loads nothing and stores only zero rows
    p_hist = conv_states_ptr + i_slot * stride_s_slot + o_c  # [BLOCK_C]
    p_ti = token_index_ptr + i_s * stride_ti_seq
    p_window = scratch_ptr + i_s * stride_w_seq + o_c  # [BLOCK_C]
    i_last = tl.zeros([], dtype=tl.int32) - 1  # the last real column so far (-1: the window is the slot's rows)
    for j in range(width):
        i_t = i64(tl.load(p_ti + j))
        is_real = i_t >= 0
        i_last = tl.where(is_real, j, i_last)
        b_acc = tl.zeros([BLOCK_C], dtype=tl.float32)
        for t in tl.static_range(K):
            i_row = i_last + t  # row of the line: K-1 slot rows, then the chunk's columns
            from_hist = is_live & (i_row >= 0) & (i_row < K - 1)
            from_x = is_live & (i_row >= K - 1)
            i_src = i64(tl.load(p_ti + (i_row - (K - 1)), mask=from_x, other=0))
            b_hist = tl.load(p_hist + i_row * stride_s_row, mask=m_c & from_hist, other=0.0)
            b_x = tl.load(x_ptr + i_src * stride_x + o_c, mask=m_c & from_x, other=0.0)
            b_row = tl.where(from_x, b_x, b_hist.to(x_ptr.dtype.element_ty))  # [BLOCK_C]
            b_w = tl.load(weight_ptr + o_c * K + t, mask=m_c, other=0.0)
            b_acc += (b_row.to(tl.float32) * b_w.to(tl.float32)).to(x_ptr.dtype.element_ty).to(tl.float32)
            if t >= 1:  # rows i_last+1 .. i_last+K-1: the window after the last real column
                tl.store(p_window + j * stride_w_col + (t - 1) * stride_w_row, b_row, mask=m_c & is_live)
        # A padded sequence loaded nothing, so its sum is 0 and SiLU(0) = 0: the zero rows need no select.
        tl.store(out_ptr + i_t * stride_o + o_c, silu_f32(b_acc), mask=m_c & is_real)


def causal_conv1d_verify_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_states: torch.Tensor,
    state_indices: torch.Tensor,
    token_index: torch.Tensor,
    scratch_conv: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [N, C] (the verify rows; a column slice of a wider projection is fine), weight [C, K], conv_states
    [slots, K-1, C], state_indices [S], token_index [S, W] -> y [N, C]; scratch_conv [S_max, W_max, K-1, C] gets
    the window after each token."""
    require_last_dim_contiguous("x", x)
    assert weight.is_contiguous(), "weight [C, K] must be contiguous"
    for name, t in (("conv_states", conv_states), ("token_index", token_index), ("scratch_conv", scratch_conv)):
        require_last_dim_contiguous(name, t)
    num_seqs, width = token_index.shape
    channels = x.shape[1]
    kernel_size = weight.shape[1]
    assert scratch_conv.shape[0] >= num_seqs and scratch_conv.shape[1] >= width, "scratch_conv too small for the step"
    assert tuple(scratch_conv.shape[2:]) == (kernel_size - 1, channels), f"scratch_conv {tuple(scratch_conv.shape)}"
    out = output(out, tuple(x.shape), x)
    if num_seqs == 0 or width == 0:
        return out
    block_c = min(256, next_pow2(channels))
    _causal_conv1d_verify_kernel[(num_seqs, triton.cdiv(channels, block_c))](
        x, weight, conv_states, state_indices, token_index, scratch_conv, out, width,
        x.stride(0), out.stride(0), conv_states.stride(0), conv_states.stride(1), token_index.stride(0),
        scratch_conv.stride(0), scratch_conv.stride(1), scratch_conv.stride(2),
        C=channels, K=kernel_size, BLOCK_C=block_c, num_warps=4,
    )  # fmt: skip
    return out
