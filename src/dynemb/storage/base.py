"""Contract of a row store: plain rows ``[embedding | optimizer state]`` addressed by row id.

n rows in a call, D embedding columns, S optimizer state columns, C capacity in rows.

A store does not know keys, and does not hand out row ids: the key index owns them. A table
accepts any object that satisfies :class:`RowStore`, so host or disk tiers can plug in; the
optional extensions below are detected with isinstance.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class RowStore(Protocol):
    """Rows of one table."""

    width: int  # D + S
    capacity: int  # C: row ids are in [0, C)
    dtype: torch.dtype
    device: torch.device  # where gather returns rows and scatter takes them

    def reserve(self, n: int) -> None:
        """Make row ids [0, n) addressable (n <= C); rows not yet written have undefined content."""

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """Copy of rows (Tensor[int64]: [n], valid ids) -> Tensor: [n, D + S], a fresh tensor."""

    def scatter(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Write values (Tensor: [n, D + S], or [n, k] for the first k columns) into distinct rows [n]."""

    def to(self, device: torch.device, dtype: torch.dtype) -> RowStore:
        """The same rows on another device and / or dtype (may be ``self``, converted in place)."""

    def nbytes(self) -> int:
        """Bytes of row memory held now."""


@runtime_checkable
class KeyedRowStore(Protocol):
    """Optional extension of a RowStore that needs each row's key (a caching store writes rows
    back to an external store by key). The engine calls it whenever a row id changes hands."""

    def bind(self, rows: torch.Tensor, keys: torch.Tensor) -> None:
        """Rows (Tensor[int64]: [n], distinct) were just given to keys (Tensor[int64]: [n]);
        their content is undefined until written."""

    def release(self, rows: torch.Tensor) -> None:
        """Rows (Tensor[int64]: [n], distinct) lost their keys (evicted or erased), after the
        caller read what it needed of them."""


@runtime_checkable
class FlushableStore(Protocol):
    """Optional extension of a RowStore that holds rows in a faster layer than their home."""

    def flush(self) -> None:
        """Write every row changed in the faster layer back to its home."""


@runtime_checkable
class Touchable(Protocol):
    """A store that places rows by heat (tiers): the engine tells it the scores of rows used."""

    def touch(self, rows: torch.Tensor, scores: torch.Tensor) -> None:
        """The index's scores (Tensor[int64]: [n]) of distinct rows [n] just resolved."""


@runtime_checkable
class TierStats(Protocol):
    """A store with tiers: ``stats()["tiers"]`` shows its figures."""

    def tier_stats(self) -> list[dict]:
        """One dict per tier, fastest first: kind, rows, capacity, hits, misses, promotions,
        demotions, bytes."""
