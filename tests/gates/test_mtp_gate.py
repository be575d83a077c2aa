"""`deltaserve gate mtp` on the CPU, fp32, on the trained tiny checkpoints (their MTP heads are trained): deltaserve
with MTP equals deltaserve without, and drafts were made; a broken accept rule turns the verdict to 1; a run that
cannot draft exits 2; against a fake vLLM (tests/gates/test_gate_vllm_reference.py's, given vLLM's offline metrics
API) the oracle is the registry's MTP arm, both engines' acceptance is printed side by side, and a token or a
per-position rate that disagrees fails the gate, each printed. The real vLLM run is on the H200
(`scripts/h200.sh gates mtp`)."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from deltaserve.bench import registry
from deltaserve.gates import mtp
from deltaserve.gates.references import ReferenceError
from deltaserve.gates.vllm_reference import spec_decode_counts
from deltaserve.runner import spec_decode
from deltaserve.sampler import rejection
from deltaserve.tiny.trained import trained_model_dir
from tests.gates.test_gate_vllm_reference import fake_vllm

SMALL = {"num_prompts": 4, "max_tokens": 16, "max_prompt_len": 96}


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("variant", ["dense", "moe", "next"])
def test_mtp_equals_no_mtp_and_drafts(variant: str, k: int, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    record = tmp_path / "gate.json"
    assert mtp.run_gate(trained_model_dir(variant), k, record_path=record, **SMALL) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"STRICT 4/4 deltaserve with MTP (k = {k}) against deltaserve without (float32)")
    saved = json.loads(record.read_text())
    ours = saved["verdict"]["ours"]
    assert saved["exit_code"] == 0 and saved["speculative_config"] == {"method": "mtp", "num_speculative_tokens": k}
    assert ours["num_drafts"] > 0 and len(ours["accepted_per_pos"]) == k
    assert ours["accepted_per_pos"][0] > 0  # trained heads: some first drafts are right, so acceptance was exercised


def test_mtp_at_two_ranks_equals_no_mtp_at_two_ranks(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`--tensor-parallel-size 2`: both of deltaserve's engines at two ranks (a spawned worker each)."""
    record = tmp_path / "gate.json"
    code = mtp.run_gate(trained_model_dir("dense"), 3, num_prompts=2, max_tokens=12, max_prompt_len=64,
                        record_path=record, tensor_parallel_size=2)  # fmt: skip
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "STRICT 2/2 deltaserve with MTP (k = 3) against deltaserve without (float32, tensor parallel 2)"
    assert lines[-1].endswith("(float32, tensor parallel 2), 2 corpus prompts, 12 tokens each, k = 3; exit 0")
    verdict = json.loads(record.read_text())["verdict"]
    assert verdict["tensor_parallel_size"] == 2 and verdict["ours"]["num_drafts"] > 0


