"""Thinking-token budgets (engine/thinking_budget.py, reasoning_config.py): which positions are forced, on streams
whose expected outputs are vLLM 0.26's (its ThinkingBudgetStateHolder replayed on the CPU on the same streams, no
speculation: docs/reasoning.md#thinking-token-budgets); drafts walked like emitted tokens; the launch rule that
defers a step never missing a force; the markers' resolution and the field's validation in vLLM's words."""

from __future__ import annotations

import itertools
import random

import pytest

from deltaserve.engine.thinking_budget import ThinkingBudget, ThinkingStart, open_section
from deltaserve.reasoning_config import NOT_CONFIGURED, ReasoningMarkers, parse_reasoning_config, resolve_markers
from deltaserve.sampling_params import ParamError, SamplingParams, check_thinking_token_budget

S, E = (7,), (8,)  # a start and an end token, as Qwen3.5's <think> and </think>

# (name, start, end, budget, prompt, what the model proposes each step, what vLLM 0.26 emits: the proposal, or the
# end token where its holder forces one)
CASES = [
    ("prompt opens, budget 5", S, E, 5, [1, 2, 7, 3], [4] * 10, [4, 4, 4, 4, 8, 4, 4, 4, 4, 4]),
    ("prompt opens, budget 0", S, E, 0, [1, 7, 3], [4] * 4, [8, 4, 4, 4]),
    ("prompt opens, budget 1", S, E, 1, [1, 7, 3], [4] * 4, [8, 4, 4, 4]),
    ("prompt opens, budget 2", S, E, 2, [1, 7, 3], [4] * 4, [4, 8, 4, 4]),
    ("prompt opens at its end", S, E, 3, [1, 2, 7], [4] * 8, [4, 4, 4, 8, 4, 4, 4, 4]),
    ("prompt closed", S, E, 2, [7, 3, 8, 3], [4] * 8, [4] * 8),
    ("natural end before the budget", S, E, 6, [1, 7, 3], [4, 4, 8, 4, 4, 4, 4, 4, 4], [4, 4, 8, 4, 4, 4, 4, 4, 4]),
    ("model opens, budget 3", S, E, 3, [1, 2], [4, 7, 4, 4, 4, 4, 4, 4, 4], [4, 7, 4, 4, 4, 8, 4, 4, 4]),
    ("model opens, budget 0", S, E, 0, [1, 2], [4, 7, 4, 4, 4], [4, 7, 8, 4, 4]),
    ("a second section, a fresh budget", S, E, 2, [1, 7, 3], [4, 4, 4, 7, 4, 4, 4, 4, 4], [4, 8, 4, 7, 4, 4, 8, 4, 4]),
    ("reopened after a natural end", S, E, 2, [1, 7], [8, 4, 7, 4, 4, 4, 4], [8, 4, 7, 4, 4, 8, 4]),
    ("a two-token end forced in turn", S, (8, 9), 2, [1, 7, 3], [4] * 8, [4, 8, 9, 4, 4, 4, 4, 4]),
    ("two-token markers from the model", (7, 9), (8, 9), 2, [1, 2], [4, 7, 9, 4, 4, 4, 4, 4, 4],
     [4, 7, 9, 4, 4, 8, 9, 4, 4]),
]  # fmt: skip


def budget_of(start: tuple, end: tuple, budget: int, prompt: list[int]) -> ThinkingBudget:
    markers = ReasoningMarkers(start, end)
    return ThinkingBudget(ThinkingStart(markers, open_section(prompt, markers)), budget)


def emit(tracker: ThinkingBudget, proposals: list[int]) -> list[int]:
    """What a request emits: the forced token where there is one, else the model's proposal."""
    out = []
    for proposal in proposals:
        forced = tracker.forced()
        token = proposal if forced is None else forced
        tracker.accept([token])
        out.append(token)
    return out


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_forced_positions_are_vllms(case: tuple) -> None:
    _, start, end, budget, prompt, proposals, expected = case
    assert emit(budget_of(start, end, budget, prompt), proposals) == expected


def test_open_section_counts_the_prompt_tokens_after_the_last_start() -> None:
    markers = ReasoningMarkers(S, E)
    assert open_section([1, 7, 3, 3], markers) == 2
    assert open_section([1, 2, 7], markers) == 0
    assert open_section([7, 3, 8, 3], markers) is None  # closed
    assert open_section([8, 3, 7], markers) == 0  # an end before the start does not close it
    assert open_section([1, 2, 3], markers) is None
    assert open_section([7, 9, 7, 9, 1], ReasoningMarkers((7, 9), (8, 9))) == 1
    assert open_section([5] * 200_000 + [7, 1], markers) == 1  # vectorised: a long prompt without a scan in Python


