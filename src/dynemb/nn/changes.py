"""Which rows changed and which keys left since a point in time: what a checkpoint delta writes.

R rows of the store, n rows or keys in a call.

An engine holds a :class:`ChangeLog` once something asked it to track changes (a checkpoint
save or load calls ``engine.track_changes()``; a sharded engine's is its local engine's); without
one, tracking costs nothing. Rows are marked when a training lookup touches their
key (its score changes), an update writes them or an insert assigns them; keys are recorded when
they leave (evicted or erased). Positions in the index do not matter: checkpoints store keys.
"""

from __future__ import annotations

import torch


class ChangeLog:
    """Rows touched and keys that left since the last :meth:`reset`.

    Args:
        rows: R, every row id the engine's index can hand out (``index.capacity()``).
        device: of the store.
    """

    def __init__(self, rows: int, device: torch.device):
        with torch.inference_mode(False):
            self.dirty = torch.zeros(rows, dtype=torch.bool, device=device)
        self._left: list[tuple[torch.Tensor, torch.Tensor | None]] = []

    def touch(self, rows: torch.Tensor) -> None:
        """Mark row ids ([n] int64 below R, -1 ignored) as changed."""
        rows = rows[rows >= 0]
        if rows.numel():
            with torch.inference_mode(False):
                self.dirty.index_fill_(0, rows, True)

    def left(self, keys: torch.Tensor, segments: torch.Tensor | None = None) -> None:
        """Record keys ([n] int64; with their segments in a group) that left the table."""
        if keys.numel():
            self._left.append((keys.clone(), None if segments is None else segments.clone()))

    def left_keys(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every key recorded by :meth:`left` ([m], duplicates possible) and their segments."""
        if not self._left:
            return torch.empty(0, dtype=torch.int64, device=self.dirty.device), None
        keys = torch.cat([k for k, _ in self._left])
        segs = None if self._left[0][1] is None else torch.cat([s for _, s in self._left])
        return keys, segs

    def reset(self) -> None:
        with torch.inference_mode(False):
            self.dirty.zero_()
        self._left = []

    def to(self, device: torch.device) -> None:
        with torch.inference_mode(False):
            self.dirty = self.dirty.to(device)
        self._left = [(k.to(device), None if s is None else s.to(device)) for k, s in self._left]
