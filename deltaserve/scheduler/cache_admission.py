"""Admission through the prefix cache: where a waiting sequence starts, the room it takes, what the hit counters gain.

The scheduler's side of scheduler/prefix_cache.py (docs/prefix-caching.md), as functions over the pools and the
cache (None: prefix caching off, and every function here reduces to the plain pools). A waiting sequence is looked
up (never a prefill-only request, nor one that asks for prompt logprobs: vLLM reads no cache for those) and starts at
the deepest ready checkpoint its tokens match, with its prefill's checkpoint targets set from there
(scheduler/checkpoint_targets.py: one that asks for prompt logprobs saves the others only where its chunks, those
of the cache-off run, meet them); the room it
takes (KV blocks, then a state slot) may evict ready checkpoints, least recently used first, never its own hit; once
admitted, the cache shares the hit's blocks with it and remembers its chain hashes, and the counters gain its tokens
as queried and the hit's as hits (vLLM counts in tokens). The Scheduler keeps the queues and the counters.
"""

from __future__ import annotations

from dataclasses import dataclass

from deltaserve.scheduler.block_manager import BlockManager, StateSlotPool
from deltaserve.scheduler.checkpoint_targets import set_targets
from deltaserve.scheduler.prefix_cache import Checkpoint, PrefixCache
from deltaserve.scheduler.sequence import Sequence


@dataclass(frozen=True)
class Entry:
    """Where a waiting sequence would start."""

    hit: Checkpoint | None  # the checkpoint its first step reads; None: a fresh prefill
    start: int  # tokens the hit covers (0: none)
    num_shared: int  # its leading KV blocks shared with the hit (the next one, when partial, is copied)


def lookup(cache: PrefixCache | None, seq: Sequence) -> Checkpoint | None:
    """The checkpoint a waiting sequence starts from (none for a request that skips reading: vLLM's rule, which
    prompt logprobs set by default)."""
    if cache is None or seq.is_prefill_only or seq.sampling.skip_reading_prefix_cache:
        return None
    return cache.lookup(seq)


def entry_point(cache: PrefixCache | None, seq: Sequence) -> Entry:
    """Looks the head of the waiting queue up and sets its prefill's checkpoint targets from where it would start."""
    hit = lookup(cache, seq)
    start = hit.position if hit is not None else 0
    set_targets(cache, seq, start)
    num_shared = cache.num_shared_blocks(start) if cache is not None else 0
    return Entry(hit, start, num_shared)


def available_blocks(blocks: BlockManager, cache: PrefixCache | None, keep: Checkpoint | None = None) -> int:
    """Blocks free or to be had by evicting ready checkpoints (not `keep`): those only checkpoints hold, and in one
    pool the pages of their slots."""
    return blocks.num_available_blocks if cache is None else cache.num_available_blocks(keep)


def reserve(blocks: BlockManager, cache: PrefixCache | None, num_blocks: int, keep: Checkpoint | None = None) -> bool:
    """Whether num_blocks blocks are free, evicting unused checkpoints (LRU, never `keep`) first to make them so."""
    if cache is None:
        return blocks.can_allocate(num_blocks)
    return cache.reserve_blocks(num_blocks, keep)


def frees_later(blocks: BlockManager, cache: PrefixCache | None, num_blocks: int) -> bool:
    """Whether num_blocks blocks that cannot be had now may be once the steps in flight are collected: pending
    checkpoints exist, and the blocks free or held by checkpoints alone would be enough."""
    return cache is not None and cache.num_pending > 0 and num_blocks <= available_blocks(blocks, cache)


def take_room(
    blocks: BlockManager, slots: StateSlotPool, cache: PrefixCache | None, num_blocks: int, hit: Checkpoint | None
) -> int | None:
    """The state slot of an admission once num_blocks blocks are free, evicting ready checkpoints other than its hit
    for both; None: no room (nothing is allocated then). In one pool the slot's pages are reserved with the blocks
    (the slot is taken first, from them)."""
    if not reserve(blocks, cache, num_blocks + slots.pages_per_slot, hit):
        return None
    return slots.allocate() if cache is None else cache.take_slot(hit)


def admit(cache: PrefixCache | None, seq: Sequence, entry: Entry) -> tuple[int, int]:
    """Hands an admitted sequence (slot, row and fresh blocks set) to the cache: the hit's blocks go in front and its
    chain hashes count as seen. Returns the (queried, hit) tokens the scheduler's counters gain."""
    if cache is None or seq.is_prefill_only:
        return 0, 0
    cache.admit(seq, entry.hit)
    if seq.sampling.skip_reading_prefix_cache:  # not a lookup
        return 0, 0
    return seq.num_tokens, entry.start
