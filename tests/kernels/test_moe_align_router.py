"""The expert alignments (one program; chunked) and the router GEMV against their twins.

Under the interpreter at fp32 (the same bodies run natively on the GPU, with bf16 router cases and the sizes the
interpreter is too slow for, marked gpu): every output starts poisoned (NaN floats, a sentinel in int tensors),
so an element a kernel never writes fails the comparison. The alignment must equal moe_align_ref entry for
entry (stable order within each expert, padding = N, block_expert -1 past the last run); the router must equal
F.linear's logits up to fp32 summation order, with the gate logit as column E, at every switch point of
router_gemv_config. The GPU tests also capture both launchers into CUDA graphs (no host sync) and replay them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch

from deltaserve.kernels import moe_decode_triton, moe_routing_triton, moe_triton
from deltaserve.kernels.moe import router_logits_ref
from deltaserve.kernels.moe_align import moe_align_ref
from deltaserve.kernels.moe_decode_triton import (
    ROUTER_GEMV_BLOCK_T,
    ROUTER_GEMV_MAX_TOKENS,
    ROUTER_GEMV_MIN_PROGRAMS,
    ROUTER_GEMV_SINGLE_MAX_TOKENS,
    ROUTER_W_BEFORE_WAIT_MAX_HIDDEN,
    router_gemv_config,
    router_logits_into,
    router_logits_triton,
)
from deltaserve.kernels.moe_routing_triton import (
    ALIGN_CHUNKED_MAX_ENTRIES,
    ALIGN_MAX_ENTRIES,
    align_chunked_launch,
    align_launch,
    moe_align_chunked_triton,
    moe_align_triton,
)

from ._util import DEVICE, DTYPES, assert_close, poisoned_empty, randn, tolerance

# Written into every int tensor torch.empty returns inside `poisoned`: no alignment output can hold it.
POISON = -1_234_567


def poisoned() -> contextlib.AbstractContextManager[None]:
    """torch.empty / torch.empty_like return NaN-filled floats and POISON-filled integer tensors."""
    return poisoned_empty(POISON)


# ------------------------------------------------------------------------------------------------------------
# Alignment


def _skewed_ids(num_tokens: int, num_experts: int, top_k: int, seed: int) -> torch.Tensor:
    """Distinct top-k ids per token, skewed so some experts get many entries and most get few or none."""
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    scores = torch.rand(num_tokens, num_experts, device=DEVICE, generator=generator) ** 4
    return torch.topk(scores, top_k, dim=-1).indices  # [T, k] int64


def _every_expert_ids(num_tokens: int, num_experts: int, top_k: int, seed: int) -> torch.Tensor:
    """Every expert hit (T·k ≥ E): each token takes k distinct experts, the union covers all of them."""
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    rows = [torch.randperm(num_experts, device=DEVICE, generator=generator) for _ in range(num_tokens)]
    ids = torch.stack(rows)[:, :top_k].clone()  # [T, k]
    cover = torch.randperm(num_experts, device=DEVICE, generator=generator)
    for e in range(num_experts):
        # token e % T takes expert cover[e] in its slot e // T (keeps the ids of a token distinct)
        t, j = e % num_tokens, e // num_tokens
        row = ids[t]
        clash = (row == cover[e]).nonzero()
        if clash.numel():
            row[clash[0, 0]] = row[j]
        row[j] = cover[e]
    assert torch.unique(ids).numel() == num_experts
    return ids


def _check_align(
    ids: torch.Tensor, num_experts: int, block_m: int, align: Callable[..., Any] = moe_align_triton
) -> None:
    ref_sorted, ref_blocks = moe_align_ref(ids, num_experts, block_m)
    with poisoned():
        sorted_ids, block_expert = align(ids, num_experts, block_m)
    assert sorted_ids.dtype == torch.int32 and block_expert.dtype == torch.int32
    assert not (sorted_ids == POISON).any(), "a slot of sorted_ids was never written"
    assert not (block_expert == POISON).any(), "a block's expert was never written"
    assert torch.equal(sorted_ids, ref_sorted)
    assert torch.equal(block_expert, ref_blocks)


@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "block_m"),
    [
        (1, 256, 1, 16),  # N = 1
        (1, 256, 8, 16),  # N = 8
        (32, 256, 8, 16),  # N = 256 (35B-A3B B = 32)
        (64, 256, 8, 16),  # N = 512 (B = 64)
        (100, 64, 5, 64),  # N = 500, not a power of two
        (17, 60, 4, 32),  # E = 60, not a power of two
        (40, 512, 10, 16),  # Qwen3-Next: E = 512, top-10 (N = 400)
        (3, 8, 2, 128),  # runs far shorter than a block
        (65, 256, 8, 16),  # N = 520: the 8-warp variant, a 1024-entry sort
        pytest.param(256, 256, 8, 16, marks=pytest.mark.gpu),  # N = 2048 (B = 256)
        pytest.param(512, 512, 8, 32, marks=pytest.mark.gpu),  # N = 4096
        pytest.param(1023, 256, 8, 64, marks=pytest.mark.gpu),  # N = 8184: the 16-warp variant, not a power of two
        pytest.param(1024, 512, 8, 16, marks=pytest.mark.gpu),  # N = 8192 = ALIGN_MAX_ENTRIES
    ],
)
def test_align_equals_the_ref_on_skewed_routing(num_tokens: int, num_experts: int, top_k: int, block_m: int) -> None:
    _check_align(_skewed_ids(num_tokens, num_experts, top_k, seed=num_tokens), num_experts, block_m)


@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "block_m"),
    [
        (16, 64, 4, 16),  # each expert exactly once
        (64, 64, 8, 16),  # each expert eight times on average, runs straddling blocks
        (30, 60, 8, 32),
        pytest.param(1024, 256, 8, 16, marks=pytest.mark.gpu),
    ],
)
def test_align_with_every_expert_hit(num_tokens: int, num_experts: int, top_k: int, block_m: int) -> None:
    _check_align(_every_expert_ids(num_tokens, num_experts, top_k, seed=num_experts), num_experts, block_m)


@pytest.mark.parametrize(
    ("num_entries", "num_experts", "expert", "block_m"),
    [
        (300, 64, 7, 16),  # one run of 19 blocks
        (77, 60, 59, 128),  # the last expert, E not a power of two
        (256, 512, 0, 32),  # the first expert, 511 empty ones after it
        pytest.param(8192, 256, 255, 16, marks=pytest.mark.gpu),  # 512 blocks of one expert
    ],
)
def test_align_with_all_entries_on_one_expert(num_entries: int, num_experts: int, expert: int, block_m: int) -> None:
    """The stable order is the whole answer here: one run, entries in entry order, then padding and -1 blocks."""
    ids = torch.full((num_entries, 1), expert, dtype=torch.int64, device=DEVICE)
    _check_align(ids, num_experts, block_m)
    sorted_ids, _ = moe_align_triton(ids, num_experts, block_m)
    assert sorted_ids[:num_entries].tolist() == list(range(num_entries))


def test_align_takes_int32_ids_and_a_non_contiguous_view() -> None:
    ids = _skewed_ids(24, 64, 8, seed=3)
    _check_align(ids.int(), 64, 16)
    wide = torch.zeros(24, 16, dtype=torch.int64, device=DEVICE)
    wide[:, ::2] = ids
    view = wide[:, ::2]  # flattens to a view of stride 2, not a copy: the kernel must follow the stride
    assert view.reshape(-1).stride() == (2,)
    _check_align(view, 64, 16)


def test_align_launch_variants_follow_the_power_of_two_of_n() -> None:
    """Constexprs depend on next_pow2(N) only (one compiled variant per power of two, all met by the start-up
    warm-up), every histogram input holds at least one element per thread, and the block bins bound every N."""
    for low, high in [(1, 128), (129, 256), (257, 512), (513, 1024), (2049, 4096), (4097, 8192)]:
        for num_experts, block_m in [(60, 16), (256, 16), (512, 64)]:
            configs = {
                tuple(sorted(align_launch(n, num_experts, block_m).items())) for n in (low, (low + high) // 2, high)
            }
            assert len(configs) == 1, (low, high, num_experts, block_m)
            config = align_launch(high, num_experts, block_m)
            threads = 32 * config["num_warps"]
            assert config["BLOCK_N"] >= max(high, threads) and config["BLOCK_E"] >= max(num_experts, threads)
            assert config["BLOCK_B"] >= -(-high // block_m) + min(num_experts, high)


def test_align_refuses_more_than_its_limit() -> None:
    assert ALIGN_MAX_ENTRIES == 8192
    ids = torch.zeros(ALIGN_MAX_ENTRIES + 1, 1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match=f"at most {ALIGN_MAX_ENTRIES} entries"):
        moe_align_triton(ids, 8, 16)


# ------------------------------------------------------------------------------------------------------------
# Chunked alignment: on the CPU the chunk is shrunk to 128 entries (at most 4 programs, so the chunk grows
# past 512 entries) to reach several programs at interpreter-sized N; the GPU cases run the served constants.


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    if DEVICE.type == "cpu":
        monkeypatch.setattr(moe_routing_triton, "ALIGN_CHUNK_MIN", 128)
        monkeypatch.setattr(moe_routing_triton, "ALIGN_CHUNKED_MAX_PROGRAMS", 4)


@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "block_m"),
    [
        (1, 256, 8, 16),  # N = 8: one program, mostly padding
        (16, 256, 8, 16),  # N = 128 = one whole chunk
        (33, 256, 8, 16),  # N = 264: three programs, the last partial
        (100, 60, 5, 32),  # E = 60, N = 500: four programs
        (40, 512, 10, 16),  # Qwen3-Next: E = 512 (BLOCK_E 512), top-10
        (90, 64, 8, 64),  # N = 720 > 4 · 128: the chunk grows to 256
        (5, 8, 2, 128),  # runs far shorter than a block
        pytest.param(513, 256, 8, 16, marks=pytest.mark.gpu),  # N = 4104: the first the fused MoE sends here
        pytest.param(2048, 256, 8, 32, marks=pytest.mark.gpu),  # N = 16384: a 2048-token prefill step
        pytest.param(8192, 256, 8, 64, marks=pytest.mark.gpu),  # N = 65536: 64 programs of 1024
        pytest.param(8193, 256, 8, 16, marks=pytest.mark.gpu),  # N = 65544: chunks of 2048, 33 programs
        pytest.param(2000, 512, 10, 16, marks=pytest.mark.gpu),  # Qwen3-Next, N = 20000
    ],
)
def test_chunked_align_equals_the_ref(
    num_tokens: int, num_experts: int, top_k: int, block_m: int, small_chunks: None
) -> None:
    ids = _skewed_ids(num_tokens, num_experts, top_k, seed=num_tokens + 1)
    _check_align(ids, num_experts, block_m, moe_align_chunked_triton)


@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "block_m"),
    [(64, 64, 8, 16), (30, 60, 8, 32), pytest.param(4096, 256, 8, 16, marks=pytest.mark.gpu)],
)
def test_chunked_align_with_every_expert_hit(
    num_tokens: int, num_experts: int, top_k: int, block_m: int, small_chunks: None
) -> None:
    ids = _every_expert_ids(num_tokens, num_experts, top_k, seed=num_tokens)
    _check_align(ids, num_experts, block_m, moe_align_chunked_triton)


@pytest.mark.parametrize(
    ("num_entries", "num_experts", "expert", "block_m"),
    [
        (300, 64, 7, 16),  # one run across three chunks
        (260, 60, 59, 128),  # the last expert
        (129, 512, 0, 32),  # the first expert, one entry in the second chunk
        pytest.param(ALIGN_CHUNKED_MAX_ENTRIES, 256, 255, 64, marks=pytest.mark.gpu),  # the limit, one run
    ],
)
def test_chunked_align_with_all_entries_on_one_expert(
    num_entries: int, num_experts: int, expert: int, block_m: int, small_chunks: None
) -> None:
    """Across chunks the stable order is the whole answer: entries in entry order, then padding, -1 blocks."""
    ids = torch.full((num_entries, 1), expert, dtype=torch.int64, device=DEVICE)
    _check_align(ids, num_experts, block_m, moe_align_chunked_triton)
    sorted_ids, _ = moe_align_chunked_triton(ids, num_experts, block_m)
    assert torch.equal(sorted_ids[:num_entries].long(), torch.arange(num_entries, device=DEVICE))


def test_chunked_align_takes_int32_ids_a_strided_view_and_bad_ids(small_chunks: None) -> None:
    """int32 ids and a flattened view of stride 2 are read as given; an id outside [0, E) belongs to no expert
    (the ref would fail on it): left out, exactly as the one-program kernel leaves it."""
    ids = _skewed_ids(40, 64, 8, seed=5)
    _check_align(ids.int(), 64, 16, moe_align_chunked_triton)
    wide = torch.zeros(40, 16, dtype=torch.int64, device=DEVICE)
    wide[:, ::2] = ids
    _check_align(wide[:, ::2], 64, 16, moe_align_chunked_triton)
    bad = ids.clone()
    bad[3, 2] = 64
    sorted_ids, block_expert = moe_align_chunked_triton(bad, 64, 16)
    assert 3 * 8 + 2 not in sorted_ids.tolist()
    assert int((sorted_ids < bad.numel()).sum()) == bad.numel() - 1
    one_sorted, one_blocks = moe_align_triton(bad, 64, 16)
    assert torch.equal(sorted_ids, one_sorted) and torch.equal(block_expert, one_blocks)


def test_chunked_align_launch_follows_the_power_of_two_of_n() -> None:
    """One compiled variant per power of two of N; programs ≤ the maximum; a chunk is one program's sort (≤
    ALIGN_MAX_ENTRIES) up to the limit; every histogram input holds at least one element per thread."""
    for low, high in [(4097, 8192), (8193, 16384), (32769, 65536), (65537, 131072), (262145, 524288)]:
        for num_experts in (60, 256, 512):
            launches = [align_chunked_launch(n, num_experts) for n in (low, (low + high) // 2, high)]
            assert len({(c["CHUNK"], c["BLOCK_E"], c["num_warps"]) for c in launches}) == 1, (low, num_experts)
            config = launches[-1]
            assert config["num_programs"] <= moe_routing_triton.ALIGN_CHUNKED_MAX_PROGRAMS
            assert config["num_programs"] * config["CHUNK"] >= high
            assert config["CHUNK"] <= ALIGN_MAX_ENTRIES
            threads = 32 * config["num_warps"]
            assert config["CHUNK"] >= threads and config["BLOCK_E"] >= max(num_experts, threads)
    assert ALIGN_CHUNKED_MAX_ENTRIES == moe_routing_triton.ALIGN_CHUNKED_MAX_PROGRAMS * ALIGN_MAX_ENTRIES


def test_chunked_align_refuses_more_than_its_limit() -> None:
    ids = torch.zeros(ALIGN_CHUNKED_MAX_ENTRIES + 1, 1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match=f"at most {ALIGN_CHUNKED_MAX_ENTRIES} entries"):
        moe_align_chunked_triton(ids, 8, 16)


def test_the_fused_moe_picks_the_alignment_by_entry_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """align_experts: one program up to ALIGN_DISPATCH_MAX_ENTRIES, chunked up to ALIGN_CHUNKED_MAX_ENTRIES, torch
    beyond (the switch points, not the sizes: the counts are lowered so the interpreter reaches them)."""
    calls: list[str] = []

    def spy(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            calls.append(name)
            return fn(*args)

        return call

    monkeypatch.setattr(moe_triton, "ALIGN_DISPATCH_MAX_ENTRIES", 64)
    monkeypatch.setattr(moe_triton, "ALIGN_CHUNKED_MAX_ENTRIES", 256)
    monkeypatch.setattr(moe_triton, "moe_align_triton", spy("one", moe_align_triton))
    monkeypatch.setattr(moe_triton, "moe_align_chunked_triton", spy("chunked", moe_align_chunked_triton))
    monkeypatch.setattr(moe_triton, "moe_align_ref", spy("torch", moe_align_ref))
    for num_tokens, want in [(8, "one"), (9, "chunked"), (32, "chunked"), (33, "torch")]:
        ids = _skewed_ids(num_tokens, 64, 8, seed=num_tokens)
        got = moe_triton.align_experts(ids, 64, 16)
        ref = moe_align_ref(ids, 64, 16)
        assert calls[-1] == want, (num_tokens, calls)
        assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))


# ------------------------------------------------------------------------------------------------------------
# Router


class _Spy:
    """Stands in for a kernel object: records each launch's grid and constexprs, then launches the real one."""

    def __init__(self, kernel: Any, calls: list[tuple[str, tuple[int, ...], dict[str, Any]]], name: str) -> None:
        self.kernel, self.calls, self.name = kernel, calls, name

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., Any]:
        def launch(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((self.name, grid, kwargs))
            return self.kernel[grid](*args, **kwargs)

        return launch


def _assert_router_matches_f_linear(num_tokens: int, dtype: torch.dtype, hidden: int = 1100) -> None:
    """router_logits_triton on 20 experts (+ the gate: 21 rows) at H = 1100 (the last reduction step partial),
    NaN-poisoned outputs, with and without the gate: F.linear's values, the gate logit in column E."""
    num_experts = 20
    torch.manual_seed(num_tokens)
    x = randn(num_tokens, hidden, dtype=dtype)
    router, gate = randn(num_experts, hidden, dtype=dtype), randn(1, hidden, dtype=dtype)
    with poisoned():
        logits = router_logits_triton(x, router, gate)
        plain = router_logits_triton(x, router, None)
    assert logits.shape == (num_tokens, num_experts + 1) and plain.shape == (num_tokens, num_experts)
    ref = router_logits_ref(x, router, gate)
    # fp32 at 1e-5: the sum orders differ by ~2e-5 absolute over H = 1100 (logits ~33 RMS). The gate column is
    # checked with the router rows, at their scale: alone, one token's gate logit can be near 0 and its relative
    # error any size (a flaky check that failed once in 2026-12-03's local run); a wrong or unwritten gate still
    # moves the whole tile's error by ~1 / sqrt(E + 1) of its RMS.
    assert_close("router and gate", ref, logits, tolerance(dtype, 1e-5, 4e-3))
    assert_close("router without the gate", ref[:, :num_experts], plain, tolerance(dtype, 1e-5, 4e-3))


# T = 4 / 5: the single-token GEMV's last count and the block GEMV's first; 7, 8, 9: BLOCK_T ± 1; 16, 17, 33:
# bucket edges where the rows per program change; 64 / 65: the GEMV's last count and the tl.dot kernel's first.
ROUTER_TOKENS = [1, 4, 5, 7, 8, 9, 16, 17, 33, 64, 65]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", ROUTER_TOKENS)
@pytest.mark.parametrize("min_programs", [ROUTER_GEMV_MIN_PROGRAMS, 8])
def test_router_at_every_switch_point(
    num_tokens: int, min_programs: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Equal to F.linear (fp32 sums, one rounding), gate logit in column E, with and without the gate. 20
    experts (+ the gate: 21 rows, so the last row block is partial for 2, 4 and 8 rows a program) and H = 1100
    (the last reduction step partial); min_programs = 8 makes these small shapes take the 4- and 8-row
    programs the 35B-A3B shape takes at 9-64 tokens."""
    for switch in (ROUTER_GEMV_SINGLE_MAX_TOKENS, ROUTER_GEMV_BLOCK_T - 1, ROUTER_GEMV_BLOCK_T, ROUTER_GEMV_MAX_TOKENS):
        assert {switch, switch + 1} <= set(ROUTER_TOKENS), "the parametrisation must straddle every switch"
    monkeypatch.setattr(moe_decode_triton, "ROUTER_GEMV_MIN_PROGRAMS", min_programs)
    calls: list[tuple[str, tuple[int, ...], dict[str, Any]]] = []
    for name in ("_moe_router_gemv_kernel", "_moe_router_kernel"):
        monkeypatch.setattr(moe_decode_triton, name, _Spy(getattr(moe_decode_triton, name), calls, name))
    _assert_router_matches_f_linear(num_tokens, dtype)
    # which kernel ran, with which blocks
    name, grid, kwargs = calls[0]
    if num_tokens > ROUTER_GEMV_MAX_TOKENS:
        assert name == "_moe_router_kernel"
        return
    assert name == "_moe_router_gemv_kernel"
    block_t = 1 if num_tokens <= ROUTER_GEMV_SINGLE_MAX_TOKENS else ROUTER_GEMV_BLOCK_T
    assert kwargs["BLOCK_T"] == block_t and grid[1] == -(-num_tokens // block_t)
    assert grid[0] == -(-(20 + 1) // kwargs["BLOCK_R"])  # the helper's 20 experts and the gate row
    if min_programs == 8 and num_tokens > 8:
        assert kwargs["BLOCK_R"] > 2  # the wider programs really ran


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [1100, 4100])
@pytest.mark.parametrize("num_tokens", [1, 3, 4, 5])
def test_router_weights_before_the_wait(
    num_tokens: int, hidden: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Up to ROUTER_GEMV_SINGLE_MAX_TOKENS tokens the GEMV takes H in one step with its weight tile loaded ahead of
    the wait; F.linear's values with and without the gate (H = 1100: the one-step tile masked past H). From 5
    tokens on, or past ROUTER_W_BEFORE_WAIT_MAX_HIDDEN (H = 4100), the weights load after the wait in 1024-column
    steps."""
    calls: list[tuple[str, tuple[int, ...], dict[str, Any]]] = []
    kernel = moe_decode_triton._moe_router_gemv_kernel
    monkeypatch.setattr(moe_decode_triton, "_moe_router_gemv_kernel", _Spy(kernel, calls, "gemv"))
    _assert_router_matches_f_linear(num_tokens, dtype, hidden)
    is_early = (
        num_tokens <= ROUTER_GEMV_SINGLE_MAX_TOKENS and hidden <= moe_decode_triton.ROUTER_W_BEFORE_WAIT_MAX_HIDDEN
    )
    assert calls
    for _, _, kwargs in calls:
        assert kwargs.get("W_BEFORE_WAIT", False) == is_early
        assert kwargs["BLOCK_K"] == (2048 if is_early else 1024)  # one step over next_pow2(1100), or 1024 a step


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [3, 5, 9, 33, 64])
def test_router_writes_only_its_tokens_rows(num_tokens: int, dtype: torch.dtype) -> None:
    """x and the logits are views into larger buffers: the logits rows past T (poison) must stay untouched, so a
    program whose token block runs past T masks its stores (x rows past T hold NaN: a masked-off load must not
    leak into the rows that are stored)."""
    num_experts, hidden, extra = 12, 96, 8
    x_all = randn(num_tokens + extra, hidden, dtype=dtype)
    x_all[num_tokens:] = float("nan")  # a load of a row past T would turn its logits into NaN
    router, gate = randn(num_experts, hidden, dtype=dtype), randn(1, hidden, dtype=dtype)
    for gate_weight in (gate, None):
        width = num_experts + int(gate_weight is not None)
        out = torch.full((num_tokens + extra, width), 7.0, dtype=dtype, device=DEVICE)
        router_logits_into(x_all[:num_tokens], router, gate_weight, out[:num_tokens])
        assert torch.equal(out[num_tokens:], torch.full_like(out[num_tokens:], 7.0)), "a row past T was written"
        ref = router_logits_ref(x_all[:num_tokens], router, gate_weight)
        assert_close("logits", ref, out[:num_tokens], tolerance(dtype, 1e-5, 4e-3))


@pytest.mark.parametrize("hidden", [2048, 5120])
def test_router_gemv_config_fills_the_device_and_follows_the_bucket(hidden: int) -> None:
    """On the 35B-A3B (256 experts + gate) and Qwen3-Next (512 + gate) shapes every T up to the GEMV's limit
    launches at least ROUTER_GEMV_MIN_PROGRAMS programs; T ≤ 4 keeps one program per (row pair, token), over H in
    one K step with the weights ahead of the wait at H = 2048 (as served) and in 1024-column steps after it past
    ROUTER_W_BEFORE_WAIT_MAX_HIDDEN; the blocks depend on next_pow2(T) alone (the start-up warm-up compiles every
    variant)."""
    is_w_early = hidden <= ROUTER_W_BEFORE_WAIT_MAX_HIDDEN
    for num_rows in (257, 513):
        for num_tokens in range(1, ROUTER_GEMV_MAX_TOKENS + 1):
            config = router_gemv_config(num_tokens, num_rows, hidden)
            programs = -(-num_rows // config["BLOCK_R"]) * -(-num_tokens // config["BLOCK_T"])
            assert programs >= ROUTER_GEMV_MIN_PROGRAMS, (num_rows, num_tokens, config)
            assert config["BLOCK_T"] * config["BLOCK_R"] <= 64  # fp32 partial sums: 64 registers a thread
            bucket = 1 << (num_tokens - 1).bit_length()
            assert config == router_gemv_config(bucket, num_rows, hidden)
            if num_tokens <= ROUTER_GEMV_SINGLE_MAX_TOKENS:
                block_k = 2048 if is_w_early else 1024
                assert (config["BLOCK_T"], config["BLOCK_R"], config["BLOCK_K"]) == (1, 2, block_k)
                assert config.get("W_BEFORE_WAIT", False) == is_w_early
    # rows per program grow with T on the 35B-A3B shape: 2 (5-8 tokens), 4 (9-32), 8 (33-64)
    assert [router_gemv_config(t, 257, 2048)["BLOCK_R"] for t in (5, 8, 9, 32, 33, 64)] == [2, 2, 4, 4, 8, 8]


# ------------------------------------------------------------------------------------------------------------
# CUDA graphs (GPU only)


def _replay_equals_eager(fn: Callable[[], tuple[torch.Tensor, ...]]) -> None:
    eager = fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fn()
    for t in captured:
        t.fill_(POISON if not t.is_floating_point() else float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for e, c in zip(eager, captured, strict=True):
        assert torch.equal(e, c)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("align", "num_tokens"),
    [(moe_align_triton, n) for n in (1, 32, 64, 256, 1024)]
    + [(moe_align_chunked_triton, n) for n in (513, 2048, 8192)],
    ids=lambda v: getattr(v, "__name__", v),
)
def test_align_captures_into_a_cuda_graph(align: Callable[..., Any], num_tokens: int) -> None:
    ids = _skewed_ids(num_tokens, 256, 8, seed=num_tokens)
    _replay_equals_eager(lambda: align(ids, 256, 16))
    sorted_ids, block_expert = align(ids, 256, 16)
    ref_sorted, ref_blocks = moe_align_ref(ids, 256, 16)
    assert torch.equal(sorted_ids, ref_sorted) and torch.equal(block_expert, ref_blocks)


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [2048, 5120])
@pytest.mark.parametrize("num_tokens", [1, 4, 5, 8, 9, 33, 64, 65])
def test_router_captures_into_a_cuda_graph(num_tokens: int, hidden: int) -> None:
    """The 35B-A3B router shape in bf16 (and a deeper one, whose weights load after the wait at every T), under
    PDL as served; run twice eagerly it is also bitwise reproducible (no atomics)."""
    bf16 = torch.bfloat16
    x = randn(num_tokens, hidden, dtype=bf16)
    scale = hidden**-0.5
    router, gate = randn(256, hidden, dtype=bf16, scale=scale), randn(1, hidden, dtype=bf16, scale=scale)
    _replay_equals_eager(lambda: (router_logits_triton(x, router, gate),))
    assert torch.equal(router_logits_triton(x, router, gate), router_logits_triton(x, router, gate))
    assert_close("router", router_logits_ref(x, router, gate), router_logits_triton(x, router, gate), 4e-3)
