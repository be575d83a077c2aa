"""Public kernel ops: each routes to its Triton kernel on CUDA and to its plain-torch `*_ref` twin elsewhere.

Every op lives in its own module with three names: `<op>_ref` (plain torch, fp32 inside, the CPU execution
path and the test oracle), `<op>_triton` (the Triton launcher) and `<op>` (the dispatcher the model calls).
Model files import ops from here only, so kernels drop in without touching the model.
"""

from deltaserve.kernels.activation import sigmoid_gate_mul, sigmoid_gate_mul_ref, silu_and_mul, silu_and_mul_ref
from deltaserve.kernels.attention import paged_attention, paged_attention_ref, store_kv, store_kv_ref
from deltaserve.kernels.conv import (
    causal_conv1d_prefill,
    causal_conv1d_prefill_ref,
    causal_conv1d_update,
    causal_conv1d_update_ref,
)
from deltaserve.kernels.fp8 import Fp8Weight, fp8_linear, fp8_linear_ref, quantize_activation_ref
from deltaserve.kernels.fp8_moe import fused_moe_fp8, fused_moe_fp8_ref
from deltaserve.kernels.gdn import gdn_decode, gdn_decode_ref, gdn_prefill, gdn_prefill_ref
from deltaserve.kernels.gdn_spec import (
    causal_conv1d_verify,
    causal_conv1d_verify_ref,
    gdn_verify,
    gdn_verify_ref,
    spec_state_commit,
    spec_state_commit_layers,
    spec_state_commit_layers_ref,
)
from deltaserve.kernels.linear import linear, linear_ref
from deltaserve.kernels.moe import (
    fused_moe,
    fused_moe_block,
    fused_moe_block_fp8,
    fused_moe_block_fp8_ref,
    fused_moe_block_ref,
    fused_moe_ref,
    moe_route,
    moe_route_ref,
    router_logits,
    router_logits_ref,
)
from deltaserve.kernels.norm import gated_rms_norm, gated_rms_norm_ref, rms_norm, rms_norm_ref
from deltaserve.kernels.preamble import (
    attn_preamble,
    attn_preamble_ref,
    attn_preamble_unfused,
    rope_cos_sin_cache,
    rope_cos_sin_for_positions,
    rotary_embedding,
    rotary_embedding_ref,
)

__all__ = [
    "attn_preamble",
    "attn_preamble_ref",
    "attn_preamble_unfused",
    "causal_conv1d_prefill",
    "causal_conv1d_prefill_ref",
    "causal_conv1d_update",
    "causal_conv1d_update_ref",
    "Fp8Weight",
    "fp8_linear",
    "fp8_linear_ref",
    "causal_conv1d_verify",
    "causal_conv1d_verify_ref",
    "fused_moe",
    "fused_moe_block",
    "fused_moe_block_fp8",
    "fused_moe_block_fp8_ref",
    "fused_moe_block_ref",
    "fused_moe_fp8",
    "fused_moe_fp8_ref",
    "fused_moe_ref",
    "gated_rms_norm",
    "gated_rms_norm_ref",
    "gdn_decode",
    "gdn_decode_ref",
    "gdn_prefill",
    "gdn_prefill_ref",
    "gdn_verify",
    "gdn_verify_ref",
    "linear",
    "linear_ref",
    "moe_route",
    "moe_route_ref",
    "router_logits",
    "router_logits_ref",
    "quantize_activation_ref",
    "paged_attention",
    "paged_attention_ref",
    "rms_norm",
    "rms_norm_ref",
    "rope_cos_sin_cache",
    "rope_cos_sin_for_positions",
    "rotary_embedding",
    "rotary_embedding_ref",
    "sigmoid_gate_mul",
    "sigmoid_gate_mul_ref",
    "silu_and_mul",
    "silu_and_mul_ref",
    "spec_state_commit",
    "spec_state_commit_layers",
    "spec_state_commit_layers_ref",
    "store_kv",
    "store_kv_ref",
]
