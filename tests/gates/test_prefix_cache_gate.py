"""`deltaserve gate prefix-cache`: its traffic, its verdict and exit codes, and one run on a trained checkpoint."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from deltaserve.gates import prefix_cache as gate
from deltaserve.tiny.trained import trained_model_dir


def _verdict(checked: int, matched: int, cached: int, mismatches: int = 0) -> gate.GateVerdict:
    found = [gate.Mismatch("retry", 1, 0, 3, 5, 6)] * mismatches
    return gate.GateVerdict(checked, matched, 100, cached, found, {})


def test_exit_codes_say_what_was_checked() -> None:
    assert gate.verdict_code(_verdict(4, 4, 10)) == 0
    assert gate.verdict_code(_verdict(4, 3, 10, mismatches=1)) == 1
    assert gate.verdict_code(_verdict(4, 4, 0)) == 2  # the cache never hit: nothing of it was exercised
    assert gate.verdict_code(_verdict(0, 0, 0)) == 2


def test_traffic_shares_the_prefixes_it_claims() -> None:
    ids = list(range(1000, 3000))
    scenarios = {s.name: s for s in gate.make_scenarios(ids, seed=0)}
    assert scenarios == {s.name: s for s in gate.make_scenarios(ids, seed=0)}  # seeded: both engines see the same
    for length in gate.SHARED_PREFIX_LENGTHS:
        prompts = [p for r in scenarios[f"shared-prefix-{length}"].rounds for p in r.prompts]
        assert len(prompts) == 5 and len({tuple(p[:length]) for p in prompts}) == 1
        assert all(gate.SUFFIX_LENGTHS[0] <= len(p) - length <= gate.SUFFIX_LENGTHS[1] for p in prompts)
    retry = [r.prompts[0] for r in scenarios["retry"].rounds]
    assert len(retry) == 3 and retry[0] == retry[1] == retry[2]
    (same,) = scenarios["same-prompt-x3"].rounds
    assert len(same.prompts) == 3 and same.prompts[0] == same.prompts[1] == same.prompts[2]
    assert [len(s) for s in scenarios["multi-turn"].turn_spans] == list(gate.TURN_LENGTHS)


def test_verdict_lists_every_mismatch(capsys: pytest.CaptureFixture[str]) -> None:
    gate.print_verdict(_verdict(4, 3, 10, mismatches=1))
    out = capsys.readouterr().out
    assert out.startswith("STRICT 3/4")
    assert "mismatch retry round 1 prompt 0: first difference at output position 3, off 5 vs on 6" in out
    assert "10 of 100 prompt tokens" in out


def test_verdict_prints_the_yardstick_after_the_hits(capsys: pytest.CaptureFixture[str]) -> None:
    verdict = _verdict(4, 3, 10, mismatches=1)
    verdict.yardstick = gate.Yardstick(64, 4, 2, [gate.Mismatch("retry", 0, 0, 2, 7, 8, 0.03, 0.0)] * 2)
    gate.print_verdict(verdict)
    out = capsys.readouterr().out
    assert out.startswith("STRICT 3/4") and out.index("hits:") < out.index("yardstick STRICT 2/4")
    assert "yardstick retry round 0 prompt 0: output position 2, whole 7 vs chunked 8 (margins 0.03, 0.0)" in out
    assert gate.verdict_code(verdict) == 1  # the yardstick explains a mismatch, it never excuses it


def test_the_yardstick_runs_outside_fp32_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[bool] = []
    monkeypatch.setattr(gate, "run_gate", lambda *args: asked.append(args[-1]) or _verdict(4, 4, 10))
    parser = argparse.ArgumentParser()
    gate.add_arguments(parser)
    for argv, expected in (([], False), (["--dtype", "bfloat16"], True), (["--yardstick", "on"], True),
                           (["--dtype", "bfloat16", "--yardstick", "off"], False)):  # fmt: skip
        assert gate.run(parser.parse_args(["--model", "m", *argv])) == 0
        assert asked[-1] is expected, argv


@pytest.fixture(scope="module")
def dense() -> Path:
    return trained_model_dir("dense")


def test_cache_on_matches_cache_off_on_the_trained_dense_checkpoint(dense: Path) -> None:
    verdict = gate.run_gate(dense, "float32", max_tokens=8, seed=0)
    gate.print_verdict(verdict)
    assert verdict.num_checked == 29 and verdict.mismatches == []
    assert gate.verdict_code(verdict) == 0
    hits = verdict.hits_by_scenario
    # every kind of traffic hit: a shared prefix by its later sightings, turn k + 1 turn k's history, the retries
    assert all(hits[f"shared-prefix-{n}"][0] > 0 for n in gate.SHARED_PREFIX_LENGTHS)
    assert hits["multi-turn"][0] > 0 and hits["retry"][0] > 0


def test_in_fp32_the_yardstick_is_exact_too(dense: Path) -> None:
    """Chunked prefill without the cache, against one pass: fp32 keeps every greedy token (in bf16 both it and the
    cache flip near-ties alike, docs/prefix-caching.md#exactness-in-bf16)."""
    verdict = gate.run_gate(dense, "float32", max_tokens=6, seed=0, yardstick=True)
    stick = verdict.yardstick
    assert stick is not None and stick.chunk == gate.YARDSTICK_CHUNK
    assert (stick.num_checked, stick.num_matched, stick.mismatches) == (29, 29, [])


def test_a_cache_that_restores_no_state_fails_the_gate(dense: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hit resumes from the checkpoint's GDN state: with the state copies dropped (no checkpoint saved, no
    checkpoint read into the live slot) the resumed requests run from a stale state and the gate must say 1."""
    from deltaserve.runner import model_runner

    monkeypatch.setattr(model_runner, "copy_state_slots", lambda model, pairs: None)
    verdict = gate.run_gate(dense, "float32", max_tokens=8, seed=0)
    assert verdict.mismatches and gate.verdict_code(verdict) == 1
