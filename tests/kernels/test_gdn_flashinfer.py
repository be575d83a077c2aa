"""The FlashInfer GDN prefill path (kernels/gdn_flashinfer.py) against gdn_prefill_ref, its twin.

On the CPU a strict stand-in for flashinfer.gdn_prefill (FakeFlashInfer: FlashInfer 0.6.14's documented semantics in
plain torch, with its checks of layouts, dtypes and shapes) tests the plumbing: vLLM's prep, the gather of the states
into FlashInfer's [N, HV, dv, dk], the scatter back, and the dispatcher's per-call choice (an in-step checkpoint takes
deltaserve's kernel). The prep's Triton launcher runs under the interpreter against its twin. On the H200 (-m gpu,
with flashinfer on the path) the real kernel runs against deltaserve's Triton kernel at the served head shapes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from deltaserve.kernels import _dispatch, gdn, gdn_flashinfer
from deltaserve.kernels.gdn import gdn_prefill, gdn_prefill_ref
from deltaserve.kernels.gdn_flashinfer import gdn_prefill_flashinfer, gdn_prefill_prep_ref, unusable_reason
from tests.support.fake_cuda import HOST_SYNCS, MASK_INDEXING
from tests.support.fake_flashinfer import FakeFlashInfer, install_fake_flashinfer

from ._util import DEVICE, assert_close, randn, varlen_starts


@pytest.fixture
def fake_flashinfer(monkeypatch: pytest.MonkeyPatch) -> FakeFlashInfer:
    return install_fake_flashinfer(monkeypatch)


def _inputs(num_tokens: int, hk: int, hv: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """q, k, v as strided head views of one conv-output row (as the layer splits it), a, b views of one [b | a]
    row, A_log fp32 and dt_bias in the activation dtype (as the model holds them)."""
    key_dim, value_dim = hk * head_dim, hv * head_dim
    mixed = randn(num_tokens, 2 * key_dim + value_dim, dtype=dtype)
    q = mixed[:, :key_dim].view(num_tokens, hk, head_dim)
    k = mixed[:, key_dim : 2 * key_dim].view(num_tokens, hk, head_dim)
    v = mixed[:, 2 * key_dim :].view(num_tokens, hv, head_dim)
    ba = randn(num_tokens, 2 * hv, dtype=dtype)
    # mild decays (e^g ~ 0.5-0.97 a token): a sequence's start state still shows in its outputs and final state
    A_log = torch.log(torch.empty(hv, device=DEVICE).uniform_(0.05, 1.0))
    return q, k, v, ba[:, hv:], ba[:, :hv], A_log, randn(hv, scale=0.5).to(dtype)


# Lengths not multiples of 64, an empty sequence, a slot -1 with has_initial_state set (starts from zeros, writes
# nothing) and sequences without an initial state over slots that hold one.
LENGTHS = [100, 5, 0, 64, 130, 37]
HAS_INIT = [True, False, False, True, False, True]


def _batch(hk: int, hv: int, dtype: torch.dtype, head_dim: int = 32) -> tuple[tuple[torch.Tensor, ...], ...]:
    num_slots = len(LENGTHS) + 3
    inputs = _inputs(sum(LENGTHS), hk, hv, head_dim, dtype)
    # not symmetric in (dk, dv), so a state passed untransposed gives other numbers
    states = randn(num_slots, hv, head_dim, head_dim, scale=0.1)
    slots = torch.randperm(num_slots, device=DEVICE)[: len(LENGTHS)].int()
    slots[3] = -1
    routing = (varlen_starts(LENGTHS), slots, torch.tensor(HAS_INIT, device=DEVICE))
    return inputs, (states,), routing


def _compare(
    path: Callable[..., torch.Tensor], hk: int, hv: int, dtype: torch.dtype, tol: float, out: bool = False
) -> None:
    """path and gdn_prefill_ref on one batch (each on its own copy of the states): outputs and every slot agree, the
    slots no sequence writes are untouched."""
    inputs, (states,), routing = _batch(hk, hv, dtype)
    before, ref_states = states.clone(), states.clone()
    ref = gdn_prefill_ref(*inputs, ref_states, *routing)
    given = torch.full(ref.shape, float("nan"), dtype=ref.dtype, device=DEVICE) if out else None
    result = path(*inputs, states, *routing, out=given)
    assert given is None or result.data_ptr() == given.data_ptr(), "the output goes into `out`"
    assert_close("o", ref, result, tol)
    # fp32 states from the same rounded q̂ / k̂ on both sides: tight at any activation dtype
    assert_close("states", ref_states, states, 2e-5)
    qsl, slots, _ = routing
    written = {s for s, n in zip(slots.tolist(), (qsl[1:] - qsl[:-1]).tolist(), strict=True) if s >= 0 and n > 0}
    untouched = [s for s in range(states.shape[0]) if s not in written]
    assert torch.equal(states[untouched], before[untouched]), "a slot no sequence writes (-1, empty, unused) changed"


@pytest.mark.parametrize(("hk", "hv"), [(2, 4), (2, 6)], ids=["group2", "group3"])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 2e-5), (torch.bfloat16, 1e-2)], ids=["float32", "bfloat16"])
def test_flashinfer_path_equals_ref(
    fake_flashinfer: FakeFlashInfer, hk: int, hv: int, dtype: torch.dtype, tol: float
) -> None:
    _compare(gdn_prefill_flashinfer, hk, hv, dtype, tol, out=dtype == torch.float32)
    assert fake_flashinfer.calls == 1


def test_flashinfer_path_with_the_triton_launchers(
    fake_flashinfer: FakeFlashInfer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same, with the Triton launchers of the prep and the state copies (the interpreter on the CPU) in place of
    their twins."""
    launched: list[str] = []
    from deltaserve.kernels import gdn_flashinfer_triton

    for name in ("gdn_prefill_prep_triton", "gather_states_triton", "scatter_states_triton"):
        real = getattr(gdn_flashinfer_triton, name)
        monkeypatch.setattr(gdn_flashinfer_triton, name,
                            lambda *a, name=name, real=real: launched.append(name) or real(*a))  # fmt: skip
    monkeypatch.setattr(_dispatch, "use_triton", lambda t: True)
    _compare(gdn_prefill_flashinfer, 2, 6, torch.float32, 2e-5)
    assert launched == ["gdn_prefill_prep_triton", "gather_states_triton", "scatter_states_triton"]
    assert fake_flashinfer.calls == 1


