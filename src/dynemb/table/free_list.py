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

    ``high_water`` is one past the largest id ever handed out: a row store must address
    ``[0, high_water)``.
    """

    def __init__(self, capacity: int, device: torch.device | str = "cpu"):
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"capacity={capacity!r}: must be an int >= 1")
        self.capacity = capacity
        self.device = torch.device(device)
        self.high_water = 0
        self._stack = self._new_stack(0)
        self._top = 0

    def _new_stack(self, n: int) -> torch.Tensor:
        # Kept across calls: never an inference tensor, even when made under inference mode.
        with torch.inference_mode(False):
            return torch.empty(n, dtype=torch.int64, device=self.device)

    def num_free(self) -> int:
        """Ids not in use."""
        return self.capacity - self.high_water + self._top

    def num_used(self) -> int:
        """Ids handed out and not released."""
        return self.high_water - self._top

    def reusable(self) -> torch.Tensor:
        """The released ids the next allocations reuse, from the end (Tensor[int64]: [k], a view
        valid until the next ``allocate`` or ``release``); ids past them are fresh, from
        ``high_water`` up. For a kernel that hands out ids as ``allocate`` would."""
        return self._stack[: self._top]

    def reusable_stack(self) -> tuple[torch.Tensor, int]:
        """:meth:`reusable` as (the stack, k): its first k entries are the reusable ids (no view
        made: for a kernel called right after another, where each tensor operation is costly)."""
        return self._stack, self._top

    def allocate(self, n: int, *, borrow: bool = False) -> torch.Tensor:
        """``n`` distinct free ids (Tensor[int64]: [n]); raises if fewer are free. ``borrow``:
        reused ids may come as a view of the stack, valid until the next ``release`` (for a
        caller that copies them at once: no fresh [n] tensor)."""
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
        return ids.clone() if reused and not fresh and not borrow else ids

    def take(self, n: int) -> None:
        """Hand out ``n`` ids as ``allocate(n)`` would, without making them: for a kernel that
        wrote them itself from :meth:`reusable` and ``high_water`` (no tensor per call)."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"n={n!r}: must be an int >= 0")
        if n > self.num_free():
            raise RuntimeError(f"free list: asked for {n} rows, {self.num_free()} free of {self.capacity}")
        reused = min(n, self._top)
        self._top -= reused
        self.high_water += n - reused

    def release(self, rows: torch.Tensor) -> None:
        """Take back distinct ids (Tensor[int64]: [n]) that were handed out."""
        n = rows.numel()
        if n == 0:
            return
        with torch.inference_mode(False):
            if self._top + n > self._stack.numel():
                grown = self._new_stack(max(2 * self._stack.numel(), self._top + n, 1024))
                grown[: self._top] = self._stack[: self._top]
                self._stack = grown
            self._stack[self._top : self._top + n] = rows.reshape(-1)
        self._top += n

    def state(self) -> dict[str, torch.Tensor | int]:
        """What a checkpoint needs to restore the free list: ``high_water`` (int) and ``free``
        (Tensor[int64]: [n], released ids from first to last released)."""
        return {"high_water": self.high_water, "free": self._stack[: self._top].clone()}

    def check_state(self, high_water: int, free: torch.Tensor) -> None:
        """Raise ValueError unless (high_water, free) is a valid state of this free list."""
        if not isinstance(high_water, int) or isinstance(high_water, bool) or not 0 <= high_water <= self.capacity:
            raise ValueError(f"free list high_water={high_water!r}: must be an int in [0, {self.capacity}]")
        if not isinstance(free, torch.Tensor) or free.dtype != torch.int64 or free.dim() != 1:
            raise ValueError(f"free list free: must be a 1-d int64 tensor, got {_describe(free)}")
        if free.numel() > high_water:
            raise ValueError(f"free list free: {free.numel()} ids released but only {high_water} handed out")
        if free.numel():
            if not bool(((free >= 0) & (free < high_water)).all()):
                raise ValueError(f"free list free: ids must lie in [0, high_water={high_water})")
            if torch.unique(free).numel() != free.numel():
                raise ValueError("free list free: ids must be distinct")

    def load_state(self, high_water: int, free: torch.Tensor) -> None:
        """Restore :meth:`state` (validated first; a bad state raises ValueError and changes nothing)."""
        self.check_state(high_water, free)
        stack = self._new_stack(max(free.numel(), 1024 if free.numel() else 0))
        with torch.inference_mode(False):
            stack[: free.numel()] = free
        self._stack, self._top, self.high_water = stack, free.numel(), high_water

    def to(self, device: torch.device | str) -> FreeList:
        """Move the released ids to ``device``; ids are returned there from now on."""
        self.device = torch.device(device)
        with torch.inference_mode(False):
            self._stack = self._stack.to(self.device)
        return self


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"{x.dtype} tensor of shape {tuple(x.shape)}"
    return type(x).__name__
