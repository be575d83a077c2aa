"""ScheduledBatch: the only thing the runner receives from the scheduler each step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class ScheduledSequence:
    seq_id: str
    token_ids: list[int]  # the tokens computed this step
    positions: list[list[int]]  # [3][len(token_ids)]
    start: int  # tokens already computed before this step
    block_ids: list[int]  # the sequence's whole block table
    state_slot: int
    needs_sample: bool  # this chunk reaches the last known token, so the step samples the next one
    sampling: Any = None  # the engine's per-sequence sampling state, handed to the sampler

    @property
    def has_initial_state(self) -> bool:
        return self.start > 0

    @property
    def is_decode(self) -> bool:
        return len(self.token_ids) == 1 and self.start > 0


@dataclass
class ScheduledBatch:
    sequences: list[ScheduledSequence]  # decodes first, then prefill chunks
    num_preempted: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.sequences)

    @property
    def num_decodes(self) -> int:
        return sum(1 for s in self.sequences if s.is_decode)

    @property
    def is_empty(self) -> bool:
        return not self.sequences
