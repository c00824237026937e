"""Row store in one tensor on the table's device (cpu or cuda).

n rows in a call, D + S row width, C capacity.
"""

from __future__ import annotations

import torch

from dynemb.config import ROW_DTYPES, resolve_device
from dynemb.workspace import Recycler, empty


class DeviceRowStore:
    """Rows ``[embedding | optimizer state]`` in an [R, D + S] tensor that grows (by doubling,
    copying rows) when more row ids are reserved, up to C rows. Row ids never change.

    Args:
        width: D + S, columns per row.
        capacity: C, most rows.
        dtype, device: of the rows.
        init_rows: rows allocated at creation (default ``capacity``).
    """

    def __init__(self, width: int, capacity: int, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", init_rows: int | None = None):
        for name, value in (("width", width), ("capacity", capacity)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r}: must be an int >= 1")
        if dtype not in ROW_DTYPES:
            raise ValueError(f"dtype={dtype}: rows must be one of {', '.join(str(d) for d in ROW_DTYPES)}")
        self.width = width
        self.capacity = capacity
        self.device = resolve_device(device)
        self.dtype = dtype
        rows = capacity if init_rows is None else max(1, min(init_rows, capacity))
        self.data = empty((rows, width), dtype=dtype, device=self.device)

    def reserve(self, n: int) -> None:
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"n={n!r}: must be an int >= 0")
        if n > self.data.shape[0]:
            if n > self.capacity:
                raise ValueError(f"n={n}: more rows than the store's capacity {self.capacity}")
            rows = self.data.shape[0]
            while rows < n:
                rows *= 2
            grown = empty((min(rows, self.capacity), self.width), dtype=self.dtype, device=self.device)
            with torch.inference_mode(False):
                grown[: self.data.shape[0]] = self.data
            self.data = grown

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cpu":
            return self.data.index_select(0, rows)
        # On CPU into a recycled block: a fresh [n, D+S] page-faults on every call, and the
        # block is reused only once nothing can read the last result (dynemb.workspace.Recycler).
        recycler = self.__dict__.get("_recycler")
        if recycler is None:
            recycler = self._recycler = Recycler()
        out = recycler.get("gather", (rows.numel(), self.width), self.dtype, self.device)
        return torch.index_select(self.data, 0, rows, out=out)

    def __getstate__(self) -> dict:
        # A copy (or pickle) never shares, or carries, the recycled output memory.
        state = self.__dict__.copy()
        state.pop("_recycler", None)
        return state

    def scatter(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        if values.dim() != 2 or values.shape[1] > self.width or values.dtype != self.dtype:
            raise ValueError(
                f"values: [{values.shape[0]}, {values.shape[1] if values.dim() == 2 else '?'}] {values.dtype}, must be [n, <= {self.width}] {self.dtype}"
            )
        if self.device.type == "cpu" and rows.numel():
            # index_copy_ would write the rows before a bad id; on CPU the check costs one pass
            # (on CUDA it would cost a host sync, and the kernel's own assert stops the process).
            low, high = (int(v) for v in torch.aminmax(rows))
            if low < 0 or high >= self.data.shape[0]:
                raise IndexError(f"rows: ids must lie in [0, {self.data.shape[0]}) (reserved rows), got [{low}, {high}]")
        with torch.inference_mode(False):
            if values.shape[1] == self.width:
                self.data.index_copy_(0, rows, values)
            else:
                self.data[:, : values.shape[1]].index_copy_(0, rows, values)

    def to(self, device: torch.device, dtype: torch.dtype) -> DeviceRowStore:
        with torch.inference_mode(False):
            self.data = self.data.to(device=device, dtype=dtype)
        self.device, self.dtype = torch.device(device), dtype
        return self

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()
