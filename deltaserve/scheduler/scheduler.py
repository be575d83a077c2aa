"""Token-budget continuous batching, as vLLM v1 schedules: no prefill or decode phases.

Each sequence carries num_computed_tokens; each step hands out up to max_num_batched_tokens tokens over at
most max_num_seqs running sequences, running ones first (FCFS), then waiting ones. So chunked prefill and
mixed prefill + decode batches need no special cases. When KV blocks run out, the latest-arrived running
sequence is preempted by recompute: its blocks and state slot are freed and it restarts from zero later.
"""

from __future__ import annotations

from collections import deque

from deltaserve.scheduler.batch import ScheduledBatch, ScheduledSequence
from deltaserve.scheduler.block_manager import BlockManager, StateSlotPool
from deltaserve.scheduler.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(
        self, block_manager: BlockManager, slot_pool: StateSlotPool, max_num_seqs: int, max_num_batched_tokens: int
    ) -> None:
        if max_num_seqs > slot_pool.num_slots:
            raise ValueError(
                f"max_num_seqs ({max_num_seqs}) exceeds the GDN state slots available ({slot_pool.num_slots}); "
                "lower max_num_seqs or give the state pool more memory"
            )
        self.blocks = block_manager
        self.slots = slot_pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions_total = 0
        self._num_arrivals = 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.arrival_index = self._num_arrivals
        self._num_arrivals += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        chosen: list[tuple[Sequence, int]] = []
        num_preempted = 0
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(seq.num_uncomputed_tokens, budget)
            if num_new == 0:
                continue
            needed = self.blocks.blocks_needed(seq.num_computed_tokens + num_new, len(seq.block_ids))
            while not self.blocks.can_allocate(needed):
                victim = self.running[-1]
                self._preempt(victim)
                num_preempted += 1
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            seq.block_ids.extend(self.blocks.allocate(needed))
            chosen.append((seq, num_new))
            budget -= num_new
        # Admit waiting sequences only when nothing had to be preempted this step.
        while not num_preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            num_new = min(seq.num_uncomputed_tokens, budget)
            needed = self.blocks.blocks_needed(num_new, 0)
            if not self.blocks.can_allocate(needed) or self.slots.num_free_slots == 0:
                break
            self.waiting.popleft()
            seq.state_slot = self.slots.allocate()
            seq.block_ids = self.blocks.allocate(needed)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chosen.append((seq, num_new))
            budget -= num_new
        scheduled = [self._scheduled(seq, num_new) for seq, num_new in chosen]
        scheduled.sort(key=lambda s: not s.is_decode)  # stable: decodes first, FCFS within each group
        return ScheduledBatch(sequences=scheduled, num_preempted=num_preempted)

    def _scheduled(self, seq: Sequence, num_new: int) -> ScheduledSequence:
        start = seq.num_computed_tokens
        end = start + num_new
        return ScheduledSequence(
            seq_id=seq.seq_id,
            token_ids=seq.tokens(start, end),
            positions=seq.positions(start, end),
            start=start,
            block_ids=list(seq.block_ids),
            state_slot=seq.state_slot,
            needs_sample=end == seq.num_tokens,
            sampling=seq.sampling,
        )

    def advance(self, batch: ScheduledBatch) -> None:
        """Marks this step's tokens as computed (call after the runner ran the batch)."""
        running = {seq.seq_id: seq for seq in self.running}
        for scheduled in batch.sequences:
            seq = running.get(scheduled.seq_id)
            if seq is not None:
                seq.num_computed_tokens = scheduled.start + len(scheduled.token_ids)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        self.blocks.free(seq.block_ids)
        seq.block_ids = []
        if seq.state_slot is not None:
            self.slots.free(seq.state_slot)
            seq.state_slot = None

    def finish(self, seq: Sequence) -> None:
        """Removes a sequence (finished or aborted) wherever it is and frees its blocks and slot."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED

    def preempt_all(self) -> int:
        """Forces every running sequence back to waiting (used by tests to exercise recompute)."""
        victims = list(self.running)
        for seq in reversed(victims):
            self._preempt(seq)
        return len(victims)
