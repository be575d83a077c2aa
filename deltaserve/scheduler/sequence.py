"""Sequence: one generating stream as the scheduler sees it (one engine-core request; n > 1 arrives as n of them).

Pure Python and ints. The scheduler is the one owner of its token list and its computed count: only
`Scheduler.update(plan, result)` appends tokens and advances `num_computed_tokens`. Under async scheduling a step
is planned before the previous one's tokens are known, so two counters describe work in flight: tokens scheduled
but not yet reported (`num_inflight_tokens`) and sampled tokens not yet seen (`num_pending_outputs`; a verify chunk
counts all 1 + k it may emit).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from deltaserve.multimodal.inputs import MultimodalInput
from deltaserve.sampling_params import SamplingParams
from deltaserve.scheduler.repetition import RepetitionWatch


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: str
    prompt_token_ids: list[int]
    max_tokens: int  # output-token cap (already bounded by max_model_len)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    eos_token_ids: frozenset[int] = frozenset()
    eos_token_id: int | None = None  # the primary one of eos_token_ids (EngineCoreRequest.eos_token_id)
    arrival_index: int = 0  # FCFS order; preempted sequences keep theirs
    arrival_time: float = 0.0
    priority: int = 0  # --scheduling-policy priority: a lower value is scheduled first (vLLM's convention)
    # vLLM's per-request prefix-cache salt: it seeds the chain of block hashes, so only sequences with the same salt
    # (or none) share cached prefixes (scheduler/prefix_cache.py root_hash)
    cache_salt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_inflight_tokens: int = 0
    num_pending_outputs: int = 0
    # speculative verify steps planned, result not seen (one; two when a chained verify follows, SpecSchedule.can_chain)
    num_inflight_verifies: int = 0
    # drafts the runner holds for this sequence's next verify: the num_drafts_next of the last plan that samples it
    # (the runner steps in plan order, so that step's drafter wrote them last); None: k; 0 after a planned chunk
    # that samples nothing (its row's drafts are another step's, or another sequence's)
    num_drafts_ready: int | None = None
    block_ids: list[int] = field(default_factory=list)
    num_blocks_sent: int = 0  # how many of block_ids the runner's table already holds
    state_slot: int | None = None
    row: int | None = None  # the runner's request-table row while running
    is_in_runner: bool = False  # the runner's row holds this sequence (else the next plan adds it)
    status: SequenceStatus = SequenceStatus.WAITING
    num_preemptions: int = 0
    epoch: int = 0  # bumped at each preemption: results of steps planned before it are stale
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    repetition: RepetitionWatch | None = None  # repetition_detection's mirror of the outputs (scheduler/stop.py)
    # MRoPE: positions [3][prompt_len] for prompts with vision tokens, and the decode offset
    # (docs/ARCHITECTURE.md#positions-and-mrope).
    # None means text: every axis is the token index.
    mrope_positions: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None = None
    mrope_delta: int = 0
    mm_input: MultimodalInput | None = None  # images / videos: their spans, pixels and MRoPE positions
    # A prefill-only request (LLMEngine.prefill_logits): its prompt runs in exactly these chunk sizes, nothing is
    # sampled, the runner returns every position's logits and it finishes once the prompt is computed. None: a
    # generating request.
    logits_chunks: tuple[int, ...] | None = None
    logits: list[bytes] = field(default_factory=list)  # the prefill-only request's logits, one entry per chunk
    # prompt tokens served from the prefix cache at its first admission (vLLM's RequestOutput.num_cached_tokens)
    num_cached_tokens: int = 0
    # the deepest position its prefills left a prefix-cache checkpoint at (saved by it, or found saved): what a later
    # request of the same tokens could hit (vLLM's estimate_cached_tokens, for num_cache_creation_tokens)
    num_cache_depth: int = 0
    # prefix cache (scheduler/prefix_cache.py): chain hashes of its full blocks (its tokens only grow); positions
    # where its prefill saves checkpoints, those of them that never cut a chunk, and the GDN chunk grid on which a
    # chunk saves one inside itself (scheduler/checkpoint_targets.py; 0: none); the checkpoint slot its first step
    # reads and the (source, destination) partial KV block that step copies, after a hit
    block_hashes: list[bytes] = field(default_factory=list)
    checkpoint_targets: list[int] = field(default_factory=list)
    uncut_targets: set[int] = field(default_factory=set)
    checkpoint_grid: int = 0
    restore_slot: int | None = None
    block_copy: tuple[int, int] | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def priority_key(self) -> tuple[int, int]:
        """The order of the priority policy: lower priority value first, then earlier arrival."""
        return self.priority, self.arrival_index

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_planned_tokens(self) -> int:
        """Tokens known or in flight: the prompt, the outputs seen, and the sampled tokens not yet seen."""
        return self.num_tokens + self.num_pending_outputs

    @property
    def num_unplanned_tokens(self) -> int:
        """Tokens no step has been planned for yet."""
        return self.num_planned_tokens - self.num_computed_tokens - self.num_inflight_tokens

    @property
    def is_length_capped(self) -> bool:
        """Every token this sequence may still produce is already in flight: planning more would be wasted."""
        return len(self.output_token_ids) + self.num_pending_outputs >= self.max_tokens

    @property
    def is_prefill_only(self) -> bool:
        return self.logits_chunks is not None

    def next_chunk(self) -> int:
        """A prefill-only request's next chunk size (0 once every chunk is planned)."""
        start = self.num_computed_tokens + self.num_inflight_tokens
        end = 0
        for size in self.logits_chunks or ():
            end += size
            if end > start:
                return end - start
        return 0

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The ids masked while the sequence is under min_tokens: eos (even with ignore_eos, as vLLM) and stops."""
        return tuple(sorted(self.eos_token_ids | set(self.sampling.stop_token_ids)))
