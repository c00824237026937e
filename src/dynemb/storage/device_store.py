"""Row store in one tensor on the table's device (cpu or cuda).

n rows in a call, D + S row width, C capacity.
"""

from __future__ import annotations

import torch

from dynemb.table.free_list import FreeList


class DeviceRowStore:
    """Rows ``[embedding | optimizer state]`` in a [R, D + S] tensor that grows (by doubling,
    copying rows) as the free list's high-water mark rises, up to C rows. Row ids never change.

    Args:
        width: D + S, columns per row.
        capacity: C, most rows.
        dtype, device: of the rows.
        init_rows: rows allocated at creation (default ``capacity``).
    """

    def __init__(self, width: int, capacity: int, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", init_rows: int | None = None):
        if not isinstance(width, int) or width < 1:
            raise ValueError(f"width={width!r}: must be an int >= 1")
        self.width = width
        self.capacity = capacity
        self.device = torch.device(device)
        self.dtype = dtype
        self.free_list = FreeList(capacity, self.device)
        rows = capacity if init_rows is None else max(1, min(init_rows, capacity))
        self.data = torch.empty(rows, width, dtype=dtype, device=self.device)

    def allocate(self, n: int) -> torch.Tensor:
        ids = self.free_list.allocate(n)
        if self.free_list.high_water > self.data.shape[0]:
            self._grow(self.free_list.high_water)
        return ids

    def release(self, rows: torch.Tensor) -> None:
        self.free_list.release(rows)

    def num_free(self) -> int:
        return self.free_list.num_free()

    def _grow(self, needed: int) -> None:
        rows = self.data.shape[0]
        while rows < needed:
            rows *= 2
        rows = min(rows, self.capacity)
        grown = torch.empty(rows, self.width, dtype=self.dtype, device=self.device)
        grown[: self.data.shape[0]] = self.data
        self.data = grown

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """Copy of rows (Tensor[int64]: [n]) -> [n, D + S]."""
        return self.data.index_select(0, rows)

    def scatter(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Write values [n, k] into the first k columns of distinct rows [n]."""
        if values.shape[1] == self.width:
            self.data.index_copy_(0, rows, values)
        else:
            self.data[:, : values.shape[1]].index_copy_(0, rows, values)
