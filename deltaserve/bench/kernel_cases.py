"""The cases `deltaserve bench kernels` times for the attention and GDN layers, and the inputs every case is built from.

A Case is one op at one shape: `make` builds a fresh input set at real shapes on DEVICE (bf16 activations, fp32 GDN
states), `call` runs the public dispatcher on one, and `bytes` / `flops` count what the op must move and compute at
least. Here: the attention preamble (fused and unfused) and rotary embedding, the norms and SiLU-and-mul, KV stores
and paged attention, the conv and the delta rule in their decode and prefill forms, and the speculative verify step's
conv, delta rule and commit. device_randn and fp8_weight build every input, kernel_gemm_cases.py's too, so every case
reads DEVICE here: the CPU tests of the case builders point it at "cpu" in this module.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from deltaserve.bench.kernel_shapes import ModelShapes

EPS = 1e-6
ROPE_POSITIONS = 65536
# Where the cases build their inputs; the CPU test of the case builders points it at "cpu".
DEVICE = "cuda"


@dataclass
class Case:
    """One op at one shape: `make` builds a fresh input set, `call` runs the op on one."""

    op: str
    mode: str
    make: Callable[[], tuple[Any, ...]]
    call: Callable[[tuple[Any, ...]], object]
    bytes: int
    flops: int = 0
    note: str = ""


def device_randn(*shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=DEVICE) * scale).to(dtype)


def fp8_weight(*shape: int) -> Any:
    """A block-FP8 weight [..., N, K] (docs/fp8.md): N(0, 1) values cast to e4m3, every block scale K^-0.5."""
    from deltaserve.kernels import Fp8Weight

    weight = Fp8Weight(*shape, device=DEVICE)
    weight.weight.copy_(torch.randn(*shape, device=DEVICE).to(weight.weight.dtype))
    weight.scale.fill_(shape[-1] ** -0.5)
    return weight


def preamble_cases(m: ModelShapes, tokens: int, dtype: torch.dtype) -> list[Case]:
    from deltaserve.kernels import attn_preamble, attn_preamble_unfused, rope_cos_sin_cache, rotary_embedding

    nq, nkv, d, r = m.num_q_heads, m.num_kv_heads, m.head_dim, m.rotary_dim
    width = nq * 2 * d + 2 * nkv * d
    cache = rope_cos_sin_cache(r, ROPE_POSITIONS, 1e7, dtype, DEVICE)
    q_w, k_w = device_randn(d, dtype=dtype, scale=0.1), device_randn(d, dtype=dtype, scale=0.1)
    size = dtype.itemsize
    # Compulsory traffic: q|gate and k read, cos/sin rows read, q, k, gate written (v is not touched).
    moved = tokens * ((nq * 2 * d + nkv * d) + r + (2 * nq * d + nkv * d)) * size

    def make() -> tuple[Any, ...]:
        positions = torch.randint(0, ROPE_POSITIONS, (tokens,), device=DEVICE)
        return device_randn(tokens, width, dtype=dtype), positions, cache[positions]

    def fused(s: tuple[Any, ...]) -> object:
        return attn_preamble(s[0], q_w, k_w, s[2], nq, nkv, d, r, EPS)

    def unfused(s: tuple[Any, ...]) -> object:
        return attn_preamble_unfused(s[0], q_w, k_w, s[1], cache, nq, nkv, d, r, EPS)

    def make_rope() -> tuple[Any, ...]:
        positions = torch.randint(0, ROPE_POSITIONS, (tokens,), device=DEVICE)
        return positions, device_randn(tokens, nq * d, dtype=dtype), device_randn(tokens, nkv * d, dtype=dtype)

    def rope(s: tuple[Any, ...]) -> object:
        return rotary_embedding(s[0], s[1], s[2], cache, d, r)

    rope_moved = tokens * (2 * (nq + nkv) * d + r) * size
    return [
        Case("preamble_fused", "-", make, fused, moved, note="1 launch"),
        Case("preamble_unfused", "-", make, unfused, moved, note="4 ops; bytes = fused's compulsory bytes"),
        Case("rotary_embedding", "-", make_rope, rope, rope_moved, note="out of place, as the ref"),
    ]


def norm_cases(m: ModelShapes, tokens: int, dtype: torch.dtype) -> list[Case]:
    from deltaserve.kernels import gated_rms_norm, rms_norm, silu_and_mul

    size = dtype.itemsize
    w_h = device_randn(m.hidden, dtype=dtype, scale=0.1)
    w_v = device_randn(m.head_v_dim, dtype=dtype)
    return [
        Case(
            "rms_norm_residual",
            "-",
            lambda: (device_randn(tokens, m.hidden, dtype=dtype), device_randn(tokens, m.hidden, dtype=dtype)),
            lambda s: rms_norm(s[0], w_h, EPS, s[1]),
            4 * tokens * m.hidden * size,
        ),
        Case(
            "gated_rms_norm",
            "-",
            lambda: tuple(device_randn(tokens, m.num_v_heads, m.head_v_dim, dtype=dtype) for _ in range(2)),
            lambda s: gated_rms_norm(s[0], s[1], w_v, EPS),
            3 * tokens * m.num_v_heads * m.head_v_dim * size,
        ),
        Case(
            "silu_and_mul",
            "-",
            lambda: (device_randn(tokens, 2 * m.mlp_inter, dtype=dtype),),
            lambda s: silu_and_mul(s[0]),
            3 * tokens * m.mlp_inter * size,
            note=f"I = {m.mlp_inter}",
        ),
    ]


def attention_cases(
    m: ModelShapes, tokens: int, dtype: torch.dtype, is_decode: bool, context: int, page: int
) -> list[Case]:
    from deltaserve.kernels import paged_attention, store_kv

    nq, nkv, d = m.num_q_heads, m.num_kv_heads, m.head_dim
    size = dtype.itemsize
    batch, seq_len = (tokens, context) if is_decode else (1, tokens)
    pages_per_seq = math.ceil(seq_len / page)
    scale = d**-0.5

    def make_attn() -> tuple[Any, ...]:
        num_blocks = batch * pages_per_seq
        k_cache = device_randn(num_blocks, page, nkv, d, dtype=dtype)
        v_cache = device_randn(num_blocks, page, nkv, d, dtype=dtype)
        block_tables = torch.randperm(num_blocks, device=DEVICE).int().view(batch, pages_per_seq)
        q = device_randn(tokens, nq, d, dtype=dtype)
        q_lens = torch.full((batch,), tokens // batch, dtype=torch.int32, device=DEVICE)
        qsl = torch.zeros(batch + 1, dtype=torch.int32, device=DEVICE)
        qsl[1:] = q_lens.cumsum(0)
        seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device=DEVICE)
        return q, k_cache, v_cache, qsl, seq_lens, block_tables

    def attn(s: tuple[Any, ...]) -> object:
        return paged_attention(*s, scale, tokens // batch, seq_len)

    kv_read = batch * seq_len * nkv * d * 2 * size
    flops = 4 * nq * d * (tokens * seq_len if is_decode else tokens * (tokens + 1) // 2)

    def make_store() -> tuple[Any, ...]:
        num_blocks = math.ceil(tokens / page)
        k, v = (device_randn(tokens, nkv, d, dtype=dtype) for _ in range(2))
        caches = [device_randn(num_blocks, page, nkv, d, dtype=dtype) for _ in range(2)]
        return k, v, caches[0], caches[1], torch.arange(tokens, dtype=torch.int64, device=DEVICE)

    mode = "decode" if is_decode else "prefill"
    note = f"{batch} seq x {seq_len} ctx, page {page}"
    return [
        Case("store_kv", "-", make_store, lambda s: store_kv(*s), 4 * tokens * nkv * d * size),
        Case("paged_attention", mode, make_attn, attn, kv_read + 2 * tokens * nq * d * size, flops, note),
    ]


def _gdn_inputs(m: ModelShapes, tokens: int, num_seqs: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """q, k, v (views of one conv output, as served), a, b [tokens, ...] and num_seqs fp32 states."""
    hk, hv, dk, dv = m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim
    mixed = device_randn(tokens, 2 * hk * dk + hv * dv, dtype=dtype)
    q = mixed[:, : hk * dk].view(tokens, hk, dk)
    k = mixed[:, hk * dk : 2 * hk * dk].view(tokens, hk, dk)
    v = mixed[:, 2 * hk * dk :].view(tokens, hv, dv)
    a, b = device_randn(tokens, hv, dtype=dtype), device_randn(tokens, hv, dtype=dtype)
    return q, k, v, a, b, device_randn(num_seqs, hv, dk, dv, dtype=torch.float32, scale=0.1)


def gdn_cases(m: ModelShapes, tokens: int, dtype: torch.dtype, is_decode: bool) -> list[Case]:
    from deltaserve.kernels import causal_conv1d_prefill, causal_conv1d_update, gdn_decode, gdn_prefill

    size = dtype.itemsize
    channels, width = m.conv_dim, m.conv_kernel
    hk, hv, dk, dv = m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim
    conv_w = device_randn(channels, width, dtype=dtype, scale=0.5)
    A_log = torch.log(torch.empty(hv, device=DEVICE).uniform_(1, 16))
    dt_bias = device_randn(hv, dtype=torch.float32, scale=0.5)
    num_seqs = tokens if is_decode else 1
    state_bytes = num_seqs * hv * dk * dv * 4

    def make_conv() -> tuple[Any, ...]:
        x = device_randn(tokens, channels, dtype=dtype)
        states = device_randn(num_seqs, width - 1, channels, dtype=dtype)
        slots = torch.arange(num_seqs, dtype=torch.int32, device=DEVICE)
        qsl = torch.tensor([0, tokens], dtype=torch.int32, device=DEVICE)
        return x, states, slots, qsl, torch.ones(num_seqs, dtype=torch.bool, device=DEVICE)

    def conv(s: tuple[Any, ...]) -> object:
        if is_decode:
            return causal_conv1d_update(s[0], conv_w, s[1], s[2])
        return causal_conv1d_prefill(s[0], conv_w, s[1], s[3], s[2], s[4])

    def make_gdn() -> tuple[Any, ...]:
        q, k, v, a, b, states = _gdn_inputs(m, tokens, num_seqs, dtype)
        slots = torch.arange(num_seqs, dtype=torch.int32, device=DEVICE)
        qsl = torch.tensor([0, tokens], dtype=torch.int32, device=DEVICE)
        return q, k, v, a, b, states, slots, qsl, torch.ones(num_seqs, dtype=torch.bool, device=DEVICE)

    def gdn(s: tuple[Any, ...]) -> object:
        q, k, v, a, b, states, slots, qsl, has_init = s
        if is_decode:
            return gdn_decode(q, k, v, a, b, A_log, dt_bias, states, slots)
        return gdn_prefill(q, k, v, a, b, A_log, dt_bias, states, qsl, slots, has_init)

    mode = "decode" if is_decode else "prefill"
    conv_bytes = 2 * tokens * channels * size + 2 * num_seqs * (width - 1) * channels * size
    gdn_bytes = tokens * (2 * hk * dk + 2 * hv * dv + 2 * hv) * size + 2 * state_bytes
    gdn_flops = 8 * tokens * hv * dk * dv  # decay, Sᵀk, rank-1 update, Sᵀq (recurrent form)
    return [
        Case("causal_conv1d", mode, make_conv, conv, conv_bytes),
        Case(
            "gdn",
            mode,
            make_gdn,
            gdn,
            gdn_bytes,
            gdn_flops,
            f"{num_seqs} seq, fp32 state" + ", chunked" * (not is_decode),
        ),
    ]


VERIFY_WIDTH = 4  # 1 + k tokens a verify chunk at k = 3, issue 41's grids


def verify_cases(m: ModelShapes, tokens: int, dtype: torch.dtype, is_decode: bool) -> list[Case]:
    """The speculative verify step's conv at decode token counts: `tokens` sequences of 1 + k = 4 tokens each."""
    if not is_decode:
        return []
    from deltaserve.kernels import causal_conv1d_verify

    size = dtype.itemsize
    channels, width, num_seqs = m.conv_dim, m.conv_kernel, tokens
    rows = num_seqs * VERIFY_WIDTH
    conv_w = device_randn(channels, width, dtype=dtype, scale=0.5)
    index = torch.arange(rows, device=DEVICE).view(num_seqs, VERIFY_WIDTH)
    slots = torch.arange(num_seqs, dtype=torch.int32, device=DEVICE)

    def make() -> tuple[Any, ...]:
        scratch = torch.empty(num_seqs, VERIFY_WIDTH, width - 1, channels, dtype=dtype, device=DEVICE)
        return (
            device_randn(rows, channels, dtype=dtype),
            device_randn(num_seqs, width - 1, channels, dtype=dtype),
            scratch,
        )

    def call(s: tuple[Any, ...]) -> object:
        return causal_conv1d_verify(s[0], conv_w, s[1], slots, index, s[2])

    # x read and y written, the slot's rows read, a window written after every token
    moved = (2 * rows * channels + num_seqs * (width - 1) * channels + rows * (width - 1) * channels) * size
    return [
        Case("gdn_verify_conv", "verify", make, call, moved, note=f"{num_seqs} seq x {VERIFY_WIDTH} tokens"),
        *_verify_gdn_cases(m, num_seqs, dtype),
    ]


