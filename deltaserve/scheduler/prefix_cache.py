"""The hybrid prefix cache's index: chain hashes of KV blocks, GDN state checkpoints, their LRU and their pools.

A checkpoint is the unit of the cache (docs/prefix-caching.md): a position P, a state slot holding the GDN state
after tokens [0, P), and the KV blocks covering [0, P), which it holds by reference count (BlockManager.share).
Its key is (the chain hash of the full blocks [0, floor(P / block_size) * block_size), the tail token ids up to P,
the multimodal items the tail overlaps), so a lookup walks a sequence's chain hashes from its deepest full block
down and compares tails. A checkpoint written by a step is pending until that step's result is collected
(`collected`); only ready ones are matched or evicted (a pending one's slot is still being written). Ready
checkpoints are evicted least recently used first, when a running sequence needs a block or a slot, those that two
or more sequences have hit (a shared prefix) only once no other is left: a few slots are not flushed by the prompt
and generation ends of one-off requests (docs/prefix-caching.md#eviction-order).

Hashes are blake2b-128 over the parent hash, the block's token ids and the (content identifier, offset) of every
image or video item overlapping the block: Python's hash() is salted per process and the core may run in its own.
A request's cache_salt (vLLM's) seeds the chain (root_hash), so salted requests share prefixes only with each other.
A bounded LRU of chain hashes seen before (no memory attached) tells how deep a new sequence's prefix is shared with
earlier traffic, the branch point where the scheduler places a checkpoint for the requests that follow.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

from deltaserve.multimodal.inputs import MultimodalInput
from deltaserve.scheduler.block_manager import BlockManager, StateSlotPool
from deltaserve.scheduler.sequence import Sequence

ROOT_HASH = b""  # the chain's parent of block 0
MAX_SEEN_HASHES = 1 << 16  # chain hashes remembered for branch points (16 bytes each, no memory attached)
# A checkpoint hit by this many sequences is protected: evicted only after every unprotected one. One hit is what a
# conversation's next turn gives its previous turn's end (then dead); two are a prefix that others share.
PROTECT_AFTER_HITTERS = 2
PROTECTED_SHARE = 3 / 4  # protected checkpoints beyond this share of all checkpoints go back, least recent first

MediaKeys = tuple[tuple[str, int], ...]
CheckpointKey = tuple[bytes, tuple[int, ...], MediaKeys]


def media_keys(mm_input: MultimodalInput | None, start: int, end: int) -> MediaKeys:
    """(content identifier, offset) of every image / video item whose placeholder span overlaps [start, end)."""
    if mm_input is None:
        return ()
    return tuple((item.identifier, item.offset) for item in mm_input.items if item.offset < end and item.end > start)


def block_hash(parent: bytes, token_ids: list[int], extra: MediaKeys) -> bytes:
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    for identifier, offset in extra:
        digest.update(f"|{identifier}@{offset}".encode())
    return digest.digest()


def root_hash(seq: Sequence) -> bytes:
    """The chain's parent of block 0: empty without a salt, else a hash of the salt, so a salted sequence's every
    chain hash and checkpoint key (the tail of a checkpoint before the first full block included) differs from an
    unsalted or otherwise salted one's (vLLM puts the salt in the first block's extra keys: the same isolation)."""
    if seq.cache_salt is None:
        return ROOT_HASH
    return hashlib.blake2b(b"cache_salt|" + seq.cache_salt.encode(), digest_size=16).digest()


def sequence_tokens(seq: Sequence) -> list[int]:
    return seq.prompt_token_ids + seq.output_token_ids


def chain_hashes(seq: Sequence, block_size: int, num_tokens: int) -> list[bytes]:
    """The chain hashes of the sequence's full blocks within its first num_tokens tokens, extending the ones kept on
    the sequence (its tokens only ever grow)."""
    hashes = seq.block_hashes
    num_blocks = num_tokens // block_size
    if len(hashes) < num_blocks:
        tokens = sequence_tokens(seq)
        for index in range(len(hashes), num_blocks):
            start, end = index * block_size, (index + 1) * block_size
            parent = hashes[-1] if hashes else root_hash(seq)
            hashes.append(block_hash(parent, tokens[start:end], media_keys(seq.mm_input, start, end)))
    return hashes[:num_blocks]


@dataclass(eq=False)
class Checkpoint:
    """The unit of the cache: the GDN state after [0, position) in `slot` and the KV blocks of [0, position)."""

    key: CheckpointKey
    position: int  # tokens [0, position) consumed by the state in `slot`
    slot: int
    block_ids: tuple[int, ...]  # KV blocks covering [0, position), one reference each held
    is_ready: bool = False
    num_hitters: int = 0  # sequences whose lookup matched it (one sequence's repeated lookups count once)
    last_hitter: str | None = None
    is_protected: bool = False


@dataclass
class PrefixCache:
    """The checkpoints (LRU first), indexed by the chain hash in their key; the seen hashes; what the scheduler asks
    of them at admission (lookup, targets, admit), while planning (checkpoint_at), at a finish (hand_over) and
    when a step's result is collected (collected)."""

    blocks: BlockManager
    slots: StateSlotPool
    max_pending: int  # checkpoints may hold at most this many slots that cannot be evicted (the checkpoint share)
    chunk_size: int  # the GDN chunk: branch and periodic checkpoints sit on its grid
    interval: int = 0  # a periodic checkpoint every `interval` tokens of a prefill (a multiple of chunk_size); 0: none
    max_seen: int = MAX_SEEN_HASHES
    # the model has an MTP layer: a hit at P rewrites the MTP KV entry at P - 1, so the block holding P - 1 is copied
    # for it, never shared (runner/mtp_resume.py)
    rewrites_last_row: bool = False
    _checkpoints: OrderedDict[CheckpointKey, Checkpoint] = field(default_factory=OrderedDict)  # LRU first
    _by_hash: dict[bytes, list[Checkpoint]] = field(default_factory=dict)
    _pending: dict[int, list[Checkpoint]] = field(default_factory=dict)  # step id -> checkpoints it writes
    _seen: OrderedDict[bytes, None] = field(default_factory=OrderedDict)

    @property
    def block_size(self) -> int:
        return self.blocks.block_size

    @property
    def num_checkpoints(self) -> int:
        return len(self._checkpoints)

    @property
    def num_ready(self) -> int:
        """Checkpoints that can be evicted: their slots count as free in the engine's stats."""
        return len(self._checkpoints) - self.num_pending

    @property
    def num_pending(self) -> int:
        return sum(len(items) for items in self._pending.values())

    def checkpoints(self) -> list[Checkpoint]:
        """Every checkpoint, least recently used first."""
        return list(self._checkpoints.values())

    def key(self, seq: Sequence, position: int) -> CheckpointKey:
        full = position - position % self.block_size
        hashes = chain_hashes(seq, self.block_size, full)
        tail = tuple(sequence_tokens(seq)[full:position])
        return hashes[-1] if hashes else root_hash(seq), tail, media_keys(seq.mm_input, full, position)

    def num_shared_blocks(self, position: int) -> int:
        """The leading blocks of a hit at `position` that the sequence shares; the block after them, when it holds a
        token before `position`, is copied (a partial block its owner keeps writing; with the MTP layer, also the
        full block holding position - 1, whose MTP entry the hit rewrites)."""
        if position < 1:
            return 0
        return (position - 1) // self.block_size if self.rewrites_last_row else position // self.block_size

    # -- lookups --------------------------------------------------------------------------------------

    def lookup(self, seq: Sequence) -> Checkpoint | None:
        """The deepest ready checkpoint whose key matches the sequence's tokens at a position before its last token
        (which must run to give the next token's logits)."""
        best = self._match(seq, is_ready=True)
        if best is not None:
            self._checkpoints.move_to_end(best.key)
            if best.last_hitter != seq.seq_id:
                best.num_hitters += 1
                best.last_hitter = seq.seq_id
                if best.num_hitters >= PROTECT_AFTER_HITTERS and not best.is_protected:
                    best.is_protected = True
                    self._cap_protected()
        return best

    def _cap_protected(self) -> None:
        """Unprotects the least recently used protected checkpoints beyond PROTECTED_SHARE of all, so that shared
        prefixes no longer used age out and new ones find room."""
        cap = max(1, int(PROTECTED_SHARE * len(self._checkpoints)))
        protected = [c for c in self._checkpoints.values() if c.is_protected]  # least recently used first
        for checkpoint in protected[: max(0, len(protected) - cap)]:
            checkpoint.is_protected = False

    def pending_depth(self, seq: Sequence) -> int:
        """The position of the deepest pending checkpoint (a step in flight writes it) that a lookup of the sequence
        will match once that step is collected; 0: none. Touches no LRU."""
        if not self._pending:
            return 0
        best = self._match(seq, is_ready=False)
        return best.position if best is not None else 0

    def _match(self, seq: Sequence, is_ready: bool) -> Checkpoint | None:
        """The deepest checkpoint, ready or pending as asked, whose key matches the sequence's tokens before its
        last token."""
        limit = seq.num_tokens - 1
        if limit < 1 or not self._checkpoints:
            return None
        hashes = chain_hashes(seq, self.block_size, limit)
        tokens = sequence_tokens(seq)
        for depth in range(len(hashes), -1, -1):
            candidates = self._by_hash.get(hashes[depth - 1] if depth else root_hash(seq), ())
            start = depth * self.block_size
            best = None
            for checkpoint in candidates:
                position = checkpoint.position
                if checkpoint.is_ready is not is_ready or position > limit or (best and best.position >= position):
                    continue
                if checkpoint.key[1] == tuple(tokens[start:position]) and checkpoint.key[2] == media_keys(
                    seq.mm_input, start, position
                ):
                    best = checkpoint
            if best is not None:
                return best
        return None

    def branch_point(self, seq: Sequence, chunk_size: int) -> int:
        """The end of the prefix this sequence shares with earlier traffic: its leading full blocks whose chain hash
        was seen before, capped before its last token, on the GDN chunk grid (0: none)."""
        limit = seq.num_tokens - 1
        depth = 0
        for chain_hash in chain_hashes(seq, self.block_size, limit):
            if chain_hash not in self._seen:
                break
            depth += 1
        shared = min(depth * self.block_size, limit)
        return shared - shared % chunk_size

    def remember(self, seq: Sequence) -> None:
        """Records the sequence's full-block chain hashes as seen (at its admission)."""
        for chain_hash in chain_hashes(seq, self.block_size, seq.num_tokens):
            self._seen[chain_hash] = None
            self._seen.move_to_end(chain_hash)
        while len(self._seen) > self.max_seen:
            self._seen.popitem(last=False)

    # -- checkpoints ----------------------------------------------------------------------------------

    def contains(self, key: CheckpointKey) -> bool:
        if key in self._checkpoints:
            self._checkpoints.move_to_end(key)
            return True
        return False

    def can_add(self) -> bool:
        return self.num_pending < self.max_pending

    def add(
        self, key: CheckpointKey, position: int, slot: int, block_ids: tuple[int, ...], step_id: int | None
    ) -> None:
        """Indexes a checkpoint that takes over `slot` and one reference to each of block_ids; pending until step
        step_id is collected (None: ready now)."""
        checkpoint = Checkpoint(key, position, slot, block_ids, is_ready=step_id is None)
        self._checkpoints[key] = checkpoint
        self._by_hash.setdefault(key[0], []).append(checkpoint)
        if step_id is not None:
            self._pending.setdefault(step_id, []).append(checkpoint)

    def collected(self, step_id: int) -> None:
        """The result of step step_id is back: the checkpoints it wrote can be read by steps planned from now on."""
        for checkpoint in self._pending.pop(step_id, ()):
            checkpoint.is_ready = True

    def evict_one(
        self, keep: Checkpoint | None = None, keep_slot: int | None = None, may_evict_protected: bool = True
    ) -> bool:
        """Drops the least recently used ready checkpoint (not `keep`, nor the one in keep_slot), an unprotected one
        while there is one (only those unless may_evict_protected): its slot and block references go back."""
        for is_protected in (False, True) if may_evict_protected else (False,):
            for checkpoint in self._checkpoints.values():
                if (
                    checkpoint.is_ready
                    and checkpoint.is_protected is is_protected
                    and checkpoint is not keep
                    and checkpoint.slot != keep_slot
                ):
                    self._drop(checkpoint)
                    return True
        return False

    def _drop(self, checkpoint: Checkpoint) -> None:
        del self._checkpoints[checkpoint.key]
        siblings = self._by_hash[checkpoint.key[0]]
        siblings.remove(checkpoint)
        if not siblings:
            del self._by_hash[checkpoint.key[0]]
        self.blocks.free(checkpoint.block_ids, by_cache=True)
        self.slots.free(checkpoint.slot)

    def num_available_blocks(self, keep: Checkpoint | None = None) -> int:
        """Blocks free or held by checkpoints alone (BlockManager.num_available_blocks) and, in one pool, the pages of
        the ready checkpoints' slots (not keep's), blocks once those are evicted; with the pool split a slot holds no
        block's pages."""
        per_slot = self.slots.pages_per_slot
        ready = sum(1 for c in self._checkpoints.values() if c.is_ready and c is not keep) if per_slot else 0
        return self.blocks.num_available_blocks + per_slot * ready

    def reserve_blocks(self, num_blocks: int, keep: Checkpoint | None = None) -> bool:
        """Evicts ready checkpoints until num_blocks blocks are free; False if they cannot be. When even every block
        that only checkpoints hold (and, in one pool, their slots' pages) would not be enough, nothing is evicted: a
        sequence about to be preempted keeps the checkpoints its restart would read (the bound counts pending
        checkpoints' blocks too, so it is not exact)."""
        if num_blocks > self.num_available_blocks(keep):
            return False
        while not self.blocks.can_allocate(num_blocks):
            if not self.evict_one(keep):
                return False
        return True

    def take_slot(
        self, keep: Checkpoint | None = None, keep_slot: int | None = None, may_evict_protected: bool = True
    ) -> int | None:
        """A free state slot, evicting a ready checkpoint for it when none is free (a protected one only where
        may_evict_protected: a running sequence's slot may take one, a new checkpoint's may not)."""
        if self.slots.num_free_slots == 0 and not self.evict_one(keep, keep_slot, may_evict_protected):
            return None
        return self.slots.allocate()

    # -- planning (called by the scheduler) ------------------------------------------------------------

    def admit(self, seq: Sequence, hit: Checkpoint | None) -> None:
        """Sets an admitted sequence up (its fresh blocks already in seq.block_ids): with a hit, the hit's full
        blocks go in front (one more reference each, num_shared_blocks), it starts at the hit's position from the hit's
        slot, and its first step copies the hit's next block (partial, or holding position - 1 with the MTP layer)
        into its first fresh one. Its chain hashes count as seen."""
        if hit is not None:
            num_shared = self.num_shared_blocks(hit.position)
            shared = list(hit.block_ids[:num_shared])
            self.blocks.share(shared)
            seq.block_ids = shared + seq.block_ids
            seq.num_computed_tokens, seq.restore_slot = hit.position, hit.slot
            if num_shared * self.block_size < hit.position:
                seq.block_copy = (hit.block_ids[num_shared], seq.block_ids[num_shared])
        self.remember(seq)

    def targets(self, seq: Sequence, start: int) -> list[int]:
        """Where the prefill of a sequence admitted at `start` saves checkpoints: the branch point, every interval
        tokens, and the end of its known tokens (the chunk that samples); scheduler/checkpoint_targets.py adds the
        repeat point and decides which of them cut a chunk."""
        end = seq.num_tokens
        found = {end}
        branch = self.branch_point(seq, self.chunk_size)
        if branch > start:
            found.add(branch)
        if self.interval:
            found.update(range(start - start % self.interval + self.interval, end, self.interval))
        return sorted(found)

    def checkpoint_at(
        self, seq: Sequence, end: int, step_id: int, read_slot: int | None
    ) -> tuple[tuple[int, int], ...]:
        """The (position, slot) checkpoint a chunk of step step_id saves at `end` (its end or, in-step, a position
        inside it: scheduler/checkpoint_targets.py), unless its key is cached already or no slot is to be had
        (skipped, never an error); never the chunk's read slot (the runner refuses it)."""
        key = self.key(seq, end)
        if self.contains(key):
            seq.num_cache_depth = max(seq.num_cache_depth, end)
            return ()
        if not self.can_add():
            return ()
        # a new checkpoint, which nothing has hit yet, never evicts a protected one (letting a new branch point do so
        # simulated worse at c64: docs/prefix-caching.md#eviction-order); with no other evictable it is skipped
        slot = self.take_slot(keep_slot=read_slot, may_evict_protected=False)
        if slot is None:
            return ()
        block_ids = tuple(seq.block_ids[: -(-end // self.block_size)])
        self.blocks.share(block_ids, by_cache=True)
        self.add(key, end, slot, block_ids, step_id)
        seq.num_cache_depth = max(seq.num_cache_depth, end)
        return ((end, slot),)

    def hand_over(self, seq: Sequence, last_step: int | None) -> None:
        """A finished sequence's live slot and blocks become a checkpoint at the tokens its state consumed (no copy),
        pending until last_step (its last step in flight; None: none) is collected. Takes the slot and the blocks
        off the sequence (the blocks the checkpoint needs gain its reference; the sequence's own go as it is
        released); does nothing when the checkpoint exists already or no room is left for it."""
        position = seq.num_computed_tokens + seq.num_inflight_tokens
        if position < 1 or seq.state_slot is None or not self.can_add():
            return
        if position > seq.num_tokens:
            return  # a stop inside an accepted speculative run: the state consumed drafts the sequence dropped
        key = self.key(seq, position)
        if self.contains(key):
            return
        block_ids = tuple(seq.block_ids[: -(-position // self.block_size)])
        self.blocks.share(block_ids, by_cache=True)
        self.add(key, position, seq.state_slot, block_ids, last_step)
        seq.state_slot = None

    def reset(self) -> bool:
        """Drops every ready checkpoint and forgets the hashes seen; False when pending ones remain."""
        for checkpoint in [c for c in self._checkpoints.values() if c.is_ready]:
            self._drop(checkpoint)
        self._seen.clear()
        return not self._checkpoints
