"""GPU only: the decode-path launchers capture into a CUDA graph (no host sync) and replay to eager results.

Each op runs once eagerly on a copy of its state, then is captured on the original state and replayed;
outputs and in-place states must match the eager run.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from deltaserve.kernels import attention_triton
from deltaserve.kernels.attention_triton import paged_attention_triton, store_kv_triton
from deltaserve.kernels.conv_triton import causal_conv1d_update_triton
from deltaserve.kernels.gdn_spec import verify_row_width
from deltaserve.kernels.gdn_spec_conv_triton import causal_conv1d_verify_triton
from deltaserve.kernels.gdn_spec_triton import gdn_verify_triton
from deltaserve.kernels.gdn_triton import gdn_decode_triton
from deltaserve.kernels.moe import moe_route_ref
from deltaserve.kernels.moe_align import moe_align_ref
from deltaserve.kernels.moe_configs import GemmConfig, MoEConfig
from deltaserve.kernels.moe_decode_triton import moe_block_triton
from deltaserve.kernels.moe_routing_triton import moe_align_triton, moe_route_triton
from deltaserve.kernels.moe_triton import fused_moe_triton
from deltaserve.kernels.norm_triton import gated_rms_norm_triton, rms_norm_triton
from deltaserve.kernels.preamble_triton import attn_preamble_triton

from ._util import DEVICE, randn, varlen_starts

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16
DECODE = MoEConfig("decode", GemmConfig(32, 128, 4, 4), GemmConfig(16, 128, 4, 1))
GROUPED = MoEConfig("grouped", GemmConfig(32, 128, 4, 4), GemmConfig(32, 128, 4, 4), block_m=16)
# the tuned decode variants: the down GEMM split over the choices (its scratch and combine launch in the graph) and
# the routing on next_pow2(T) rows
DECODE_VARIANTS = MoEConfig(
    "decode", GemmConfig(32, 128, 4, 4, ROUTE_ROWS=1), GemmConfig(16, 128, 4, 1, CHOICES_PER_PROGRAM=2)
)


def _capture_matches_eager(fn: Callable[[], object], states: list[torch.Tensor]) -> None:
    """fn() reads/writes `states` in place and returns a tensor or tuple of tensors."""
    saved = [s.clone() for s in states]
    eager = fn()
    eager_states = [s.clone() for s in states]
    for s, c in zip(states, saved, strict=True):
        s.copy_(c)
    fn()  # warm-up on a side stream is not needed for Triton kernels; this also primes autotuning
    for s, c in zip(states, saved, strict=True):
        s.copy_(c)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fn()
    for s, c in zip(states, saved, strict=True):
        s.copy_(c)
    graph.replay()
    torch.cuda.synchronize()
    eager_t = eager if isinstance(eager, tuple) else (eager,)
    captured_t = captured if isinstance(captured, tuple) else (captured,)
    for e, c in zip(eager_t, captured_t, strict=True):
        if e is not None:
            assert torch.equal(e, c)
    for e, s in zip(eager_states, states, strict=True):
        assert torch.equal(e, s)


def test_graph_preamble_and_norms() -> None:
    qkv = randn(8, 4 * 2 * 64 + 2 * 2 * 64, dtype=BF16)
    cos_sin = randn(8, 32, dtype=BF16)
    w = randn(64, dtype=BF16)
    _capture_matches_eager(lambda: attn_preamble_triton(qkv, w, w, cos_sin, 4, 2, 64, 32, 1e-6), [])
    x, r, hw = randn(8, 512, dtype=BF16), randn(8, 512, dtype=BF16), randn(512, dtype=BF16)
    _capture_matches_eager(lambda: rms_norm_triton(x, hw, 1e-6, r), [])
    o, z = randn(8, 4, 128, dtype=BF16), randn(8, 4, 128, dtype=BF16)
    _capture_matches_eager(lambda: gated_rms_norm_triton(o, z, w.new_ones(128), 1e-6), [])


def test_graph_store_kv_and_decode_attention() -> None:
    batch, nq, nkv, d, page, width = 5, 6, 2, 128, 16, 8
    k_cache = randn(batch * width, page, nkv, d, dtype=BF16)
    v_cache = randn(batch * width, page, nkv, d, dtype=BF16)
    block_tables = torch.arange(batch * width, device=DEVICE, dtype=torch.int32).view(batch, width)
    seq_lens = torch.tensor([1, 17, 100, 128, 0], device=DEVICE, dtype=torch.int32)
    qsl = varlen_starts([1] * batch)
    q = randn(batch, nq, d, dtype=BF16)
    k, v = randn(batch, nkv, d, dtype=BF16), randn(batch, nkv, d, dtype=BF16)
    slots = torch.tensor([0, 20, 40, -1, -1], device=DEVICE)
    _capture_matches_eager(lambda: store_kv_triton(k, v, k_cache, v_cache, slots), [k_cache, v_cache])
    _capture_matches_eager(
        lambda: paged_attention_triton(q, k_cache, v_cache, qsl, seq_lens, block_tables, d**-0.5, 1, 128), []
    )


def test_graph_conv_and_gdn_decode() -> None:
    batch, channels, hk, hv, dk, dv = 6, 512, 2, 4, 128, 128
    x = randn(batch, channels, dtype=BF16)
    conv_states = randn(batch + 2, 3, channels, dtype=BF16)
    weight = randn(channels, 4, dtype=BF16)
    slots = torch.tensor([3, 0, -1, 5, 7, -1], device=DEVICE, dtype=torch.int32)
    _capture_matches_eager(lambda: causal_conv1d_update_triton(x, weight, conv_states, slots), [conv_states])
    q, k = randn(batch, hk, dk, dtype=BF16), randn(batch, hk, dk, dtype=BF16)
    v, a, b = randn(batch, hv, dv, dtype=BF16), randn(batch, hv, dtype=BF16), randn(batch, hv, dtype=BF16)
    A_log, dt_bias = randn(hv), randn(hv)
    ssm = randn(batch + 2, hv, dk, dv, scale=0.1)
    _capture_matches_eager(lambda: gdn_decode_triton(q, k, v, a, b, A_log, dt_bias, ssm, slots), [ssm])


def test_graph_verify_conv_and_gdn() -> None:
    """The verify step's conv and delta rule (a CUDA-graph bucket's padded sequence has slot -1 and -1 columns)."""
    channels, hk, hv, dk, dv = 512, 2, 4, 128, 128
    index = torch.tensor([[0, 1, 2, 3], [4, 5, -1, -1], [6, -1, -1, -1]], device=DEVICE)  # k = 3 / 1 / 0
    slots = torch.tensor([3, 0, -1], device=DEVICE, dtype=torch.int32)
    rows = 7
    x = randn(rows, channels, dtype=BF16)
    conv_states = randn(5, 3, channels, dtype=BF16)
    weight = randn(channels, 4, dtype=BF16)
    scratch_conv = torch.zeros(4, 4, 3, channels, dtype=BF16, device=DEVICE)
    _capture_matches_eager(
        lambda: causal_conv1d_verify_triton(x, weight, conv_states, slots, index, scratch_conv),
        [conv_states, scratch_conv],
    )
    q, k = randn(rows, hk, dk, dtype=BF16), randn(rows, hk, dk, dtype=BF16)
    v, a, b = randn(rows, hv, dv, dtype=BF16), randn(rows, hv, dtype=BF16), randn(rows, hv, dtype=BF16)
    A_log, dt_bias = randn(hv), randn(hv)
    ssm = randn(5, hv, dk, dv, scale=0.1)
    scratch_rows = torch.zeros(4, 4, verify_row_width(hk, dk, hv, dv), dtype=BF16, device=DEVICE)
    _capture_matches_eager(
        lambda: gdn_verify_triton(q, k, v, a, b, A_log, dt_bias, ssm, slots, index, scratch_rows), [ssm, scratch_rows]
    )


@pytest.mark.parametrize("num_tokens", [4, 200])
def test_graph_fused_moe(num_tokens: int) -> None:
    """4 tokens take the decode path (default config), 200 x top-8 the grouped path's prefill config."""
    experts, top_k, hidden, inter = 32, 8, 256, 128
    x = randn(num_tokens, hidden, dtype=BF16)
    w13 = randn(experts, 2 * inter, hidden, dtype=BF16, scale=hidden**-0.5)
    w2 = randn(experts, hidden, inter, dtype=BF16, scale=inter**-0.5)
    weights, ids = moe_route_ref(randn(num_tokens, experts), top_k, True)
    _capture_matches_eager(lambda: fused_moe_triton(x, w13, w2, weights, ids), [])


