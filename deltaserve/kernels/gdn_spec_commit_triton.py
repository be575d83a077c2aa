"""Triton kernel of the verify step's commit over every GDN layer at once (kernels/gdn_spec.py:
`spec_state_commit_layers_ref` is its twin): one launch for all layers
(docs/speculative-decoding.md#the-commit-one-launch).

Grid (block, verify sequence, layer), from shapes only: no host sync, so it captures in a CUDA graph. The first
CONV_BLOCKS blocks of a (sequence, layer) copy BLOCK elements of the conv window of scratch entry clamp(a_s, 0,
conv_entries - 1) into the live slot (a window [K-1, C] is one contiguous run). The rest are (value head, BV
column block) programs of the recurrent state, laid out as the verify kernel's: each loads its [dk, BV] slice of
the live state, replays tokens 0 .. a_s of the row scratch (k, v, a, b as the verify kernel stored them) through
the verify kernel's own `delta_step` with its tile shapes and warps, and stores the slice back: the state the
verify held after token a_s, one state read and written a sequence and layer, where storing a state after every
token would hold 1 + k of them. A sequence whose slot is < 0 (a padded row of a graph bucket) reads and writes
nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.kernels._triton import i64, next_pow2
from deltaserve.kernels.gdn_spec import row_key_heads
from deltaserve.kernels.gdn_spec_triton import VERIFY_NUM_WARPS, delta_step
from deltaserve.kernels.gdn_triton import state_block_v

BLOCK = 2048


# the step's width and the sequence count change with the step: unspecialised, so no variant compiles while serving
@triton.jit(do_not_specialize=["width"])
def _spec_state_commit_kernel(
    conv_ptr,
    ssm_ptr,
    scratch_conv_ptr,
    rows_ptr,
    A_log_ptr,
    dt_bias_ptr,
    slots_ptr,
    accepted_ptr,
    width,
    stride_c_layer,
    stride_c_slot,
    stride_sc_layer,
    stride_sc_seq,
    stride_sc_entry,
    stride_h_layer,
    stride_h_slot,
    stride_h_head,
    stride_h_k,
    stride_r_layer,
    stride_r_seq,
    stride_r_col,
    stride_g_layer,
    conv_entries,
    row_entries,
    N_CONV: tl.constexpr,
    CONV_BLOCKS: tl.constexpr,
    BLOCK: tl.constexpr,
    HK: tl.constexpr,
    HV: tl.constexpr,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    i_b = tl.program_id(0)
    i_s = i64(tl.program_id(1))
    i_l = i64(tl.program_id(2))
    i_slot = i64(tl.load(slots_ptr + i_s))
    i_acc = i64(tl.load(accepted_ptr + i_s))
    is_live = i_slot >= 0
    i_slot = tl.maximum(i_slot, 0)  # no address from slot -1 (its lanes are masked anyway)
    if i_b < CONV_BLOCKS:
        o = tl.arange(0, BLOCK)
        i_conv = tl.minimum(tl.maximum(i_acc, 0), conv_entries - 1)
        o_conv = i64(i_b) * BLOCK + o  # [BLOCK]
        m_conv = (o_conv < N_CONV) & is_live
        p_conv = scratch_conv_ptr + i_l * stride_sc_layer + i_s * stride_sc_seq + i_conv * stride_sc_entry
        b_conv = tl.load(p_conv + o_conv, mask=m_conv)
        tl.store(conv_ptr + i_l * stride_c_layer + i_slot * stride_c_slot + o_conv, b_conv, mask=m_conv)
    else:
        num_v_blocks = tl.cdiv(DV, BV)
        i_h = (i_b - CONV_BLOCKS) // num_v_blocks
        i_v = (i_b - CONV_BLOCKS) % num_v_blocks
        i_hk = i_h // GROUP
        o_k = tl.arange(0, BK)  # [BK]
        m_k = o_k < DK
        o_v = i_v * BV + tl.arange(0, BV)  # [BV]
        m_v = o_v < DV
        m_s = m_k[:, None] & m_v[None, :] & is_live
        p_s = ssm_ptr + i_l * stride_h_layer + i_slot * stride_h_slot + i_h * stride_h_head
        p_s += o_k[:, None] * stride_h_k + o_v[None, :]
        b_s = tl.load(p_s, mask=m_s, other=0.0).to(tl.float32)  # [BK, BV]: the live state
        b_A_log = tl.load(A_log_ptr + i_l * stride_g_layer + i_h)
        b_dt_bias = tl.load(dt_bias_ptr + i_l * stride_g_layer + i_h)
        p_r = rows_ptr + i_l * stride_r_layer + i_s * stride_r_seq
        # tokens 0 .. a_s, never past the step's columns or the scratch's entries; none for a padded sequence
        num_tokens = tl.where(is_live, tl.minimum(tl.minimum(i_acc + 1, width), row_entries), 0)
        for j in range(num_tokens):
            p_col = p_r + j * stride_r_col
            b_k = tl.load(p_col + i_hk * DK + o_k, mask=m_k, other=0.0)
            b_v = tl.load(p_col + HK * DK + i_h * DV + o_v, mask=m_v, other=0.0)
            b_a = tl.load(p_col + HK * DK + HV * DV + i_h)
            b_b = tl.load(p_col + HK * DK + HV * DV + HV + i_h)
            b_s = delta_step(b_s, b_k, b_v, b_a, b_b, b_A_log, b_dt_bias)
        tl.store(p_s, b_s.to(ssm_ptr.dtype.element_ty), mask=m_s)


def _require_slot_runs(name: str, t: torch.Tensor, lead: int) -> None:
    """The dims after the first `lead` form one contiguous run of elements (a slot's or an entry's state)."""
    assert t[(0,) * lead].is_contiguous(), f"{name} {tuple(t.shape)}: each state must be contiguous ({t.stride()})"


def spec_state_commit_layers_triton(
    conv_states: torch.Tensor,
    ssm_states: torch.Tensor,
    scratch_conv: torch.Tensor,
    scratch_rows: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state_indices: torch.Tensor,
    num_accepted: torch.Tensor,
    width: int,
) -> None:
    """conv_states [L, slots, K-1, C], ssm_states [L, slots, HV, dk, dv], scratch_conv [L, S_max, W_max, K-1, C],
    scratch_rows [L, S_max, W_max, R], A_log / dt_bias [L, HV], state_indices [S], num_accepted [S] (on the device):
    every layer's live slot state_indices[s] <- the conv window after token num_accepted[s] of the step's `width`
    columns, and the recurrent state with tokens 0 .. num_accepted[s] replayed on it."""
    num_layers, num_seqs = conv_states.shape[0], state_indices.shape[0]
    if num_layers == 0 or num_seqs == 0:
        return
    assert ssm_states.shape[0] == scratch_conv.shape[0] == scratch_rows.shape[0] == num_layers, "layer counts differ"
    assert A_log.shape[0] == dt_bias.shape[0] == num_layers, "gate parameters: one row a layer"
    assert scratch_conv.shape[1] >= num_seqs and scratch_rows.shape[1] >= num_seqs, "scratch too small for the step"
    assert tuple(scratch_conv.shape[3:]) == tuple(conv_states.shape[2:]), "conv scratch and states differ in shape"
    assert scratch_conv.dtype == conv_states.dtype, "conv scratch dtype differs"
    for name, t, lead in (("conv_states", conv_states, 2), ("ssm_states", ssm_states, 2),
                          ("scratch_conv", scratch_conv, 3), ("scratch_rows", scratch_rows, 3)):  # fmt: skip
        _require_slot_runs(name, t, lead)
    assert A_log.stride(1) == dt_bias.stride(1) == 1 and A_log.stride(0) == dt_bias.stride(0), "gate rows differ"
    num_v_heads, head_k_dim, head_v_dim = ssm_states.shape[2:]
    num_k_heads = row_key_heads(scratch_rows.shape[3], num_v_heads, head_k_dim, head_v_dim)
    n_conv = conv_states[0, 0].numel()
    conv_blocks = triton.cdiv(n_conv, BLOCK)
    block_v = state_block_v(head_v_dim)  # the verify kernel's column block: the same tile, the same reduction
    grid = (conv_blocks + num_v_heads * triton.cdiv(head_v_dim, block_v), num_seqs, num_layers)
    _spec_state_commit_kernel[grid](
        conv_states, ssm_states, scratch_conv, scratch_rows, A_log, dt_bias, state_indices, num_accepted, width,
        conv_states.stride(0), conv_states.stride(1),
        scratch_conv.stride(0), scratch_conv.stride(1), scratch_conv.stride(2),
        ssm_states.stride(0), ssm_states.stride(1), ssm_states.stride(2), ssm_states.stride(3),
        scratch_rows.stride(0), scratch_rows.stride(1), scratch_rows.stride(2), A_log.stride(0),
        scratch_conv.shape[2], scratch_rows.shape[2],
        N_CONV=n_conv, CONV_BLOCKS=conv_blocks, BLOCK=BLOCK, HK=num_k_heads, HV=num_v_heads,
        GROUP=num_v_heads // num_k_heads, DK=head_k_dim, DV=head_v_dim, BK=next_pow2(head_k_dim), BV=block_v,
        num_warps=VERIFY_NUM_WARPS,
    )  # fmt: skip
