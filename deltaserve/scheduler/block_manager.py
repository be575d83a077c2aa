"""Paged KV blocks for the full-attention layers, the pool of GDN state slots, and id pools (request-table rows).

Both are free lists of integer ids; the runner owns the tensors they index. Split (the default), blocks and slots
are two lists over two memories; shared ("one pool", docs/ARCHITECTURE.md), both draw on one PageTable: a block is
a page, a slot a run of pages_per_slot aligned pages, blocks the lowest free pages, slots the highest free run. KV
blocks are reference-counted: a sequence and the prefix cache's checkpoints (scheduler/prefix_cache.py) may hold
the same block, which returns to the free list when its last holder lets go; a block only checkpoints hold can be
had by evicting them, so usage counts it free, as vLLM counts its cached blocks. A state slot is handed out "fresh":
the sequence's first step runs with has_initial_state False, so whatever the slot held from an earlier owner (in
one pool, a block's K and V too) is never read (docs/ARCHITECTURE.md#gated-deltanet-and-its-state).
"""

from __future__ import annotations

import heapq
from collections import deque


class PageTable:
    """num_pages pages, each free or held; run s is the pages [s x R, (s + 1) x R), R = pages_per_slot. Pages go out
    lowest first (KV blocks), runs highest fully free run first (state slots), so the two grow from the two ends of
    the pool and meet wherever the traffic puts them."""

    def __init__(self, num_pages: int, pages_per_slot: int) -> None:
        if pages_per_slot < 1 or num_pages < pages_per_slot:
            raise ValueError(f"{num_pages} pages hold no run of {pages_per_slot} (a state slot's pages)")
        self.num_pages = num_pages
        self.pages_per_slot = pages_per_slot
        self.num_runs = num_pages // pages_per_slot  # the pages past the last run serve blocks only
        self._is_free = [True] * num_pages
        self._num_free = num_pages
        self._heap = list(range(num_pages))  # free pages, lowest first; entries of taken pages are skipped lazily
        self._run_free = [pages_per_slot] * self.num_runs  # free pages of each run
        self._runs = [-s for s in range(self.num_runs)]  # candidate free runs, highest first (lazily validated)
        heapq.heapify(self._runs)
        self._num_free_runs = self.num_runs

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_free_runs(self) -> int:
        return self._num_free_runs

    def _taken(self, page: int) -> None:
        self._is_free[page] = False
        self._num_free -= 1
        run = page // self.pages_per_slot
        if run < self.num_runs:
            if self._run_free[run] == self.pages_per_slot:
                self._num_free_runs -= 1
            self._run_free[run] -= 1

    def give(self, page: int) -> None:
        if self._is_free[page]:
            raise RuntimeError(f"page {page} given back while free")
        self._is_free[page] = True
        self._num_free += 1
        heapq.heappush(self._heap, page)
        run = page // self.pages_per_slot
        if run < self.num_runs:
            self._run_free[run] += 1
            if self._run_free[run] == self.pages_per_slot:
                self._num_free_runs += 1
                heapq.heappush(self._runs, -run)
                if len(self._runs) > 2 * self.num_runs:  # stale entries of runs a block took since: rebuild
                    self._runs = [-r for r in range(self.num_runs) if self._run_free[r] == self.pages_per_slot]
                    heapq.heapify(self._runs)
        if len(self._heap) > 2 * self.num_pages:  # stale entries: rebuild (a list in ascending order is a heap)
            self._heap = [p for p in range(self.num_pages) if self._is_free[p]]

    def take(self, num_pages: int) -> list[int]:
        """The num_pages lowest free pages."""
        if num_pages > self._num_free:
            raise RuntimeError(f"asked for {num_pages} pages with {self._num_free} free")
        pages = []
        while len(pages) < num_pages:
            page = heapq.heappop(self._heap)
            if self._is_free[page]:
                self._taken(page)
                pages.append(page)
        return pages

    def take_run(self) -> int | None:
        """The highest run whose pages are all free, taken whole (None: no run is free)."""
        while self._runs:
            run = -self._runs[0]
            if self._run_free[run] == self.pages_per_slot:
                heapq.heappop(self._runs)
                first = run * self.pages_per_slot
                for page in range(first, first + self.pages_per_slot):
                    self._taken(page)
                return run
            heapq.heappop(self._runs)  # stale: a page of it was taken since
        return None

    def give_run(self, run: int) -> None:
        first = run * self.pages_per_slot
        pages = range(first, first + self.pages_per_slot)
        if not 0 <= run < self.num_runs or any(self._is_free[page] for page in pages):
            raise RuntimeError(f"run {run} given back while not held whole")
        for page in pages:
            self.give(page)


class _DequeFree:
    """The split pool's free list of ids 0..n-1: first in, first out."""

    def __init__(self, num_ids: int) -> None:
        self._free: deque[int] = deque(range(num_ids))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, num_ids: int) -> list[int]:
        return [self._free.popleft() for _ in range(num_ids)]

    def give(self, index: int) -> None:
        self._free.append(index)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, pages: PageTable | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache has no room for a single block (num_blocks={num_blocks})")
        if pages is not None and pages.num_pages != num_blocks:
            raise ValueError(f"a shared pool's blocks are its pages: {num_blocks} blocks, {pages.num_pages} pages")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.pages = pages  # shared with the state slots (None: the split pool)
        self._free: PageTable | _DequeFree = pages if pages is not None else _DequeFree(num_blocks)
        self._refs = [0] * num_blocks  # holders of each block (sequences and checkpoints)
        self._cache_refs = [0] * num_blocks  # of those, prefix-cache checkpoints
        self._num_cache_only = 0  # blocks held by checkpoints alone

    @property
    def num_free_blocks(self) -> int:
        return self._free.num_free

    @property
    def num_available_blocks(self) -> int:
        """Free blocks plus those only checkpoints hold (evictable): what vLLM reports as free."""
        return self._free.num_free + self._num_cache_only

    @property
    def usage(self) -> float:
        return 1.0 - self.num_available_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int, num_held: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - num_held)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self._free.num_free

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > self._free.num_free:
            raise RuntimeError(f"asked for {num_blocks} KV blocks with {self._free.num_free} free")
        block_ids = self._free.take(num_blocks)
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
                self._free.give(block_id)

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
    """GDN state slots; each running sequence holds one. Shared (`pages`), slot s is run s of the page table: the
    slot ids are the runs, and a slot is free only while none of its pages holds a block."""

    def __init__(self, num_slots: int, pages: PageTable | None = None) -> None:
        if num_slots < 1:
            raise ValueError(f"the GDN state pool has no slot (num_slots={num_slots})")
        if pages is not None and pages.num_runs != num_slots:
            raise ValueError(f"a shared pool's slots are its runs: {num_slots} slots, {pages.num_runs} runs")
        super().__init__(num_slots, "state slot")
        self.pages = pages

    @property
    def num_slots(self) -> int:
        return self.num_ids

    @property
    def num_free(self) -> int:
        return super().num_free if self.pages is None else self.pages.num_free_runs

    @property
    def num_free_slots(self) -> int:
        return self.num_free

    @property
    def pages_per_slot(self) -> int:
        """The pages a slot takes from the blocks (0: the split pool, where it takes none)."""
        return 0 if self.pages is None else self.pages.pages_per_slot

    def allocate(self) -> int | None:
        return super().allocate() if self.pages is None else self.pages.take_run()

    def free(self, index: int) -> None:
        if self.pages is None:
            super().free(index)
        else:
            self.pages.give_run(index)
