"""Paged KV blocks for the full-attention layers, the pool of GDN state slots, and id pools (request-table rows).

Both are free lists of integer ids; the runner owns the tensors they index. A state slot is handed out
"fresh": the sequence's first step runs with has_initial_state False, so whatever the slot held from an
earlier owner is never read (docs/ARCHITECTURE.md#gated-deltanet-and-its-state).
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

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_needed(self, num_tokens: int, num_held: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - num_held)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self._free):
            raise RuntimeError(f"asked for {num_blocks} KV blocks with {len(self._free)} free")
        return [self._free.popleft() for _ in range(num_blocks)]

    def free(self, block_ids: list[int]) -> None:
        self._free.extend(block_ids)


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
