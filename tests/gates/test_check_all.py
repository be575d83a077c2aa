"""`deltaserve check all`: one summary line per gate and the combined exit code (token gate faked here), in one
process (--jobs 1) and on worker subprocesses (the default)."""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from deltaserve.gates import all as check_all
from deltaserve.gates import oracle_flags, parallel

from . import check_all_fakes


def fake_token_gate(monkeypatch: pytest.MonkeyPatch, codes: dict[str, int], totals: dict[str, int]) -> list[str]:
    """Replace the token gate, the conditioning and MTP checks and the checkpoint lookup; returns the variants the
    token gate was called on."""
    calls: list[str] = []

    def run_gate(model_dir: Path, reference: str = "transformers", num_prompts: int = 32, max_tokens: int = 32) -> int:
        variant = Path(model_dir).name
        calls.append(variant)
        total = totals.get(variant, num_prompts)
        print(f"STRICT {total if codes[variant] == 0 else total - 1}/{total}")
        return codes[variant]

    def check_conditioning(model_dir: Path, num_prompts: int = 32, max_tokens: int = 32) -> int:
        print(f"conditioning: transformers-bfloat16 vs transformers-float32 STRICT {num_prompts}/{num_prompts}")
        return 0

    def check_mtp(model_dir: Path) -> object:
        return types.SimpleNamespace(num_agree=60, num_positions=100, rate=0.6)

    monkeypatch.setitem(sys.modules, "deltaserve.gates.tokens", types.SimpleNamespace(run_gate=run_gate))
    monkeypatch.setitem(
        sys.modules, "deltaserve.gates.conditioning", types.SimpleNamespace(check_conditioning=check_conditioning)
    )
    monkeypatch.setitem(sys.modules, "deltaserve.tiny.mtp", types.SimpleNamespace(check_mtp=check_mtp))
    monkeypatch.setattr(check_all, "_checkpoint", lambda tmp, variant, checkpoints: Path("/nowhere") / variant)
    return calls


def args(**overrides: object) -> argparse.Namespace:
    defaults = {"skip": [], "num_prompts": 4, "max_tokens": 4, "checkpoints": "trained"}
    return argparse.Namespace(**{**defaults, "with_": ["conditioning", "mtp"], **overrides})


