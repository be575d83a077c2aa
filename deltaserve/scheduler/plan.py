"""Step-plan building: the sequences one schedule() pass chose, each with its token count, become the StepPlan.

schedule() decides who runs this step and how many tokens each gets; build_plan turns that choice into the
plain-data StepPlan the runner executes (deltaserve/step.py) and puts its work in flight on each sequence (the
in-flight token, output and verify counters, the blocks the runner's table now holds). Per sequence:
- one the runner's table does not hold (new, or resumed after a preemption) goes whole into `added`;
- it starts at its computed tokens plus those in flight; tokens past its planned ones are drafts (a verify chunk);
  it samples when the chunk reaches its last planned token (never a prefill-only request, which returns logits);
- it reads its own slot, none on its first chunk, or, on its first step after a prefix-cache hit, the hit's slot,
  whose partial KV block that step copies (`block_copies`);
- a chunk that ends on one of its checkpoint targets saves a prefix-cache checkpoint there, and one whose GDN grid
  meets a target inside it saves that one during its forward (scheduler/checkpoint_targets.py).
The plan lists decodes, then verify chunks, then prefill chunks, FCFS within each group.

The Scheduler owns the step counter, the removed rows and its record of steps in flight: build_plan takes the first
two as arguments and returns the entries for the third.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from deltaserve.scheduler.checkpoint_targets import chunk_checkpoints
from deltaserve.scheduler.prefix_cache import PrefixCache
from deltaserve.scheduler.sequence import Sequence
from deltaserve.scheduler.spec import SpecSchedule
from deltaserve.step import NewRequest, ScheduledSeq, StepPlan, window_spans

# (sequence, its epoch when planned, tokens planned, whether it samples): what update() needs of a planned step
InflightEntry = tuple[Sequence, int, int, bool]


def new_request(seq: Sequence) -> NewRequest:
    """The runner's table entry of a sequence; a resumed one's earlier outputs are prompt tokens to recompute."""
    return NewRequest(
        row=seq.row,
        req_id=seq.seq_id,
        prompt_token_ids=tuple(seq.prompt_token_ids) + tuple(seq.output_token_ids),
        output_token_ids=tuple(seq.output_token_ids),
        sampling=seq.sampling,
        stop_token_ids=seq.stop_token_ids,
        mrope_positions=seq.mrope_positions,
        mrope_delta=seq.mrope_delta,
        mm_input=seq.mm_input,
    )


def schedule_seq(seq: Sequence, num_new: int, step_id: int, prefix_cache: PrefixCache | None) -> ScheduledSeq:
    """One chosen sequence's work in step step_id (num_new tokens), with its in-flight counters advanced; the block
    copy of its first step after a prefix-cache hit is the caller's to put in the plan."""
    start = seq.num_computed_tokens + seq.num_inflight_tokens
    is_chained = seq.num_inflight_verifies > 0  # planned behind its verify in flight: `start` assumes it accepts all
    num_drafts = max(0, num_new - seq.num_unplanned_tokens)  # a verify chunk: its token plus the drafts
    needs_sample = start + num_new - num_drafts == seq.num_planned_tokens and not seq.is_prefill_only
    read_slot = seq.state_slot if start > 0 else None
    if seq.restore_slot is not None:  # the first step after a prefix-cache hit starts from the checkpoint
        read_slot, seq.restore_slot = seq.restore_slot, None
    checkpoints = ()
    if prefix_cache is not None and seq.checkpoint_targets:
        checkpoints = chunk_checkpoints(prefix_cache, seq, start, start + num_new, step_id, read_slot)
    item = ScheduledSeq(
        row=seq.row,
        num_computed_tokens=start,
        num_new_tokens=num_new,
        write_slot=seq.state_slot,
        read_slot=read_slot,
        new_block_ids=tuple(seq.block_ids[seq.num_blocks_sent :]),
        needs_sample=needs_sample,
        checkpoints=checkpoints,
        num_draft_tokens=num_drafts,
        mm_spans=window_spans(seq.mm_input, start, start + num_new),
        return_logits=seq.is_prefill_only,
        is_chained=is_chained,
    )
    seq.num_blocks_sent = len(seq.block_ids)
    seq.num_inflight_tokens += num_new
    # a verify may emit 1 + k outputs: counted as if it did while in flight, so that a chained chunk behind it
    # starts past all of them and the caps on outputs and length stay conservative
    seq.num_pending_outputs += (1 + num_drafts) if needs_sample else 0
    seq.num_inflight_verifies += int(num_drafts > 0)
    return item


def build_plan(
    chosen: list[tuple[Sequence, int]], step_id: int, removed: tuple[int, ...], prefix_cache: PrefixCache | None,
    spec: SpecSchedule | None = None, running: Iterable[Sequence] = (),
) -> tuple[StepPlan, list[InflightEntry]]:  # fmt: skip
    """The StepPlan of step step_id for the chosen (sequence, tokens) pairs and the rows freed since the last plan,
    and its in-flight entries in plan order; spec: speculative decoding's schedule (the drafts to propose after
    the step, StepPlan.num_drafts_next, which the plan's sampling sequences then hold), from the running sequences
    (`running`, the chosen ones among them)."""
    now = time.time()
    added: list[NewRequest] = []
    block_copies: list[tuple[int, int]] = []
    scheduled: list[tuple[ScheduledSeq, Sequence]] = []
    for seq, num_new in chosen:
        if not seq.is_in_runner:
            added.append(new_request(seq))
            seq.is_in_runner = True
            seq.num_blocks_sent = 0
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = now
        if seq.block_copy is not None:
            block_copies.append(seq.block_copy)
            seq.block_copy = None
        scheduled.append((schedule_seq(seq, num_new, step_id, prefix_cache), seq))
    # once every chosen sequence is in flight: the decodes of the steps that follow are known
    num_drafts_next = None if spec is None else spec.num_drafts_next(running)
    for item, seq in scheduled:
        # the drafter writes a sampling row's drafts after this step; a chunk that samples nothing (a prefill chunk
        # short of the prompt's end, also of a resumed sequence's recompute) leaves its row without drafts for this
        # sequence, so the 1-token chunk that may follow it (a prompt's last token) verifies none
        seq.num_drafts_ready = num_drafts_next if item.needs_sample else 0
    # stable: decodes first, then verify chunks, then prefill chunks, FCFS within each group
    scheduled.sort(key=lambda entry: 0 if entry[0].is_decode else 1 if entry[0].num_draft_tokens else 2)
    plan = StepPlan(
        step_id=step_id,
        seqs=tuple(item for item, _ in scheduled),
        added=tuple(added),
        removed=removed,
        block_copies=tuple(block_copies),
        num_drafts_next=num_drafts_next,
    )
    return plan, [(seq, seq.epoch, item.num_new_tokens, item.needs_sample) for item, seq in scheduled]
