"""Free list of row ids: a high-water mark plus a stack of released ids.

n row ids per call, C capacity.
"""

from __future__ import annotations

import torch


class FreeList:
    """Row ids in [0, capacity); reuses released ids (last released, first reused) before new ones.

    Args:
        capacity: C, number of row ids.
        device: where the returned id tensors live.
    """

    def __init__(self, capacity: int, device: torch.device | str = "cpu"):
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity={capacity!r}: must be an int >= 1")
        self.capacity = capacity
        self.device = torch.device(device)
        self.high_water = 0
        self._stack = torch.empty(0, dtype=torch.int64, device=self.device)
        self._top = 0

    def num_free(self) -> int:
        """Ids not in use."""
        return self.capacity - self.high_water + self._top

    def num_used(self) -> int:
        """Ids handed out and not released."""
        return self.high_water - self._top

    def allocate(self, n: int) -> torch.Tensor:
        """``n`` distinct free ids (Tensor[int64]: [n]); raises if fewer are free."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"n={n!r}: must be an int >= 0")
        if n > self.num_free():
            raise RuntimeError(f"free list: asked for {n} rows, {self.num_free()} free of {self.capacity}")
        reused = min(n, self._top)
        ids = self._stack[self._top - reused : self._top]
        self._top -= reused
        fresh = n - reused
        if fresh:
            new = torch.arange(self.high_water, self.high_water + fresh, dtype=torch.int64, device=self.device)
            self.high_water += fresh
            ids = torch.cat([ids, new]) if reused else new
        return ids.clone() if reused and not fresh else ids

    def release(self, rows: torch.Tensor) -> None:
        """Take back distinct ids (Tensor[int64]: [n]) that were handed out."""
        n = rows.numel()
        if n == 0:
            return
        if self._top + n > self._stack.numel():
            grown = torch.empty(max(2 * self._stack.numel(), self._top + n, 1024), dtype=torch.int64, device=self.device)
            grown[: self._top] = self._stack[: self._top]
            self._stack = grown
        self._stack[self._top : self._top + n] = rows.reshape(-1)
        self._top += n

    def state(self) -> dict[str, torch.Tensor | int]:
        """What a checkpoint needs to restore the free list."""
        return {"high_water": self.high_water, "free": self._stack[: self._top].clone()}