def test_all_gates_pass(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    calls = fake_token_gate(monkeypatch, {"dense": 0, "moe": 0, "next": 0}, {})
    assert check_all.run(args()) == 0
    out = capsys.readouterr().out
    assert calls == ["dense", "moe", "next"]
    assert "oracle-flags         PASS" in out and "tokens[next]         PASS               STRICT 4/4" in out
    assert "conditioning[moe]    PASS               bf16 vs fp32 STRICT 4/4" in out
    assert "mtp[dense]           PASS               agreement 60/100 = 0.600" in out
    assert "check all: PASS (10 gates, 0 failed)" in out


def test_a_failing_gate_fails_the_whole(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    fake_token_gate(monkeypatch, {"dense": 0, "moe": 1, "next": 0}, {})
    assert check_all.run(args(skip=["oracle-flags"])) == 1
    out = capsys.readouterr().out
    assert "tokens[moe]          FAIL (exit 1)      STRICT 3/4" in out and "1 failed" in out


def test_nothing_to_check_is_2_unless_something_failed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake_token_gate(monkeypatch, {"dense": 0, "moe": 0, "next": 0}, {"next": 0})
    assert check_all.run(args(skip=["oracle-flags"])) == 2
    monkeypatch.setattr(oracle_flags, "DEFAULT_PATHS", ())
    monkeypatch.setattr(oracle_flags, "default_paths", lambda: [tmp_path])
    assert check_all.run(args(skip=["tokens", "conditioning", "mtp"])) == 2
    fake_token_gate(monkeypatch, {"dense": 1, "moe": 0, "next": 0}, {})
    assert check_all.run(args()) == 1


def test_a_gate_that_raises_is_a_failure(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    def broken(model_dir: Path, **kwargs: object) -> int:
        raise RuntimeError("engine exploded")

    fake_token_gate(monkeypatch, {"dense": 0, "moe": 0, "next": 0}, {})
    monkeypatch.setitem(sys.modules, "deltaserve.gates.tokens", types.SimpleNamespace(run_gate=broken))
    assert check_all.run(args(skip=["oracle-flags"])) == 1
    assert "no STRICT line printed" in capsys.readouterr().out


def test_failures_beyond_strict_are_named(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    def run_gate(model_dir: Path, **kwargs: object) -> int:
        print("STRICT 4/4\nlogits vs reference: ok\nprefill-then-decode vs full forward: 3e-4 (tolerance 1e-5) FAIL")
        return 1

    fake_token_gate(monkeypatch, {"dense": 0, "moe": 0, "next": 0}, {})
    monkeypatch.setitem(sys.modules, "deltaserve.gates.tokens", types.SimpleNamespace(run_gate=run_gate))
    assert check_all.run(args(skip=["oracle-flags"])) == 1
    assert "STRICT 4/4; prefill-then-decode vs full forward: 3e-4 (tolerance 1e-5) FAIL" in capsys.readouterr().out


def test_conditioning_and_mtp_failures_fail_the_whole(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    fake_token_gate(monkeypatch, {"dense": 0, "moe": 0, "next": 0}, {})

    def badly_conditioned(model_dir: Path, num_prompts: int = 32, max_tokens: int = 32) -> int:
        print(f"conditioning: transformers-bfloat16 vs transformers-float32 STRICT 3/{num_prompts}")
        return 1

    monkeypatch.setitem(
        sys.modules, "deltaserve.gates.conditioning", types.SimpleNamespace(check_conditioning=badly_conditioned)
    )
    untrained = types.SimpleNamespace(num_agree=1, num_positions=1000, rate=0.001)
    monkeypatch.setitem(sys.modules, "deltaserve.tiny.mtp", types.SimpleNamespace(check_mtp=lambda d: untrained))
    assert check_all.run(args(skip=["oracle-flags", "tokens"])) == 1
    out = capsys.readouterr().out
    assert "conditioning[dense]  FAIL (exit 1)      bf16 vs fp32 STRICT 3/4" in out
    assert "mtp[next]            FAIL (exit 1)      agreement 1/1000 = 0.001" in out and "6 failed" in out


def test_the_trained_checkpoints_are_found_as_package_data() -> None:
    for variant in check_all.TINY_VARIANTS:
        folder = check_all._checkpoint("", variant, "trained")
        assert (folder / "config.json").is_file() and (folder / "training.json").is_file()
        assert any(folder.glob("*.safetensors"))


def test_conditioning_and_mtp_run_by_default_on_trained_checkpoints_only(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    fake_token_gate(monkeypatch, {"dense": 0, "moe": 0, "next": 0}, {})
    assert check_all.run(args(with_=[], skip=["oracle-flags"])) == 0
    out = capsys.readouterr().out
    assert "conditioning[moe]" in out and "mtp[next]" in out and "(9 gates, 0 failed)" in out
    assert check_all.run(args(with_=[], skip=["oracle-flags"], checkpoints="random")) == 0
    out = capsys.readouterr().out
    assert "conditioning[" not in out and "mtp[" not in out and "(3 gates, 0 failed)" in out


# The workers' path: each gate in a worker subprocess (gates/parallel.py) with the fakes of check_all_fakes.py.
def in_workers(monkeypatch: pytest.MonkeyPatch, spec: dict[str, Any], **overrides: object) -> int:
    monkeypatch.setattr(parallel, "worker_command", check_all_fakes.worker_command(spec))
    return check_all.run(args(jobs=2, **overrides))


def test_workers_print_what_one_process_prints(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    # the first gate ends last, so the order of the output is the order of the gates, not of their ends
    spec = {"sleep": {"dense": 1.5}}
    with monkeypatch.context() as patch:
        for name in ("deltaserve.gates.tokens", "deltaserve.gates.conditioning", "deltaserve.tiny.mtp"):
            patch.setitem(sys.modules, name, sys.modules.get(name, types.ModuleType(name)))
        patch.setattr(check_all, "_checkpoint", check_all._checkpoint)
        check_all_fakes.install(spec)
        assert check_all.run(args()) == 0
    alone = capsys.readouterr()
    assert in_workers(monkeypatch, spec) == 0
    together = capsys.readouterr()
    assert together.out == alone.out
    assert together.err.count("fake token gate warning on") == 3
    assert together.err.index("on dense") < together.err.index("on moe") < together.err.index("on next")
    assert "fake token gate on dense\nSTRICT 4/4" in together.out
    assert "check all: PASS (10 gates, 0 failed)" in together.out


def test_failures_in_workers_fail_the_whole(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    assert in_workers(monkeypatch, {"codes": {"moe": 1}, "agree": 3, "rate": 0.01}, skip=["oracle-flags"]) == 1
    out = capsys.readouterr().out
    assert "tokens[moe]          FAIL (exit 1)      STRICT 3/4" in out
    assert "conditioning[next]   FAIL (exit 1)      bf16 vs fp32 STRICT 3/4" in out
    assert "mtp[dense]           FAIL (exit 1)      agreement 1/100 = 0.010" in out
    assert "check all: FAIL (9 gates, 7 failed)" in out
    assert in_workers(monkeypatch, {"totals": {"next": 0}}, skip=["oracle-flags"]) == 2
    assert "tokens[next]         NOTHING TO CHECK" in capsys.readouterr().out


def test_a_worker_that_dies_fails_its_gate_only(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    assert in_workers(monkeypatch, {"die": {"moe": 7}}, skip=["oracle-flags", "conditioning"]) == 1
    captured = capsys.readouterr()
    assert "tokens[moe]          FAIL (exit 1)      the gate's worker process died (exit 7)" in captured.out
    assert "fake gate: dying on purpose" in captured.out and "about to die" in captured.out
    assert "tokens[next]         PASS" in captured.out and "mtp[next]            PASS" in captured.out
    assert "check all: FAIL (6 gates, 1 failed)" in captured.out


def test_the_command_runs_the_gates_on_workers_by_default() -> None:
    parser = argparse.ArgumentParser()
    check_all.add_arguments(parser)
    jobs = parser.parse_args([]).jobs
    assert check_all.worker_count(jobs, 10) == min(parallel.available_cpus(), 10)
    assert check_all.worker_count(1, 10) == 1 and check_all.worker_count(4, 3) == 3


def test_every_gate_skipped_is_nothing_to_check(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    fake_token_gate(monkeypatch, {"dense": 0, "moe": 0, "next": 0}, {})
    skipped = args(skip=["oracle-flags", "tokens", "conditioning", "mtp"], jobs=1)
    assert check_all.run(skipped) == 2
    assert "check all: NOTHING TO CHECK (0 gates, 0 failed)" in capsys.readouterr().out