def test_drafts_walk_like_emitted_tokens() -> None:
    """forced(drafts) is what forced() says once the drafts were emitted, on random streams."""
    rng = random.Random(1)
    for _ in range(2000):
        start, end = rng.choice([(S, E), ((7, 9), (8, 9)), (S, (8, 9))])
        prompt = [rng.randrange(10) for _ in range(rng.randint(1, 6))]
        tracker = budget_of(start, end, rng.choice([0, 1, 2, 4]), prompt)
        emit(tracker, rng.choices(range(10), k=rng.randint(0, 8)))
        drafts = rng.choices(range(10), k=rng.randint(0, 5))
        walked = budget_of(start, end, tracker.budget, prompt)
        walked.state = tracker.state
        expected = []
        for j in range(len(drafts) + 1):
            expected.append(walked.forced())
            if j < len(drafts):
                walked.accept([drafts[j]])
        assert [tracker.forced(drafts[:j]) for j in range(len(drafts) + 1)] == expected


def test_the_launch_rule_never_misses_a_force() -> None:
    """may_force_within(n) is True wherever some continuation of the emitted tokens has a forced token among the
    next n positions (every continuation over a small vocabulary, the markers among its tokens)."""
    rng = random.Random(2)
    vocab = (4, 7, 8, 9)
    for _ in range(300):
        start, end = rng.choice([(S, E), ((7, 9), (8, 9)), (S, (8, 9))])
        tracker = budget_of(start, end, rng.choice([0, 1, 2, 3]), [1, 7] if rng.random() < 0.5 else [1])
        emit(tracker, rng.choices(vocab, k=rng.randint(0, 6)))
        for n in range(1, 6):
            forced_somewhere = False
            for continuation in itertools.product(vocab, repeat=n - 1):
                probe = budget_of(start, end, tracker.budget, [1])
                probe.state = tracker.state
                if any(probe.forced(continuation[:j]) is not None for j in range(n)):
                    forced_somewhere = True
                    break
            if forced_somewhere:
                assert tracker.may_force_within(n), (tracker.state, n)
    # and it is not always True: far from the budget no step waits
    far = budget_of(S, E, 100, [1, 7])
    assert not far.may_force_within(4)
    assert not budget_of(S, E, 100, [1]).may_force_within(4)


def test_markers_resolve_as_vllms_reasoning_config() -> None:
    ids = {"<think>": [10], "</think>": [11], "<a>": [1, 2], "</a>": [3, 2]}
    encode = ids.__getitem__
    assert resolve_markers("qwen3", None, encode) == ReasoningMarkers((10,), (11,))
    both = '{"reasoning_start_str": "<a>", "reasoning_end_str": "</a>"}'
    assert resolve_markers(None, both, encode) == ReasoningMarkers((1, 2), (3, 2))
    assert resolve_markers("qwen3", both, encode) == ReasoningMarkers((1, 2), (3, 2))  # the config's strings win
    assert resolve_markers("qwen3", {"reasoning_end_str": "</a>"}, encode) == ReasoningMarkers((10,), (3, 2))
    assert resolve_markers(None, {"reasoning_parser": "qwen3"}, encode) == ReasoningMarkers((10,), (11,))
    assert resolve_markers(None, None, encode) is None
    assert resolve_markers(None, {"reasoning_start_str": "<a>"}, encode) is None  # no end: budgets refused
    with pytest.raises(ValueError, match="failed to tokenize reasoning strings"):
        resolve_markers(None, both, lambda text: [])
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['reasoning_start_token_ids'\]"):
        parse_reasoning_config('{"reasoning_start_token_ids": [1]}')
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_reasoning_config("{oops")
    assert "--reasoning-parser and/or --reasoning-config" in NOT_CONFIGURED


def test_the_field_is_validated_in_vllms_words() -> None:
    assert SamplingParams(thinking_token_budget=-1).thinking_token_budget is None
    assert SamplingParams(thinking_token_budget=0).thinking_token_budget == 0
    assert SamplingParams().needs_history_mask is False
    assert SamplingParams(thinking_token_budget=3).needs_history_mask is True
    for value in (-2, 1.5, True, "3"):
        with pytest.raises(ParamError) as info:
            check_thinking_token_budget(value)
        assert str(info.value) == (
            "`thinking_token_budget` must be a non-negative integer or -1 for unlimited. "
            f"(parameter=thinking_token_budget, value={value})"
        )
        assert info.value.param == "thinking_token_budget"
