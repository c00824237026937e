"""Caching mode: a write-back cache of rows on the table's device over an external store.

n rows in a call, m rows missing from the cache, W = D + S row width, R row ids reserved
(R <= C, the capacity), M cache rows (slots).

Every row lives in the external store (:class:`dynemb.storage.ExternalStorage`), under its key;
the M rows used most recently also live in a cache tensor [M, W] on the table's device, where
they are read and written. A row written in the cache is dirty until it is written back: when
its slot is taken by another row, or at :meth:`CachingRowStore.flush`. Rows move whole and
unchanged (same dtype), so a caching table computes bitwise what an in-memory one does.

The engine tells the store which key each row id serves (:meth:`CachingRowStore.bind`) and
which keys left (:meth:`CachingRowStore.release`: evicted or erased, deleted from the store).
"""

from __future__ import annotations

import torch

from dynemb.config import ROW_DTYPES, resolve_device
from dynemb.storage.base import KeyedRowStore
from dynemb.storage.external import ExternalStorage
from dynemb.table.index import KeyIndex
from dynemb.workspace import empty, poison_


class CachingRowStore:
    """RowStore of C row ids whose rows live in ``external``, the most recently used M of them
    in a cache on ``device``.

    Per reserved row id it keeps the key (int64), whether a key is bound and whether the
    external store holds that key's row (18 bytes a row id, on ``device``); per slot the row id,
    a dirty flag and the clock of its last use. A call first pins the slots it uses (they are
    not taken by its own misses); a miss takes a free slot, else the least recently used one
    (writing it back when dirty). Misses beyond the free and unpinned slots of a call are read
    from, or written through to, the external store without being cached.

    Args:
        width: W, columns per row.
        capacity: C, most row ids (the table's keys).
        external: the :class:`dynemb.storage.ExternalStorage` holding every row.
        cache_rows: M, rows cached on ``device``.
        dtype, device: of the rows.
    """

    def __init__(
        self, width: int, capacity: int, external: ExternalStorage, *, cache_rows: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ):
        for name, value in (("width", width), ("capacity", capacity), ("cache_rows", cache_rows)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r}: must be an int >= 1")
        if not isinstance(external, ExternalStorage):
            raise ValueError(f"external={external!r}: must implement dynemb.storage.ExternalStorage (get, put, delete, items)")
        if dtype not in ROW_DTYPES:
            raise ValueError(f"dtype={dtype}: rows must be one of {', '.join(str(d) for d in ROW_DTYPES)}")
        self.width, self.capacity, self.dtype = width, capacity, dtype
        self.device = dev = resolve_device(device)
        self.external = external
        M = self.cache_rows = min(cache_rows, capacity)
        with torch.inference_mode(False):
            self.cache = empty((M, width), dtype=dtype, device=dev)
            self.slot_row = torch.full((M,), -1, dtype=torch.int64, device=dev)
            self.dirty = torch.zeros(M, dtype=torch.bool, device=dev)
            self.used = torch.zeros(M, dtype=torch.int64, device=dev)
            self.row_slot = torch.full((1,), -1, dtype=torch.int64, device=dev)
            self.row_key = torch.zeros(1, dtype=torch.int64, device=dev)
            self.row_bound = torch.zeros(1, dtype=torch.bool, device=dev)
            self.row_stored = torch.zeros(1, dtype=torch.bool, device=dev)
        self.clock = 0
        self.hits = self.misses = self.fetched = self.written = 0

    def reserve(self, n: int) -> None:
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"n={n!r}: must be an int >= 0")
        R = self.row_slot.shape[0]
        if n <= R:
            return
        if n > self.capacity:
            raise ValueError(f"n={n}: more rows than the store's capacity {self.capacity}")
        while R < n:
            R *= 2
        R = min(R, self.capacity)
        with torch.inference_mode(False):
            for name, fill in (("row_slot", -1), ("row_key", 0), ("row_bound", False), ("row_stored", False)):
                old = getattr(self, name)
                grown = torch.full((R,), fill, dtype=old.dtype, device=self.device)
                grown[: old.shape[0]] = old
                setattr(self, name, grown)

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode(False):
            self.clock += 1
            slots = self.row_slot.index_select(0, rows)
            hit = slots >= 0
            # One host sync per call: misses go to the external store on the CPU anyway.
            n_hit = int(hit.sum())
            self.hits += n_hit
            self.misses += rows.numel() - n_hit
            if n_hit == rows.numel():
                self.used.index_fill_(0, slots, self.clock)
                return self.cache.index_select(0, slots)
            out = torch.empty(rows.numel(), self.width, dtype=self.dtype, device=self.device)
            hsel, msel = hit.nonzero().squeeze(1), (~hit).nonzero().squeeze(1)
            hit_slots = slots.index_select(0, hsel)
            out.index_copy_(0, hsel, self.cache.index_select(0, hit_slots))
            self.used.index_fill_(0, hit_slots, self.clock)
            missing, inverse = torch.unique(rows.index_select(0, msel), return_inverse=True)
            values = self._fetch(missing)  # [m, W]
            self._admit(missing, values, dirty=False)
            out.index_copy_(0, msel, values.index_select(0, inverse))
            return out

    def scatter(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        if values.dim() != 2 or values.shape[1] > self.width or values.dtype != self.dtype:
            raise ValueError(
                f"values: [{values.shape[0]}, {values.shape[1] if values.dim() == 2 else '?'}] {values.dtype}, must be [n, <= {self.width}] {self.dtype}"
            )
        with torch.inference_mode(False):
            values = values.detach()
            self.clock += 1
            k = values.shape[1]
            slots = self.row_slot.index_select(0, rows)
            hit = slots >= 0
            hsel = hit.nonzero().squeeze(1)
            hit_slots = slots.index_select(0, hsel)
            self.cache[:, :k].index_copy_(0, hit_slots, values.index_select(0, hsel))
            self.dirty.index_fill_(0, hit_slots, True)
            self.used.index_fill_(0, hit_slots, self.clock)
            if hsel.numel() == rows.numel():
                return
            msel = (~hit).nonzero().squeeze(1)
            missing = rows.index_select(0, msel)
            full = values.index_select(0, msel)
            if k < self.width:
                # The other columns are the row's own: read it first.
                full = self._fetch(missing)
                full[:, :k] = values.index_select(0, msel)
            cached = self._admit(missing, full, dirty=True)
            if cached < missing.numel():
                # No slot left in this call: write the rest through to the external store.
                self._put(missing[cached:], full[cached:])

    def bind(self, rows: torch.Tensor, keys: torch.Tensor) -> None:
        """Rows (Tensor[int64]: [n], distinct) now serve keys (Tensor[int64]: [n]); their content
        is undefined until written. A key a row served before leaves the external store."""
        with torch.inference_mode(False):
            bound = self.row_bound.index_select(0, rows)
            old = self.row_key.index_select(0, rows)
            other = bound & (old != keys)
            if bool(other.any()):
                self.external.delete(old[other].cpu())
            same = bound & ~other
            self.row_stored.index_copy_(0, rows, self.row_stored.index_select(0, rows) & same)
            self._uncache(rows)
            self.row_key.index_copy_(0, rows, keys)
            self.row_bound.index_fill_(0, rows, True)

    def release(self, rows: torch.Tensor) -> None:
        """Rows (Tensor[int64]: [n], distinct) no longer serve their keys (evicted or erased):
        the keys leave the external store, the rows' cached copies are dropped."""
        with torch.inference_mode(False):
            bound = self.row_bound.index_select(0, rows)
            if bool(bound.any()):
                self.external.delete(self.row_key.index_select(0, rows)[bound].cpu())
            self._uncache(rows)
            self.row_bound.index_fill_(0, rows, False)
            self.row_stored.index_fill_(0, rows, False)

    def flush(self) -> None:
        """Write every dirty cached row back to the external store."""
        with torch.inference_mode(False):
            slots = (self.dirty & (self.slot_row >= 0)).nonzero().squeeze(1)
            if slots.numel():
                self._put(self.slot_row.index_select(0, slots), self.cache.index_select(0, slots))
                self.dirty.index_fill_(0, slots, False)

    def bound_keys(self) -> torch.Tensor:
        """Keys (Tensor[int64]: [K]) that rows serve now."""
        return self.row_key[self.row_bound]

    def retire(self, successor, holds) -> None:
        """``successor`` (a store) replaces this one: keys that ``holds(keys [K]) -> [K] bool``
        says the successor's table lacks leave the external store, when both share it."""
        if isinstance(successor, CachingRowStore) and successor.external is self.external:
            keys = self.bound_keys()
            gone = keys[~holds(keys)]
            if gone.numel():
                self.external.delete(gone.cpu())

    def cache_stats(self) -> dict[str, int | float]:
        """rows (cached now), capacity (M), hits and misses (row reads served by the cache or
        not), hit_rate, fetched (rows read from the external store), written (rows written back
        or through), dirty (cached rows not yet written back), bytes (device memory held)."""
        reads = self.hits + self.misses
        return {
            "rows": int((self.slot_row >= 0).sum()),
            "capacity": self.cache_rows,
            "hits": self.hits,
            "misses": self.misses,
            "hit_rate": self.hits / reads if reads else 0.0,
            "fetched": self.fetched,
            "written": self.written,
            "dirty": int(self.dirty.sum()),
            "bytes": self.nbytes(),
        }

    def to(self, device: torch.device, dtype: torch.dtype) -> CachingRowStore:
        if dtype not in ROW_DTYPES:
            raise ValueError(f"dtype={dtype}: rows must be one of {', '.join(str(d) for d in ROW_DTYPES)}")
        device = resolve_device(device)
        with torch.inference_mode(False):
            if dtype != self.dtype:
                # The external store holds the rows too: rewrite them there, a chunk at a time.
                self.flush()
                held = (self.row_bound & self.row_stored).nonzero().squeeze(1)
                for lo in range(0, held.numel(), 1 << 16):
                    keys = self.row_key.index_select(0, held[lo : lo + (1 << 16)]).cpu()
                    rows, found = self.external.get(keys)
                    if not bool(found.all()):
                        raise RuntimeError(f"external_storage lost the rows of {int((~found).sum())} key(s) it was given (first: {keys[~found][:8].tolist()})")
                    self.external.put(keys, rows.to(dtype))
                self.cache, self.dtype = self.cache.to(dtype), dtype
            for name in ("cache", "slot_row", "dirty", "used", "row_slot", "row_key", "row_bound", "row_stored"):
                setattr(self, name, getattr(self, name).to(device))
        self.device = device
        return self

    def nbytes(self) -> int:
        tensors = (self.cache, self.slot_row, self.dirty, self.used, self.row_slot, self.row_key, self.row_bound, self.row_stored)
        return sum(t.numel() * t.element_size() for t in tensors)

    def _uncache(self, rows: torch.Tensor) -> None:
        """Drop the cached copies of rows [n] without writing them back."""
        slots = self.row_slot.index_select(0, rows)
        slots = slots[slots >= 0]
        self.slot_row.index_fill_(0, slots, -1)
        self.dirty.index_fill_(0, slots, False)
        self.row_slot.index_fill_(0, rows, -1)

    def _fetch(self, rows: torch.Tensor) -> torch.Tensor:
        """Whole rows [m, W] of distinct rows [m] not in the cache, read from the external store;
        rows it does not hold for their key (never written) have undefined content: zeros (NaN
        when tests poison fresh buffers)."""
        values = poison_(torch.zeros(rows.numel(), self.width, dtype=self.dtype, device=self.device))
        held = (self.row_bound.index_select(0, rows) & self.row_stored.index_select(0, rows)).nonzero().squeeze(1)
        if held.numel():
            keys = self.row_key.index_select(0, rows.index_select(0, held)).cpu()
            got, found = self.external.get(keys)
            if not bool(found.all()):
                lost = keys[~found]
                raise RuntimeError(f"external_storage lost the rows of {lost.numel()} key(s) it was given (first: {lost[:8].tolist()})")
            if got.shape != (keys.numel(), self.width) or got.dtype != self.dtype:
                raise RuntimeError(
                    f"external_storage.get returned rows [{', '.join(map(str, got.shape))}] {got.dtype}, not the [{keys.numel()}, {self.width}] {self.dtype} it was given"
                )
            values.index_copy_(0, held, got.to(self.device))
            self.fetched += keys.numel()
        return values

    def _put(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Write rows [n] (values [n, W]) of their keys to the external store (bound rows only)."""
        bound = self.row_bound.index_select(0, rows)
        if not bool(bound.all()):
            sel = bound.nonzero().squeeze(1)
            rows, values = rows.index_select(0, sel), values.index_select(0, sel)
        if rows.numel():
            self.external.put(self.row_key.index_select(0, rows).cpu(), values.cpu())
            self.row_stored.index_fill_(0, rows, True)
            self.written += rows.numel()

    def _admit(self, rows: torch.Tensor, values: torch.Tensor, *, dirty: bool) -> int:
        """Cache the first rows of distinct rows [m] (values [m, W]) that free and unpinned slots
        can take, least recently used slots first (dirty ones written back); returns how many."""
        free = (self.slot_row < 0).nonzero().squeeze(1)[: rows.numel()]
        slots = free
        short = rows.numel() - free.numel()
        if short > 0:
            unpinned = ((self.slot_row >= 0) & (self.used < self.clock)).nonzero().squeeze(1)
            take = min(short, unpinned.numel())
            if take:
                oldest = unpinned.index_select(0, torch.topk(self.used.index_select(0, unpinned), take, largest=False).indices)
                self._evict(oldest)
                slots = torch.cat([free, oldest])
        n = slots.numel()
        if n:
            rows = rows[:n]
            self.slot_row.index_copy_(0, slots, rows)
            self.row_slot.index_copy_(0, rows, slots)
            self.cache.index_copy_(0, slots, values[:n])
            self.dirty.index_fill_(0, slots, dirty)
            self.used.index_fill_(0, slots, self.clock)
        return n

    def _evict(self, slots: torch.Tensor) -> None:
        """Free slots [k]: write their dirty rows back, unmap them."""
        rows = self.slot_row.index_select(0, slots)
        dirty = self.dirty.index_select(0, slots).nonzero().squeeze(1)
        if dirty.numel():
            self._put(rows.index_select(0, dirty), self.cache.index_select(0, slots.index_select(0, dirty)))
        self.row_slot.index_fill_(0, rows, -1)
        self.slot_row.index_fill_(0, slots, -1)
        self.dirty.index_fill_(0, slots, False)


def caching_problem(configs: list, store) -> str:
    """Why caching ``configs`` (one engine's tables) cannot be served: a store given (a caching
    table builds its own over its external storage), or tables sharing one external store (their
    keys would collide there)."""
    if store is not None:
        return f"store={store!r}: a caching table keeps its rows in its external_storage, not in a store given here"
    return f"external_storage: tables {[c.name for c in configs]} share one store, where their keys would collide; give each table its own"


def bind_held(store, index: KeyIndex, tables: int | None = None) -> None:
    """A store that needs keys (:class:`KeyedRowStore`) learns the row of every key ``index``
    holds (an index just loaded from a state); ``tables``: the segments of a group's index."""
    if isinstance(store, KeyedRowStore):
        chunks = index.export() if tables is None else (c for s in range(tables) for c in index.export_segment(s))
        for keys, rows, _ in chunks:
            store.bind(rows, keys)
