"""FlashInfer's Gated DeltaNet chunked prefill, called as vLLM 0.26 calls it on SM90 (--gdn-prefill-backend flashinfer).

`gdn_prefill_flashinfer` takes `gdn_prefill`'s call (kernels/gdn.py) and runs vLLM's FlashInfer sequence, so its
rounding points are vLLM's production ones (vLLM: qwen_gdn_linear_attn._forward_core and fi_chunk_gated_delta_rule):
1. `gdn_prefill_prep` (vLLM's fused_post_conv_prep with apply_l2norm=True): q̂ = q / √(Σq² + 1e-6) and k̂ likewise in
   fp32, rounded to the activation dtype, not scaled; v made contiguous; g = −e^A_log·softplus(a + dt_bias)
   (threshold 20) and β = σ(b) in fp32.
2. The initial states: each sequence's slot gathered, zeros where has_initial_state is False (or the slot < 0), and
   transposed to FlashInfer's [N, HV, dv, dk] (vLLM stores its states so; deltaserve's slots are [HV, dk, dv]).
3. flashinfer.gdn_prefill.chunk_gated_delta_rule(q̂, k̂, v, g=e^g, beta=β, initial_state, output_final_state=True,
   cu_seqlens): its default scale is dk^-½ (head_size^-½); value head h reads q/k head h·HQ // HV = h // (HV/HK),
   deltaserve's mapping.
4. The final states transposed back into the sequences' slots (a slot < 0 or an empty sequence writes nothing).
Steps 2 and 4 are `gather_states` and `scatter_states`, one Triton launch each on the GPU (twins in torch here).

Its plain-torch twin is `gdn_prefill_ref` (same call, same result up to the kernels' summation order); the in-step
prefix-cache checkpoint is not done here (kernels/gdn.py sends such a call to deltaserve's own kernel). flashinfer is
imported per call, so nothing imports it unless the path is served. `unusable_reason` is the start-up check
(runner/device_setup.py refuses --gdn-prefill-backend flashinfer with it); `warm_up` compiles FlashInfer's kernels
and `state_copy_bytes` sizes the state copies for the cache sizing (runner/memory.py). Design and measurements:
docs/kernels.md#flashinfers-gdn-prefill.
"""

from __future__ import annotations

import torch

from deltaserve.kernels._dispatch import output, triton_or_ref
from deltaserve.kernels.flashinfer_import import import_or_reason
from deltaserve.kernels.gdn import gdn_gates, l2norm_fp32, write_slots

# The one head size FlashInfer 0.6.14's SM90 kernel compiles (delta_rule_sm90: "only supports D=128").
FLASHINFER_HEAD_SIZE = 128


def gdn_prefill_prep_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k [T, HK, dk]; v [T, HV, dv]; a, b [T, HV] (row-strided views allowed) -> (q̂, k̂ [T, HK, dk] L2-normed in
    fp32 and rounded to the input dtype, v [T, HV, dv], g [T, HV] fp32 log-decay, β [T, HV] fp32), all contiguous:
    vLLM's post-conv prep for its chunked prefill."""
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    q_hat = l2norm_fp32(q).to(q.dtype).contiguous()
    k_hat = l2norm_fp32(k).to(k.dtype).contiguous()
    return q_hat, k_hat, v.contiguous(), g.contiguous(), beta.contiguous()


gdn_prefill_prep = triton_or_ref(gdn_prefill_prep_ref, "gdn_flashinfer_triton.gdn_prefill_prep_triton")


def gather_states_ref(
    ssm_states: torch.Tensor, state_indices: torch.Tensor, has_initial_state: torch.Tensor
) -> torch.Tensor:
    """The sequences' start states in FlashInfer's layout [N, HV, dv, dk], fp32 contiguous: slot state_indices[n]
    transposed, zeros where has_initial_state[n] is False or the slot is < 0 (as vLLM: ssm_state[indices], then the
    rows without an initial state set to 0). One copy of the states: gathered straight into that layout."""
    slots = state_indices.long()
    reads = (slots >= 0) & has_initial_state.bool()  # [N]
    # a row that reads nothing gathers slot 0 and is filled with zeros (not multiplied: a free slot may hold NaN)
    initial = ssm_states.transpose(-1, -2).index_select(0, slots.clamp_min(0)).contiguous()  # [N, HV, dv, dk]
    return initial.masked_fill_(~reads[:, None, None, None], 0.0)


def scatter_states_ref(
    ssm_states: torch.Tensor, state_indices: torch.Tensor, query_start_loc: torch.Tensor, final: torch.Tensor
) -> None:
    """final [N, HV, dv, dk] (FlashInfer's layout, overwritten) into ssm_states[state_indices[n]] as [HV, dk, dv], for
    each sequence with a slot >= 0 and at least one token (the ref's rule), without a host sync or another copy of
    the states (kernels/gdn.py write_slots, in place in `final`)."""
    slots = state_indices.long()
    lengths = query_start_loc[1:] - query_start_loc[:-1]  # [N]
    writes = (slots >= 0) & (lengths > 0)  # [N]
    write_slots(ssm_states, slots, final.transpose(-1, -2), writes, in_place=True)  # [N, HV, dk, dv] view


# One launch each on the GPU (kernels/gdn_flashinfer_triton.py) where the torch twins take ~6 and ~12
gather_states = triton_or_ref(gather_states_ref, "gdn_flashinfer_triton.gather_states_triton")
scatter_states = triton_or_ref(scatter_states_ref, "gdn_flashinfer_triton.scatter_states_triton")


