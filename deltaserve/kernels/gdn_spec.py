"""The Gated DeltaNet ops of a speculative verify step: multi-token recurrent decode with per-token states, and the
commit that rolls each sequence back to its last accepted token (docs/speculative-decoding.md).

A verify chunk is a sequence's last sampled token followed by its k drafts, 1 + k tokens. Its tokens are addressed
through `token_index` [S, W] (W = the widest chunk of the step): row s lists the step rows of sequence s in order,
-1 past its own 1 + k_s. Both ops read the live state of each sequence's slot. The conv op writes the window after
every token j into scratch entry [s, j] and leaves the live slot alone; the recurrent op writes the state after
every token j < W - 1 into scratch entry [s, j] and the state after the last column, W - 1, into the live slot
itself, so its scratch holds k states a chunk, not 1 + k (the recurrent state is ~98 % of a slot's bytes: one state
fewer a speculating sequence, as vLLM's 1 + k). Once the rejection sampler knows how many drafts each sequence
accepted (a_s, on the device), `spec_state_commit` copies conv scratch [s, a_s] into the live slot, and recurrent
scratch [s, a_s] where a_s < W - 1 (a chunk that accepted all it ran already has its state in place), so a
rejection costs no recompute and the host never waits for the counts.

- `causal_conv1d_verify`: conv + SiLU of the chunk's pre-conv rows after the slot's K-1 rows; scratch_conv
  [S_max, W_max, K-1, C] gets the window after each token (a padded column repeats the last real window, as the
  recurrent state repeats the last real state). Rounding as causal_conv1d_update.
- `gdn_verify`: the recurrent delta rule token by token (gdn_decode's arithmetic: fp32, q/k not rounded);
  scratch_ssm [S_max, >= W_max - 1, HV, dk, dv] gets the state after each token but the last, the live slot the
  state after the last column (a padded last column: the last real state).
- `spec_state_commit`: live slot <- the state after token num_accepted[s], conv and recurrent;
  `spec_state_commit_layers` the same over every GDN layer's stacked tensors in one call (on CUDA one Triton launch,
  kernels/gdn_spec_commit_triton.py, where the per-layer twin is ~28 small kernels a layer).

A verify sequence whose state index is < 0 (a padded row of a CUDA-graph bucket) is skipped, as the decode ops skip
slot -1: no slot is read or written, its scratch entries are not written, the output rows of its tokens are zeros,
and the commit writes no slot for it. (Each layer's slot pool is a view into one tensor over all GDN layers, so a
slot -1 would address the previous layer's last slot, or memory before the pool.)

The `*_ref` twins are vectorised over sequences with no host sync (a loop over the W <= 1 + k token columns only),
so they are also a correct device path. On CUDA `causal_conv1d_verify` runs its Triton kernel
(kernels/gdn_spec_conv_triton.py: one launch a layer in place of the twin's ~3·W·K elementwise launches), and
`gdn_verify` its own (kernels/gdn_spec_triton.py) when the state is fp32.
"""

from __future__ import annotations

import torch

from deltaserve.kernels._dispatch import output, triton_or_ref, use_triton
from deltaserve.kernels.gdn import _gates, _l2norm, _write_slots


def _scatter_rows(out: torch.Tensor, token_index: torch.Tensor, column: int, values: torch.Tensor) -> None:
    """out[token_index[s, column]] = values[s] where the index is >= 0; padded entries go to a spare row (sliced off
    by the caller), so no boolean mask syncs the host."""
    index = token_index[:, column]
    spare = out.shape[0] - 1
    out.index_copy_(0, torch.where(index >= 0, index, spare), values.to(out.dtype))