def _slot_pool(num_slots: int, hv: int, dk: int, dv: int, strided: bool) -> torch.Tensor:
    """[slots, HV, dk, dv] fp32 of random states; strided: a view whose slot stride is 64 elements wider, as a slot
    of a shared page pool is (docs/ARCHITECTURE.md, "One pool"); NaN between the slots."""
    size = hv * dk * dv
    pool = torch.full((num_slots, size + (64 if strided else 0)), float("nan"), device=DEVICE)
    states = pool[:, :size].view(num_slots, hv, dk, dv)
    states.copy_(randn(num_slots, hv, dk, dv))
    return states


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize(("hv", "dk", "dv"), [(3, 32, 32), (2, 48, 24), (1, 128, 128)])
def test_state_copies_triton_equal_their_twins(hv: int, dk: int, dv: int, strided: bool) -> None:
    """gather_states_triton and scatter_states_triton (the interpreter here) against their torch twins, bit for bit:
    a slot -1, a sequence without an initial state, an empty one, a free slot holding NaN that nothing reads; dk 48 /
    dv 24: a partial row block and a padded column block; 128: the served head size, four row blocks."""
    from deltaserve.kernels.gdn_flashinfer import gather_states_ref, scatter_states_ref
    from deltaserve.kernels.gdn_flashinfer_triton import gather_states_triton, scatter_states_triton

    states = _slot_pool(6, hv, dk, dv, strided)
    states[4] = float("nan")  # free: no sequence reads or writes it
    slots = torch.tensor([2, -1, 0, 5, 1], dtype=torch.int32, device=DEVICE)
    has_initial_state = torch.tensor([True, True, False, True, True], device=DEVICE)
    starts = varlen_starts([7, 3, 1, 0, 64])
    want = gather_states_ref(states, slots, has_initial_state)
    got = gather_states_triton(states, slots, has_initial_state)
    assert got.is_contiguous() and got.shape == (5, hv, dv, dk) and torch.equal(got, want)
    final = randn(5, hv, dv, dk)
    ref_states, tri_states = states.clone(), _slot_pool(6, hv, dk, dv, strided)
    tri_states.copy_(states)
    scatter_states_ref(ref_states, slots, starts, final.clone())
    scatter_states_triton(tri_states, slots, starts, final)
    assert torch.equal(ref_states.nan_to_num(7.0), tri_states.nan_to_num(7.0))
    # slots 2, 0 and 1 took their sequences' finals (transposed); 5 (an empty sequence) and the free 4 kept theirs
    assert torch.equal(tri_states[2], final[0].transpose(-1, -2)) and torch.equal(tri_states[5], states[5])


