"""The Gated DeltaNet ops of a speculative verify step: multi-token recurrent decode over the live state, and the
commit that moves each sequence's state to its last accepted token (docs/speculative-decoding.md#memory).

A verify chunk is a sequence's last sampled token followed by its k drafts, 1 + k tokens. Its tokens are addressed
through `token_index` [S, W] (W = the widest chunk of the step): row s lists the step rows of sequence s in order,
-1 past its own 1 + k_s. Both ops read the live state of each sequence's slot and leave it alone. The conv op writes
the window after every token j into scratch entry [s, j]. The recurrent op keeps its running state in registers and
writes, for every token j, the inputs the delta rule consumed (k, v, a, b as it loaded them) into a row scratch
entry [s, j]: ~17 KB a token and layer on the 27B, where the state after the token would be 3 MiB, so a
speculating sequence holds one recurrent state (its live slot), not 1 + k. Once the rejection sampler knows how
many drafts each sequence accepted (a_s, on the device), `spec_state_commit` copies conv scratch [s, a_s] into the
live slot and replays tokens 0 .. a_s of the row scratch on the live recurrent state, with the verify op's own
arithmetic (the same step function on the same stored values), so the committed state is the one the verify op
held after token a_s; a rejection costs no forward recompute and the host never waits for the counts.

- `causal_conv1d_verify`: conv + SiLU of the chunk's pre-conv rows after the slot's K-1 rows; scratch_conv
  [S_max, W_max, K-1, C] gets the window after each token (a padded column repeats the last real window). Rounding
  as causal_conv1d_update.
- `gdn_verify`: the recurrent delta rule token by token (gdn_decode's arithmetic: fp32, q/k not rounded);
  scratch_rows [S_max, W_max, R] gets each real token's [k | v | a | b] (R = HK·dk + HV·dv + 2·HV, the inputs'
  dtype; `verify_row_width`); the live slot is read only.
- `spec_state_commit`: live slot <- the conv window after token num_accepted[s], and the recurrent state after
  replaying tokens 0 .. num_accepted[s]; `spec_state_commit_layers` the same over every GDN layer's stacked tensors
  in one call (on CUDA one Triton launch, kernels/gdn_spec_commit_triton.py).

A verify sequence whose state index is < 0 (a padded row of a CUDA-graph bucket) is skipped, as the decode ops skip
slot -1: no slot is read or written, its scratch entries are not written, the output rows of its tokens are zeros,
and the commit writes no slot for it. (Each layer's slot pool is a view into one tensor over all GDN layers, so a
slot -1 would address the previous layer's last slot, or memory before the pool.)

The `*_ref` twins are vectorised over sequences with no host sync (a loop over the W <= 1 + k token columns only),
so they are also a correct device path; the verify twin and the commit twin take each column's gates, norms and
update through one function (`_column_step`) on same-shaped tensors, so on the CPU the replayed state is bit-equal
to the verify's. On CUDA `causal_conv1d_verify` runs its Triton kernel (kernels/gdn_spec_conv_triton.py), and
`gdn_verify` its own (kernels/gdn_spec_triton.py) when the state is fp32.
"""

from __future__ import annotations

import torch

from deltaserve.kernels._dispatch import output, triton_or_ref, use_triton
from deltaserve.kernels.gdn import gdn_gates, l2norm_fp32, write_slots


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


def verify_row_width(num_k_heads: int, head_k_dim: int, num_v_heads: int, head_v_dim: int) -> int:
    """R, the elements of one row scratch entry: a token's k [HK·dk], v [HV·dv], a [HV] and b [HV]."""
    return num_k_heads * head_k_dim + num_v_heads * head_v_dim + 2 * num_v_heads


def row_key_heads(row_width: int, num_v_heads: int, head_k_dim: int, head_v_dim: int) -> int:
    """HK of a row scratch entry of R = row_width elements (verify_row_width's inverse, given the state's heads);
    refuses a width that is not [k | v | a | b]."""
    key = row_width - num_v_heads * head_v_dim - 2 * num_v_heads
    num_k_heads = key // head_k_dim
    assert num_k_heads > 0 and num_k_heads * head_k_dim == key and num_v_heads % num_k_heads == 0, (
        f"a row of {row_width} elements is not [k | v | a | b] for {num_v_heads} value heads of {head_k_dim} x "
        f"{head_v_dim}"
    )
    return num_k_heads


