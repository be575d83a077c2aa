"""`deltaserve gate fp8` on the CPU, with a stand-in for vLLM (no vLLM here; the real run is on the H200:
`scripts/h200.sh gates fp8`, on the checkpoints it trains there): the gate writes the FP8 copy of dense-w128 (here
the untrained one, the conftest's `wide_dirs`) deterministically,
serves it with deltaserve, and judges deltaserve's greedy tokens against the reference's: a reference that agrees
gives STRICT n/N and exit 0 (on random prompts and on held-out text); one token changed gives a STRICT line short
of N first, then that mismatch with the reference's margin, and exit 1; a refused reference exits 1; no vLLM (or
no prompt) exits 2; the record is the house format and the results index describes it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from deltaserve.bench import records_index
from deltaserve.gates import fp8 as gate
from deltaserve.gates.references import ReferenceError, ReferenceRun, StepScores
from deltaserve.gates.tokens import make_prompts, make_text_prompts

SMALL = {"num_prompts": 3, "max_tokens": 5, "max_prompt_len": 40, "dtype": "float32", "device": "cpu"}


class StandIn:
    """A reference that returns given tokens, with a top-2 row per step (its token first, by `margin`)."""

    def __init__(self, tokens: list[list[int]], margin: float = 0.5, error: str | None = None) -> None:
        self.tokens, self.margin, self.error = tokens, margin, error
        self.prompts: list[list[int]] = []

    def run(self, prompts: list[list[int]], max_tokens: int) -> ReferenceRun:
        if self.error is not None:
            raise ReferenceError(self.error)
        self.prompts = prompts
        scores = [[StepScores({t: 10.0, t + 1: 10.0 - self.margin}, False) for t in row] for row in self.tokens]
        return ReferenceRun(self.tokens, scores, {"engine": "stand-in", "version": "0.26.0-stand-in"})


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory, wide_dirs: dict[str, Path]
) -> tuple[Path, dict[str, list[list[int]]]]:
    """The FP8 copy of dense-w128 (written by the gate's own helper) and deltaserve's greedy tokens on it, on the
    gate's random prompts and on its held-out text prompts."""
    folder, is_written = gate.fp8_checkpoint(wide_dirs["dense-w128"], tmp_path_factory.mktemp("fp8") / "d")
    assert is_written and gate.is_fp8_checkpoint(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokens = {}
    for source, maker in (("random", make_prompts), ("text", make_text_prompts)):
        prompts = maker(tokenizer, 3, SMALL["max_prompt_len"], 0)
        tokens[source] = gate.run_deltaserve(folder, prompts, SMALL["max_tokens"], "float32", "cpu", 0, False)
    return folder, tokens


def test_an_agreeing_reference_passes_strict(
    served: tuple[Path, dict[str, list[list[int]]]], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    folder, ours = served[0], served[1]["random"]
    record = tmp_path / "gate-fp8-dense-w128-test.json"
    stand_in = StandIn(ours)
    assert gate.run_gate(folder, reference=lambda path: stand_in, record_path=record, **SMALL) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "STRICT 3/3 deltaserve against vllm 0.26.0-stand-in, both serving the FP8 checkpoint"
    assert lines[-1].endswith("3 random prompts, 5 tokens each; exit 0")
    saved = json.loads(record.read_text())
    assert saved["kind"] == "gate-fp8" and saved["exit_code"] == 0 and saved["strict"] == {"num_exact": 3,
                                                                                          "num_prompts": 3}  # fmt: skip
    assert saved["prompts"]["lengths"] == [len(p) for p in stand_in.prompts] and saved["mismatches"] == []
    assert saved["fp8_checkpoint"]["written_by_gate"] is False  # an FP8 folder is served as it is
    assert saved["checkpoint"] == {"path": str(folder), "weights_sha256": gate.weights_sha256(folder), "training": None}
    assert records_index.kind_of(record.name) == "gates"
    what = records_index._what_json(saved)
    assert what == f"FP8 token gate: {folder.name} as block FP8, float32, vs vLLM in process; {lines[0]}"


def test_one_changed_token_fails_with_its_margin(
    served: tuple[Path, dict[str, list[list[int]]]], capsys: pytest.CaptureFixture
) -> None:
    folder, ours = served[0], served[1]["random"]
    theirs = [list(row) for row in ours]
    theirs[1][2] += 7  # the reference's token at output position 2 of prompt 1
    assert gate.run_gate(folder, reference=lambda path: StandIn(theirs, margin=0.25), **SMALL) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("STRICT 2/3 deltaserve against vllm 0.26.0-stand-in") and "1 mismatches" in lines[0]
    assert lines[1].startswith(f"  prompt 1 (len 2), output position 2: vLLM {theirs[1][2]}")
    assert f"vs deltaserve {ours[1][2]}" in lines[1] and "margin > " in lines[1]  # ours is outside its top-2
    assert lines[-1].endswith("exit 1")


def test_a_refused_reference_fails_and_no_vllm_checks_nothing(
    served: tuple[Path, dict[str, list[list[int]]]], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    folder, ours = served[0], served[1]["random"]
    assert gate.run_gate(folder, reference=lambda path: StandIn(ours, error="partly random"), **SMALL) == 1
    assert "gate fp8: the vllm reference REFUSED: partly random" in capsys.readouterr().out
    monkeypatch.setattr(gate, "vllm_importable", lambda: False)
    assert gate.run_gate(folder, **SMALL) == 2
    assert capsys.readouterr().out.startswith("gate fp8: nothing to check: vLLM is not importable")
    assert gate.run_gate(folder, reference=lambda path: StandIn(ours), **{**SMALL, "num_prompts": 0}) == 2


def test_the_fp8_copy_is_deterministic_and_the_record_names_the_trained_checkpoint(
    served: tuple[Path, dict[str, list[list[int]]]],
    wide_dirs: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
) -> None:
    """The bf16 folder is written as FP8 first, to the same bytes as the fixture's copy; the record names the
    checkpoint's sha256 and, from its training.json (here a hand-made one: training runs on the H200), the device
    that trained it, and the results index says so."""
    folder, ours = served[0], served[1]["text"]
    trained = shutil.copytree(wide_dirs["dense-w128"], tmp_path / "dense-w128")
    manifest = {"recipe": {"device": "cuda", "num_steps": 360, "seed": 0}, "seconds": 41.5, "first_loss": 7.2,
                "final_loss": 0.61, "held_out_loss": 3.9, "tensor_sha256": {}}  # fmt: skip
    (trained / "training.json").write_text(json.dumps(manifest))
    seen: list[Path] = []

    def reference(path: Path) -> StandIn:
        seen.append(path)
        return StandIn(ours)

    record = tmp_path / "gate-fp8-dense-w128-test.json"
    code = gate.run_gate(trained, tmp_path / "copy", reference=reference, record_path=record, prompts="text", **SMALL)
    out = capsys.readouterr().out
    assert code == 0 and seen == [tmp_path / "copy"] and "3 held-out text prompts" in out and "FP8 copy" in out
    assert "trained on cuda (360 steps)" in out
    saved = json.loads(record.read_text())
    facts = saved["fp8_checkpoint"]
    assert facts["written_by_gate"] is True and facts["weights_sha256"] == gate.weights_sha256(folder)
    assert saved["prompts"]["source"] == "held-out text"
    training = {"device": "cuda", "num_steps": 360, "seed": 0, "seconds": 41.5, "first_loss": 7.2, "final_loss": 0.61,
                "held_out_loss": 3.9}  # fmt: skip
    sha = gate.weights_sha256(wide_dirs["dense-w128"])
    assert saved["checkpoint"] == {"path": str(trained), "weights_sha256": sha, "training": training}
    assert "dense-w128 (trained on cuda) as block FP8" in records_index._what_json(saved)