def test_untransposed_states_fail_the_comparison(
    fake_flashinfer: FakeFlashInfer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The comparison above can fail: states handed over in deltaserve's [HV, dk, dv] instead of FlashInfer's
    [HV, dv, dk] (same shapes, dk = dv) give other outputs and states."""
    real = gdn_flashinfer.gather_states
    monkeypatch.setattr(gdn_flashinfer, "gather_states", lambda *a: real(*a).transpose(-1, -2).contiguous())
    with pytest.raises(AssertionError, match="relative RMSE"):
        _compare(gdn_prefill_flashinfer, 2, 4, torch.float32, 2e-5)


@pytest.mark.parametrize(
    ("bad", "message"),
    [("q", "contiguous"), ("state", "initial_state"), ("g", "g"), ("heads", "GVA"), ("l2norm", "normed")],
)
def test_the_stand_in_is_strict(bad: str, message: str) -> None:
    """FakeFlashInfer refuses what FlashInfer refuses, so a wrong layout fails the tests rather than passing them."""
    fake = FakeFlashInfer()
    q, k, v = (randn(10, heads, 32, dtype=torch.bfloat16) for heads in (2, 2, 4))
    g, beta = torch.rand(10, 4, device=DEVICE), torch.rand(10, 4, device=DEVICE)
    kwargs = {"initial_state": torch.zeros(1, 4, 32, 32, device=DEVICE), "cu_seqlens": varlen_starts([10])}
    fake(q, k, v, g=g, beta=beta, **kwargs)  # the good call passes
    with pytest.raises(AssertionError, match="q: torch.float32"):
        fake(q.float(), k.float(), v.float(), g=g, beta=beta, **kwargs)  # the SM90 kernel takes 16-bit only
    if bad == "q":
        q = randn(10, 32, 2, dtype=torch.bfloat16).transpose(1, 2)
    elif bad == "state":
        kwargs["initial_state"] = torch.zeros(1, 4, 32, 16, device=DEVICE)
    elif bad == "g":
        g = g.double()
    elif bad == "heads":
        v = randn(10, 3, 32, dtype=torch.bfloat16)
        g, beta = g[:, :3].contiguous(), beta[:, :3].contiguous()
        kwargs["initial_state"] = torch.zeros(1, 3, 32, 32, device=DEVICE)
    else:
        kwargs["use_qk_l2norm_in_kernel"] = True
    with pytest.raises(AssertionError, match=message):
        fake(q, k, v, g=g, beta=beta, output_final_state=True, **kwargs)


def test_a_call_that_writes_no_slot_changes_none(fake_flashinfer: FakeFlashInfer) -> None:
    """Every sequence a slot -1 or empty: no slot changes (the scatter's fallback target rewrites slot 0 with its own
    state), and the outputs are the ref's."""
    inputs = _inputs(20, 2, 4, 32, torch.float32)
    states = randn(3, 4, 32, 32, scale=0.1)
    before = states.clone()
    routing = (varlen_starts([12, 0, 8]), torch.tensor([-1, 1, -1], dtype=torch.int32, device=DEVICE),
               torch.tensor([True, True, False], device=DEVICE))  # fmt: skip
    ref = gdn_prefill_ref(*inputs, before.clone(), *routing)
    assert_close("o", ref, gdn_prefill_flashinfer(*inputs, states, *routing), 2e-5)
    assert torch.equal(states, before) and fake_flashinfer.calls == 1


class _HostSyncs(TorchDispatchMode):
    """The ops that would wait for the device on CUDA (a host sync, a boolean-mask index), outside FlashInfer."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []
        self.in_flashinfer = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 (torch's protocol)
        is_mask = func in MASK_INDEXING and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                               for i in tree_leaves(args[1:]))  # fmt: skip
        if not self.in_flashinfer and (func in HOST_SYNCS or is_mask):
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def test_the_path_does_not_sync_the_host(fake_flashinfer: FakeFlashInfer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Gather, scatter and prep read no device value on the host (the stand-in itself does, and is not watched)."""
    mode = _HostSyncs()
    module = sys.modules["flashinfer.gdn_prefill"]

    def watched(*args: object, **kwargs: object) -> object:
        mode.in_flashinfer = True
        try:
            return fake_flashinfer(*args, **kwargs)
        finally:
            mode.in_flashinfer = False

    monkeypatch.setattr(module, "chunk_gated_delta_rule", watched)
    inputs, (states,), routing = _batch(2, 4, torch.float32)
    with mode:
        gdn_prefill(*inputs, states, *routing, backend="flashinfer")
    assert fake_flashinfer.calls == 1 and mode.seen == []


def test_warm_up_runs_both_kernels(fake_flashinfer: FakeFlashInfer) -> None:
    """One sequence (FlashInfer's context-parallel kernel), then enough to pass SMs x heads (2 SMs off CUDA, so
    2 sequences of the 4 heads; on a GPU its own SM count, e.g. 33 of them on an H100's 132)."""
    A_log, dt_bias = torch.zeros(4, device=DEVICE), torch.zeros(4, device=DEVICE)
    gdn_flashinfer.warm_up(2, 32, A_log, dt_bias)
    is_cuda = torch.device(DEVICE).type == "cuda"
    num_sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count if is_cuda else 2
    num_seqs = max(2, -(-num_sms // 4))
    assert num_seqs * 4 >= num_sms
    assert fake_flashinfer.batches == [(1, 64), (num_seqs, 64 * num_seqs)]


def test_dispatcher_sends_checkpoint_calls_to_ours(fake_flashinfer: FakeFlashInfer) -> None:
    """backend flashinfer: a call without checkpoint tensors runs FlashInfer; one with an in-step checkpoint runs
    deltaserve's kernel (the ref on the CPU, the Triton kernel on a GPU: what backend triton runs), which also saves
    the checkpoint, bit for bit; backend triton never runs FlashInfer."""
    inputs, (states,), routing = _batch(2, 4, torch.float32)
    ours_states = states.clone()
    chunks = torch.tensor([1, -1, -1, -1, 2, -1], dtype=torch.int32, device=DEVICE)
    spare = [s for s in range(states.shape[0]) if s not in routing[1].tolist()]
    ckpt_slots = torch.tensor([spare[0], 0, 0, 0, spare[1], 0], dtype=torch.int32, device=DEVICE)
    ours = gdn_prefill(*inputs, ours_states, *routing, checkpoint_chunks=chunks, checkpoint_slots=ckpt_slots,
                       backend="triton")  # fmt: skip
    ref_states = states.clone()
    ref = gdn_prefill_ref(*inputs, ref_states, *routing, checkpoint_chunks=chunks, checkpoint_slots=ckpt_slots)
    assert_close("out", ref, ours, 2e-5)
    assert_close("states and checkpoints", ref_states, ours_states, 2e-5)
    out = gdn_prefill(*inputs, states, *routing, checkpoint_chunks=chunks, checkpoint_slots=ckpt_slots,
                      backend="flashinfer")  # fmt: skip
    assert fake_flashinfer.calls == 0
    assert torch.equal(out, ours) and torch.equal(states, ours_states)
    gdn_prefill(*inputs, states.clone(), *routing, backend="triton")
    assert fake_flashinfer.calls == 0
    gdn_prefill(*inputs, states.clone(), *routing, backend="flashinfer")
    assert fake_flashinfer.calls == 1
    with pytest.raises(ValueError, match="'cutedsl'"):
        gdn_prefill(*inputs, states, *routing, backend="cutedsl")


def test_takes_flashinfer_is_the_one_rule() -> None:
    chunks = torch.tensor([-1, 3], dtype=torch.int32)
    large = gdn.FLASHINFER_MIN_TOKENS
    assert gdn.takes_flashinfer("flashinfer", 1, None, None)
    assert not gdn.takes_flashinfer("flashinfer", large, chunks, chunks)
    assert not gdn.takes_flashinfer("triton", large, None, None)
    # the default where FlashInfer runs: its kernel from FLASHINFER_MIN_TOKENS rows a call, ours below and for
    # any call that saves an in-step checkpoint
    assert gdn.takes_flashinfer("flashinfer-large", large, None, None)
    assert not gdn.takes_flashinfer("flashinfer-large", large - 1, None, None)
    assert not gdn.takes_flashinfer("flashinfer-large", 4 * large, chunks, chunks)
    assert gdn.uses_flashinfer("flashinfer-large") and gdn.uses_flashinfer("flashinfer")
    assert not gdn.uses_flashinfer("triton")
    with pytest.raises(ValueError, match="saves no in-step checkpoint"):
        gdn_prefill_flashinfer(*_inputs(4, 1, 2, 32, torch.float32), torch.zeros(2, 2, 32, 32), varlen_starts([4]),
                               torch.tensor([0]), torch.tensor([True]), checkpoint_chunks=chunks[:1],
                               checkpoint_slots=chunks[:1])  # fmt: skip


@pytest.mark.parametrize(("hk", "hv", "dk", "dv"), [(2, 6, 32, 32), (1, 2, 128, 64), (3, 3, 48, 24)])
def test_prep_triton_equals_its_twin(hk: int, hv: int, dk: int, dv: int) -> None:
    """The prep's Triton launcher (the interpreter here) against gdn_prefill_prep_ref on strided views; 37 tokens:
    a partial block of 16. dk 48 / dv 24: partial column blocks."""
    from deltaserve.kernels.gdn_flashinfer_triton import gdn_prefill_prep_triton

    num_tokens = 37
    mixed = randn(num_tokens, 2 * hk * dk + hv * dv, scale=2.0)
    q = mixed[:, : hk * dk].view(num_tokens, hk, dk)
    k = mixed[:, hk * dk : 2 * hk * dk].view(num_tokens, hk, dk)
    v = mixed[:, 2 * hk * dk :].view(num_tokens, hv, dv)
    ba = randn(num_tokens, 2 * hv, scale=4.0)  # softplus on both sides of 0 and past the threshold 20 below
    ba[0, hv:] = 30.0
    b, a = ba[:, :hv], ba[:, hv:]
    A_log, dt_bias = torch.log(torch.empty(hv, device=DEVICE).uniform_(1, 16)), randn(hv, scale=0.5)
    ref = gdn_prefill_prep_ref(q, k, v, a, b, A_log, dt_bias)
    out = gdn_prefill_prep_triton(q, k, v, a, b, A_log, dt_bias)
    for name, r, o in zip(("q", "k", "v", "g", "beta"), ref, out, strict=True):
        assert o.is_contiguous() and o.shape == r.shape and o.dtype == r.dtype, name
        torch.testing.assert_close(o, r, rtol=2e-6, atol=2e-6, msg=name)
    assert torch.equal(out[2], v)


def test_unusable_reasons(fake_flashinfer: FakeFlashInfer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each reason FlashInfer's path cannot serve names itself; with an SM90 GPU, bf16 and 128 heads: none."""
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert unusable_reason(cuda, bf16, 128, 128) is None
    assert "device is cpu" in unusable_reason(torch.device("cpu"), bf16, 128, 128)
    assert "torch.float32" in unusable_reason(cuda, torch.float32, 128, 128)
    assert "dk 64 / dv 128" in unusable_reason(cuda, bf16, 64, 128)
    fake_flashinfer_module = sys.modules["flashinfer.gdn_prefill"]
    monkeypatch.setattr(fake_flashinfer_module, "chunk_gated_delta_rule_sm90", None)
    assert "SM90 GDN prefill kernel does not" in unusable_reason(cuda, bf16, 128, 128)
    monkeypatch.setitem(sys.modules, "flashinfer.gdn_prefill", None)  # as if not installed
    assert "does not import (ModuleNotFoundError" in unusable_reason(cuda, bf16, 128, 128)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert "compute capability 10.0" in unusable_reason(cuda, bf16, 128, 128)


def _real_flashinfer() -> None:
    """Skips the GPU tests with the reason when the real FlashInfer SM90 kernel cannot run here."""
    if torch.cuda.is_available():
        reason = unusable_reason(torch.device("cuda"), torch.bfloat16, 128, 128)
        if reason is not None:
            pytest.skip(f"FlashInfer's GDN prefill cannot run: {reason}")


@pytest.mark.gpu
@pytest.mark.parametrize(("hk", "hv"), [(16, 48), (16, 32)], ids=["27b", "35b-a3b"])
@pytest.mark.parametrize("lengths", [[1024] * 8, [4096]], ids=["8x1024", "1x4096"])
def test_flashinfer_against_ours_served_shapes(hk: int, hv: int, lengths: list[int]) -> None:
    """The real FlashInfer path against deltaserve's Triton kernel (and the ref) in bf16 at the served heads (128),
    initial states in scattered slots: outputs within bf16 tolerance, states in the right slots, the rest untouched."""
    _real_flashinfer()
    from deltaserve.kernels.gdn_triton import gdn_prefill_triton

    head_dim, num_slots = 128, len(lengths) + 4
    inputs = _inputs(sum(lengths), hk, hv, head_dim, torch.bfloat16)
    states = randn(num_slots, hv, head_dim, head_dim, scale=0.05)
    slots = torch.randperm(num_slots, device=DEVICE)[: len(lengths)].int()
    routing = (varlen_starts(lengths), slots, torch.ones(len(lengths), dtype=torch.bool, device=DEVICE))
    ours_states, ref_states, before = states.clone(), states.clone(), states.clone()
    ours = gdn_prefill_triton(*inputs, ours_states, *routing)
    ref = gdn_prefill_ref(*inputs, ref_states, *routing)
    theirs = gdn_prefill(*inputs, states, *routing, backend="flashinfer")
    rel = ((theirs.float() - ours.float()).norm() / ours.float().norm()).item()
    state_diff = (states - ours_states).abs().max().item()
    print(f"\nflashinfer vs ours: output relative error {rel:.3e}, state max abs diff {state_diff:.3e}")
    assert_close("o vs ours", ours, theirs, 2e-2)
    assert_close("o vs ref", ref, theirs, 2e-2)
    assert_close("states vs ours", ours_states[slots.long()], states[slots.long()], 2e-2)
    assert_close("states vs ref", ref_states[slots.long()], states[slots.long()], 2e-2)
    untouched = [s for s in range(num_slots) if s not in slots.tolist()]
    assert torch.equal(states[untouched], before[untouched])


@pytest.mark.gpu
@pytest.mark.parametrize(("hk", "hv"), [(16, 48), (16, 32)], ids=["27b", "35b-a3b"])
def test_prep_triton_served_shapes(hk: int, hv: int) -> None:
    """The prep's Triton kernel against its twin in bf16 at the served heads: q̂ / k̂ within one bf16 rounding."""
    from deltaserve.kernels.gdn_flashinfer_triton import gdn_prefill_prep_triton

    inputs = _inputs(3000, hk, hv, 128, torch.bfloat16)
    ref = gdn_prefill_prep_ref(*inputs)
    out = gdn_prefill_prep_triton(*inputs)
    for name, r, o in zip(("q", "k", "v", "g", "beta"), ref, out, strict=True):
        assert o.is_contiguous() and o.dtype == r.dtype, name
        # q̂ / k̂: one bf16 rounding of nearly equal fp32 values; g, β: Triton's exp / log against torch's
        torch.testing.assert_close(o.float(), r.float(), rtol=1e-2 if name in ("q", "k") else 1e-4, atol=1e-5, msg=name)
