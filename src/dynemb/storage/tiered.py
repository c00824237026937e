"""Row store over memory tiers (device, host, disk), rows moving between them by score.

n rows in a call, T tiers, C row ids (capacity), L slots of all tiers together (L = C),
W = D + S row width.

Every row id has one slot in one tier. The placement lives in memory on the table's device:
``slot_of`` [C] (row id -> global slot), ``row_of`` [L] (slot -> row id) and ``score_of`` (the
row's last score, for the slots of every tier but the last, whose rows never have to make room):
8 bytes per row of the last tier and 16 above it with int32 ids (below 2^31 rows; else 16 and 24). Global slots are
the tiers' slots laid end to end, fastest tier first. docs/design/0032-tiers.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dynemb.config import ROW_DTYPES, Tier, resolve_device
from dynemb.storage.base import RowStore
from dynemb.storage.device_store import DeviceRowStore
from dynemb.storage.disk import DiskRowStore

INT64_MIN = -(2**63)


def id_dtype(capacity: int) -> torch.dtype:
    """dtype of the placement's row ids and slots: int32 while they fit."""
    return torch.int32 if capacity < 2**31 else torch.int64


def placement_bytes(capacity: int) -> int:
    """Bytes per row of the placement maps: slot_of, row_of (ids) and score_of (int64)."""
    return 2 * torch.empty(0, dtype=id_dtype(capacity)).element_size() + 8


