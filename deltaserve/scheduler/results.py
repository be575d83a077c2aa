"""One sequence's share of a step result: its counters advance, its tokens are appended and checked for a stop.

Scheduler.update drops results that went stale (the sequence finished, was aborted or preempted since the step was
planned) and hands each live one here. The in-flight tokens it planned leave flight; a verify chunk computes its
token and the accepted drafts (the rejected drafts' KV rows are overwritten by later steps) and feeds the k policy
before a stop drops any of them; a prefill-only request keeps its chunk's logits and is done once its prompt is
computed; a generating one appends its accepted tokens one at a time under the stop rules (scheduler/stop.py),
dropping those after a stop. The caller finishes a sequence that stopped (it owns the queues).
"""

from __future__ import annotations

from dataclasses import dataclass

from deltaserve.scheduler.sequence import Sequence
from deltaserve.scheduler.spec_policy import KPolicy
from deltaserve.scheduler.stop import FINISH_STOP, check_stop
from deltaserve.step import ScheduledSeq

Logprobs = tuple[tuple[int, float, int], ...]  # one token's ((token, logprob, rank), ...): sampled, then the top-N


@dataclass(frozen=True)
class Applied:
    """What a sequence gained from a step."""

    new_tokens: list[int]
    logprobs: list[Logprobs | None]  # one per new token
    stop: tuple[str, int | str | None] | None  # (finish reason, stop reason) when it is done; None: it goes on

    @property
    def is_news(self) -> bool:
        """It gained tokens or finished: the caller reports it."""
        return bool(self.new_tokens) or self.stop is not None


def apply_result(
    seq: Sequence,
    item: ScheduledSeq,
    num_new: int,
    needs_sample: bool,
    tokens: tuple[int, ...],
    token_logprobs: tuple[Logprobs, ...] | None,
    logits: bytes | None,
    step_id: int,
    max_model_len: int,
    policy: KPolicy | None,
    now: float,
) -> Applied:
    """Applies a live sequence's result of step step_id, for which num_new tokens were planned (item)."""
    seq.num_inflight_tokens -= num_new
    if item.num_draft_tokens:
        # a verify chunk: its token and the accepted drafts are computed; the rejected drafts' KV rows are
        # overwritten by later steps
        if not 1 <= len(tokens) <= num_new:
            raise ValueError(f"step {step_id}: {len(tokens)} accepted tokens for a {num_new}-token verify")
        seq.num_inflight_verifies -= 1
        num_new = len(tokens)
        if policy is not None:  # before a stop drops any of them
            policy.observe(item.num_draft_tokens, len(tokens) - 1)
    seq.num_computed_tokens += num_new
    seq.num_pending_outputs -= (1 + item.num_draft_tokens) if needs_sample else 0  # as schedule_seq counted them
    if seq.is_prefill_only:
        if logits is None:
            raise RuntimeError(f"step {step_id}: no logits for prefill-only request {seq.seq_id}")
        seq.logits.append(logits)
        done = seq.num_computed_tokens == seq.num_prompt_tokens
        return Applied([], [], (FINISH_STOP, None) if done else None)
    new_tokens: list[int] = []
    stop = None
    for token_id in tokens:
        seq.output_token_ids.append(token_id)
        new_tokens.append(token_id)
        stop = check_stop(seq, token_id, max_model_len)
        if stop is not None:
            break  # tokens accepted after a stop are dropped
    if not new_tokens:
        return Applied([], [], None)
    seq.first_token_time = seq.first_token_time or now
    seq.last_token_time = now
    if token_logprobs is None:
        kept: list[Logprobs | None] = [None] * len(new_tokens)
    else:
        kept = list(token_logprobs[: len(new_tokens)])
    return Applied(new_tokens, kept, stop)
