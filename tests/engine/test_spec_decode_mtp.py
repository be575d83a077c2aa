"""Speculative decoding with the checkpoints' MTP layer as the drafter (runner/mtp_drafter.py), fp32 on the CPU, on
the trained tiny dense / MoE / Next checkpoints (their MTP heads are trained):

- greedy outputs equal the outputs without speculation, k = 1..4, and drafts are accepted (the per-position
  acceptance is printed: `pytest -s`);
- every first draft the engine proposed, step after step (prefill, decodes, verify chunks with rollbacks), equals the
  trainer's MTP head (deltaserve/tiny/mtp.py, on transformers' trunk) run once over the finished sequence: the MTP
  layer's own KV cache followed the accepted tokens exactly.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from deltaserve.engine.llm import LLM
from deltaserve.runner.drafter import DraftInputs
from deltaserve.sampling_params import SamplingParams
from deltaserve.tiny.mtp import load_mtp_head, text_model_of
from deltaserve.tiny.trained import trained_model_dir
from tests.engine.test_spec_decode import make_prompts, run
from tests.support.engines import share

MAX_TOKENS = 24
VARIANTS = ("dense", "moe", "next")


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def references() -> dict[str, tuple[list[list[int]], list[list[int]]]]:
    found = {}
    for variant in VARIANTS:
        llm = LLM(trained_model_dir(variant), dtype="float32", max_num_seqs=8)
        prompts = make_prompts(llm)
        found[variant] = prompts, [list(o.token_ids) for o in run(llm, prompts, greedy())]
    return found


def mtp_llm(variant: str, k: int, **engine_kwargs: object) -> tuple[LLM, dict]:
    """An engine drafting with its MTP layer, and per-position acceptance counters its updates fill."""
    config = {"method": "mtp", "num_speculative_tokens": k}
    engine_kwargs = {"max_num_seqs": 8, **share(), **engine_kwargs}
    llm = LLM(trained_model_dir(variant), dtype="float32", speculative_config=config, **engine_kwargs)
    core = llm.engine.core
    stats = {"verifies": 0, "drafts": 0, "accepted_per_position": [0] * k}
    update = core.scheduler.update

    def counting_update(plan, result):  # noqa: ANN001, ANN202 (the scheduler's own signature)
        for item, tokens in zip(plan.seqs, result.token_ids, strict=True):
            if item.num_draft_tokens:
                stats["verifies"] += 1
                stats["drafts"] += item.num_draft_tokens
                for j in range(len(tokens) - 1):
                    stats["accepted_per_position"][j] += 1
        return update(plan, result)

    core.scheduler.update = counting_update
    return llm, stats


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("variant", VARIANTS)
def test_mtp_greedy_equals_no_speculation(references: dict, variant: str, k: int) -> None:
    prompts, expected = references[variant]
    llm, stats = mtp_llm(variant, k)
    assert [list(o.token_ids) for o in run(llm, prompts, greedy())] == expected
    accepted = stats["accepted_per_position"]
    verifies = stats["verifies"]
    rates = [round(a / verifies, 3) for a in accepted]
    mean_length = 1 + sum(accepted) / verifies
    print(f"\n{variant} k={k}: {verifies} verify chunks, {stats['drafts']} drafts, accepted per position {rates}, "
          f"mean acceptance length {mean_length:.2f}")  # fmt: skip
    assert verifies > 0
    assert accepted[0] / verifies > 0.2  # trained heads: the first draft is often right


@pytest.mark.parametrize("variant", VARIANTS)
def test_mtp_drafts_equal_the_trainers_head(references: dict, variant: str) -> None:
    prompts, expected = references[variant]
    llm, _ = mtp_llm(variant, 2)
    core = llm.engine.core
    table, drafter = core.runner.table, core.runner.spec.drafter
    proposed: list[tuple[tuple[int, ...], int, int]] = []  # (prompt, token index t, the first draft for t + 2)
    propose = drafter.propose

    def recording_propose(inputs: DraftInputs) -> torch.Tensor:
        drafts = propose(inputs)
        if len(inputs.rows):
            index, first = inputs.target.draft_index.tolist(), drafts[:, 0].tolist()
            for r, row in enumerate(inputs.rows.tolist()):
                proposed.append(
                    (tuple(table.prompts[row][: table.num_original_prompt[row]].tolist()), index[r], first[r])
                )
        return drafts

    drafter.propose = recording_propose
    assert [list(o.token_ids) for o in run(llm, prompts, greedy())] == expected
    model_dir = trained_model_dir(variant)
    architecture = json.loads((model_dir / "config.json").read_text())["architectures"][0]
    trunk = getattr(transformers, architecture).from_pretrained(model_dir, dtype=torch.float32).eval()
    head = load_mtp_head(trunk, model_dir)
    offline = {}
    with torch.inference_mode():
        for prompt, outputs in zip(prompts, expected, strict=True):
            ids = torch.tensor([prompt + outputs])
            positions = torch.arange(ids.shape[1]).unsqueeze(0)
            hidden = text_model_of(trunk)(input_ids=ids, position_ids=positions).last_hidden_state
            # the draft at t guesses token t + 2 from (h_t, token t + 1)
            offline[tuple(prompt)] = head(trunk, ids[:, 1:], hidden[:, :-1], positions[:, :-1]).argmax(-1)[0].tolist()
    checked = [(prompt, t, draft) for prompt, t, draft in proposed if t < len(offline[prompt])]
    assert len(checked) >= len(prompts) * (MAX_TOKENS // 3)
    mismatches = [(t, draft, offline[prompt][t]) for prompt, t, draft in checked if draft != offline[prompt][t]]
    assert not mismatches, mismatches
