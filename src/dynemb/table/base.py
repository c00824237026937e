"""Contract of the key index: key -> row id, with a score per key.

Shape legend: N keys in a call (duplicates allowed unless said), U unique keys, E keys that left
the index in the call, F failed keys, K keys held.

Every int64 is a valid key; emptiness is tracked apart from the key bits. Batch operations first
de-duplicate their keys, so results never depend on the order of keys in a batch. Scores are
int64; what they mean is set by :class:`dynemb.ScoreStrategy`. The index owns the row ids (its
own free list over ``[0, capacity())``); it never touches row contents and never reads wall
time: callers pass the clock as ``now``. It applies no policy either: failed keys are returned,
never raised (the module layer applies the check mode).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Protocol, runtime_checkable

import torch


@dataclasses.dataclass(frozen=True)
class IndexResult:
    """Outcome of an index call over N keys; the one result type of every mutating call.

    Attributes:
        positions (Tensor[int64]): [N] flat slot of each key after the call, -1 where absent.
        rows (Tensor[int64]): [N] row id of each key, -1 where absent (failed, or erased).
        found (Tensor[bool]): [N] the key was in the index before the call.
        inserted (Tensor[bool]): [N] the key was newly placed by this call.
        evicted_keys (Tensor[int64]): [E] keys that left the index in this call (evicted to make
            room, or erased), each once.
        evicted_rows (Tensor[int64]): [E] their former row ids. After an eviction the row id
            belongs to a newly inserted key; after an erase it is back on the free list. Either
            way its content is unchanged until the caller writes it: read it first.
        evicted_scores (Tensor[int64]): [E] their scores when they left.
        failed_keys (Tensor[int64]): [F] unique keys that could not be placed.
        evicted_segments, failed_segments (Tensor[int64] | None): [E] and [F] segment of each
            evicted and failed key (segmented indexes only, else None).
    """

    positions: torch.Tensor
    rows: torch.Tensor
    found: torch.Tensor
    inserted: torch.Tensor
    evicted_keys: torch.Tensor
    evicted_rows: torch.Tensor
    evicted_scores: torch.Tensor
    failed_keys: torch.Tensor
    evicted_segments: torch.Tensor | None = None
    failed_segments: torch.Tensor | None = None

    @property
    def ok(self) -> torch.Tensor:
        """Tensor[bool]: [N] the key is in the index after the call."""
        return self.rows >= 0


@runtime_checkable
class Index(Protocol):
    """What the layers above rely on from a key index (implemented by :class:`KeyIndex`).

    An index is a list of segments (a collection group's tables, each with its own bucket
    range, capacity, scores, eviction and growth); a plain table's index has one. Every call
    that takes keys takes ``segments`` (Tensor[int64] of the keys' shape, the segment of each
    key): required with several segments, optional (None) with one (docs/design/0025).
    """

    def size(self) -> int:
        """K, keys held."""

    def capacity(self) -> int:
        """Most keys the index can hold (the requested capacity rounded up, at most 2x)."""

    def find(self, keys: torch.Tensor, *, segments: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Row ids without side effects: keys (Tensor[int64]) [*] -> rows [*] (-1 absent), found [*]."""

    def scores(self, keys: torch.Tensor, *, segments: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores without side effects: keys [*] -> scores [*] (0 absent), found [*]."""

    def upsert_unique(
        self,
        unique: torch.Tensor,
        counts: torch.Tensor,
        *,
        now: int | None = None,
        given: torch.Tensor | None = None,
        segments: torch.Tensor | None = None,
    ) -> IndexResult:
        """Find U distinct (segment, key) pairs, sorted by segment then key, and insert the missing ones, evicting where full.

        Args:
            unique (Tensor[int64]): [U] distinct keys, sorted ascending.
            counts (Tensor[int64]): [U] occurrences of each in the batch (the lfu score).
            now: the clock (timestamp or step) for the ``timestamp``, ``step`` and
                ``no_eviction`` strategies; required by them.
            given (Tensor[int64] | None): [U] scores to assign (``customized``; any strategy).
        """

    def find_or_insert(
        self, keys: torch.Tensor, *, now: int | None = None, scores: torch.Tensor | None = None, segments: torch.Tensor | None = None
    ) -> IndexResult:
        """:meth:`upsert_unique` on keys [N] with duplicates; the result is over the N keys."""

    def erase(self, keys: torch.Tensor, *, segments: torch.Tensor | None = None) -> IndexResult:
        """Remove keys [N] (duplicates allowed); their row ids go back to the free list."""

    def export(self, chunk_size: int = 1 << 16) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(keys, rows, scores), each Tensor[int64] [K'], over every held key, in slot order."""

    def export_segment(self, segment: int, chunk_size: int = 1 << 16) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(keys, rows, scores) of one segment's keys, as :meth:`export`."""

    def export_slots(self, chunk_size: int = 1 << 16, *, segment: int | None = None) -> Iterator[tuple[torch.Tensor, ...]]:
        """(keys, rows, scores, slots) in slot order (slots: each key's flat slot), one segment
        or all: what a checkpoint saves as the layout an exact load restores."""

    def locate(self, keys: torch.Tensor, segments: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat slot [N] of each key (-1 absent) and found [N]."""

    def counters(self, segment: int | None = None) -> list[int]:
        """The whole index's inserts, evictions, failed_inserts, growths; or one segment's
        inserts, evictions, failed_inserts, erased."""

    def set_counters(self, values: list[int], segment: int | None = None) -> None:
        """Restore :meth:`counters` (a load)."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole index as plain tensors (slots, row ids, free list, counters)."""

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore a :meth:`state_dict` of the same geometry; ValueError (nothing changed) else."""
