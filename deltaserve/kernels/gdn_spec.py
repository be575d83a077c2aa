"""The Gated DeltaNet ops of a speculative verify step: multi-token recurrent decode with per-token states, and the
commit that rolls each sequence back to its last accepted token (docs/speculative-decoding.md).

A verify chunk is a sequence's last sampled token followed by its k drafts, 1 + k tokens. Its tokens are addressed
through `token_index` [S, W] (W = the widest chunk of the step): row s lists the step rows of sequence s in order,
-1 past its own 1 + k_s. Neither op below touches the live slots: they read the live state of each sequence's slot
and write the state after every token j into scratch entry [s, j]. Once the rejection sampler knows how many drafts
each sequence accepted (a_s, on the device), `spec_state_commit` copies scratch [s, a_s] into the live slot, so a
rejection costs no recompute and the host never waits for the counts.

- `causal_conv1d_verify`: conv + SiLU of the chunk's pre-conv rows after the slot's K-1 rows; scratch_conv
  [S_max, W_max, K-1, C] gets the window after each token. Rounding as causal_conv1d_update.
- `gdn_verify`: the recurrent delta rule token by token (gdn_decode's arithmetic: fp32, q/k not rounded);
  scratch_ssm [S_max, W_max, HV, dk, dv] gets the state after each token.
- `spec_state_commit`: live slot <- scratch [s, num_accepted[s]], conv and recurrent state.

The `*_ref` twins are vectorised over sequences with no host sync (a loop over the W <= 1 + k token columns only),
so they are also a correct device path; `gdn_verify` runs its Triton kernel (kernels/gdn_spec_triton.py) on CUDA
when the state is fp32.
"""

from __future__ import annotations

import torch

from deltaserve.kernels._dispatch import output, use_triton
from deltaserve.kernels.gdn import _gates, _l2norm


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
    -> y [N, C]; scratch_conv[s, j] = the K-1 pre-conv rows after token j. The live slots are not written."""
    num_seqs, width = token_index.shape
    kernel_size = weight.shape[1]
    out = output(out, tuple(x.shape), x)
    history = conv_states.index_select(0, state_indices.long()).to(x.dtype)  # [S, K-1, C]
    chunk = x.index_select(0, token_index.clamp(min=0).reshape(-1)).view(num_seqs, width, -1)  # [S, W, C]
    rows = torch.cat([history, chunk], dim=1)  # [S, K-1+W, C]
    padded = torch.empty(x.shape[0] + 1, x.shape[1], dtype=x.dtype, device=x.device)  # a spare row for padding
    for j in range(width):
        acc = torch.zeros(num_seqs, x.shape[1], dtype=torch.float32, device=x.device)
        for t in range(kernel_size):
            acc += (rows[:, j + t] * weight[:, t]).to(x.dtype).float()
        _scatter_rows(padded, token_index, j, torch.nn.functional.silu(acc))
        scratch_conv[:num_seqs, j] = rows[:, j + 1 : j + kernel_size].to(scratch_conv.dtype)
    out.copy_(padded[:-1])
    return out


def causal_conv1d_verify(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_states: torch.Tensor,
    state_indices: torch.Tensor,
    token_index: torch.Tensor,
    scratch_conv: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    # The conv of a verify step is a few [S, C] elementwise passes; the vectorised twin serves both devices.
    return causal_conv1d_verify_ref(x, weight, conv_states, state_indices, token_index, scratch_conv, out)


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
    state after token j of sequence s (padded columns repeat the last real state). The live slots are not written."""
    num_seqs, width = token_index.shape
    num_v_heads, head_k_dim = v.shape[1], q.shape[2]
    group = num_v_heads // q.shape[1]
    g, beta = _gates(a, b, A_log, dt_bias)  # [N, HV]
    q_hat = _l2norm(q).repeat_interleave(group, dim=1) * head_k_dim**-0.5  # [N, HV, dk]
    k_hat = _l2norm(k).repeat_interleave(group, dim=1)  # [N, HV, dk]
    out = output(out, tuple(v.shape), v)
    padded = torch.empty((v.shape[0] + 1, *v.shape[1:]), dtype=v.dtype, device=v.device)
    state = ssm_states.index_select(0, state_indices.long()).float()  # [S, HV, dk, dv]
    for j in range(width):
        index = token_index[:, j]
        rows = index.clamp(min=0)
        is_real = (index >= 0)[:, None, None, None]
        new = state * g[rows].exp()[:, :, None, None]
        u = beta[rows][:, :, None] * (v[rows].float() - torch.einsum("shkv,shk->shv", new, k_hat[rows]))
        new = new + k_hat[rows][:, :, :, None] * u[:, :, None, :]
        _scatter_rows(padded, token_index, j, torch.einsum("shkv,shk->shv", new, q_hat[rows]))
        state = torch.where(is_real, new, state)
        scratch_ssm[:num_seqs, j] = state.to(scratch_ssm.dtype)
    out.copy_(padded[:-1])
    return out


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
) -> None:
    """Live slot state_indices[s] <- scratch[s, num_accepted[s]] (the state after the last accepted token), for
    conv and recurrent state; num_accepted [S] stays on the device."""
    num_seqs = state_indices.shape[0]
    seq = torch.arange(num_seqs, device=state_indices.device)
    accepted = num_accepted.long().clamp(0, scratch_ssm.shape[1] - 1)  # never an index outside the scratch
    slots = state_indices.long()
    conv_states.index_copy_(0, slots, scratch_conv[seq, accepted].to(conv_states.dtype))
    ssm_states.index_copy_(0, slots, scratch_ssm[seq, accepted].to(ssm_states.dtype))
