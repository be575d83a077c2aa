"""The token gate itself: it passes on the real engine, fails when the engine is broken, judges mismatches by the
reference's own margins, builds its reference from config.architectures[0] and refuses a partly random one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import deltaserve.runner.model_runner as model_runner
from deltaserve.engine import llm as llm_module
from deltaserve.gates.references import ReferenceError, StepScores, load_transformers, ulp
from deltaserve.gates.tokens import TIE_ULPS, judge_mismatch, run_gate


def test_gate_passes_on_the_engine(tiny_next: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_gate(tiny_next, num_prompts=6, max_tokens=8) == 0
    out = capsys.readouterr().out
    assert "STRICT 6/6 against transformers Qwen3NextForCausalLM (float32)" in out
    # The verdict comes first: STRICT precedes every other line the gate prints about the run.
    verdict = [line for line in out.splitlines() if line.startswith(("STRICT", "gate tokens:", "logits", "prefill"))]
    assert verdict[0].startswith("STRICT")


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


def test_near_tie_margin_is_in_the_reference_dtype() -> None:
    """A 1e-4 margin at logit 8 is a bf16 near-tie (4 bf16 ulps = 0.25) but a real fp32 mismatch (4 ulps = 4e-6)."""
    step = StepScores({0: 8.0, 1: 8.0 - 1e-4, 2: 1.0}, True)
    fp32 = judge_mismatch([1], [0], [step], "float32")
    bf16 = judge_mismatch([1], [0], [step], "bfloat16")
    assert fp32 is not None and bf16 is not None
    assert fp32.margin == pytest.approx(1e-4) and fp32.tie_margin == pytest.approx(TIE_ULPS * 2.0**-20)
    assert not fp32.is_near_tie and bf16.is_near_tie
    assert ulp(8.0, "bfloat16") == 2.0**-4 and ulp(8.0, "float32") == 2.0**-20
    # a token outside a top-k row (vLLM's) gives a lower bound, never a tie
    top_k = StepScores({0: 8.0, 2: 7.0}, False)
    bounded = judge_mismatch([1], [0], [top_k], "bfloat16")
    assert bounded is not None and not bounded.is_margin_exact and bounded.margin == 1.0 and not bounded.is_near_tie
    assert judge_mismatch([0, 5], [0, 5], [step, step], "float32") is None


def test_fp32_gate_reports_fp32_margins(
    tiny_moe: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An injected wrong token is reported with the fp32 reference's own margin, not a bf16-ulp estimate."""
    generate = llm_module.LLM.generate

    def one_wrong_token(self: object, *args: object, **kwargs: object) -> object:
        outputs = generate(self, *args, **kwargs)
        tokens = outputs[1].outputs[0].token_ids
        tokens[2] = (tokens[2] + 7) % 1000
        return outputs

    monkeypatch.setattr(llm_module.LLM, "generate", one_wrong_token)
    assert run_gate(tiny_moe, num_prompts=3, max_tokens=4) == 1
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("  prompt 1"))
    assert "output position 2" in line and "(float32; near-tie margin" in line and "beyond the near-tie margin" in line
    # the printed margin is the fp32 reference's own logit difference at that step
    import transformers

    from deltaserve.gates.tokens import make_prompts

    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_moe)
    prompt = make_prompts(tokenizer, 3, 160, 0)[1]
    model, _ = load_transformers(tiny_moe, torch.float32, "cpu")
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(3):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            ids.append(int(torch.argmax(logits)))
    ref_token = ids[-1]
    ours = (ref_token + 7) % 1000
    expected = float(logits[ref_token].double() - logits[ours].double())
    printed = float(line.split("reference margin ")[1].split(" ")[0])
    assert printed == pytest.approx(expected, rel=1e-5)


def _tf_saved_composite(src: Path, out: Path, is_text_tied: bool, architecture: str | None = None) -> Path:
    """A composite checkpoint written by transformers' own Qwen3_5ForConditionalGeneration.save_pretrained."""
    import transformers

    model = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(src, dtype=torch.float32)
    model.config.text_config.tie_word_embeddings = is_text_tied
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(src / name, out / name)
    if architecture:
        config = json.loads((out / "config.json").read_text())
        config["architectures"] = [architecture]
        (out / "config.json").write_text(json.dumps(config))
    return out


def test_composite_checkpoint_uses_the_composite_reference(
    tiny_dense: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Top-level tie true, text_config tie false, no lm_head tensor: the composite class ties (as the checkpoint
    means), the text-only class AutoModelForCausalLM would build leaves lm_head random."""
    from transformers import AutoModelForCausalLM

    folder = _tf_saved_composite(tiny_dense, tmp_path / "composite", is_text_tied=False)
    model, facts = load_transformers(folder, torch.float32, "cpu")
    assert facts["class"] == "Qwen3_5ForConditionalGeneration"
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    _, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert "lm_head.weight" in info["missing_keys"]  # what the gate's old reference silently ran with
    consistent = _tf_saved_composite(tiny_dense, tmp_path / "consistent", is_text_tied=True)
    assert run_gate(consistent, num_prompts=3, max_tokens=4) == 0
    assert "STRICT 3/3 against transformers Qwen3_5ForConditionalGeneration (float32)" in capsys.readouterr().out


def test_partly_random_reference_is_refused(
    tiny_dense: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text_class = "Qwen3_5ForCausalLM"  # what AutoModelForCausalLM builds for this config
    folder = _tf_saved_composite(tiny_dense, tmp_path / "text-class", is_text_tied=False, architecture=text_class)
    with pytest.raises(ReferenceError, match="lm_head.weight"):
        load_transformers(folder, torch.float32, "cpu")
    assert run_gate(folder, num_prompts=2, max_tokens=2) == 1
    out = capsys.readouterr().out
    assert "REFUSED" in out and "partly random" in out and "lm_head.weight" in out and "STRICT" not in out
