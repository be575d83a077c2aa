"""The token gate itself: it passes on the real engine and fails (exit 1) when the engine is broken."""

from __future__ import annotations

from pathlib import Path

import pytest

import deltaserve.runner.model_runner as model_runner
from deltaserve.gates.tokens import run_gate


def test_gate_passes_on_the_engine(tiny_next: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_gate(tiny_next, num_prompts=6, max_tokens=8) == 0
    assert "STRICT 6/6" in capsys.readouterr().out


def test_gate_catches_a_state_restart(
    tiny_dense: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Continuing sequences that restart their GDN state from zero (transformers' old bug, §8.1) must fail."""
    build = model_runner.build_eager_inputs

    def forgetful(*args: object) -> object:
        inputs = build(*args)
        inputs.ctx.has_initial_state.zero_()
        inputs.ctx.prefill_has_initial_state.zero_()
        return inputs

    monkeypatch.setattr(model_runner, "build_eager_inputs", forgetful)
    assert run_gate(tiny_dense, num_prompts=6, max_tokens=8) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out


def test_gate_with_nothing_to_check_exits_2(tiny_dense: Path) -> None:
    assert run_gate(tiny_dense, num_prompts=0) == 2
