"""Thinking-token budgets through the engine, fp32 on the CPU on the trained tiny dense checkpoint (its tokenizer's
<think> / </think> are single tokens, its chat template opens a thinking turn with `<think>\\n`): the reasoning end
forced where vLLM forces it, greedy and random rows alike, with the model's own logprobs; the steps that wait for
the tokens before them only near the budget's end; MTP speculation (drafts of the MTP layer, and reference drafts
that hold the forced token or not) giving the tokens of an engine without it; vLLM's refusal without markers."""

from __future__ import annotations

import pytest

from deltaserve.engine.llm import LLM
from deltaserve.engine.thinking_budget import ThinkingBudget
from deltaserve.reasoning_config import NOT_CONFIGURED
from deltaserve.sampling_params import SamplingParams
from deltaserve.tiny.trained import trained_model_dir
from tests.engine.test_spec_decode_mtp import mtp_llm
from tests.support.drafts import enable_reference_drafts
from tests.support.engines import share

THINK_END = 1297  # </think> in the tiny tokenizer
BUDGETS = (0, 1, 2, 5, 9)


@pytest.fixture(scope="module")
def llm() -> LLM:
    # max_logprobs -1: a request may ask every token's logprob
    return LLM(trained_model_dir("dense"), dtype="float32", reasoning_parser="qwen3", max_num_seqs=8, max_logprobs=-1,
               **share())  # fmt: skip


def chat_prompt(llm: LLM, text: str = "Tell me about the sea.") -> list[int]:
    """A thinking turn's prompt: the template ends it with `<think>\\n`, the newline the budget's first token."""
    tokenizer = llm.get_tokenizer()
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)  # fmt: skip
    return tokenizer.encode(rendered, add_special_tokens=False)


def greedy(budget: int | None, **kwargs: object) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 24, "ignore_eos": True, **kwargs},
                          thinking_token_budget=budget)  # fmt: skip


def generate(llm: LLM, prompt: list[int], params: list[SamplingParams]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": prompt}] * len(params), params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_a_spent_budget_forces_the_reasoning_end(llm: LLM) -> None:
    """Budget B: the prompt's newline and B - 1 generated tokens think (the model's own greedy tokens), then
    </think>; a budget the model does not reach, or -1, changes nothing."""
    prompt = chat_prompt(llm)
    free, unbounded = generate(llm, prompt, [greedy(None), greedy(-1)])
    natural_end = free.index(THINK_END)
    assert unbounded == free and natural_end > max(BUDGETS)
    outputs = generate(llm, prompt, [greedy(b) for b in BUDGETS] + [greedy(natural_end + 3)])
    for budget, tokens in zip(BUDGETS, outputs, strict=False):
        at = max(budget - 1, 0)
        assert tokens[:at] == free[:at] and tokens[at] == THINK_END, (budget, tokens)
        assert THINK_END not in tokens[:at]
    assert outputs[-1] == free


def test_random_rows_are_forced_and_keep_the_models_logprobs(llm: LLM) -> None:
    """A sampled row is forced as a greedy one (vLLM's logit of 1e9); the forced token's logprob is the model's, as
    a request without a budget reports it for that token."""
    prompt = chat_prompt(llm)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=12, ignore_eos=True, thinking_token_budget=4)
              for s in range(4)]  # fmt: skip
    for tokens in generate(llm, prompt, params):
        assert tokens[3] == THINK_END and THINK_END not in tokens[:3]
    asked = {"max_tokens": 1, "logprobs": -1}  # every token's logprob
    forced, free = llm.generate(
        [{"prompt_token_ids": prompt}] * 2,
        [greedy(0, **asked), greedy(None, **asked)],
        use_tqdm=False,
    )
    assert forced.outputs[0].token_ids[0] == THINK_END != free.outputs[0].token_ids[0]
    assert forced.outputs[0].logprobs[0][THINK_END].logprob == free.outputs[0].logprobs[0][THINK_END].logprob < 0


def test_steps_wait_for_tokens_only_near_the_budget(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A budgeted row defers its step's sampling (which waits for the step before) only where a force may fall
    within the tokens not yet seen: a few steps around the end, not every step."""
    deferred = []
    execute = llm.engine.core.runner.execute

    def recording(plan, defer_sampling=False):  # noqa: ANN001, ANN202 (the runner's own signature)
        deferred.append(defer_sampling)
        return execute(plan, defer_sampling=defer_sampling)

    monkeypatch.setattr(llm.engine.core.runner, "execute", recording)
    (tokens,) = generate(llm, chat_prompt(llm), [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                                thinking_token_budget=14)])  # fmt: skip
    assert tokens[13] == THINK_END
    assert 1 <= sum(deferred) <= 4 and len(deferred) > 30, deferred


def test_async_scheduling_on_and_off_agree() -> None:
    outputs = {}
    for is_async in (True, False):
        engine = LLM(trained_model_dir("dense"), dtype="float32", reasoning_parser="qwen3",
                     async_scheduling=is_async, **share())  # fmt: skip
        outputs[is_async] = generate(engine, chat_prompt(engine), [greedy(b) for b in BUDGETS])
    assert outputs[True] == outputs[False]


def test_mtp_gives_the_tokens_of_no_speculation(llm: LLM) -> None:
    """Each verify position is forced as the budget stands after the drafts before it: greedy budgeted rows (mixed
    with a free one) give an engine's tokens without speculation."""
    prompts = [chat_prompt(llm), chat_prompt(llm, "What is a river?")]
    params = [greedy(b) for b in BUDGETS] + [greedy(None)]
    expected = [generate(llm, p, params) for p in prompts]
    spec, stats = mtp_llm("dense", 3, reasoning_parser="qwen3")
    assert [generate(spec, p, params) for p in prompts] == expected
    assert stats["verifies"] > 0 and stats["accepted_per_position"][0] > 0


@pytest.mark.parametrize("mode", ["all", "none", "mixed"])
def test_reference_drafts_that_hold_the_forced_token_or_not(llm: LLM, mode: str) -> None:
    """Drafts that follow the budgeted answer (the forced </think> among them: accepted), that are all wrong, or
    both: the tokens of an engine without speculation."""
    prompt = chat_prompt(llm)
    (expected,) = generate(llm, prompt, [greedy(5)])
    spec = LLM(trained_model_dir("dense"), dtype="float32", reasoning_parser="qwen3", max_num_seqs=8, **share())
    stats = enable_reference_drafts(spec.engine.core, {tuple(prompt): expected}, mode, 3)
    assert generate(spec, prompt, [greedy(5)]) == [expected]
    assert stats["drafts"] > 0
    if mode == "all":
        assert stats["accepted"] > 0


def test_refused_where_the_engine_has_no_markers() -> None:
    """vLLM's error without --reasoning-parser / --reasoning-config; the config's own strings are enough."""
    plain = LLM(trained_model_dir("dense"), dtype="float32", **share())
    with pytest.raises(ValueError, match="reasoning_config is not configured") as info:
        plain.generate([{"prompt_token_ids": [1, 2, 3]}], greedy(3), use_tqdm=False)
    assert str(info.value) == NOT_CONFIGURED
    config = {"reasoning_start_str": "<think>", "reasoning_end_str": "</think>"}
    configured = LLM(trained_model_dir("dense"), dtype="float32", reasoning_config=config, **share())
    (tokens,) = generate(configured, chat_prompt(configured), [greedy(3)])
    assert tokens[2] == THINK_END
    assert isinstance(configured.engine.core.structured.states, dict)  # finished: nothing left behind
    assert not configured.engine.core.structured.states
    assert ThinkingBudget  # the tracker the core keeps per budgeted request
