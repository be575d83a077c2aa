"""A prefill's prefix-cache checkpoint targets, and how its chunks meet them (docs/prefix-caching.md).

At admission a sequence gets its targets (set_targets): the cache's branch, periodic and prompt-end positions
(PrefixCache.targets) and the repeat point R, the deepest `start + 64 j` (j >= 1) before its last token, which an
identical prompt sent again can resume (the prompt end cannot serve it: its last token must run). A target is met
in one of three ways by the chunk [start, end) that reaches it:
- at the chunk's end: saved after the forward by copying the write slot;
- strictly inside the chunk on its GDN grid (`start + 64 j`): saved during the forward (in-step,
  runner/step_checkpoints.py), at most one per chunk, the first such target;
- otherwise the chunk is cut there (`cap`), the extra step a target cost before in-step saving, except for an uncut
  target (R always; every target of a request that asks for prompt logprobs, whose chunks must stay those of the
  cache-off run), which is then skipped.
"""

from __future__ import annotations

from deltaserve.scheduler.prefix_cache import PrefixCache
from deltaserve.scheduler.sequence import Sequence


def repeat_point(seq: Sequence, start: int, chunk_size: int) -> int:
    """R: the deepest start + chunk_size · j (j >= 1) at most the sequence's last token index; 0 when none."""
    span = (seq.num_tokens - 1 - start) // chunk_size * chunk_size
    return start + span if span > 0 else 0


def set_targets(cache: PrefixCache | None, seq: Sequence, start: int) -> None:
    """The checkpoint targets of a sequence admitted at `start` (no cache, or a prefill-only request: none)."""
    seq.checkpoint_grid = 0 if cache is None else cache.chunk_size
    seq.uncut_targets = set()
    if cache is None or seq.is_prefill_only:
        seq.checkpoint_targets = []
        return
    found = set(cache.targets(seq, start))
    repeat = repeat_point(seq, start, cache.chunk_size)
    if seq.sampling.prompt_logprobs is not None:
        # its chunks must be the cache-off run's (a cut moves the prompt logprobs it reports by fp32 rounding):
        # every target but its prompt end is saved only where a chunk meets it anyway
        seq.uncut_targets = found - {seq.num_tokens}
    if repeat and repeat not in found:
        seq.uncut_targets.add(repeat)
        found.add(repeat)
    seq.checkpoint_targets = sorted(found)


def inner_target(seq: Sequence, start: int, end: int) -> int | None:
    """The target the chunk [start, end) saves during its forward: the first strictly inside it on its GDN grid."""
    grid = seq.checkpoint_grid
    if not grid:
        return None
    for target in seq.checkpoint_targets:
        if target >= end:
            break
        if target > start and (target - start) % grid == 0:
            return target
    return None


def cap(seq: Sequence, start: int, num_new: int) -> int:
    """num_new, shortened so that the chunk from `start` ends on the first target it can neither save inside itself
    (inner_target) nor skip (an uncut target)."""
    end = start + num_new
    inner = inner_target(seq, start, end)
    for target in seq.checkpoint_targets:
        if start < target < end and target != inner and target not in seq.uncut_targets:
            return target - start
    return num_new


def chunk_checkpoints(
    cache: PrefixCache, seq: Sequence, start: int, end: int, step_id: int, read_slot: int | None
) -> tuple[tuple[int, int], ...]:
    """The (position, slot) checkpoints the chunk [start, end) of step step_id saves, by position: its in-step target
    and its end when that is a target; the targets it passes are dropped. A target whose key is cached already, or
    that finds no slot (or no room in the pending share), is skipped (never an error)."""
    inner = inner_target(seq, start, end)
    targets = seq.checkpoint_targets
    while targets and targets[0] < end:
        targets.pop(0)
    positions = [] if inner is None else [inner]
    if targets and targets[0] == end:
        # an uncut target (R) yields to the chunk's end when the pending share has room for one only: the prompt
        # end serves every later request that extends the prompt
        positions.insert(0 if inner in seq.uncut_targets else len(positions), targets.pop(0))
    saves: tuple[tuple[int, int], ...] = ()
    for position in positions:
        saves += cache.checkpoint_at(seq, position, step_id, read_slot)
    return tuple(sorted(saves))