class TieredRowStore:
    """Rows of one table (or collection group) over tiers, fastest first.

    New row ids take the fastest tier with room. :meth:`touch` hands the store the scores of
    the rows a step used: a used row in a lower tier that is hotter than the coldest row of a
    tier above swaps places with it (one batch per call and tier), so a full tier sends its
    coldest rows down instead of evicting them. Rows keep their values bit for bit wherever
    they live.

    Args:
        width: W, columns per row.
        tiers: the tiers (kind, rows, path), fastest first.
        capacity: C, row ids (default: the tiers' rows summed; more rows join the last tier,
            as when the index rounds the capacity up to whole buckets).
        dtype, device: of the rows the store takes and returns (the table's).
        init_rows: rows the device tier allocates at creation (it grows on demand).
    """

    def __init__(
        self,
        width: int,
        tiers: Sequence[Tier],
        capacity: int | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        init_rows: int | None = None,
    ):
        if not tiers or not all(isinstance(t, Tier) for t in tiers):
            raise ValueError(f"tiers={tiers!r}: must be a non-empty list of dynemb.Tier")
        if dtype not in ROW_DTYPES:
            raise ValueError(f"dtype={dtype}: rows must be one of {', '.join(str(d) for d in ROW_DTYPES)}")
        rows = [t.rows for t in tiers]
        total = sum(rows)
        capacity = total if capacity is None else capacity
        if not isinstance(capacity, int) or capacity < total:
            raise ValueError(f"capacity={capacity!r}: must be an int >= the tiers' rows summed ({total})")
        rows[-1] += capacity - total
        self.width, self.capacity, self.dtype = width, capacity, dtype
        self.device = resolve_device(device)
        self.kinds = [t.kind for t in tiers]
        self.stores: list[RowStore] = [self._tier_store(t, n, init_rows) for t, n in zip(tiers, rows)]
        self.starts = [sum(rows[:i]) for i in range(len(rows))]
        self.sizes = rows
        # Slots handed out per tier; always a prefix of the tier's slots.
        self.used = [0] * len(rows)
        self.reserved = 0
        self.counts = {name: [0] * len(rows) for name in ("hits", "misses", "promotions", "demotions")}
        with torch.inference_mode(False):
            ids = id_dtype(capacity)
            self.slot_of = torch.full((capacity,), -1, dtype=ids, device=self.device)
            self.row_of = torch.full((capacity,), -1, dtype=ids, device=self.device)
            # Scores only where a colder row may have to leave: every tier but the last.
            self.score_of = torch.full((self.starts[-1],), INT64_MIN, dtype=torch.int64, device=self.device)
        self._bounds = torch.tensor(self.starts[1:], dtype=torch.int64, device=self.device)

    def _tier_store(self, tier: Tier, rows: int, init_rows: int | None) -> RowStore:
        if tier.kind == "disk":
            return DiskRowStore(self.width, rows, path=tier.path, dtype=self.dtype)
        if tier.kind == "device" or self.device.type == "cpu":
            # A host tier of a CPU table is CPU memory like its device tier.
            init = rows if init_rows is None else max(1, min(init_rows, rows))
            return DeviceRowStore(self.width, rows, dtype=self.dtype, device=self.device if tier.kind == "device" else "cpu", init_rows=init)
        store = DeviceRowStore(self.width, rows, dtype=self.dtype, device="cpu")
        # Pinned host memory (allocated whole: growing it would re-pin) copies to and from the GPU by DMA.
        store.data = store.data.pin_memory()
        return store

    def tier_of(self, slots: torch.Tensor) -> torch.Tensor:
        """Tier of global slots [n] -> [n] int64."""
        return torch.bucketize(slots, self._bounds, right=True)

    def reserve(self, n: int) -> None:
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"n={n!r}: must be an int >= 0")
        if n > self.capacity:
            raise ValueError(f"n={n}: more rows than the store's capacity {self.capacity}")
        if n <= self.reserved:
            return
        with torch.inference_mode(False):
            for t, store in enumerate(self.stores):
                take = min(n - self.reserved, self.sizes[t] - self.used[t])
                if take <= 0:
                    continue
                first = self.starts[t] + self.used[t]
                self.slot_of[self.reserved : self.reserved + take] = torch.arange(first, first + take, device=self.device)
                self.row_of[first : first + take] = torch.arange(self.reserved, self.reserved + take, device=self.device)
                self.used[t] += take
                self.reserved += take
                store.reserve(self.used[t])

    def _split(self, slots: torch.Tensor):
        """(tier, positions in the call [k], tier-local slots [k]) for each tier some slots are in."""
        if len(self.stores) == 1:
            yield 0, None, slots
            return
        tiers = self.tier_of(slots)
        for t in range(len(self.stores)):
            # A device sync per tier: the disk tier reads on the host anyway.
            sel = (tiers == t).nonzero().squeeze(1)
            if sel.numel():
                yield t, sel, slots.index_select(0, sel) - self.starts[t]

    def _read(self, slots: torch.Tensor) -> torch.Tensor:
        out = torch.empty(slots.numel(), self.width, dtype=self.dtype, device=self.device)
        for t, sel, local in self._split(slots):
            store = self.stores[t]
            values = store.gather(local.to(store.device)).to(self.device, non_blocking=True)
            if sel is None:
                return values
            out.index_copy_(0, sel, values)
        return out

    def _write(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        for t, sel, local in self._split(slots):
            store = self.stores[t]
            part = values if sel is None else values.index_select(0, sel)
            store.scatter(local.to(store.device), part.to(store.device))

    def _slots(self, rows: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu" and rows.numel():
            low, high = (int(v) for v in torch.aminmax(rows))
            if low < 0 or high >= self.reserved:
                raise IndexError(f"rows: ids must lie in [0, {self.reserved}) (reserved rows), got [{low}, {high}]")
        return self.slot_of.index_select(0, rows).long()

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        return self._read(self._slots(rows))

    def scatter(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        if values.dim() != 2 or values.shape[1] > self.width or values.dtype != self.dtype:
            raise ValueError(
                f"values: [{values.shape[0]}, {values.shape[1] if values.dim() == 2 else '?'}] {values.dtype}, must be [n, <= {self.width}] {self.dtype}"
            )
        with torch.inference_mode(False):
            self._write(self._slots(rows), values)

    def touch(self, rows: torch.Tensor, scores: torch.Tensor) -> None:
        """Scores [n] (int64) of distinct rows [n] a step used: counts hits and misses per tier,
        then promotes the used rows of lower tiers that are hotter than the coldest rows above."""
        if rows.numel() == 0:
            return
        with torch.inference_mode(False):
            if len(self.stores) == 1:
                self.counts["hits"][0] += rows.numel()
                return
            slots = self._slots(rows)
            scored = (slots < self.starts[-1]).nonzero().squeeze(1)
            self.score_of.index_copy_(0, slots.index_select(0, scored), scores.index_select(0, scored))
            per_tier = torch.bincount(self.tier_of(slots), minlength=len(self.stores)).tolist()
            for t, n in enumerate(per_tier):
                self.counts["hits"][t] += n
                self.counts["misses"][t] += sum(per_tier[t + 1 :])
            for t in range(len(self.stores) - 1):
                self._promote_into(t, slots, scores)
                slots = self.slot_of.index_select(0, rows).long()

    def _promote_into(self, t: int, slots: torch.Tensor, scores: torch.Tensor) -> None:
        """Swap the hottest used rows below tier t with tier t's coldest rows, where hotter."""
        below = (slots >= self.starts[t + 1]).nonzero().squeeze(1)
        k = min(below.numel(), self.used[t])
        if k == 0:
            return
        up_scores, order = scores.index_select(0, below).sort(descending=True, stable=True)
        up_scores, up = up_scores[:k], slots.index_select(0, below.index_select(0, order[:k]))
        start = self.starts[t]
        cold_scores, cold = self.score_of[start : start + self.used[t]].topk(k, largest=False, sorted=True)
        # Hottest candidates against coldest residents: "hotter" holds for a prefix of the pairs.
        m = int((up_scores > cold_scores).sum())
        if m == 0:
            return
        self._swap(up[:m], cold[:m] + start, up_scores[:m])
        self.counts["promotions"][t] += m
        self.counts["demotions"][t] += m

    def _swap(self, a: torch.Tensor, b: torch.Tensor, score_a: torch.Tensor) -> None:
        """Exchange the rows in global slots a [m] (below) and b [m] (a scored tier), distinct:
        values, ids and scores (``score_a``: the rows of a's, just used)."""
        va, vb = self._read(a), self._read(b)
        self._write(a, vb)
        self._write(b, va)
        ra, rb = self.row_of.index_select(0, a), self.row_of.index_select(0, b)
        sb = self.score_of.index_select(0, b)
        self.row_of.index_copy_(0, a, rb).index_copy_(0, b, ra)
        self.score_of.index_copy_(0, b, score_a)
        scored = (a < self.starts[-1]).nonzero().squeeze(1)
        self.score_of.index_copy_(0, a.index_select(0, scored), sb.index_select(0, scored))
        ids = self.slot_of.dtype
        self.slot_of.index_copy_(0, ra.long(), b.to(ids)).index_copy_(0, rb.long(), a.to(ids))

    def to(self, device: torch.device, dtype: torch.dtype) -> TieredRowStore:
        device = resolve_device(device)
        with torch.inference_mode(False):
            for t, kind in enumerate(self.kinds):
                store = self.stores[t]
                if kind == "device":
                    self.stores[t] = store.to(device, dtype)
                else:
                    self.stores[t] = store.to(torch.device("cpu"), dtype)
                    if kind == "host" and device.type == "cuda" and not store.data.is_pinned():
                        store.data = store.data.pin_memory()
            self.slot_of, self.row_of, self.score_of = (x.to(device) for x in (self.slot_of, self.row_of, self.score_of))
            self._bounds = self._bounds.to(device)
        self.device, self.dtype = device, dtype
        return self

    def nbytes(self) -> int:
        """Bytes of rows held now, every tier (the disk tier's on disk)."""
        return sum(s.nbytes() for s in self.stores)

    def tier_stats(self) -> list[dict[str, int | str]]:
        """One dict per tier, fastest first: kind, rows (row ids placed there), capacity, hits and
        misses (used rows found in / below this tier), promotions (rows moved up into it),
        demotions (rows moved down out of it), bytes (of its rows) and placement_bytes (the
        in-memory row -> slot maps of its slots, :func:`placement_bytes` per row)."""
        return [
            {
                "kind": kind,
                "rows": self.used[t],
                "capacity": self.sizes[t],
                **{name: c[t] for name, c in self.counts.items()},
                "bytes": self.stores[t].nbytes(),
                "placement_bytes": (placement_bytes(self.capacity) - (8 if t == len(self.sizes) - 1 else 0)) * self.sizes[t],
            }
            for t, kind in enumerate(self.kinds)
        ]

    def __repr__(self) -> str:
        tiers = ", ".join(f"{k} {n}" for k, n in zip(self.kinds, self.sizes))
        return f"TieredRowStore({tiers} rows x {self.width} {self.dtype} on {self.device})"