@pytest.mark.parametrize("num_tokens", [1, 8, 64])
def test_graph_moe_routing_align_and_shared_epilogue(num_tokens: int) -> None:
    """The decode MoE path as the model runs it today: Triton routing, the one-program align, the grouped GEMMs
    (forced: the default sends 1 and 8 tokens down the decode path) and the shared-expert epilogue."""
    experts, top_k, hidden, inter = 256, 8, 256, 64
    x = randn(num_tokens, hidden, dtype=BF16)
    w13 = randn(experts, 2 * inter, hidden, dtype=BF16, scale=hidden**-0.5)
    w2 = randn(experts, hidden, inter, dtype=BF16, scale=inter**-0.5)
    logits = randn(num_tokens, experts, dtype=BF16)
    shared, gate_logits = randn(num_tokens, hidden, dtype=BF16), randn(num_tokens, 1, dtype=BF16)

    def step() -> torch.Tensor:
        weights, ids = moe_route_triton(logits, top_k, True)
        return fused_moe_triton(x, w13, w2, weights, ids, shared, gate_logits, config=GROUPED)

    _capture_matches_eager(step, [])
    weights, ids = moe_route_triton(logits, top_k, True)
    ref_weights, _ = moe_route_ref(logits, top_k, True)
    # bf16 logits tie: the two may order tied experts differently, the weights agree as sets
    assert torch.allclose(weights.sort(dim=1).values, ref_weights.sort(dim=1).values, atol=1e-6)
    sorted_ids, block_expert = moe_align_triton(ids, experts, 16)
    ref_sorted, ref_blocks = moe_align_ref(ids, experts, 16)
    assert torch.equal(sorted_ids, ref_sorted) and torch.equal(block_expert, ref_blocks)


