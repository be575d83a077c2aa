"""Gated DeltaNet core: gates, q/k L2 norm and the delta-rule recurrence over fp32 state slots.

ssm_states [num_slots, HV, dk, dv] fp32 (S in the orientation of docs/ARCHITECTURE.md#gated-deltanet-and-its-state).
Value head h reads q/k head h // (HV/HK). Per token: S ← exp(g)·S; u = β(v − Sᵀk̂); S ← S + k̂uᵀ; o = Sᵀq̂, with
g = −exp(A_log)·softplus(a + dt_bias), β = sigmoid(b), q̂ = l2norm(q)·dk^-0.5, k̂ = l2norm(k).

- `gdn_prefill`: varlen sequences by query_start_loc, the chunked (WY) form with chunks of 64; reads each
  sequence's initial state from its slot (zeros when has_initial_state is False) and writes the final state
  back (a slot < 0 starts from zeros and is not written); optionally also the state at the start of one chosen
  64-token chunk of a sequence into another slot (an in-step prefix-cache checkpoint, docs/prefix-caching.md).
  As vLLM's prefill, the L2-normed q/k are rounded to the input dtype before the core. The layer's `backend`
  picks the kernel per call (`takes_flashinfer`): deltaserve's own, or FlashInfer's (kernels/gdn_flashinfer.py;
  the default where it runs, for calls of FLASHINFER_MIN_TOKENS rows or more) for calls without an in-step
  checkpoint; `gdn_prefill_ref` is the twin of
  both. `chunk_inverse_ref`: (I + A)^-1 of strictly lower chunk tiles, the twin of the chunked prefill's blocked
  inverse.
- `gdn_decode`: one token per sequence, the recurrent form in place on the slots, all fp32 (q/k not
  rounded), as vLLM's packed decode kernel. Slots < 0 (CUDA-graph padding) are skipped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltaserve.kernels._dispatch import output, triton_or_ref

CHUNK_SIZE = 64


def gdn_gates(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    g = -torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float())  # [T, HV]
    beta = torch.sigmoid(b.float())  # [T, HV]
    return g, beta


def write_slots(
    states: torch.Tensor, slots: torch.Tensor, values: torch.Tensor, writes: torch.Tensor, in_place: bool = False
) -> None:
    """states[slots[s]] <- values[s] where writes[s], with no host sync. The rows that write nothing cannot be dropped
    from the copy without one, so each is aimed at an anchor slot with the value that slot ends with anyway: the first
    writing row's slot and value, or, when none writes, slot 0 and its own content. Duplicate indices in index_copy_
    then all carry identical values, so the result does not depend on their order. in_place: values (in states'
    dtype, a buffer the caller no longer needs) takes the masked rows itself, so no copy of the states is made (the
    FlashInfer GDN prefill's write-back, kernels/gdn_flashinfer.py)."""
    # [1]-shaped picks (index_select), not a 0-d index: indexing by a 0-d tensor may read it on the host
    first = writes.int().argmax().view(1)  # [1]: the first writing row (0 when none writes)
    any_write = writes.index_select(0, first)  # [1]
    anchor = torch.where(any_write, slots.index_select(0, first), 0)  # [1]
    values = values.to(states.dtype)  # [S, ...]
    keep = torch.where(any_write, values.index_select(0, first), states.index_select(0, anchor))  # [1, ...]
    mask = writes.view(-1, *([1] * (values.dim() - 1)))
    rows = torch.where(mask, values, keep, out=values) if in_place else torch.where(mask, values, keep)
    states.index_copy_(0, torch.where(writes, slots, anchor), rows)


def l2norm_fp32(x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return xf / torch.sqrt((xf * xf).sum(-1, keepdim=True) + 1e-6)


def _chunked_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
    save_chunk: int = -1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """One sequence, fp32: q, k [L, HV, dk] (normed, q scaled), v [L, HV, dv], g, beta [L, HV], state [HV, dk, dv]
    -> (o, final state, the state at the start of chunk save_chunk: None when save_chunk is -1)."""
    length = q.shape[0]
    pad = (CHUNK_SIZE - length % CHUNK_SIZE) % CHUNK_SIZE
    # Padded steps carry k = 0, β = 0, g = 0: they leave the state unchanged.
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)).transpose(0, 1) for x in (q, k, v))  # [HV, Lp, *]
    g, beta = (F.pad(x, (0, 0, 0, pad)).transpose(0, 1) for x in (g, beta))  # [HV, Lp]
    num_heads = q.shape[0]
    num_chunks = q.shape[1] // CHUNK_SIZE
    q, k, v = (x.reshape(num_heads, num_chunks, CHUNK_SIZE, -1) for x in (q, k, v))  # [HV, N, C, *]
    g, beta = (x.reshape(num_heads, num_chunks, CHUNK_SIZE) for x in (g, beta))  # [HV, N, C]
    cum_g = g.cumsum(-1)  # [HV, N, C]
    is_causal = torch.ones(CHUNK_SIZE, CHUNK_SIZE, dtype=torch.bool, device=q.device).tril()
    decay = (cum_g[..., :, None] - cum_g[..., None, :]).masked_fill(~is_causal, float("-inf")).exp()  # [HV, N, C, C]
    k_beta = k * beta[..., None]
    strict_lower = (k_beta @ k.transpose(-1, -2)) * decay
    strict_lower = strict_lower.tril(-1)  # A_ij = β_i k_i·k_j e^{Γi−Γj}, j < i
    eye = torch.eye(CHUNK_SIZE, device=q.device, dtype=q.dtype)
    system = eye + strict_lower  # (I + A): unit lower triangular
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)  # [HV, N, C, dv]
    w = torch.linalg.solve_triangular(
        system, k_beta * cum_g.exp()[..., None], upper=False, unitriangular=True
    )  # [HV, N, C, dk]
    out = torch.empty_like(u)
    saved = None
    for i in range(num_chunks):
        if i == save_chunk:
            saved = state.clone()
        v_new = u[:, i] - w[:, i] @ state  # [HV, C, dv]
        intra = (q[:, i] @ k[:, i].transpose(-1, -2)) * decay[:, i]  # [HV, C, C]
        out[:, i] = (q[:, i] * cum_g[:, i, :, None].exp()) @ state + intra @ v_new
        last = cum_g[:, i, -1]  # [HV]
        state = (
            state * last.exp()[:, None, None]
            + (k[:, i] * (last[:, None] - cum_g[:, i]).exp()[..., None]).transpose(-1, -2) @ v_new
        )
    out = out.reshape(num_heads, -1, out.shape[-1])[:, :length].transpose(0, 1)  # [L, HV, dv]
    return out, state, saved


