"""Chunk sizing: how many tokens a sequence gets in a step, within what is left of the step's token budget.

A running sequence gets its unplanned tokens up to the budget, ended early at its next prefix-cache checkpoint target
that the chunk cannot save inside itself (checkpoint_targets.cap). It gets none while every output it may still
produce is in flight or it has reached max_model_len (update() will finish it on the length rules), nor while a
verify chunk of its own is in flight (its next position depends on how many drafts that step accepts) unless it may
chain (SpecSchedule.can_chain). A decode of a sequence that
speculates adds its drafts (scheduler/spec.py) when the step may still hold a verify chunk. A prefill-only request's
next chunk is planned whole or not at all (its logits must come from the chunks it asked for); one larger than the step
budget runs as the first work of a step.
"""

from __future__ import annotations

from deltaserve.scheduler import checkpoint_targets
from deltaserve.scheduler.sequence import Sequence
from deltaserve.scheduler.spec import SpecSchedule


def prefill_only_chunk(seq: Sequence, budget: int, step_budget: int) -> int:
    """A prefill-only request's next chunk, or 0 when it does not fit what is left (budget) of a step that already
    holds other work (a step of step_budget tokens)."""
    chunk = seq.next_chunk()
    return chunk if chunk <= budget or budget == step_budget else 0


def running_chunk(
    seq: Sequence, budget: int, step_budget: int, max_model_len: int, spec: SpecSchedule | None,
    can_chain: bool = False,
) -> tuple[int, int]:  # fmt: skip
    """(tokens, drafts among them) of a running sequence's next chunk; spec: None when this step plans no more verify
    chunks (speculation off, or the step holds SpecSchedule.max_verifies of them); can_chain: it may be planned with
    a verify in flight (SpecSchedule.can_chain)."""
    if seq.is_prefill_only:
        return prefill_only_chunk(seq, budget, step_budget), 0
    if seq.is_length_capped or seq.num_planned_tokens >= max_model_len:
        return 0, 0  # its last token is in flight; update() will finish it on the length rules
    if seq.num_inflight_verifies and not can_chain:
        return 0, 0  # its position depends on how many drafts that step accepts
    start = seq.num_computed_tokens + seq.num_inflight_tokens
    num_new = checkpoint_targets.cap(seq, start, min(seq.num_unplanned_tokens, budget))
    is_decode = num_new == seq.num_unplanned_tokens == 1 and start > 0
    if spec is None or not is_decode:
        return num_new, 0
    drafts = spec.num_drafts(seq, budget - 1, max_model_len)
    return num_new + drafts, drafts
