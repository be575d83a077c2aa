"""Triton kernel of the verify step's commit over every GDN layer at once (kernels/gdn_spec.py:
`spec_state_commit_layers_ref` is its twin): one launch where the twin's per-layer torch ops are ~28 small kernels
a layer, ~1,350 a 27B verify step (docs/speculative-decoding.md#the-commit-one-launch).

Grid (block of a slot's state, verify sequence, layer), from shapes only: no host sync, so it captures in a CUDA
graph. A slot's conv window [K-1, C] and recurrent state [HV, dk, dv] are each one contiguous run of elements, so a
program copies one BLOCK of one of them: the first CONV_BLOCKS blocks of a (sequence, layer) the conv window of
scratch entry clamp(a_s, 0, conv_entries - 1), the rest the recurrent state of entry clamp(a_s, 0, min(width - 2,
ssm_entries - 1)) where a_s < width - 1 (a chunk that accepted all its columns has its recurrent state in the live
slot already). A sequence whose slot is < 0 (a padded row of a graph bucket) copies nothing. A plain copy: the
values are bit-equal to the twin's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.kernels._triton import i64

BLOCK = 2048


# the step's width and the sequence count change with the step: unspecialised, so no variant compiles while serving
@triton.jit(do_not_specialize=["width"])
def _spec_state_commit_kernel(
    conv_ptr,
    ssm_ptr,
    scratch_conv_ptr,
    scratch_ssm_ptr,
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
    stride_sh_layer,
    stride_sh_seq,
    stride_sh_entry,
    conv_entries,
    ssm_entries,
    N_CONV: tl.constexpr,
    N_SSM: tl.constexpr,
    CONV_BLOCKS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i_b = tl.program_id(0)
    i_s = i64(tl.program_id(1))
    i_l = i64(tl.program_id(2))
    i_slot = i64(tl.load(slots_ptr + i_s))
    i_acc = i64(tl.load(accepted_ptr + i_s))
    is_live = i_slot >= 0
    i_slot = tl.maximum(i_slot, 0)  # no address from slot -1 (its lanes are masked anyway)
    o = tl.arange(0, BLOCK)
    if i_b < CONV_BLOCKS:
        i_conv = tl.minimum(tl.maximum(i_acc, 0), conv_entries - 1)
        o_conv = i64(i_b) * BLOCK + o  # [BLOCK]
        m_conv = (o_conv < N_CONV) & is_live
        p_conv = scratch_conv_ptr + i_l * stride_sc_layer + i_s * stride_sc_seq + i_conv * stride_sc_entry
        b_conv = tl.load(p_conv + o_conv, mask=m_conv)
        tl.store(conv_ptr + i_l * stride_c_layer + i_slot * stride_c_slot + o_conv, b_conv, mask=m_conv)
    else:
        i_ssm = tl.minimum(tl.maximum(i_acc, 0), tl.minimum(width - 2, ssm_entries - 1))
        i_ssm = tl.maximum(i_ssm, 0)  # width 1 writes nothing; keep the address inside the scratch
        o_ssm = i64(i_b - CONV_BLOCKS) * BLOCK + o  # [BLOCK]
        m_ssm = (o_ssm < N_SSM) & is_live & (i_acc < width - 1) & (width > 1)
        p_ssm = scratch_ssm_ptr + i_l * stride_sh_layer + i_s * stride_sh_seq + i_ssm * stride_sh_entry
        b_ssm = tl.load(p_ssm + o_ssm, mask=m_ssm)
        tl.store(ssm_ptr + i_l * stride_h_layer + i_slot * stride_h_slot + o_ssm, b_ssm, mask=m_ssm)


def _require_slot_runs(name: str, t: torch.Tensor, lead: int) -> None:
    """The dims after the first `lead` form one contiguous run of elements (a slot's or an entry's state)."""
    assert t[(0,) * lead].is_contiguous(), f"{name} {tuple(t.shape)}: each state must be contiguous ({t.stride()})"


def spec_state_commit_layers_triton(
    conv_states: torch.Tensor,
    ssm_states: torch.Tensor,
    scratch_conv: torch.Tensor,
    scratch_ssm: torch.Tensor,
    state_indices: torch.Tensor,
    num_accepted: torch.Tensor,
    width: int,
) -> None:
    """conv_states [L, slots, K-1, C], ssm_states [L, slots, HV, dk, dv], scratch_conv [L, S_max, W_max, K-1, C],
    scratch_ssm [L, S_max, >= W_max - 1, HV, dk, dv], state_indices [S], num_accepted [S] (on the device): every
    layer's live slot state_indices[s] <- the state after token num_accepted[s] of the step's `width` columns."""
    num_layers, num_seqs = conv_states.shape[0], state_indices.shape[0]
    if num_layers == 0 or num_seqs == 0:
        return
    assert ssm_states.shape[0] == scratch_conv.shape[0] == scratch_ssm.shape[0] == num_layers, "layer counts differ"
    assert scratch_conv.shape[1] >= num_seqs and scratch_ssm.shape[1] >= num_seqs, "scratch too small for the step"
    assert tuple(scratch_conv.shape[3:]) == tuple(conv_states.shape[2:]), "conv scratch and states differ in shape"
    assert tuple(scratch_ssm.shape[3:]) == tuple(ssm_states.shape[2:]), "recurrent scratch and states differ in shape"
    assert scratch_conv.dtype == conv_states.dtype and scratch_ssm.dtype == ssm_states.dtype, "scratch dtype differs"
    for name, t, lead in (("conv_states", conv_states, 2), ("ssm_states", ssm_states, 2),
                          ("scratch_conv", scratch_conv, 3), ("scratch_ssm", scratch_ssm, 3)):  # fmt: skip
        _require_slot_runs(name, t, lead)
    n_conv = conv_states[0, 0].numel()
    n_ssm = ssm_states[0, 0].numel()
    conv_blocks = triton.cdiv(n_conv, BLOCK)
    grid = (conv_blocks + triton.cdiv(n_ssm, BLOCK), num_seqs, num_layers)
    _spec_state_commit_kernel[grid](
        conv_states, ssm_states, scratch_conv, scratch_ssm, state_indices, num_accepted, width,
        conv_states.stride(0), conv_states.stride(1),
        scratch_conv.stride(0), scratch_conv.stride(1), scratch_conv.stride(2),
        ssm_states.stride(0), ssm_states.stride(1),
        scratch_ssm.stride(0), scratch_ssm.stride(1), scratch_ssm.stride(2),
        scratch_conv.shape[2], scratch_ssm.shape[2],
        N_CONV=n_conv, N_SSM=n_ssm, CONV_BLOCKS=conv_blocks, BLOCK=BLOCK, num_warps=4,
    )  # fmt: skip
