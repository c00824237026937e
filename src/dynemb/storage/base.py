"""Contract of a row store: rows ``[embedding | optimizer state]`` addressed by row id.

n rows in a call, D embedding columns, S optimizer state columns, C capacity in rows.
A store also hands out row ids (it is the index's :class:`dynemb.table.base.RowAllocator`).
"""

from __future__ import annotations

from typing import Protocol

import torch


class RowStore(Protocol):
    """Rows of one table on one device."""

    width: int  # D + S
    capacity: int  # C: row ids are in [0, C)

    def allocate(self, n: int) -> torch.Tensor:
        """``n`` free row ids (Tensor[int64]: [n]); their content is undefined until written."""

    def release(self, rows: torch.Tensor) -> None:
        """Free row ids (Tensor[int64]: [n], distinct)."""

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """Copy of rows (Tensor[int64]: [n], valid ids) -> Tensor: [n, D + S]."""

    def scatter(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Write values (Tensor: [n, D + S] or [n, k] for the first k columns) into distinct rows [n]."""

    def num_free(self) -> int:
        """Row ids not in use."""
