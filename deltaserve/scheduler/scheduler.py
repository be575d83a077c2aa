"""Token-budget continuous batching, as vLLM v1 schedules: no prefill or decode phases, plans in plain data.

schedule() hands out up to max_num_batched_tokens tokens over at most max_num_seqs running sequences, running ones
first (FCFS), then waiting ones (each one's chunk sized by scheduler/chunks.py), and returns a StepPlan
(deltaserve/step.py, built by scheduler/plan.py). update(plan, result) is the one place that advances computed
counts and appends tokens (each sequence's share by scheduler/results.py). Between the two, a planned step is "in
flight": under async scheduling the next step is planned from the in-flight counters before the previous result is
back, so a decode whose input token is still on the device is planned like any other (the runner takes that token
from its own record of what it sampled). When KV blocks run out, a running sequence is preempted by recompute: its
blocks, state slot and row are freed, results of its in-flight steps are dropped, and it restarts from zero later
with its outputs kept.

Two policies, vLLM's --scheduling-policy: under "fcfs" waiting sequences are admitted in arrival order, the
latest-admitted running sequence is the one preempted, and it goes back to the head of the queue. Under "priority"
the waiting queue is ordered by (priority, arrival), a lower value first; the victim is the running sequence with
the highest (priority, arrival), even one already chosen for this step (its tokens go back to the budget); a
preempted sequence goes back to its place in that order. Running sequences are planned in admission order under
both, as vLLM's scheduler walks its running list.

With the prefix cache on (scheduler/prefix_cache.py, docs/prefix-caching.md) a waiting sequence is admitted at the
deepest ready checkpoint its tokens match (scheduler/cache_admission.py; its first step reads the checkpoint's slot
and shares its blocks), its prefill chunks end on its checkpoint targets (branch point, periodic, prompt end), a
finished sequence's state and blocks become a checkpoint, and allocations evict unused checkpoints before anything
is preempted. A waiting sequence whose shared prefix a running prefill is computing waits, its place kept, for that
prefill's checkpoint (scheduler/prefix_wait.py); the sequences behind it are admitted meanwhile.

A prefill-only request (Sequence.logits_chunks, LLMEngine.prefill_logits) goes the same way with three differences:
its prompt is planned in exactly the chunks it asked for, none of its chunks samples (each returns its logits
instead), and update() finishes it once its prompt is computed.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections import deque

from deltaserve.scheduler import cache_admission, checkpoint_targets, prefix_wait
from deltaserve.scheduler.block_manager import BlockManager, IdPool, StateSlotPool
from deltaserve.scheduler.chunks import prefill_only_chunk, running_chunk
from deltaserve.scheduler.plan import InflightEntry, build_plan
from deltaserve.scheduler.prefix_cache import PrefixCache
from deltaserve.scheduler.results import Logprobs, apply_result
from deltaserve.scheduler.sequence import Sequence, SequenceStatus
from deltaserve.scheduler.spec import SpecSchedule
from deltaserve.scheduler.stop import FINISH_ABORT
from deltaserve.step import StepPlan, StepResult

SCHEDULING_POLICIES = ("fcfs", "priority")


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        slot_pool: StateSlotPool,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        policy: str = "fcfs",
        enable_prefix_caching: bool = False,
        checkpoint_interval: int = 0,
        chunk_size: int = 64,
        lone_prefill_tokens: int = 0,
    ) -> None:
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"unknown scheduling policy {policy!r}; choose from {SCHEDULING_POLICIES}")
        if max_num_seqs > slot_pool.num_slots:
            raise ValueError(
                f"max_num_seqs ({max_num_seqs}) exceeds the GDN state slots available ({slot_pool.num_slots}); "
                "lower max_num_seqs or give the state pool more memory"
            )
        self.blocks = block_manager
        self.slots = slot_pool
        self.rows = IdPool(max_num_seqs, "request-table row")
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # a step whose only work is one prompt's prefill may take this many (engine/budget.py step_budgets)
        self.lone_prefill_tokens = max(lone_prefill_tokens, max_num_batched_tokens)
        self.max_model_len = max_model_len
        self.is_priority = policy == "priority"
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions_total = 0
        self.num_waiting_for_capacity = 0
        self._num_arrivals = 0
        self._num_steps = 0
        self._removed_rows: list[int] = []
        self._inflight: dict[int, list[InflightEntry]] = {}  # step_id -> its entries, in plan order
        # hybrid prefix caching (docs/prefix-caching.md); the counters are in tokens, as vLLM counts them: a lookup
        # adds the request's token count to the queries and its cached tokens to the hits
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.prefix_cache: PrefixCache | None = None
        if enable_prefix_caching:
            if checkpoint_interval % chunk_size:
                raise ValueError(
                    f"prefix_cache_checkpoint_interval ({checkpoint_interval}) must be a multiple of the GDN chunk "
                    f"size ({chunk_size}), so that a prefill resumed there runs the same chunks"
                )
            # slots beyond max_num_seqs are the checkpoints' share: at most that many pending (unevictable) ones, so
            # an admission always finds a free slot or a ready checkpoint to evict
            max_pending = slot_pool.num_slots - max_num_seqs
            self.prefix_cache = PrefixCache(block_manager, slot_pool, max_pending, chunk_size, checkpoint_interval)
        self.spec: SpecSchedule | None = None  # speculative decoding (scheduler/spec.py); None: off
        self._num_verifies = 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_inflight_steps(self) -> int:
        return len(self._inflight)

    def reset_prefix_cache(self) -> bool:
        """Drops every checkpoint not in use; False when some could not be dropped (vLLM's answer): those a step
        in flight still writes."""
        return self.prefix_cache.reset() if self.prefix_cache is not None else True

    @property
    def num_available_slots(self) -> int:
        """Free state slots plus those only ready checkpoints hold (evictable)."""
        ready = self.prefix_cache.num_ready if self.prefix_cache is not None else 0
        return self.slots.num_free_slots + ready

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.arrival_index = self._num_arrivals
        self._num_arrivals += 1
        seq.status = SequenceStatus.WAITING
        if self.is_priority:
            self._insert_by_priority(seq)
        else:
            self.waiting.append(seq)

    def _insert_by_priority(self, seq: Sequence) -> None:
        """Puts seq in the waiting queue after every sequence of a lower (priority, arrival) key."""
        index = bisect.bisect_right(self.waiting, seq.priority_key, key=lambda other: other.priority_key)
        self.waiting.insert(index, seq)

    def _choose_victim(self) -> Sequence:
        if self.is_priority:
            return max(self.running, key=lambda seq: seq.priority_key)
        return self.running[-1]

    # -- planning -------------------------------------------------------------------------------------

    def _num_to_plan(self, seq: Sequence, budget: int) -> int:
        spec = self.spec
        can_verify = spec is not None and (spec.max_verifies is None or self._num_verifies < spec.max_verifies)
        can_chain = spec is not None and spec.can_chain(seq)
        num_new, num_drafts = running_chunk(
            seq, budget, self.max_num_batched_tokens, self.max_model_len, spec if can_verify else None, can_chain
        )
        self._num_verifies += int(num_drafts > 0)
        return num_new

    def _lookahead(self, seq: Sequence, end: int) -> int:
        return 0 if self.spec is None else self.spec.lookahead(seq, end, self.max_model_len)

    def _step_budget(self) -> int:
        """max_num_batched_tokens, or lone_prefill_tokens when this step's only possible work is one prompt's
        prefill: one sequence in the scheduler (no other running or waiting), at least two of its tokens not yet
        planned (a prompt, or a preempted sequence's recompute; not a prefill-only request, whose chunks are its
        own). Its other chunk caps (checkpoint targets, max_model_len) hold as at any budget."""
        if self.lone_prefill_tokens == self.max_num_batched_tokens or len(self.running) + len(self.waiting) != 1:
            return self.max_num_batched_tokens
        seq = self.running[0] if self.running else self.waiting[0]
        is_prefilling = seq.num_computed_tokens + seq.num_inflight_tokens < seq.num_tokens - 1
        return self.lone_prefill_tokens if is_prefilling and not seq.is_prefill_only else self.max_num_batched_tokens

    def schedule(self) -> StepPlan:
        budget = step_budget = self._step_budget()
        self._num_verifies = 0  # verify chunks planned in this step (SpecSchedule.max_verifies)
        if self.spec is not None and self.spec.policy is not None:  # this step's k (scheduler/spec_policy.py)
            self.spec.policy.plan_step(self.spec.num_decodes(self.running))
        chosen: list[tuple[Sequence, int]] = []
        num_preempted = num_deferred = 0
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = self._num_to_plan(seq, budget)
            if num_new == 0:
                continue
            start = seq.num_computed_tokens + seq.num_inflight_tokens
            end = start + num_new
            needed = self.blocks.blocks_needed(end + self._lookahead(seq, end), len(seq.block_ids))
            is_deferred = False
            while not cache_admission.reserve(self.blocks, self.prefix_cache, needed):
                victim = self._choose_victim()
                if victim is seq and cache_admission.frees_later(self.blocks, self.prefix_cache, needed):
                    # what it lacks is held by checkpoints a step in flight still writes (a victim's, evictable once
                    # collected): preempting itself too would let the two take turns throwing their progress away
                    # forever, so it waits a step instead
                    is_deferred = True
                    break
                chosen_index = next((i for i, (other, _) in enumerate(chosen) if other is victim), None)
                if chosen_index is not None:  # chosen earlier in this loop (priority only): its tokens come back
                    budget += chosen.pop(chosen_index)[1]
                self._preempt(victim)
                num_preempted += 1
                if victim is seq:
                    break
            if is_deferred:
                num_deferred += 1
                continue
            if seq.status is not SequenceStatus.RUNNING:
                continue
            seq.block_ids.extend(self.blocks.allocate(needed))
            chosen.append((seq, num_new))
            budget -= num_new
        # Admit waiting sequences only when nothing had to be preempted or deferred this step, in queue order,
        # passing over (in place) those that wait for a prefix a running prefill is computing (prefix_wait.py).
        is_blocked_by_capacity = False
        is_held_back = bool(num_preempted or num_deferred)
        promised = None  # KV blocks the running sequences' known tokens still need (on the first admission)
        index = 0
        while not is_held_back and index < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[index]
            entry = cache_admission.entry_point(self.prefix_cache, seq)
            start = entry.start
            is_waiting, gained = prefix_wait.must_wait(self.prefix_cache, seq, start, self.running, chosen)
            if is_waiting:
                budget += gained
                index += 1
                continue
            if seq.is_prefill_only:
                num_new = prefill_only_chunk(seq, budget, step_budget)
            else:
                num_new = checkpoint_targets.cap(seq, start, min(seq.num_tokens - start, budget))
            if num_new == 0:
                break  # a prefill-only chunk that waits for a step with room for it whole
            end = start + num_new
            needed = self.blocks.blocks_needed(end + self._lookahead(seq, end), entry.num_shared)
            if promised is None:
                promised = sum(self.blocks.blocks_needed(s.num_tokens, len(s.block_ids)) for s in self.running)
            if not self._fits_whole(seq, entry, promised):
                is_blocked_by_capacity = True
                break
            slot = None
            if self.rows.num_free:
                slot = cache_admission.take_room(self.blocks, self.slots, self.prefix_cache, needed, entry.hit)
            if slot is None:
                is_blocked_by_capacity = True
                break
            del self.waiting[index]
            seq.state_slot = slot
            seq.row = self.rows.allocate()
            seq.block_ids = self.blocks.allocate(needed)
            queried, hits = cache_admission.admit(self.prefix_cache, seq, entry)
            self.prefix_cache_queries += queried
            self.prefix_cache_hits += hits
            if seq.first_scheduled_time is None:
                seq.num_cached_tokens = start
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chosen.append((seq, num_new))
            budget -= num_new
            promised += self.blocks.blocks_needed(seq.num_tokens, len(seq.block_ids))
        if index < len(self.waiting):  # those not reached still make this step's prefills save what they'd wait for
            prefix_wait.mark(self.prefix_cache, itertools.islice(self.waiting, index, None), self.running, chosen)
        self.num_waiting_for_capacity = len(self.waiting) if is_blocked_by_capacity or is_held_back else 0
        return self._plan(chosen)

    def _fits_whole(self, seq: Sequence, entry: cache_admission.Entry, promised: int) -> bool:
        """Whether the KV blocks available now (free, or held by ready checkpoints alone) hold all of a waiting
        sequence's known tokens beside the `promised` blocks the running sequences' known tokens still need: a
        prompt admitted chunk by chunk into too little room is preempted part-way (it is the latest admitted) and
        recomputed from zero, again and again while the running ones decode (docs/ARCHITECTURE.md#admission). The
        hit's blocks it would share stop being available once shared. In one pool (docs/ARCHITECTURE.md) its slot's
        pages count beside its blocks."""
        rest = self.blocks.blocks_needed(seq.num_tokens, entry.num_shared)
        shared = entry.hit.block_ids[: entry.num_shared] if entry.hit is not None else ()
        # in one pool its state slot takes pages too, and ready checkpoints' slots give theirs back when evicted
        rest += self.slots.pages_per_slot
        available = cache_admission.available_blocks(self.blocks, self.prefix_cache, entry.hit)
        return rest + promised <= available - self.blocks.num_cache_only(shared)

    def _plan(self, chosen: list[tuple[Sequence, int]]) -> StepPlan:
        step_id = self._num_steps
        self._num_steps += 1
        removed = tuple(self._removed_rows)
        plan, entries = build_plan(chosen, step_id, removed, self.prefix_cache, self.spec, self.running)
        self._removed_rows = []
        if plan.seqs:
            self._inflight[step_id] = entries
        return plan

    # -- results --------------------------------------------------------------------------------------

    def unfinished(self, plan: StepPlan) -> tuple[bool, ...]:
        """Per sequence of a step in flight, in plan order: whether it has not finished (stopped, aborted) since."""
        return tuple(not seq.is_finished for seq, _, _, _ in self._inflight.get(plan.step_id, ()))

    def update(self, plan: StepPlan, result: StepResult) -> list[tuple[Sequence, list[int], list[Logprobs | None]]]:
        """Applies a step's result: computed counts advance, sampled tokens are appended and checked against the
        stop rules (a stopped sequence is finished and freed), a prefill-only request keeps its chunk's logits.
        Returns (sequence, new tokens, their logprobs) for every live sequence that gained tokens or finished."""
        entries = self._inflight.pop(plan.step_id, [])
        if self.prefix_cache is not None:
            self.prefix_cache.collected(plan.step_id)  # its checkpoints are written: later plans may read them
        if len(result.token_ids) != len(entries):
            raise ValueError(f"step {plan.step_id}: {len(result.token_ids)} results for {len(entries)} sequences")
        logprobs = result.logprobs or (None,) * len(entries)
        chunk_logits = result.logits or (None,) * len(entries)
        policy = self.spec.policy if self.spec is not None else None
        if policy is not None:  # it times its steps: their decodes (and verify chunks), drafts, and the others
            sampled = [s for s in plan.seqs if s.needs_sample and s.num_computed_tokens]
            drafts = [s.num_draft_tokens for s in sampled if s.num_new_tokens == 1 + s.num_draft_tokens]
            policy.step_collected(len(drafts), sum(drafts), len(drafts) == len(plan.seqs))
        now = time.time()
        touched = []
        for (seq, epoch, num_new, needs_sample), item, tokens, token_logprobs, logits in zip(
            entries, plan.seqs, result.token_ids, logprobs, chunk_logits, strict=True
        ):
            if seq.epoch != epoch or seq.status is not SequenceStatus.RUNNING:
                continue  # finished, aborted or preempted since this step was planned: its result is stale
            applied = apply_result(
                seq, item, num_new, needs_sample, tokens, token_logprobs, logits,
                plan.step_id, self.max_model_len, policy, now,
            )  # fmt: skip
            if applied.stop is not None:
                self.finish(seq, *applied.stop)
            if applied.is_news:
                touched.append((seq, applied.new_tokens, applied.logprobs))
        return touched

    # -- leaving --------------------------------------------------------------------------------------

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed_tokens = seq.num_inflight_tokens = seq.num_pending_outputs = seq.num_inflight_verifies = 0
        seq.logits = []  # a prefill-only request recomputes every chunk
        seq.epoch += 1
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions_total += 1
        if self.is_priority:
            self._insert_by_priority(seq)
        else:
            self.waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        seq.checkpoint_targets, seq.restore_slot, seq.block_copy = [], None, None
        self.blocks.free(seq.block_ids)
        seq.block_ids = []
        seq.num_blocks_sent = 0
        if seq.state_slot is not None:
            self.slots.free(seq.state_slot)
            seq.state_slot = None
        if seq.row is not None:
            self.rows.free(seq.row)
            if seq.is_in_runner:
                self._removed_rows.append(seq.row)
            seq.row = None
        seq.is_in_runner = False

    def finish(self, seq: Sequence, reason: str = FINISH_ABORT, stop_reason: int | str | None = None) -> None:
        """Removes a sequence (stopped or aborted) wherever it is and frees its blocks, slot and row."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            if reason != FINISH_ABORT and self.prefix_cache is not None and not seq.is_prefill_only:
                self.prefix_cache.hand_over(seq, self._last_inflight_step(seq))
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason

    def _last_inflight_step(self, seq: Sequence) -> int | None:
        """The latest step in flight that computes tokens of this sequence (None: none)."""
        steps = [
            sid for sid, entries in self._inflight.items() if any(e[0] is seq and e[1] == seq.epoch for e in entries)
        ]
        return max(steps, default=None)

    def preempt_all(self) -> int:
        """Forces every running sequence back to waiting (used by tests to exercise recompute)."""
        victims = list(self.running)
        for seq in reversed(victims):
            self._preempt(seq)
        return len(victims)
