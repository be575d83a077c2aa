"""vLLM's flat logprobs container (`SamplingParams(flat_logprobs=True)`, offline API only): a request's per-position
logprob dicts held as a few flat lists, so a long output with many logprobs costs a constant number of Python objects
instead of a dict and a Logprob per entry. It reads as `list[dict[int, Logprob]]` (len, index, slice, iteration)
and refuses in-place edits, as vLLM's does; a position appended as None reads back as an empty dict (vLLM's too)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, MutableSequence
from dataclasses import dataclass, field
from typing import overload

from deltaserve.engine.request import Logprob

Position = dict[int, Logprob]


@dataclass
class FlatLogprobs(MutableSequence[Position]):
    """Position i's entries are the flat lists' items starts[i]..ends[i] (exclusive); vLLM's field names."""

    start_indices: list[int] = field(default_factory=list)
    end_indices: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int | None] = field(default_factory=list)
    decoded_tokens: list[str | None] = field(default_factory=list)

    def append(self, position: Position | None) -> None:
        self.start_indices.append(len(self.logprobs))
        for token_id, entry in (position or {}).items():
            self.token_ids.append(token_id)
            self.logprobs.append(entry.logprob)
            self.ranks.append(entry.rank)
            self.decoded_tokens.append(entry.decoded_token)
        self.end_indices.append(len(self.logprobs))

    def extend(self, positions: Iterable[Position | None]) -> None:
        for position in positions:
            self.append(position)

    def __len__(self) -> int:
        return len(self.start_indices)

    @overload
    def __getitem__(self, index: int) -> Position: ...

    @overload
    def __getitem__(self, index: slice) -> FlatLogprobs: ...

    def __getitem__(self, index: int | slice) -> Position | FlatLogprobs:
        if isinstance(index, slice):
            starts, ends = self.start_indices[index], self.end_indices[index]
            if index.step not in (None, 1):
                # positions out of order or with gaps: rebuilt one by one (vLLM's slice assumes contiguous ranges)
                picked = FlatLogprobs()
                picked.extend(self[i] for i in range(len(self))[index])
                return picked
            if not starts:  # an empty slice (a delta with no new positions) is an empty container
                return FlatLogprobs()
            low, high = starts[0], ends[-1]
            span = slice(low, high)
            return FlatLogprobs([s - low for s in starts], [e - low for e in ends], self.token_ids[span],
                                self.logprobs[span], self.ranks[span], self.decoded_tokens[span])  # fmt: skip
        if not isinstance(index, int):
            raise TypeError(f"Invalid index type: {type(index)}")
        items = range(self.start_indices[index], self.end_indices[index])
        return {self.token_ids[i]: Logprob(self.logprobs[i], self.ranks[i], self.decoded_tokens[i]) for i in items}

    def __iter__(self) -> Iterator[Position]:
        for i in range(len(self)):
            yield self[i]

    # vLLM's container is append-only; its words
    def __setitem__(self, index: object, value: object) -> None:
        raise TypeError("Cannot set logprobs in FlatLogprobs")

    def __delitem__(self, index: object) -> None:
        raise TypeError("Cannot delete logprobs from FlatLogprobs")

    def insert(self, index: int, value: Position | None) -> None:
        raise TypeError("Cannot insert logprobs to FlatLogprobs")


def new_logprobs(flat: bool) -> list[Position] | FlatLogprobs:
    """An empty per-position container: FlatLogprobs where the request asked flat_logprobs, else a plain list."""
    return FlatLogprobs() if flat else []