def _split_row(rows: torch.Tensor, num_k_heads: int, num_v_heads: int, head_v_dim: int) -> tuple[torch.Tensor, ...]:
    """rows [S, R] -> k [S, HK, dk], v [S, HV, dv], a [S, HV], b [S, HV] (views)."""
    key = rows.shape[1] - num_v_heads * head_v_dim - 2 * num_v_heads
    k = rows[:, :key].view(rows.shape[0], num_k_heads, key // num_k_heads)
    v = rows[:, key : key + num_v_heads * head_v_dim].view(rows.shape[0], num_v_heads, head_v_dim)
    a = rows[:, key + num_v_heads * head_v_dim : key + num_v_heads * head_v_dim + num_v_heads]
    return k, v, a, rows[:, key + num_v_heads * head_v_dim + num_v_heads :]


def _column_step(
    state: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
    dt_bias: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """One token a sequence: state [S, HV, dk, dv] fp32; k [S, HK, dk], v [S, HV, dv], a, b [S, HV] as loaded ->
    the state after the token (gdn_decode's arithmetic). The verify twin and the commit twin both step through here."""
    group = v.shape[1] // k.shape[1]
    g, beta = gdn_gates(a, b, A_log, dt_bias)  # [S, HV]
    k_hat = l2norm_fp32(k).repeat_interleave(group, dim=1)  # [S, HV, dk]
    new = state * g.exp()[:, :, None, None]
    u = beta[:, :, None] * (v.float() - torch.einsum("shkv,shk->shv", new, k_hat))
    return new + k_hat[:, :, :, None] * u[:, :, None, :]


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
    scratch_rows: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q, k [N, HK, dk]; v [N, HV, dv]; a, b [N, HV] (the verify rows) -> o [N, HV, dv]; scratch_rows[s, j] = token
    j's [k | v | a | b] for every real token of a live sequence (padded columns and sequences with slot < 0 write
    nothing); the live slots are read only; a sequence with slot < 0 gets zero output rows."""
    num_seqs, width = token_index.shape
    num_k_heads, head_k_dim = q.shape[1], q.shape[2]
    num_v_heads, head_v_dim = v.shape[1], v.shape[2]
    assert scratch_rows.shape[2] == verify_row_width(num_k_heads, head_k_dim, num_v_heads, head_v_dim)
    group = num_v_heads // num_k_heads
    out = output(out, tuple(v.shape), v)
    padded = torch.empty((v.shape[0] + 1, *v.shape[1:]), dtype=v.dtype, device=v.device)
    is_live = state_indices >= 0  # [S]: slot -1 is CUDA-graph padding
    state = ssm_states.index_select(0, state_indices.long().clamp(min=0)).float()  # [S, HV, dk, dv]
    for j in range(width):
        index = token_index[:, j]
        rows = index.clamp(min=0)
        is_real = index >= 0
        k_j, v_j, a_j, b_j = (t.index_select(0, rows) for t in (k, v, a, b))
        new = _column_step(state, k_j, v_j, a_j, b_j, A_log, dt_bias)
        q_hat = l2norm_fp32(q.index_select(0, rows)).repeat_interleave(group, dim=1) * head_k_dim**-0.5  # [S, HV, dk]
        o = torch.einsum("shkv,shk->shv", new, q_hat)  # [S, HV, dv]
        _scatter_rows(padded, token_index, j, torch.where(is_live[:, None, None], o, 0.0))
        state = torch.where(is_real[:, None, None, None], new, state)
        packed = torch.cat([k_j.flatten(1), v_j.flatten(1), a_j, b_j], dim=1).to(scratch_rows.dtype)  # [S, R]
        writes = (is_live & is_real)[:, None]
        scratch_rows[:num_seqs, j] = torch.where(writes, packed, scratch_rows[:num_seqs, j])
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
    scratch_rows: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    args = (q, k, v, a, b, A_log, dt_bias, ssm_states, state_indices, token_index, scratch_rows)
    if use_triton(q) and ssm_states.dtype == torch.float32:
        from deltaserve.kernels.gdn_spec_triton import gdn_verify_triton

        return gdn_verify_triton(*args, out=out)
    return gdn_verify_ref(*args, out=out)


def spec_state_commit(
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
    """Live slot state_indices[s] <- the state after token num_accepted[s] of the step's W = width columns: conv
    scratch [s, num_accepted[s]], and the live recurrent state with tokens 0 .. num_accepted[s] of scratch_rows
    [S_max, >= W, R] replayed on it (_column_step, as gdn_verify_ref stepped them). ssm_states [slots, HV, dk, dv]
    gives the heads; A_log, dt_bias [HV] the layer's gates; num_accepted [S] stays on the device. A sequence with
    slot < 0 commits nothing (write_slots' anchor, no host sync)."""
    num_seqs = state_indices.shape[0]
    if num_seqs == 0:
        return
    seq = torch.arange(num_seqs, device=state_indices.device)
    slots = state_indices.long()
    is_live = slots >= 0  # [S]
    accepted = num_accepted.long()
    conv_entry = accepted.clamp(0, scratch_conv.shape[1] - 1)  # never an index outside the scratch
    write_slots(conv_states, slots, scratch_conv[seq, conv_entry], is_live)
    num_v_heads, head_k_dim, head_v_dim = ssm_states.shape[1:]
    num_k_heads = row_key_heads(scratch_rows.shape[2], num_v_heads, head_k_dim, head_v_dim)
    state = ssm_states.index_select(0, slots.clamp(min=0)).float()  # [S, HV, dk, dv]
    for j in range(min(width, scratch_rows.shape[1])):
        k_j, v_j, a_j, b_j = _split_row(scratch_rows[:num_seqs, j], num_k_heads, num_v_heads, head_v_dim)
        new = _column_step(state, k_j, v_j, a_j, b_j, A_log, dt_bias)
        state = torch.where((accepted >= j)[:, None, None, None], new, state)
    write_slots(ssm_states, slots, state, is_live)


def spec_state_commit_layers_ref(
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
    """spec_state_commit over every GDN layer at once: conv_states [L, slots, K-1, C], ssm_states [L, slots, HV,
    dk, dv], scratch_conv [L, S_max, W_max, K-1, C], scratch_rows [L, S_max, W_max, R], A_log / dt_bias [L, HV] (the
    per-layer tensors stacked: runner/spec_commit.py), state_indices [S], num_accepted [S]; layer l as
    spec_state_commit(conv_states[l], ...)."""
    for layer in range(conv_states.shape[0]):
        spec_state_commit(conv_states[layer], ssm_states[layer], scratch_conv[layer], scratch_rows[layer],
                          A_log[layer], dt_bias[layer], state_indices, num_accepted, width)  # fmt: skip


spec_state_commit_layers = triton_or_ref(
    spec_state_commit_layers_ref, "gdn_spec_commit_triton.spec_state_commit_layers_triton", on="ssm_states"
)
