"""External storage: a user's key-value store holding whole rows, behind a caching table.

N keys in a call, W = D + S row width (embedding and optimizer state), K keys held.

A caching table (``TableConfig(caching=True, external_storage=store)``) keeps a write-back cache
of rows on its device and every row in ``store``; the store only ever sees CPU tensors. Two
implementations ship: :class:`InMemoryStorage` (the reference: rows in one growing tensor) and
:class:`DiskStorage` (rows in a memory-mapped file, the key -> slot map in memory). A user's
own store (a Python dict of key -> row is enough) plugs in by implementing the four methods.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class ExternalStorage(Protocol):
    """Rows of keys, held outside the table (the table's cache writes them back here).

    Every tensor is on the CPU. A store need not know the row width or dtype in advance: it
    holds what ``put`` gave it and returns it unchanged (same dtype, same values).
    """

    def get(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of keys (Tensor[int64]: [N], distinct) -> ``(rows, found)``: ``found``
        (Tensor[bool]: [N]) whether the store holds each key, ``rows`` (Tensor: [found.sum(), W])
        the found keys' rows, in the order of ``keys``, fresh tensors. A store that holds no
        row yet may answer ``rows`` = ``torch.empty(0, 0)``."""

    def put(self, keys: torch.Tensor, rows: torch.Tensor) -> None:
        """Store rows (Tensor: [N, W]) of keys (Tensor[int64]: [N], distinct), replacing any
        row a key had."""

    def delete(self, keys: torch.Tensor) -> None:
        """Remove keys (Tensor[int64]: [N], distinct); keys the store does not hold are ignored."""

    def items(self, chunk_size: int = 1 << 16) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Every key with its row, in chunks of at most ``chunk_size``: ``(keys [n], rows [n, W])``.
        The store must not change while the iterator runs."""


def _check_keys(keys: torch.Tensor, name: str = "keys") -> torch.Tensor:
    if not isinstance(keys, torch.Tensor) or keys.dtype != torch.int64 or keys.dim() != 1:
        raise ValueError(f"{name}={keys!r}: must be a 1-D int64 tensor")
    return keys.cpu()


def _check_chunk(chunk_size) -> None:
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size!r}: must be an int >= 1")


class _SlotRows:
    """Key -> slot map (a dict) over rows in a [slots, W] tensor with a free list; the row
    tensor comes from ``allocate(slots, W, dtype)`` and grows by doubling. The first ``put``
    fixes the width; a ``put`` of another dtype converts every row held to it (a caching
    table's ``.to(dtype)`` rewrites its rows so)."""

    def __init__(self, what: str):
        self.what = what
        self.slot_of: dict[int, int] = {}
        self.free: list[int] = []
        self.data: torch.Tensor | None = None

    def allocate(self, slots: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(slots, width, dtype=dtype)

    def grown(self, slots: int) -> torch.Tensor:
        """The row tensor with ``slots`` slots, holding the rows of the current one."""
        data = self.allocate(slots, self.data.shape[1], self.data.dtype)
        data[: self.data.shape[0]] = self.data
        return data

    def converted(self, dtype: torch.dtype) -> torch.Tensor:
        """The rows held, converted to ``dtype``."""
        data = self.allocate(self.data.shape[0], self.data.shape[1], dtype)
        data.copy_(self.data)
        return data

    def __len__(self) -> int:
        return len(self.slot_of)

    def get(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys = _check_keys(keys)
        slots = [self.slot_of.get(k, -1) for k in keys.tolist()]
        found = torch.tensor(slots, dtype=torch.int64) >= 0
        if self.data is None:
            return torch.empty(0, 0), found
        held = torch.tensor([s for s in slots if s >= 0], dtype=torch.int64)
        return self.data.index_select(0, held), found

    def put(self, keys: torch.Tensor, rows: torch.Tensor) -> None:
        keys = _check_keys(keys)
        if not isinstance(rows, torch.Tensor) or rows.dim() != 2 or rows.shape[0] != keys.numel():
            raise ValueError(f"rows: {getattr(rows, 'shape', rows)!r}, must be a [{keys.numel()}, W] tensor (one row per key)")
        if keys.numel() == 0:
            return
        if self.data is None:
            self.data = self.allocate(max(16, keys.numel()), rows.shape[1], rows.dtype)
        elif rows.shape[1] != self.data.shape[1]:
            raise ValueError(f"rows: [N, {rows.shape[1]}] {rows.dtype}; {self.what} holds rows of [{self.data.shape[1]}] {self.data.dtype}")
        elif rows.dtype != self.data.dtype:
            self.data = self.converted(rows.dtype)
        slots = []
        for k in keys.tolist():
            s = self.slot_of.get(k)
            if s is None:
                s = self.free.pop() if self.free else len(self.slot_of)
                self.slot_of[k] = s
            slots.append(s)
        need = max(slots) + 1
        if need > self.data.shape[0]:
            self.data = self.grown(max(need, 2 * self.data.shape[0]))
        self.data.index_copy_(0, torch.tensor(slots, dtype=torch.int64), rows.detach().cpu())

    def delete(self, keys: torch.Tensor) -> None:
        for k in _check_keys(keys).tolist():
            s = self.slot_of.pop(k, None)
            if s is not None:
                self.free.append(s)

    def items(self, chunk_size: int = 1 << 16) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        _check_chunk(chunk_size)
        pairs = list(self.slot_of.items())
        for lo in range(0, len(pairs), chunk_size):
            part = pairs[lo : lo + chunk_size]
            keys = torch.tensor([k for k, _ in part], dtype=torch.int64)
            slots = torch.tensor([s for _, s in part], dtype=torch.int64)
            yield keys, self.data.index_select(0, slots)


class InMemoryStorage(_SlotRows):
    """The reference :class:`ExternalStorage`: rows in one CPU tensor that grows by doubling,
    keys in a dict (about 100 bytes of Python objects per key)."""

    def __init__(self):
        super().__init__("this InMemoryStorage")

    def __repr__(self) -> str:
        return f"InMemoryStorage(keys={len(self)})"


class DiskStorage(_SlotRows):
    """:class:`ExternalStorage` over a memory-mapped row file in directory ``path``.

    Rows live in one file (``rows-*.bin``, a new name per store, removed by :meth:`close`);
    the key -> slot map and the free list stay in memory (about 100 bytes of Python objects per
    key). The file is scratch space, like a cache: it is not reopened after a restart (a
    table's checkpoint is its durable state). The first ``put`` fixes the width.

    Args:
        path: a directory (created if missing).
    """

    def __init__(self, path: str | os.PathLike):
        super().__init__("this DiskStorage")
        try:
            self.path = Path(path)
            self.path.mkdir(parents=True, exist_ok=True)
        except (TypeError, OSError) as e:
            raise ValueError(f"path={path!r}: cannot use it as a directory ({e})") from None
        self.file = self.new_file()

    def allocate(self, slots: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = slots * width * torch.empty(0, dtype=dtype).element_size()
        os.truncate(self.file, nbytes)
        # shared=True maps the file itself: writes to the tensor go to the file (page cache).
        return torch.from_file(str(self.file), shared=True, size=slots * width, dtype=dtype).view(slots, width)

    def grown(self, slots: int) -> torch.Tensor:
        # Lengthening the file keeps its rows: map it again, nothing to copy.
        return self.allocate(slots, self.data.shape[1], self.data.dtype)

    def converted(self, dtype: torch.dtype) -> torch.Tensor:
        # Into a new file: the old one is read while the new one is written.
        old = self.file
        self.file = self.new_file()
        data = super().converted(dtype)
        old.unlink()
        return data

    def new_file(self) -> Path:
        fd, name = tempfile.mkstemp(prefix="rows-", suffix=".bin", dir=self.path)
        os.close(fd)
        return Path(name)

    def close(self) -> None:
        """Drop the mapping and remove the row file (the store is empty afterwards)."""
        self.data = None
        self.slot_of.clear()
        self.free.clear()
        self.file.unlink(missing_ok=True)

    def __deepcopy__(self, memo):
        raise TypeError("a DiskStorage maps one file and cannot be copied; build another DiskStorage")

    def __getstate__(self):
        raise TypeError("a DiskStorage maps one file and cannot be pickled; build another DiskStorage")

    def __repr__(self) -> str:
        return f"DiskStorage({str(self.path)!r}, keys={len(self)})"
