"""How the scheduler plans speculative decoding: how many drafts a decode verifies (docs/speculative-decoding.md).

With speculation on, a decode computes its last sampled token plus k drafts (ScheduledSeq.num_draft_tokens = k), and its
result carries 1 .. k + 1 accepted tokens. k is the configured count, lowered so that the step can never produce more
outputs than max_tokens allows or reach past max_model_len (every sampling kind speculates, grammars included: the
engine masks each verify position as the grammar stands after the drafts before it). A sequence whose verify step is in
flight is not planned again until that result is collected (its position depends on how many drafts were accepted),
unless async_verify is on and the sequence may chain (`can_chain`): then its next chunk is planned at the optimistic
start (every draft of the verify in flight accepted: Sequence.num_pending_outputs counts a verify's 1 + k outputs while
it is in flight), marked ScheduledSeq.is_chained, and the runner moves it back on the device by the drafts that verify
rejected (docs/speculative-decoding.md#async-verify). A chunk of a sequence that speculates gets KV blocks for k - 1
positions past it, which the MTP drafter's chained passes write. With a k policy (scheduler/spec_policy.py) the step's
decodes draft at most its k_step, which the scheduler sets once per step from the number of decodes (`num_decodes`) and
feeds with the applied results; the plan then tells the runner how many drafts to propose after the step
(StepPlan.num_drafts_next), and a later decode of a sequence drafts at most what the last plan that sampled it asked for
(Sequence.num_drafts_ready). With or without a policy, a 1-token chunk right after a chunk that sampled nothing (a
prompt's last token after a chunked prefill or a resumed sequence's recompute) verifies no drafts: the drafter has
proposed none for it, as vLLM's first decode follows the prefill's sample.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from deltaserve.scheduler.sequence import Sequence
from deltaserve.scheduler.spec_policy import KPolicy


@dataclass(frozen=True)
class SpecSchedule:
    num_speculative_tokens: int  # k: drafts verified per decode, at most
    max_verifies: int | None = None  # verify chunks a step may hold (the runner's scratch); None: no cap
    policy: KPolicy | None = None  # the per-step k policy; None: every decode drafts k (capped as below)
    async_verify: bool = False  # plan a sequence's next chunk while its verify runs (can_chain)

    def __post_init__(self) -> None:
        if self.policy is not None:  # the policy drafts nothing in a step whose decodes outnumber the chunks
            self.policy.max_verifies = self.max_verifies

    def num_decodes(self, running: Iterable[Sequence]) -> int:
        """The running sequences a step would plan as decodes (the k policy's batch size): one unplanned token past
        a computed prefix, no verify in flight."""
        return sum(
            1
            for seq in running
            if not seq.is_prefill_only
            and (not seq.num_inflight_verifies or self.can_chain(seq))
            and seq.num_unplanned_tokens == 1
            and seq.num_computed_tokens + seq.num_inflight_tokens > 0
        )

    def can_chain(self, seq: Sequence) -> bool:
        """Whether a sequence with a verify in flight may be planned again before that result is collected. Only
        where nothing the runner decides on the host for the next step depends on how many drafts were accepted:
        one verify in flight (two would need both rejections), no grammar (its masks need the accepted tokens), no
        per-request seed on a random row and min_tokens reached (the runner's seeds and min_tokens mask follow its
        host count of the row's outputs, which learns an accepted run only when the step is collected)."""
        if not self.async_verify or seq.num_inflight_verifies != 1 or seq.is_prefill_only:
            return False
        params = seq.sampling
        if params.structured_outputs is not None:
            return False
        if params.seed is not None and params.temperature > 0:
            return False
        return len(seq.output_token_ids) >= params.min_tokens

    def lookahead(self, seq: Sequence, end: int, max_model_len: int) -> int:
        """KV positions past a chunk ending at `end` that the drafter writes (its chained passes: k - 1), so the
        chunk's blocks cover them."""
        if seq.is_prefill_only:
            return 0
        return max(0, min(self.num_speculative_tokens - 1, max_model_len - end))

    def num_drafts(self, seq: Sequence, budget: int, max_model_len: int) -> int:
        """Drafts for a decode of `seq` that has `budget` step tokens left after its own token."""
        if seq.is_prefill_only:
            return 0
        # a verify emits up to k + 1 tokens: all of them must fit under max_tokens and max_model_len
        outputs_left = seq.max_tokens - len(seq.output_token_ids) - seq.num_pending_outputs
        room = max_model_len - seq.num_planned_tokens
        k = self.num_speculative_tokens if self.policy is None else self.policy.k_step
        if seq.num_drafts_ready is not None:  # the drafter proposed no more than this after its last sample
            k = min(k, seq.num_drafts_ready)
        return max(0, min(k, outputs_left - 1, room - 1, budget))

    def num_drafts_next(self, running: Iterable[Sequence]) -> int | None:
        """The drafts the runner proposes after the step just planned (StepPlan.num_drafts_next): the k policy's
        choice for a step whose decodes are the running sequences that will decode next (one unplanned token, or a
        verify in flight, once this plan is in flight); None without a policy (every step proposes k)."""
        if self.policy is None:
            return None
        next_decodes = sum(
            1
            for seq in running
            if not seq.is_prefill_only
            and (seq.num_inflight_verifies or seq.num_unplanned_tokens == 1)
            and seq.num_computed_tokens + seq.num_inflight_tokens > 0
        )
        return self.policy.num_drafts_next(next_decodes)