def gdn_prefill_flashinfer(
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
    """gdn_prefill_ref's call on FlashInfer's kernel: q, k [T, HK, dk]; v [T, HV, dv]; a, b [T, HV]; ssm_states
    [slots, HV, dk, dv] fp32, updated in place; query_start_loc [B+1]; state_indices, has_initial_state [B] -> o [T,
    HV, dv] (into `out` when given). An in-step checkpoint (checkpoint_chunks / checkpoint_slots) is refused:
    FlashInfer's checkpoints are a fixed stride per sequence, not one chosen chunk. max_query_len (a launch hint of
    our Triton kernel's) is unread: FlashInfer sizes its own launch."""
    if checkpoint_chunks is not None or checkpoint_slots is not None:
        raise ValueError("gdn_prefill_flashinfer saves no in-step checkpoint: kernels/gdn.py sends such a call to ours")
    num_tokens, num_v_heads, head_v_dim = v.shape
    head_k_dim = q.shape[2]
    if ssm_states.dtype != torch.float32 or tuple(ssm_states.shape[1:]) != (num_v_heads, head_k_dim, head_v_dim):
        raise ValueError(
            f"ssm_states: {tuple(ssm_states.shape)} {ssm_states.dtype}, want [slots, {num_v_heads}, {head_k_dim}, "
            f"{head_v_dim}] float32"
        )
    out = output(out, (num_tokens, num_v_heads, head_v_dim), v)
    if num_tokens == 0 or state_indices.shape[0] == 0:
        return out
    from flashinfer.gdn_prefill import chunk_gated_delta_rule  # imported where served: an optional library

    q_hat, k_hat, v_in, g, beta = gdn_prefill_prep(q, k, v, a, b, A_log, dt_bias)
    initial = gather_states(ssm_states, state_indices, has_initial_state)
    # vLLM hands FlashInfer alpha = e^g, taken by torch in fp32 after the prep, and leaves scale at its default
    _, final = chunk_gated_delta_rule(
        q=q_hat, k=k_hat, v=v_in, g=g.exp_(), beta=beta, initial_state=initial, output_final_state=True,
        cu_seqlens=query_start_loc, output=out,
    )  # fmt: skip
    scatter_states(ssm_states, state_indices, query_start_loc, final)
    return out


def warm_up(num_k_heads: int, head_dim: int, A_log: torch.Tensor, dt_bias: torch.Tensor) -> None:
    """Compiles FlashInfer's SM90 kernels at start-up, on throw-away inputs, not in a served step: each CuTe-DSL
    kernel compiles on its first call (seconds), and it takes a context-parallel kernel when sequences x value heads
    < SMs / 2 and another one else, so one 64-token sequence, then enough of them to pass SMs x heads. The layer's
    A_log [HV] and dt_bias [HV] give the heads, the device and the activation dtype."""
    device, dtype, num_v_heads = A_log.device, dt_bias.dtype, A_log.shape[0]
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
    for num_seqs in (1, max(2, -(-num_sms // num_v_heads))):
        num_tokens = 64 * num_seqs
        q, k = (torch.randn(num_tokens, num_k_heads, head_dim, device=device).to(dtype) for _ in range(2))
        v = torch.randn(num_tokens, num_v_heads, head_dim, device=device).to(dtype)
        a, b = (torch.zeros(num_tokens, num_v_heads, dtype=dtype, device=device) for _ in range(2))
        states = torch.zeros(num_seqs, num_v_heads, head_dim, head_dim, device=device)
        starts = torch.arange(0, num_tokens + 1, 64, dtype=torch.int32, device=device)
        slots = torch.arange(num_seqs, dtype=torch.int32, device=device)
        has_initial_state = torch.ones(num_seqs, dtype=torch.bool, device=device)
        gdn_prefill_flashinfer(q, k, v, a, b, A_log, dt_bias, states, starts, slots, has_initial_state)


def state_copy_bytes(num_v_heads: int, head_k_dim: int, head_v_dim: int) -> int:
    """Device memory a call takes per sequence beyond the prep's per-token buffers: the fp32 start state it gathers
    and the final state FlashInfer returns, one layer's each (vLLM's path makes the same two copies)."""
    return 2 * num_v_heads * head_k_dim * head_v_dim * 4


def unusable_reason(device: torch.device, dtype: torch.dtype, head_k_dim: int, head_v_dim: int) -> str | None:
    """Why FlashInfer's GDN prefill cannot serve a model of these heads in `dtype` on `device` (None: it can). The
    cheap checks first; the last ones import flashinfer (as serving it would)."""
    if device.type != "cuda":
        return f"the device is {device.type}, and FlashInfer's GDN prefill is a CUDA kernel"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"the model dtype is {dtype}, and FlashInfer's SM90 kernel takes bfloat16 or float16 activations only"
    if head_k_dim != FLASHINFER_HEAD_SIZE or head_v_dim != FLASHINFER_HEAD_SIZE:
        return (
            f"the GDN heads are dk {head_k_dim} / dv {head_v_dim}, and FlashInfer's SM90 kernel compiles head size "
            f"{FLASHINFER_HEAD_SIZE} only (dk = dv = {FLASHINFER_HEAD_SIZE})"
        )
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        return (
            f"the GPU is compute capability {major}.{minor}, and deltaserve serves FlashInfer's GDN prefill on SM90 "
            "(Hopper, 9.0) only"
        )
    module, reason = import_or_reason("flashinfer.gdn_prefill")
    if module is None:
        return reason
    if getattr(module, "chunk_gated_delta_rule_sm90", None) is None:
        # flashinfer.gdn_kernels sets it to None when its CuTe-DSL kernels do not import; the call would raise later
        return "flashinfer imports but its SM90 GDN prefill kernel does not (nvidia-cutlass-dsl missing or broken)"
    return None
