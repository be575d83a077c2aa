"""A test-only draft source for speculative decoding: drafts read from a reference continuation of each prompt.

`ReferenceDrafter` implements the runner's Drafter (runner/drafter.py). For each row that sampled, it finds the
request's prompt in `references` (prompt token ids -> the greedy outputs of a run without speculation) and proposes
the reference's next k tokens: mode "all" proposes them as they are (every draft is accepted), "none" shifts each
one by one token id (every draft is rejected), "mixed" shifts every third output position (runs of accepted drafts
broken by rejections). Past the reference's end it proposes token 0. It syncs the host to read the step's emitted
counts, which a served drafter never does. `stats_of` counts drafts and accepted drafts from the step results.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deltaserve.engine.core import EngineCore
from deltaserve.runner.drafter import DraftInputs
from deltaserve.runner.request_table import RequestTable

MODES = ("all", "none", "mixed")


class ReferenceDrafter:
    def __init__(
        self, table: RequestTable, references: dict[tuple[int, ...], list[int]], mode: str, k: int, vocab_size: int
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: choose from {MODES}")
        self.table = table
        self.references = references
        self.mode = mode
        self.k = k
        self.vocab_size = vocab_size

    def _draft(self, reference: list[int], index: int) -> int:
        token = reference[index] if index < len(reference) else 0
        if self.mode == "none" or (self.mode == "mixed" and index % 3 == 2):
            token = (token + 1) % self.vocab_size
        return token

    def propose(self, inputs: DraftInputs) -> torch.Tensor:
        table = self.table
        num_emitted = inputs.num_emitted.tolist()
        drafts = []
        for r, row in enumerate(inputs.rows.tolist()):
            prompt = tuple(table.prompts[row][: table.num_original_prompt[row]].tolist())
            # the table counted one output for this step at launch; the accepted drafts are counted at collect
            next_index = int(table.num_sampled[row]) + num_emitted[r] - 1
            drafts.append([self._draft(self.references[prompt], next_index + j) for j in range(self.k)])
        return torch.tensor(drafts, dtype=torch.int64, device=inputs.rows_dev.device)


def enable_reference_drafts(
    core: EngineCore, references: dict[tuple[int, ...], list[int]], mode: str, k: int
) -> dict[str, int]:
    """Turns speculation on in `core` with a ReferenceDrafter; returns counters the core's updates fill: verify
    chunks, drafts and accepted drafts."""
    core.enable_speculation(k, ReferenceDrafter(core.runner.table, references, mode, k, core.model_config.vocab_size))
    stats = {"verifies": 0, "drafts": 0, "accepted": 0}
    update: Callable = core.scheduler.update

    def counting_update(plan, result):  # noqa: ANN001, ANN202 (the scheduler's own signature)
        for item, tokens in zip(plan.seqs, result.token_ids, strict=True):
            if item.num_draft_tokens:
                stats["verifies"] += 1
                stats["drafts"] += item.num_draft_tokens
                stats["accepted"] += len(tokens) - 1
        return update(plan, result)

    core.scheduler.update = counting_update
    return stats