def chunk_inverse_ref(strict_lower: torch.Tensor) -> torch.Tensor:
    """strict_lower [N, C, C] fp32, strictly lower -> (I + A)^-1 [N, C, C] by triangular solve (fp32)."""
    eye = torch.eye(strict_lower.shape[-1], dtype=strict_lower.dtype, device=strict_lower.device)
    system = eye + strict_lower
    return torch.linalg.solve_triangular(system, eye.expand_as(system), upper=False, unitriangular=True)


def gdn_prefill_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    out: torch.Tensor | None = None,
    checkpoint_chunks: torch.Tensor | None = None,
    checkpoint_slots: torch.Tensor | None = None,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """q, k [T, HK, dk]; v [T, HV, dv]; a, b [T, HV] -> o [T, HV, dv] (into `out` when given); updates ssm_states
    in place. checkpoint_chunks / checkpoint_slots [B] (optional): sequence b's state at the start of its chunk
    checkpoint_chunks[b] (>= 1; -1: none) also goes to slot checkpoint_slots[b] (an in-step checkpoint).
    max_query_len: the longest sequence's rows, a host hint the Triton kernel picks its launch by (unread here)."""
    num_v_heads, head_k_dim = v.shape[1], q.shape[2]
    group = num_v_heads // q.shape[1]
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    # vLLM's prefill rounds the normed q/k to the activation dtype before the core.
    q_hat = l2norm_fp32(q).to(q.dtype).float().repeat_interleave(group, dim=1) * head_k_dim**-0.5
    k_hat = l2norm_fp32(k).to(k.dtype).float().repeat_interleave(group, dim=1)
    out = output(out, tuple(v.shape), v)
    starts = query_start_loc.tolist()
    save_chunks = [-1] * len(starts) if checkpoint_chunks is None else checkpoint_chunks.tolist()
    for i, slot in enumerate(state_indices.tolist()):
        start, end = starts[i], starts[i + 1]
        if end == start:
            continue
        # slot < 0 (CUDA-graph padding): start from zeros and write nothing back.
        if bool(has_initial_state[i]) and slot >= 0:
            state = ssm_states[slot].float()
        else:
            state = torch.zeros(ssm_states.shape[1:], dtype=torch.float32, device=v.device)
        o, state, saved = _chunked_delta_rule(
            q_hat[start:end], k_hat[start:end], v[start:end].float(), g[start:end], beta[start:end], state,
            save_chunks[i],
        )  # fmt: skip
        out[start:end] = o.to(v.dtype)
        if saved is not None and checkpoint_slots is not None:
            ssm_states[int(checkpoint_slots[i])] = saved.to(ssm_states.dtype)
        if slot >= 0:
            ssm_states[slot] = state.to(ssm_states.dtype)
    return out


# deltaserve's own prefill: the Triton chunked kernel on CUDA, the ref elsewhere
gdn_prefill_ours = triton_or_ref(gdn_prefill_ref, "gdn_triton.gdn_prefill_triton")

