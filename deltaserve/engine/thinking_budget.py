"""Thinking-token budgets: vLLM's `thinking_token_budget` request field, with its --reasoning-config engine setting.

A request with a budget B thinks for at most B tokens: once the open thinking section (the tokens after the
reasoning start sequence, `<think>` for the qwen3 parser) holds B tokens, the next positions are forced to the
reasoning end sequence (`</think>`), one token a step, after which the model answers. The front end resolves the
two sequences once (deltaserve/reasoning_config.py, from --reasoning-parser and --reasoning-config as vLLM's
ReasoningConfig resolves them) and sends them with each budgeted request; the engine core's StructuredOutputManager
owns one ThinkingBudget per such request, feeds it every token the request emits, and asks it, for each position a
step samples (a verify chunk's positions along its drafts included), which token is forced there.

The rules, as vLLM 0.26's ThinkingBudgetStateHolder counts (docs/reasoning.md#thinking-token-budgets):
- a prompt whose last start sequence comes after its last end sequence opens the section: the prompt tokens after
  it count (Qwen3.5's template ends a thinking turn's prompt with `<think>\\n`, so the newline is the first of B);
- outside a section, a start sequence the model emits opens one (counted from the next token, a fresh budget);
- an end sequence the model emits itself closes the section (nothing is forced);
- the forced end sequence closes it once its last token is out.
The force is vLLM's: the forced token's logit becomes 1e9 after the penalties (sampler/sampler.py), so the logprobs
a request asks for stay the model's own, and the token is sampled whatever the temperature.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from deltaserve.reasoning_config import ReasoningMarkers


def _last_index(tokens: np.ndarray, sequence: tuple[int, ...]) -> int:
    """Where the last occurrence of `sequence` in `tokens` starts; -1 when there is none. The candidates come from
    one vectorised comparison: a Python scan of a long prompt with no marker would hold the front end's loop."""
    size = len(sequence)
    if len(tokens) < size:
        return -1
    candidates = np.flatnonzero(tokens[: len(tokens) - size + 1] == sequence[0])
    for index in candidates[::-1].tolist():
        if tuple(tokens[index : index + size].tolist()) == sequence:
            return index
    return -1


def open_section(prompt_token_ids: Sequence[int], markers: ReasoningMarkers) -> int | None:
    """How many prompt tokens an open thinking section already holds (the tokens after the prompt's last start
    sequence, when no end sequence follows it); None when the prompt leaves none open."""
    tokens = np.asarray(prompt_token_ids, dtype=np.int64)
    last_start, last_end = _last_index(tokens, markers.start), _last_index(tokens, markers.end)
    return len(tokens) - (last_start + len(markers.start)) if last_start > last_end else None


@dataclass(frozen=True)
class ThinkingStart:
    """What the front end sends with a budgeted request: the engine's markers and the prompt's open section."""

    markers: ReasoningMarkers
    open_count: int | None  # open_section of the prompt


@dataclass(frozen=True)
class _State:
    count: int | None  # tokens in the open section so far; None outside one
    forced: int = 0  # end-sequence tokens forced so far (the section is closing)
    window: tuple[int, ...] = ()  # the last tokens since the section opened or closed, to match a sequence


class ThinkingBudget:
    """One request's budget: fed the tokens it emits (accept), asked which token a position must be (forced)."""

    def __init__(self, start: ThinkingStart, budget: int) -> None:
        if budget < 0:
            raise ValueError(f"a thinking-token budget is non-negative, got {budget}")
        self.markers = start.markers
        self.budget = budget
        self.state = _State(start.open_count)

    def accept(self, token_ids: Sequence[int]) -> None:
        """The tokens the request emitted, in order."""
        for token in token_ids:
            self.state = self._advance(self.state, token)

    def forced(self, drafts: Sequence[int] = ()) -> int | None:
        """The token forced at the next position after the emitted tokens and then `drafts` (a verify chunk's
        drafts before the position); None when the model chooses."""
        state = self.state
        for token in drafts:
            state = self._advance(state, token)
        return self._forced_at(state)

    def may_force_within(self, num_positions: int) -> bool:
        """Whether any of the next `num_positions` positions could be forced, whatever the tokens before them (the
        engine core launches a step before it has seen the tokens of the steps still in flight). Never False where
        a force could come; True early by at most a few positions."""
        state = self.state
        if state.count is None:
            # a start sequence first (at least one more token), then `budget` counted tokens
            return self.budget + 1 < num_positions
        if state.forced or state.count >= self.budget:
            return True
        return self.budget - state.count < num_positions

    def _forced_at(self, state: _State) -> int | None:
        if state.count is None:
            return None
        if state.forced or state.count >= self.budget:
            return self.markers.end[state.forced]
        return None

    def _advance(self, state: _State, token: int) -> _State:
        start, end = self.markers.start, self.markers.end
        if state.count is None:
            window = (state.window + (token,))[-len(start) :]
            return _State(0) if window == start else _State(None, 0, window)
        if state.forced or state.count >= self.budget:
            # a forced position: the token is the end sequence's next (the sampler emits nothing else there)
            forced = state.forced + 1
            return _State(None) if forced == len(end) else _State(state.count + 1, forced)
        window = (state.window + (token,))[-len(end) :]
        return _State(None) if window == end else _State(state.count + 1, 0, window)
