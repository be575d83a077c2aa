"""kernels/_dispatch.triton_or_ref: an op built from its two twins runs the torch twin unless use_triton holds for
the argument it names, passes the arguments through as given, and carries the twin's signature under the op's name."""

from __future__ import annotations

import inspect

import pytest
import torch

from deltaserve.kernels import _dispatch, activation, activation_triton, preamble, preamble_triton


def test_cpu_tensors_take_the_torch_twin() -> None:
    x = torch.randn(3, 8)
    assert torch.equal(activation.silu_and_mul(x), activation.silu_and_mul_ref(x))


def test_op_carries_the_twins_signature_and_name() -> None:
    op = preamble.rotary_embedding
    assert op.__name__ == "rotary_embedding"
    assert inspect.signature(op) == inspect.signature(preamble.rotary_embedding_ref)
    assert op.__doc__ == preamble.rotary_embedding_ref.__doc__


def test_launcher_gets_the_arguments_as_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """use_triton is asked about the named argument (rotary_embedding: q, not positions), whether it comes by
    position or by keyword, and the launcher, looked up at call time, receives the call unchanged."""
    asked: list[torch.Tensor] = []
    calls: list[tuple[tuple[object, ...], dict[str, object]]] = []
    monkeypatch.setattr(_dispatch, "use_triton", lambda t: asked.append(t) or True)
    monkeypatch.setattr(preamble_triton, "rotary_embedding_triton", lambda *a, **k: calls.append((a, k)))
    positions, q, k, cache = torch.zeros(2, dtype=torch.int64), torch.ones(2, 8), torch.ones(2, 8), torch.ones(4, 4)
    preamble.rotary_embedding(positions, q, k, cache, 8, 4)
    by_keyword = {"k": k, "q": q, "cos_sin_cache": cache, "head_dim": 8, "rotary_dim": 4}
    preamble.rotary_embedding(positions, **by_keyword)
    assert [t is q for t in asked] == [True, True]
    assert calls == [((positions, q, k, cache, 8, 4), {}), ((positions,), by_keyword)]


def test_without_triton_the_ref_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_dispatch, "use_triton", lambda t: False)
    monkeypatch.setattr(activation_triton, "sigmoid_gate_mul_triton", lambda *a: pytest.fail("launcher called"))
    o, gate = torch.randn(2, 4), torch.randn(2, 4)
    assert torch.equal(activation.sigmoid_gate_mul(o, gate=gate), activation.sigmoid_gate_mul_ref(o, gate))
