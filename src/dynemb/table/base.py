"""Contract of the key index: key -> row id, with a score per key.

Shape legend: N keys in a batch (duplicates allowed), U unique keys, E evicted keys, F failed keys.

Every int64 is a valid key; emptiness is tracked apart from the key bits. Batch operations first
de-duplicate their keys, so results never depend on the order of keys in a batch. Scores are
int64; what they mean is set by :class:`dynemb.ScoreStrategy`.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch


class RowAllocator(Protocol):
    """Hands out row ids for new keys and takes back those of erased keys."""

    def allocate(self, n: int) -> torch.Tensor:
        """Return ``n`` distinct free row ids (Tensor[int64]: [n]) now owned by the caller."""

    def release(self, rows: torch.Tensor) -> None:
        """Return row ids (Tensor[int64]: [n], distinct) to the free list."""


@dataclasses.dataclass(frozen=True)
class InsertResult:
    """Outcome of :meth:`KeyIndex.insert_and_evict` for a batch of N keys.

    Attributes:
        rows (Tensor[int64]): [N] row id of each key, -1 where the key failed.
        found (Tensor[bool]): [N] the key was in the index before the call.
        ok (Tensor[bool]): [N] the key is in the index after the call (found or inserted).
        evicted_keys (Tensor[int64]): [E] keys evicted to make room, each once.
        evicted_rows (Tensor[int64]): [E] their former row ids; each now belongs to one of the
            newly inserted keys, so read an evicted row's content before overwriting it.
        evicted_scores (Tensor[int64]): [E] their scores when evicted.
        failed_keys (Tensor[int64]): [F] unique keys that could not be placed.
    """

    rows: torch.Tensor
    found: torch.Tensor
    ok: torch.Tensor
    evicted_keys: torch.Tensor
    evicted_rows: torch.Tensor
    evicted_scores: torch.Tensor
    failed_keys: torch.Tensor

    @property
    def inserted(self) -> torch.Tensor:
        """Tensor[bool]: [N] the key was newly inserted by this call."""
        return self.ok & ~self.found
