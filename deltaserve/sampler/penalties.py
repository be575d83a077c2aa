"""Logit processors that look at token history: repetition/frequency/presence penalties and min_tokens masking.

Both edit fp32 logits [B, V] in place, as vLLM v1's `apply_all_penalties` and `MinTokensLogitsProcessor` do. The
history is dense per penalised row: output-token counts [P, V] and a prompt-token mask [P, V] that the runner keeps
on the device and updates after every sampled token, so a step needs no host round trip for it (a row that asks for
no penalty costs nothing). Not here: sampling, temperature, top-k/top-p (see `topk_topp.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Parameter columns of SamplingBatch.params (sampler.py defines the full layout; repeated to avoid a cycle).
_REPETITION, _FREQUENCY, _PRESENCE = 4, 5, 6


@dataclass
class PenaltyInputs:
    rows: torch.Tensor  # [P] int64: the batch rows with a penalty
    output_counts: torch.Tensor  # [P, V] int32: how often each token was generated
    prompt_mask: torch.Tensor  # [P, V] bool: tokens in the prompt (repetition counts prompt and output)


def mask_min_tokens(logits: torch.Tensor, keys: torch.Tensor) -> None:
    """keys: [N] int64 flat indices row * V + token of the stop ids of rows still under min_tokens -> -inf."""
    logits.view(-1).index_fill_(0, keys, float("-inf"))


def apply_penalties(logits: torch.Tensor, penalties: PenaltyInputs, params: torch.Tensor) -> None:
    """vLLM's order: repetition (prompt + output tokens), then frequency and presence (output tokens only)."""
    rows = penalties.rows
    row_params = params.index_select(0, rows)  # [P, 7]
    sub = logits.index_select(0, rows)  # [P, V]
    counts = penalties.output_counts.to(torch.float32)
    has_output = penalties.output_counts > 0
    repetition = row_params[:, _REPETITION].unsqueeze(1)  # [P, 1]
    seen = has_output | penalties.prompt_mask
    penalised = torch.where(sub > 0, sub / repetition, sub * repetition)
    sub = torch.where(seen, penalised, sub)
    sub -= row_params[:, _FREQUENCY].unsqueeze(1) * counts + row_params[:, _PRESENCE].unsqueeze(1) * has_output
    logits.index_copy_(0, rows, sub)