# The prefill kernels a GDN layer is built with (--gdn-prefill-backend, resolved by runner/device_setup.py): "triton",
# deltaserve's own (vLLM's name for its Triton path), "flashinfer" (kernels/gdn_flashinfer.py, every call it can
# take) or "flashinfer-large" (the default where FlashInfer runs: FlashInfer's for calls of FLASHINFER_MIN_TOKENS rows
# or more, ours below).
PREFILL_BACKENDS = ("triton", "flashinfer", "flashinfer-large")
# The rows of a call from which FlashInfer's kernel beats ours, both timed per layer as served (our FlashInfer path
# with its prep and state copies): ours is faster on one sequence of 2,048 and 4,096 rows, FlashInfer's on 8,192
# rows, one sequence or four; the lines cross near 6K rows (27B) and 7.5K (35B-A3B)
# (docs/kernels.md#flashinfers-gdn-prefill).
FLASHINFER_MIN_TOKENS = 6144


def uses_flashinfer(backend: str) -> bool:
    """Whether a layer of this resolved backend may call FlashInfer's kernel (its warm-up compiles it, the cache
    keeps room for its state copies)."""
    return backend in ("flashinfer", "flashinfer-large")


def takes_flashinfer(
    backend: str, num_tokens: int, checkpoint_chunks: torch.Tensor | None, checkpoint_slots: torch.Tensor | None
) -> bool:
    """The one per-call choice of the prefill kernel: FlashInfer's when the layer's backend is "flashinfer" (or
    "flashinfer-large" and the call has at least FLASHINFER_MIN_TOKENS rows) and the call saves no in-step
    checkpoint (FlashInfer's checkpoints are a fixed token stride, not one chosen chunk), else deltaserve's own. A
    call "saves" when it is given the checkpoint tensors: the runner passes them only on steps that save
    (runner/step_checkpoints.py), and reading their values would cost a device sync per layer. num_tokens is the
    call's row count, a host shape."""
    if backend not in PREFILL_BACKENDS:
        raise ValueError(f"GDN prefill backend {backend!r}: expected one of {', '.join(PREFILL_BACKENDS)}")
    if checkpoint_chunks is not None or checkpoint_slots is not None:
        return False
    return backend == "flashinfer" or (backend == "flashinfer-large" and num_tokens >= FLASHINFER_MIN_TOKENS)


def gdn_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    out: torch.Tensor | None = None,
    checkpoint_chunks: torch.Tensor | None = None,
    checkpoint_slots: torch.Tensor | None = None,
    max_query_len: int | None = None,
    backend: str = "triton",
) -> torch.Tensor:
    """gdn_prefill_ref's call (its twin, for both kernels) on the kernel takes_flashinfer picks for the layer's
    `backend`: FlashInfer's (kernels/gdn_flashinfer.py) or deltaserve's own."""
    if takes_flashinfer(backend, q.shape[0], checkpoint_chunks, checkpoint_slots):
        from deltaserve.kernels import gdn_flashinfer  # imports nothing of flashinfer until it runs

        return gdn_flashinfer.gdn_prefill_flashinfer(
            q, k, v, a, b, A_log, dt_bias, ssm_states, query_start_loc, state_indices, has_initial_state, out
        )
    return gdn_prefill_ours(
        q, k, v, a, b, A_log, dt_bias, ssm_states, query_start_loc, state_indices, has_initial_state, out,
        checkpoint_chunks, checkpoint_slots, max_query_len,
    )  # fmt: skip


def gdn_decode_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per sequence: q, k [B, HK, dk]; v [B, HV, dv]; a, b [B, HV] -> o [B, HV, dv] (into `out` when
    given; zeros where slot < 0); states in place."""
    num_v_heads, head_k_dim = v.shape[1], q.shape[2]
    group = num_v_heads // q.shape[1]
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    q_hat = l2norm_fp32(q).repeat_interleave(group, dim=1) * head_k_dim**-0.5  # [B, HV, dk]
    k_hat = l2norm_fp32(k).repeat_interleave(group, dim=1)  # [B, HV, dk]
    out = output(out, tuple(v.shape), v).zero_()
    for i, slot in enumerate(state_indices.tolist()):
        if slot < 0:
            continue
        state = ssm_states[slot].float() * g[i].exp()[:, None, None]  # [HV, dk, dv]
        u = beta[i][:, None] * (v[i].float() - torch.einsum("hkv,hk->hv", state, k_hat[i]))  # [HV, dv]
        state = state + k_hat[i][:, :, None] * u[:, None, :]
        out[i] = torch.einsum("hkv,hk->hv", state, q_hat[i]).to(v.dtype)
        ssm_states[slot] = state.to(ssm_states.dtype)
    return out


gdn_decode = triton_or_ref(gdn_decode_ref, "gdn_triton.gdn_decode_triton")