def causal_conv1d_verify_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_states: torch.Tensor,
    state_indices: torch.Tensor,
    token_index: torch.Tensor,
    scratch_conv: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [N, C] (the verify rows), weight [C, K], conv_states [slots, K-1, C], state_indices [S], token_index [S, W]
    -> y [N, C]; scratch_conv[s, j] = the K-1 pre-conv rows after token j (padded columns repeat the last real
    window). The live slots are not written; a sequence with slot < 0 reads none, writes no scratch and gets zero
    output rows."""
    num_seqs, width = token_index.shape
    kernel_size = weight.shape[1]
    out = output(out, tuple(x.shape), x)
    is_live = state_indices >= 0  # [S]: padded sequences of a CUDA-graph bucket carry slot -1
    window = conv_states.index_select(0, state_indices.long().clamp(min=0)).to(x.dtype)  # [S, K-1, C]
    padded = torch.empty(x.shape[0] + 1, x.shape[1], dtype=x.dtype, device=x.device)  # a spare row for padding
    for j in range(width):
        index = token_index[:, j]
        rows = torch.cat([window, x.index_select(0, index.clamp(min=0))[:, None]], dim=1)  # [S, K, C]
        acc = torch.zeros(num_seqs, x.shape[1], dtype=torch.float32, device=x.device)
        for t in range(kernel_size):
            acc += (rows[:, t] * weight[:, t]).to(x.dtype).float()
        _scatter_rows(padded, token_index, j, torch.where(is_live[:, None], torch.nn.functional.silu(acc), 0.0))
        window = torch.where((index >= 0)[:, None, None], rows[:, 1:], window)
        scratch_conv[:num_seqs, j] = torch.where(
            is_live[:, None, None], window.to(scratch_conv.dtype), scratch_conv[:num_seqs, j]
        )
    out.copy_(padded[:-1])
    return out


causal_conv1d_verify = triton_or_ref(causal_conv1d_verify_ref, "gdn_spec_conv_triton.causal_conv1d_verify_triton")


def gdn_verify_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
    token_index: torch.Tensor,
    scratch_ssm: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q, k [N, HK, dk]; v [N, HV, dv]; a, b [N, HV] (the verify rows) -> o [N, HV, dv]; scratch_ssm[s, j] = the
    state after token j of sequence s for j < W - 1, and its live slot the state after column W - 1 (padded columns
    repeat the last real state); a sequence with slot < 0 reads and writes no slot, writes no scratch and gets zero
    output rows."""
    num_seqs, width = token_index.shape
    num_v_heads, head_k_dim = v.shape[1], q.shape[2]
    group = num_v_heads // q.shape[1]
    g, beta = _gates(a, b, A_log, dt_bias)  # [N, HV]
    q_hat = _l2norm(q).repeat_interleave(group, dim=1) * head_k_dim**-0.5  # [N, HV, dk]
    k_hat = _l2norm(k).repeat_interleave(group, dim=1)  # [N, HV, dk]
    out = output(out, tuple(v.shape), v)
    padded = torch.empty((v.shape[0] + 1, *v.shape[1:]), dtype=v.dtype, device=v.device)
    is_live = (state_indices >= 0)[:, None, None, None]  # [S, 1, 1, 1]: slot -1 is CUDA-graph padding
    state = ssm_states.index_select(0, state_indices.long().clamp(min=0)).float()  # [S, HV, dk, dv]
    for j in range(width):
        index = token_index[:, j]
        rows = index.clamp(min=0)
        is_real = (index >= 0)[:, None, None, None]
        new = state * g[rows].exp()[:, :, None, None]
        u = beta[rows][:, :, None] * (v[rows].float() - torch.einsum("shkv,shk->shv", new, k_hat[rows]))
        new = new + k_hat[rows][:, :, :, None] * u[:, :, None, :]
        o = torch.einsum("shkv,shk->shv", new, q_hat[rows])  # [S, HV, dv]
        _scatter_rows(padded, token_index, j, torch.where(is_live[:, :, :, 0], o, 0.0))
        state = torch.where(is_real, new, state)
        if j < width - 1:
            scratch_ssm[:num_seqs, j] = torch.where(is_live, state.to(scratch_ssm.dtype), scratch_ssm[:num_seqs, j])
    # the last column's state goes straight into the live slot (the commit copies only a shorter accepted run)
    _write_live(ssm_states, state_indices, state)
    out.copy_(padded[:-1])
    return out


def _write_live(states: torch.Tensor, state_indices: torch.Tensor, values: torch.Tensor) -> None:
    """states[state_indices[s]] <- values[s] for every s with a slot >= 0, with no host sync (_write_slots)."""
    if state_indices.shape[0] == 0:
        return
    slots = state_indices.long()
    _write_slots(states, slots, values, slots >= 0)


def gdn_verify(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
    token_index: torch.Tensor,
    scratch_ssm: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    args = (q, k, v, a, b, A_log, dt_bias, ssm_states, state_indices, token_index, scratch_ssm)
    if use_triton(q) and scratch_ssm.dtype == torch.float32:
        from deltaserve.kernels.gdn_spec_triton import gdn_verify_triton

        return gdn_verify_triton(*args, out=out)
    return gdn_verify_ref(*args, out=out)


def spec_state_commit(
    conv_states: torch.Tensor,
    ssm_states: torch.Tensor,
    scratch_conv: torch.Tensor,
    scratch_ssm: torch.Tensor,
    state_indices: torch.Tensor,
    num_accepted: torch.Tensor,
    width: int,
) -> None:
    """Live slot state_indices[s] <- the state after token num_accepted[s] of the step's W = width columns: conv
    scratch [s, num_accepted[s]], and recurrent scratch [s, num_accepted[s]] where num_accepted[s] < W - 1 (at
    W - 1 gdn_verify already left that state in the live slot); num_accepted [S] stays on the device. A sequence with
    slot < 0 commits nothing; neither does a sequence whose state is in place (_write_slots' anchor, no host sync)."""
    num_seqs = state_indices.shape[0]
    if num_seqs == 0:
        return
    seq = torch.arange(num_seqs, device=state_indices.device)
    slots = state_indices.long()
    is_live = slots >= 0  # [S]
    accepted = num_accepted.long()
    conv_entry = accepted.clamp(0, scratch_conv.shape[1] - 1)  # never an index outside the scratch
    _write_slots(conv_states, slots, scratch_conv[seq, conv_entry], is_live)
    if width > 1:  # width 1: the one column's state is in the live slot already
        ssm_entry = accepted.clamp(0, min(width - 2, scratch_ssm.shape[1] - 1))
        _write_slots(ssm_states, slots, scratch_ssm[seq, ssm_entry], is_live & (accepted < width - 1))


def spec_state_commit_layers_ref(
    conv_states: torch.Tensor,
    ssm_states: torch.Tensor,
    scratch_conv: torch.Tensor,
    scratch_ssm: torch.Tensor,
    state_indices: torch.Tensor,
    num_accepted: torch.Tensor,
    width: int,
) -> None:
    """spec_state_commit over every GDN layer at once: conv_states [L, slots, K-1, C], ssm_states [L, slots, HV,
    dk, dv], scratch_conv [L, S_max, W_max, K-1, C], scratch_ssm [L, S_max, >= W_max - 1, HV, dk, dv] (the per-layer
    tensors stacked: runner/spec_commit.py), state_indices [S], num_accepted [S]; layer l as
    spec_state_commit(conv_states[l], ...)."""
    for layer in range(conv_states.shape[0]):
        spec_state_commit(conv_states[layer], ssm_states[layer], scratch_conv[layer], scratch_ssm[layer],
                          state_indices, num_accepted, width)  # fmt: skip


spec_state_commit_layers = triton_or_ref(
    spec_state_commit_layers_ref, "gdn_spec_commit_triton.spec_state_commit_layers_triton", on="ssm_states"
)
