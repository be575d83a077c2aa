"""Waiting for an in-flight prefix: a waiting sequence whose shared prefix is being computed right now waits for it.

With the prefix cache on (docs/prefix-caching.md#waiting-for-an-in-flight-prefix), a waiting sequence that would
start at H (its deepest ready checkpoint) is held back for this step, its place in the queue kept, when
- a checkpoint that a step in flight writes (pending) will give it a hit at least MIN_WAIT_TOKENS deeper than H, or
- its branch point B (the leading full blocks whose chain hash was seen, on the GDN grid) lies at least
  MIN_WAIT_TOKENS past H and a running sequence that is still prefilling has the same key at B (tokens, cache salt,
  media items: PrefixCache.key) and has not computed nor put in flight any token past B: that sequence gains B as a
  checkpoint target (scheduler/checkpoint_targets.py decides how its chunk meets it, and its chunk of this step, if
  already planned, is re-capped), so the waiter hits B once the step that writes it is collected.
The test runs again at every step: once the checkpoint is ready the lookup hits it; once nothing is in flight any
more (the prefill was preempted, aborted or finished without saving B, or passed B without a slot for it) the
sequence is admitted as before. A sequence that is itself waiting is never waited for; a sequence that asks for
prompt logprobs (it reads no cache) and a prefill-only request never wait.

The waiting sequences admission does not reach in a step (its budget or rows spent, or admission held back) are
still looked at (`mark`), only those whose first block a prefill planned in that step shares, MAX_MARKED at most:
without it a prefill whose chunk takes the whole budget would pass B unsaved while the requests that share it sit
unexamined.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

from deltaserve.scheduler.checkpoint_targets import cap
from deltaserve.scheduler.prefix_cache import PrefixCache, chain_hashes
from deltaserve.scheduler.sequence import Sequence, SequenceStatus

# two GDN chunks: a wait costs the waiter at least one step of TTFT, and a hit costs a state-slot copy and a block
# copy; below two chunks the prefill saved is smaller than a decode step's share of most batches (a first guess, to be
# read from the H200 prefix_repetition grids)
MIN_WAIT_TOKENS = 128
# the most waiting sequences `mark` examines in a step (those past its first-block filter): each costs a lookup and a
# branch point, ~45 us at 4,736 tokens on the CPU, and a long queue sharing a system prompt must not make every
# step pay for all of it
MAX_MARKED = 32


def must_wait(
    cache: PrefixCache | None, seq: Sequence, start: int, running: list[Sequence], chosen: list[tuple[Sequence, int]]
) -> tuple[bool, int]:
    """Whether the waiting sequence `seq`, which would start at `start`, waits this step for a prefix in flight, and
    the tokens this step's budget gains back (a running prefill's planned chunk in `chosen`, cut at the new target)."""
    if cache is None or seq.is_prefill_only or seq.sampling.skip_reading_prefix_cache:
        return False, 0
    if cache.pending_depth(seq) - start >= MIN_WAIT_TOKENS:
        return True, 0
    branch = cache.branch_point(seq, cache.chunk_size)
    if branch - start < MIN_WAIT_TOKENS:
        return False, 0
    key = None
    for other in running:
        progress = other.num_computed_tokens + other.num_inflight_tokens
        if progress >= branch or other.num_tokens < branch or other.is_prefill_only:
            continue  # past B already (or decoding), too short to share B, or saving no checkpoints
        if other.status is not SequenceStatus.RUNNING:
            continue
        key = key if key is not None else cache.key(seq, branch)
        if cache.key(other, branch) == key:
            return True, add_target(other, branch, progress, chosen)
    return False, 0


def add_target(seq: Sequence, position: int, start: int, chosen: list[tuple[Sequence, int]]) -> int:
    """Makes the running prefill `seq` (computed and in flight up to `start`) save a checkpoint at `position`; its
    chunk of this step, when one is planned, is re-capped. Returns the tokens that chunk gives back."""
    if seq.sampling.prompt_logprobs is not None:
        seq.uncut_targets.add(position)  # its chunks must stay the cache-off run's
    else:
        seq.uncut_targets.discard(position)  # its repeat point R may be there: a branch point cuts where it must
    if position not in seq.checkpoint_targets:
        bisect.insort(seq.checkpoint_targets, position)
    for index, (other, num_new) in enumerate(chosen):
        if other is seq:
            capped = cap(seq, start, num_new)
            chosen[index] = (seq, capped)
            return num_new - capped
    return 0


def mark(
    cache: PrefixCache | None, waiting: Iterable[Sequence], running: list[Sequence], chosen: list[tuple[Sequence, int]]
) -> None:
    """For the waiting sequences admission did not reach this step: each that shares its first block with a prefill
    chunk planned in this step gets the branch point it would wait for saved by that prefill (must_wait's targets;
    the chunk is re-capped, its tokens left unused this step)."""
    if cache is None:
        return
    size = cache.block_size
    firsts = {
        seq.block_hashes[0]
        for seq, _ in chosen
        if seq.block_hashes and seq.num_computed_tokens + seq.num_inflight_tokens < seq.num_tokens - 1
    }  # the first chain hash of every prefill planned this step (a decode or verify starts at its last token)
    if not firsts:
        return
    num_marked = 0
    for seq in waiting:
        if seq.num_tokens <= size or seq.is_prefill_only or seq.sampling.skip_reading_prefix_cache:
            continue
        if chain_hashes(seq, size, size)[0] not in firsts:
            continue
        if num_marked == MAX_MARKED:
            break
        num_marked += 1
        hit = cache.lookup(seq)
        must_wait(cache, seq, hit.position if hit is not None else 0, running, chosen)
