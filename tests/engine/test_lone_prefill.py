"""The lone-prefill step budget in the engine (engine/budget.py step_budgets, Scheduler._step_budget): a prompt alone
is prefilled in the larger chunks, and its greedy tokens equal those of the same engine with the lone budget off,
fp32 on the CPU, on the trained tiny dense / moe / next, with the prefix cache on (a periodic checkpoint inside a
lone chunk is saved in-step); two prompts together run in the step budget's chunks as before."""

from __future__ import annotations

from pathlib import Path

import pytest

from deltaserve.engine.llm import LLM
from deltaserve.sampling_params import SamplingParams
from deltaserve.step import StepPlan
from deltaserve.tiny.trained import trained_model_dir

CORPUS = (Path(__file__).parents[2] / "deltaserve" / "tiny" / "corpus.txt").read_text()
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def serve(llm: LLM, prompts: dict[str, list[int]]) -> tuple[dict[str, list[int]], list[int]]:
    """Runs the prompts together, one step at a time; (name -> output tokens, the tokens of each step's plan)."""
    engine = llm.engine
    step_tokens: list[int] = []
    schedule = engine.scheduler.schedule

    def recording() -> StepPlan:
        plan = schedule()
        if plan.num_tokens:
            step_tokens.append(plan.num_tokens)
        return plan

    engine.scheduler.schedule = recording
    for name, ids in prompts.items():
        engine.add_request(name, ids, GREEDY)
    states = {name: engine.requests[name] for name in prompts}
    while engine.has_unfinished():
        engine.step()
    engine.scheduler.schedule = schedule
    return {name: list(state.final_output().outputs[0].token_ids) for name, state in states.items()}, step_tokens


@pytest.mark.parametrize("variant", ["dense", "moe", "next"])
def test_a_prompt_alone_takes_the_lone_budget_and_keeps_its_tokens(variant: str) -> None:
    model_dir = trained_model_dir(variant)
    common = {
        "dtype": "float32", "device": "cpu", "max_model_len": 512, "max_num_seqs": 2, "max_num_batched_tokens": 64,
        "async_scheduling": False, "prefix_cache_checkpoint_interval": 192,
    }  # fmt: skip
    outputs, plans = {}, {}
    for lone in (0, 256):
        llm = LLM(model_dir, lone_prefill_tokens=lone, **common)
        tokens = llm.engine.tokenizer.encode(CORPUS)
        assert llm.engine.scheduler.lone_prefill_tokens == max(lone, 64)
        outputs[lone], plans[lone] = serve(llm, {"alone": tokens[:300]})
        # a second prompt beside a running one: the step budget again
        pair, pair_plans = serve(llm, {"first": tokens[300:400], "second": tokens[400:500]})
        outputs[lone] |= pair
        plans[f"pair{lone}"] = pair_plans
    assert outputs[256] == outputs[0]
    # off: 300 prompt tokens in chunks of 64; on: chunks of 256 (the periodic checkpoint at 192 is saved inside the
    # first one, an in-step checkpoint)
    assert plans[0][:5] == [64, 64, 64, 64, 44]
    assert plans[256][:2] == [256, 44]
    assert max(plans["pair256"]) <= 64 and plans["pair256"] == plans["pair0"]


def test_the_lone_budget_stops_at_max_model_len() -> None:
    # one sequence's chunk is never longer than max_model_len, so the runner and its warm-up are not sized beyond it
    llm = LLM(trained_model_dir("dense"), dtype="float32", device="cpu", max_model_len=192, max_num_batched_tokens=64,
              lone_prefill_tokens=1024)  # fmt: skip
    assert llm.engine.scheduler.lone_prefill_tokens == 192
    llm = LLM(trained_model_dir("dense"), dtype="float32", device="cpu", max_model_len=192, max_num_batched_tokens=256,
              lone_prefill_tokens=1024)  # fmt: skip
    assert llm.engine.scheduler.lone_prefill_tokens == 256