@pytest.mark.parametrize(
    ("num_tokens", "path"),
    [(1, "decode"), (8, "decode"), (24, "decode"), (64, "grouped"), (1, "decode-variants"), (8, "decode-variants")],
)
def test_graph_moe_block(num_tokens: int, path: str) -> None:
    """The whole MoE block op (router kernel, routing, routed + shared experts) captured and replayed; 24 tokens
    route in moe_route_triton's own launch. The replay must equal the eager call bit for bit (the numerics
    against the ref are test_moe_decode.py's, on the kernel's own routing)."""
    experts, top_k, hidden, inter, inter_sh = 64, 8, 256, 128, 64
    x = randn(num_tokens, hidden, dtype=BF16)
    router = randn(experts, hidden, dtype=BF16, scale=hidden**-0.5)
    w13 = randn(experts, 2 * inter, hidden, dtype=BF16, scale=hidden**-0.5)
    w2 = randn(experts, hidden, inter, dtype=BF16, scale=inter**-0.5)
    s13, s2 = randn(2 * inter_sh, hidden, dtype=BF16), randn(hidden, inter_sh, dtype=BF16)
    gate = randn(1, hidden, dtype=BF16)
    config = {"decode": DECODE, "grouped": GROUPED, "decode-variants": DECODE_VARIANTS}[path]
    _capture_matches_eager(lambda: moe_block_triton(x, router, w13, w2, top_k, True, s13, s2, gate, config=config), [])


def test_graph_autotune_never_benchmarks_in_capture() -> None:
    """A key first seen inside capture runs configs[0] instead of benchmarking (which would break capture):
    the prefill attention, the one autotuned kernel left (the MoE kernels read the committed tables)."""
    batch, nq, nkv, d, page, width, q_len = 2, 4, 2, 128, 16, 8, 40
    k_cache = randn(batch * width, page, nkv, d, dtype=BF16)
    v_cache = randn(batch * width, page, nkv, d, dtype=BF16)
    block_tables = torch.arange(batch * width, device=DEVICE, dtype=torch.int32).view(batch, width)
    seq_lens = torch.tensor([q_len, q_len], device=DEVICE, dtype=torch.int32)
    qsl = varlen_starts([q_len, q_len])
    q = randn(batch * q_len, nq, d, dtype=BF16)
    eager = paged_attention_triton(q, k_cache, v_cache, qsl, seq_lens, block_tables, d**-0.5, q_len, q_len)
    tuner = attention_triton._paged_attn_kernel
    tuner.cache.clear()  # forget the tuned choice: the capture below sees a fresh key
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention_triton(q, k_cache, v_cache, qsl, seq_lens, block_tables, d**-0.5, q_len, q_len)
    graph.replay()
    torch.cuda.synchronize()
    assert not tuner.cache, "capture must not cache an untuned choice"
    assert (out.float() - eager.float()).abs().max().item() <= 2e-2 * eager.float().abs().max().item()