def test_a_broken_accept_rule_fails_the_gate(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    def accept_every_draft(target: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor) -> Any:
        accepted = rejection._real(drafts, num_drafts)
        return rejection._emit(target, drafts, accepted, num_drafts, target[:, :-1])

    monkeypatch.setattr(spec_decode, "greedy_accept", accept_every_draft)
    assert mtp.run_gate(trained_model_dir("dense"), 3, **SMALL) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("STRICT ") and not lines[0].startswith("STRICT 4/4")
    found = [line for line in lines[1:] if "output position" in line and "without MTP" in line]
    # each with both runs' top-2 margins there: an accepted wrong draft is no near tie in the run without MTP
    assert found and all("(top-2 logprob margin without MTP " in line for line in found)
    assert any(float(line.split("without MTP ")[2].split(",")[0]) > 0.1 for line in found), found


def test_a_run_without_drafts_checks_nothing(capsys: pytest.CaptureFixture) -> None:
    # one output token: k is capped to the outputs left - 1 = 0, so no sequence ever verifies a draft
    assert mtp.run_gate(trained_model_dir("dense"), 3, num_prompts=2, max_tokens=1, max_prompt_len=32) == 2
    assert "nothing checked: deltaserve made no draft" in capsys.readouterr().out


def _counter(name: str, value: int, engine: str = "0") -> types.SimpleNamespace:
    return types.SimpleNamespace(name=name, labels={"engine": engine}, value=value)


def _vector(values: list[int], engine: str = "0") -> types.SimpleNamespace:
    name = "vllm:spec_decode_num_accepted_tokens_per_pos"
    return types.SimpleNamespace(name=name, labels={"engine": engine}, values=values)


def test_spec_decode_counts_sum_label_sets_and_refuse_a_run_without_them() -> None:
    metrics = [
        _counter("vllm:spec_decode_num_drafts", 10),
        _counter("vllm:spec_decode_num_drafts", 5, "1"),
        _counter("vllm:spec_decode_num_draft_tokens", 45),
        _counter("vllm:spec_decode_num_accepted_tokens", 12),
        _vector([6, 4, 2]),
        _vector([1, 0], "1"),
        _counter("vllm:prompt_tokens", 999),
    ]
    assert spec_decode_counts(metrics) == {
        "num_drafts": 15, "num_draft_tokens": 45, "num_accepted_tokens": 12, "accepted_per_pos": [7, 4, 2],
    }  # fmt: skip
    with pytest.raises(ReferenceError, match="no vllm:spec_decode_"):
        spec_decode_counts([_counter("vllm:prompt_tokens", 3)])


def fake_mtp_vllm(model_dir: Path, built: list[dict[str, Any]], shift: int, wrong_token: bool) -> types.ModuleType:
    """The fake vLLM, speculating: tokens from transformers' greedy loop, and vLLM's offline metrics API reporting
    the counters of an MTP run on the same weights (deltaserve's own engine stands in for vLLM's drafter), with
    `shift` accepted first drafts moved to draft position 1 (a per-position disagreement) and, if asked, one
    wrong token."""
    module = fake_vllm(model_dir, built, True)

    class LLM(module.LLM):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.spec = kwargs.get("speculative_config")  # absent: the yardstick's vLLM without MTP
            assert self.spec is None or kwargs["disable_log_stats"] is False  # else vLLM's get_metrics() asserts

        def generate(self, prompts: list[dict], params: Any, use_tqdm: bool = False) -> list[Any]:
            asked = params.logprobs
            params.logprobs = asked or 20  # the base fake always ranks its steps; dropped below when not asked for
            outputs = super().generate(prompts, params, use_tqdm)
            ids = [p["prompt_token_ids"] for p in prompts]
            if self.spec is not None:
                _, self.acceptance, _ = mtp.run_deltaserve(
                    model_dir, ids, params.max_tokens, "float32", "cpu", 0, self.spec
                )
            if wrong_token:  # vLLM's runner-up at output position 2 of prompt 0 (inside its top 20)
                completion = outputs[0].outputs[0]
                ranked = sorted(completion.logprobs[2].items(), key=lambda item: -item[1].logprob)
                completion.token_ids[2] = ranked[1][0]
            for output in outputs if asked is None else ():
                output.outputs[0].logprobs = None
            return outputs

        def get_metrics(self) -> list[Any]:
            a = self.acceptance
            per_pos = [a.accepted_per_pos[0] - shift, a.accepted_per_pos[1] + shift, *a.accepted_per_pos[2:]]
            return [
                _counter("vllm:spec_decode_num_drafts", a.num_drafts),
                _counter("vllm:spec_decode_num_draft_tokens", a.num_draft_tokens),
                _counter("vllm:spec_decode_num_accepted_tokens", a.num_accepted_tokens),
                _vector(per_pos),
            ]

    module.LLM = LLM
    return module


def test_against_vllm_the_acceptance_is_compared_side_by_side(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    model = trained_model_dir("dense")
    built: list[dict[str, Any]] = []
    monkeypatch.setattr(registry, "apply_environment", lambda env: None)
    monkeypatch.setitem(sys.modules, "vllm", fake_mtp_vllm(model, built, 0, False))
    record = tmp_path / "gate.json"
    assert mtp.run_gate(model, 2, reference="vllm", record_path=record, **SMALL) == 0
    kwargs, shutdown, off_kwargs, off_shutdown = built  # vLLM with MTP, then without it (the yardstick)
    assert shutdown == off_shutdown == {"shutdown": True}
    expected = registry.vllm_engine(
        str(model), 96, dtype="float32", seed=0, speculative_config=mtp.speculative_config(2)
    )
    assert kwargs == expected.kwargs
    assert off_kwargs == registry.vllm_engine(str(model), 96, dtype="float32", seed=0).kwargs
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("STRICT 4/4 deltaserve with MTP against vllm 0.26.0-fake with MTP (k = 2")
    assert lines[2].startswith("acceptance deltaserve: ") and lines[3].startswith("acceptance vLLM: ")
    assert lines[2].split(": ", 1)[1] == lines[3].split(": ", 1)[1].lstrip()
    assert "per-position rates within 0.05" in lines[4] and lines[4].endswith(": ok")
    assert lines[5] == "against vLLM with MTP, 0 of 0 mismatches are near ties (4 ulps of float32 at vLLM's top logit)"
    assert lines[6] == "yardstick (not part of the verdict): STRICT 4/4 vLLM with MTP against vLLM without (float32)"
    assert lines[7].startswith("yardstick (not part of the verdict): STRICT 4/4 deltaserve without MTP against vLLM")
    saved = json.loads(record.read_text())
    assert saved["verdict"]["theirs"] == saved["verdict"]["ours"]
    assert saved["verdict"]["vllm_mtp_vs_off"] == saved["verdict"]["off_vs_vllm_off"] == []
    assert saved["reference_config"]["spec_decode"]["num_drafts"] == saved["verdict"]["ours"]["num_drafts"]


@pytest.mark.parametrize("has_logprobs", [True, False])
def test_a_disagreement_with_vllm_fails_and_is_printed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, has_logprobs: bool
) -> None:
    model = trained_model_dir("dense")
    monkeypatch.setattr(registry, "apply_environment", lambda env: None)
    # 4 accepted first drafts moved to position 1: over the ~30 drafts of this run, > 0.05 of a rate at both
    built: list[dict[str, Any]] = []
    monkeypatch.setitem(sys.modules, "vllm", fake_mtp_vllm(model, built, 4, True))
    assert mtp.run_gate(model, 2, reference="vllm", share_gpu=True, reference_logprobs=has_logprobs, **SMALL) == 1
    assert built[0]["kv_cache_memory_bytes"] == 2**30  # --share-gpu: the registry's shared-GPU oracle
    out = capsys.readouterr().out
    assert "STRICT 3/4 deltaserve with MTP against vllm" in out
    line = next(line for line in out.splitlines() if line.startswith("  prompt 0, output position 2: vLLM-mtp"))
    if has_logprobs:
        # its runner-up against its own top token: a negative margin, and no near tie
        assert "vLLM's margin -" in line and line.endswith(", beyond the near-tie margin")
    else:
        assert "margin" not in line  # --no-reference-logprobs: vLLM returned no logits to measure one
    # the fake's wrong token is in both of its runs: its MTP agrees with itself, deltaserve without MTP does not
    assert "yardstick (not part of the verdict): STRICT 4/4 vLLM with MTP against vLLM without" in out
    assert "yardstick (not part of the verdict): STRICT 3/4 deltaserve without MTP against vLLM without" in out
    assert "  prompt 0, output position 2: vLLM " in out
    assert "FAIL at 2 positions" in out
    assert "  position 0: deltaserve " in out and "  position 1: deltaserve " in out


def test_no_yardstick_runs_vllm_once(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    model = trained_model_dir("dense")
    built: list[dict[str, Any]] = []
    monkeypatch.setattr(registry, "apply_environment", lambda env: None)
    monkeypatch.setitem(sys.modules, "vllm", fake_mtp_vllm(model, built, 0, False))
    assert mtp.run_gate(model, 2, reference="vllm", yardstick=False, **SMALL) == 0
    assert len(built) == 2 and "speculative_config" in built[0]
    assert "yardstick" not in capsys.readouterr().out