def _verify_gdn_cases(m: ModelShapes, num_seqs: int, dtype: torch.dtype) -> list[Case]:
    """The verify step's delta rule (reads the live state, stores each token's k, v, a, b) and its commit (one layer:
    the conv window copied, all 1 + k tokens replayed on the live state, the whole chunk accepted): num_seqs
    sequences of 1 + k = 4 tokens (docs/speculative-decoding.md#the-commit-one-launch)."""
    from deltaserve.kernels import gdn_verify, spec_state_commit_layers
    from deltaserve.kernels.gdn_spec import verify_row_width

    size = dtype.itemsize
    hk, hv, dk, dv = m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim
    channels, width = m.conv_dim, m.conv_kernel
    rows = num_seqs * VERIFY_WIDTH
    row = verify_row_width(hk, dk, hv, dv)
    A_log = torch.log(torch.empty(hv, device=DEVICE).uniform_(1, 16))
    dt_bias = device_randn(hv, dtype=dtype, scale=0.5)
    index = torch.arange(rows, device=DEVICE).view(num_seqs, VERIFY_WIDTH)
    slots = torch.arange(num_seqs, dtype=torch.int32, device=DEVICE)
    accepted = torch.full((num_seqs,), VERIFY_WIDTH - 1, dtype=torch.int64, device=DEVICE)
    state_bytes = num_seqs * hv * dk * dv * 4

    def make_verify() -> tuple[Any, ...]:
        scratch_rows = torch.empty(num_seqs, VERIFY_WIDTH, row, dtype=dtype, device=DEVICE)
        return *_gdn_inputs(m, rows, num_seqs, dtype), scratch_rows

    def verify(s: tuple[Any, ...]) -> object:
        return gdn_verify(*s[:5], A_log, dt_bias, s[5], slots, index, s[6])

    def make_commit() -> tuple[Any, ...]:
        conv = device_randn(1, num_seqs, width - 1, channels, dtype=dtype)
        states = device_randn(1, num_seqs, hv, dk, dv, dtype=torch.float32, scale=0.1)
        scratch_conv = device_randn(1, num_seqs, VERIFY_WIDTH, width - 1, channels, dtype=dtype)
        scratch_rows = device_randn(1, num_seqs, VERIFY_WIDTH, row, dtype=dtype, scale=0.5)
        return conv, states, scratch_conv, scratch_rows

    def commit(s: tuple[Any, ...]) -> object:
        spec_state_commit_layers(*s, A_log[None], dt_bias[None], slots, accepted, VERIFY_WIDTH)
        return None

    # verify: q, k, v, a, b read, o written, the state read, a row stored a token
    verify_bytes = rows * (2 * hk * dk + 2 * hv * dv + 2 * hv + row) * size + state_bytes
    # commit: the state read and written, the tokens' rows read, a conv window copied
    commit_bytes = 2 * state_bytes + rows * row * size + 2 * num_seqs * (width - 1) * channels * size
    flops = 8 * rows * hv * dk * dv
    note = f"{num_seqs} seq x {VERIFY_WIDTH} tokens, fp32 state"
    return [
        Case("gdn_verify", "verify", make_verify, verify, verify_bytes, flops, note),
        Case("spec_commit", "verify", make_commit, commit, commit_bytes, flops, note + ", all accepted"),
    ]
