"""What each op of one prefill chunk must move and compute: the bytes and FLOPs that benchmarks/profile_prefill.py
sets against the H200's two ceilings (copy bandwidth, bf16 matrix rate; docs/kernels.md#the-two-ceilings).

A chunk is T new tokens of one sequence after P tokens already in its KV cache and GDN state (the scheduler's chunked
prefill: a 65,536-token prompt at a 2048-token budget is 32 chunks, P = 0, 2048, ...). `chunk_costs` returns, per
model label (deltaserve/model/labels.py, without its prefix), (bytes, FLOPs) summed over the layers that run the op.
Bytes are compulsory traffic (every input read once, every output written once, weights once a chunk), FLOPs the
multiply-adds (counted 2) of the algorithm as served:

- a projection `y = x·Wᵀ`, W [N, K]: 2·T·N·K FLOPs; (N·K + T·K + T·N)·s bytes (s the dtype's bytes);
- attention (`attn.paged_attention`, causal over the cache): each of the T queries attends to P + its own position
  keys, pairs = T·P + T·(T + 1)/2, FLOPs 4·nq·d·pairs (q·k and p·v, 2·d each); bytes: q and o (T·nq·d each) and the
  sequence's K and V ((P + T)·nkv·d each) once;
- the GDN chunked prefill (`gdn.gdn_prefill`, docs/kernels.md#gated-deltanet, sub-chunks of C = 64 tokens), per value
  head and sub-chunk: the scores Q̂K̂ᵀ and K̂K̂ᵀ (2·C²·dk each), the triangular inverse (C³/3), w = Xw·K̂ (2·C²·dk),
  u = Xu·V (2·C²·dv), V' = u − w·S, Q̂·S and the state update K̂ᵀV' (2·C·dk·dv each), Aqk·V' (2·C²·dv): per token
  and value head 6·dk·dv + C·(6·dk + 4·dv) + C²/3. Bytes: q, k (HK heads), v, o (HV heads), a and b, and the fp32
  state written (and read when P > 0) once;
- the prefill conv (`gdn.causal_conv1d_prefill`): 2·T·conv·K FLOPs; input and output, the weights and the K − 1
  state columns read and written;
- the MoE block (`mlp.fused_moe_block`: router, top-k experts and shared expert in one op): 2·T·(k·3·I + 3·I_shared
  + E + 1)·H FLOPs; the weights of every expert the chunk is expected to hit (E·(1 − (1 − k/E)^T): all of them at
  prefill sizes), the shared expert and router, and the chunk's input and output;
- norms, activations, the preamble, store_kv, the gate multiply: bytes only, as benchmarks/decode_step.py counts them
  with T rows; lm_head and the logits' upcast (`lm.other`) for the one row a prompt's last chunk samples.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode_step as ds  # noqa: E402  (same folder: the projections' names, expected experts)

GDN_CHUNK = 64  # the chunked prefill's sub-chunk (deltaserve/kernels/gdn_triton.py): C in the FLOP count


def gdn_prefill_flops_per_token(dk: int, dv: int, chunk: int = GDN_CHUNK) -> float:
    """FLOPs of the chunked gated delta rule per token and value head (see the module docstring)."""
    return 6.0 * dk * dv + chunk * (6.0 * dk + 4.0 * dv) + chunk * chunk / 3.0


def attention_pairs(num_tokens: int, context: int) -> int:
    """(query, key) pairs a causal chunk of T queries after P cached tokens scores: T·P + T·(T + 1)/2."""
    return num_tokens * context + num_tokens * (num_tokens + 1) // 2


def chunk_costs(
    config: Any, num_tokens: int, context: int, samples: bool, dtype_bytes: int = 2
) -> dict[str, tuple[float, float]]:
    """Label -> (bytes, FLOPs) of one prefill chunk of `num_tokens` tokens after `context` cached ones, summed over
    the layers; `samples`: the chunk reaches the prompt's end, so lm_head runs on its last row."""
    t, h, s = num_tokens, config.hidden_size, dtype_bytes
    nq, nkv, d, r = config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.rotary_dim
    hv, hk, dk, dv = (config.linear_num_value_heads, config.linear_num_key_heads, config.linear_key_head_dim,
                      config.linear_value_head_dim)  # fmt: skip
    num_attn, num_gdn = len(config.full_attention_layers), len(config.linear_attention_layers)
    num_layers = config.num_hidden_layers
    num_moe = sum(1 for x in config.moe_layers if x) if config.num_experts else 0
    num_dense = num_layers - num_moe
    state_bytes = 4 if config.ssm_state_dtype == "float32" else 2
    costs: dict[str, tuple[float, float]] = {}

    def add(label: str, num_bytes: float, flops: float = 0.0, times: int = 1) -> None:
        old = costs.get(label, (0.0, 0.0))
        costs[label] = (old[0] + times * num_bytes, old[1] + times * flops)

    def linear(label: str, n: int, k: int, times: int, rows: int = t) -> None:
        add(label, (n * k + rows * k + rows * n) * s, 2.0 * rows * n * k, times)

    names = ds.linear_names(config)
    for kind, times in (("gdn", num_gdn), ("attn", num_attn)):
        for (n, k), name in names[kind].items():
            linear(f"{kind}.{name}", n, k, times)
    if samples:
        linear("lm.lm_head", config.vocab_size, h, 1, rows=1)
        add("lm.other", config.vocab_size * (s + 4))  # the sampled row's fp32 upcast
    add("lm.embed", 2 * t * h * s)
    add("layer.rms_norm", 4 * t * h * s, 0, 2 * num_layers + 1)  # residual add + norm, twice a layer, and the final
    add("layer.rope_cos_sin_for_positions", t * r * s)
    # attention
    add("attn.attn_preamble", t * ((2 * nq * d + nkv * d) * 2 + r) * s, 0, num_attn)
    add("attn.store_kv", 4 * t * nkv * d * s, 0, num_attn)
    add("attn.paged_attention", (2 * t * nq * d + 2 * (context + t) * nkv * d) * s,
        4.0 * nq * d * attention_pairs(t, context), num_attn)  # fmt: skip
    add("attn.sigmoid_gate_mul", 3 * t * nq * d * s, 0, num_attn)
    # Gated DeltaNet
    conv, kc = config.conv_dim, config.linear_conv_kernel_dim
    add("gdn.causal_conv1d_prefill", (2 * t * conv + conv * kc + 2 * (kc - 1) * conv) * s, 2.0 * t * conv * kc,
        num_gdn)  # fmt: skip
    state = hv * dk * dv * state_bytes * (2 if context else 1)
    add("gdn.gdn_prefill", t * (2 * hk * dk + 2 * hv * dv + 2 * hv) * s + state,
        t * hv * gdn_prefill_flops_per_token(dk, dv), num_gdn)  # fmt: skip
    add("gdn.gated_rms_norm", 3 * t * hv * dv * s, 0, num_gdn)
    # MLP / MoE
    if num_dense:
        for (n, k), name in names["mlp"].items():
            if name in ("gate_up", "down"):
                linear(f"mlp.{name}", n, k, num_dense)
        add("mlp.silu_and_mul", 3 * t * config.intermediate_size * s, 0, num_dense)
    if num_moe:
        e, k, i = config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size
        ish = config.shared_expert_intermediate_size
        experts = ds.expected_experts(e, k, t) * 3 * i * h * s
        flops = 2.0 * t * k * 3 * i * h
        add("mlp.fused_moe", experts + 2 * t * h * s, flops, num_moe)
        add("mlp.moe_route", t * e * s, 0, num_moe)
        add("mlp.silu_and_mul", 3 * t * ish * s, 0, num_moe)
        for (n, kk), name in names["mlp"].items():
            if name.startswith(("moe_router", "shared")):
                linear(f"mlp.{name}", n, kk, num_moe)
        add("mlp.fused_moe_block", experts + 3 * ish * h * s + (e + 1) * h * s + 2 * t * h * s,
            flops + 2.0 * t * (3 * ish + e + 1) * h, num_moe)  # fmt: skip
    return costs


def floor_us(num_bytes: float, flops: float, ceilings: dict[str, float]) -> tuple[float, str]:
    """The op's lower bound in µs, max(bytes / copy bandwidth, FLOPs / bf16 rate), and which ceiling sets it."""
    memory = num_bytes / (ceilings["copy_gbps"] * 1e9) * 1e6
    compute = flops / (ceilings["bf16_tflops"] * 1e12) * 1e6
    return (compute, "compute") if compute > memory else (memory, "memory")
