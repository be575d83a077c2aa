"""Speculative decoding of image and video prompts (MRoPE positions, encoder spans, chunked prefill in a 40-token
budget), fp32 on the CPU, on the tiny vision checkpoint: greedy outputs with the MTP drafter, and with reference
drafts of mixed acceptance, equal the outputs without speculation."""

from __future__ import annotations

import pytest

from deltaserve.engine.llm import LLM
from deltaserve.sampling_params import SamplingParams
from tests.support.drafts import enable_reference_drafts
from tests.support.vision import MAX_TOKENS, PROMPTS, case_for, generate_together

ENGINE = {"dtype": "float32", "max_num_batched_tokens": 40, "max_num_seqs": 4}


def generate(llm: LLM, prompts: dict) -> dict[str, list[int]]:
    return generate_together(llm, prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))


@pytest.fixture(scope="module")
def case_and_reference() -> tuple:
    case = case_for("dense-vl")
    prompts = {name: case.prompt(name) for name in PROMPTS}
    return case, prompts, generate(LLM(case.model_dir, **ENGINE), prompts)


def test_mtp_drafts(case_and_reference: tuple) -> None:
    case, prompts, expected = case_and_reference
    llm = LLM(case.model_dir, **ENGINE, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert generate(llm, prompts) == expected


def test_mixed_reference_drafts(case_and_reference: tuple) -> None:
    case, prompts, expected = case_and_reference
    llm = LLM(case.model_dir, **ENGINE)
    continuation = {tuple(ids): expected[name] for name, (ids, _) in prompts.items()}
    stats = enable_reference_drafts(llm.engine.core, continuation, "mixed", 3)
    assert generate(llm, prompts) == expected
    assert 0 < stats["accepted"] < stats["drafts"]
