"""Paged KV blocks for the full-attention layers, the pool of GDN state slots, and id pools (request-table rows).

Both are free lists of integer ids; the runner owns the tensors they index. KV blocks are reference-counted: a
sequence and the prefix cache's checkpoints (scheduler/prefix_cache.py) may hold the same block, which returns to
the free list when its last holder lets go; a block only checkpoints hold can be had by evicting them, so usage
counts it free, as vLLM counts its cached blocks. A state slot is handed out "fresh": the sequence's first step
runs with has_initial_state False, so whatever the slot held from an earlier owner is never read
(docs/ARCHITECTURE.md#gated-deltanet-and-its-state).
"""

from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache has no room for a single block (num_blocks={num_blocks})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks  # holders of each block (sequences and checkpoints)
        self._cache_refs = [0] * num_blocks  # of those, prefix-cache checkpoints
        self._num_cache_only = 0  # blocks held by checkpoints alone

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_available_blocks(self) -> int:
        """Free blocks plus those only checkpoints hold (evictable): what vLLM reports as free."""
        return len(self._free) + self._num_cache_only

    @property
    def usage(self) -> float:
        return 1.0 - self.num_available_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int, num_held: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - num_held)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self._free):
            raise RuntimeError(f"asked for {num_blocks} KV blocks with {len(self._free)} free")
        block_ids = [self._free.popleft() for _ in range(num_blocks)]
        for block_id in block_ids:
            self._refs[block_id] = 1
        return block_ids

    def _is_cache_only(self, block_id: int) -> bool:
        return self._refs[block_id] == self._cache_refs[block_id] > 0

    def share(self, block_ids: list[int] | tuple[int, ...], by_cache: bool = False) -> None:
        """One more holder for each of block_ids (already held by someone); by_cache: a checkpoint."""
        for block_id in block_ids:
            if self._refs[block_id] < 1:
                raise RuntimeError(f"KV block {block_id} is free: it cannot be shared")
            was = self._is_cache_only(block_id)
            self._refs[block_id] += 1
            self._cache_refs[block_id] += by_cache
            self._num_cache_only += self._is_cache_only(block_id) - was

    def free(self, block_ids: list[int] | tuple[int, ...], by_cache: bool = False) -> None:
        """One holder fewer for each of block_ids; a block nobody holds goes back to the free list."""
        for block_id in block_ids:
            if self._refs[block_id] < 1 or self._cache_refs[block_id] < by_cache:
                raise RuntimeError(f"KV block {block_id} freed more often than it was held")
            was = self._is_cache_only(block_id)
            self._refs[block_id] -= 1
            self._cache_refs[block_id] -= by_cache
            self._num_cache_only += self._is_cache_only(block_id) - was
            if self._refs[block_id] == 0:
                self._free.append(block_id)

    def num_cache_only(self, block_ids: list[int] | tuple[int, ...]) -> int:
        """How many of block_ids only checkpoints hold (counted available: a sequence that shares one takes it)."""
        return sum(self._is_cache_only(block_id) for block_id in block_ids)

    def refcount(self, block_id: int) -> int:
        return self._refs[block_id]


class IdPool:
    """A free list of the integer ids 0..num_ids-1 (state slots, request-table rows)."""

    def __init__(self, num_ids: int, what: str) -> None:
        if num_ids < 1:
            raise ValueError(f"the {what} pool is empty ({what}s: {num_ids})")
        self.num_ids = num_ids
        self._free: deque[int] = deque(range(num_ids))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        return self._free.popleft() if self._free else None

    def free(self, index: int) -> None:
        self._free.append(index)


class StateSlotPool(IdPool):
    """GDN state slots; each running sequence holds one."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"the GDN state pool has no slot (num_slots={num_slots})")
        super().__init__(num_slots, "state slot")

    @property
    def num_slots(self) -> int:
        return self.num_ids

    @property
    def num_free_slots(self) -> int:
        return self.num_free
