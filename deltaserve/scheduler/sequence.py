"""Sequence: one generating stream as the scheduler sees it (a request with n = 1, or one of n children).

Pure Python and ints: the token ids so far, how many of them are computed (their KV / state written), the
KV blocks and GDN state slot it holds, and its 3-D prompt positions for MRoPE.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    seq_id: str
    prompt_token_ids: list[int]
    max_tokens: int  # output-token cap (already bounded by max_model_len)
    arrival_index: int = 0  # FCFS order; preempted sequences keep theirs
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    state_slot: int | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    num_preemptions: int = 0
    # MRoPE: positions [3][prompt_len] for prompts with vision tokens, and the decode offset (architecture
    # doc §4). None means text: every axis is the token index.
    mrope_positions: list[list[int]] | None = None
    mrope_delta: int = 0
    sampling: Any = None  # the engine's per-sequence sampling state; opaque to the scheduler

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def token_at(self, index: int) -> int:
        num_prompt = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < num_prompt else self.output_token_ids[index - num_prompt]

    def tokens(self, start: int, end: int) -> list[int]:
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    def positions(self, start: int, end: int) -> list[list[int]]:
        """Positions [3][end - start] of tokens start..end-1."""
        if self.mrope_positions is None:
            row = list(range(start, end))
            return [row, row, row]
        num_prompt = len(self.prompt_token_ids)
        rows: list[list[int]] = []
        for axis in range(3):
            prompt_part = self.mrope_positions[axis][start : min(end, num_prompt)]
            decode_part = [i + self.mrope_delta for i in range(max(start, num_prompt), end)]
            rows.append(prompt_part + decode_part)
        return rows
