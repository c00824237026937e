"""The functional layer of a group of tables looked up and updated in one pass.

T tables in the group (segments of one index), U unique (table, key) pairs in a call, E pairs
that leave, D embedding dim (shared), S optimizer state columns (shared).

A :class:`GroupEngine` is :class:`dynemb.nn.functional.TableEngine` for several tables that
share embedding dim, optimizer, dtype, device, bucket width, score strategy and non-finite
policy: one :class:`dynemb.table.segmented.SegmentedKeyIndex` (each table a segment with its
own capacity, scores and eviction), one row store, one fused optimizer step per call, and per
table its initialiser and step count. Like the table engine it applies no policy, takes the
clock as an argument and holds no lock (docs/design/0013-collections.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from dynemb.config import TableConfig
from dynemb.nn.changes import ChangeLog
from dynemb.nn.functional import _device_memory, leaving_contents, screen_update, with_initial_state
from dynemb.optim.base import RowOptimizer
from dynemb.storage.device_store import DeviceRowStore
from dynemb.storage.initializers import RowInitializer
from dynemb.table.index import index_bytes
from dynemb.table.segmented import SegmentedKeyIndex
from dynemb.types import NonFiniteGrads
from dynemb.workspace import writable


def group_key(config: TableConfig) -> tuple:
    """Tables with equal keys share a group (and so one index call and one update per batch)."""
    c = config
    return (c.embedding_dim, c.dtype, str(c.device), c.bucket_capacity, c.score_strategy, c.nonfinite_grads)


@dataclasses.dataclass(frozen=True)
class GroupResolved:
    """Outcome of :meth:`GroupEngine.resolve` over U unique (segment, key) pairs.

    Attributes:
        keys, segments (Tensor[int64]): [U] the pairs, as given.
        rows (Tensor[int64]): [U] row id, -1 where not in the table.
        found, inserted (Tensor[bool]): [U].
        evicted_keys, evicted_segments (Tensor[int64]): [E] pairs evicted to make room.
        evicted (dict[str, Tensor] | None): their ``embeddings`` [E, D], ``optimizer_state``
            [E, S] and ``scores`` [E] (only when asked for).
        failed_keys, failed_segments (Tensor[int64]): [F] pairs that should have been inserted
            and were not.
    """

    keys: torch.Tensor
    segments: torch.Tensor
    rows: torch.Tensor
    found: torch.Tensor
    inserted: torch.Tensor
    evicted_keys: torch.Tensor
    evicted_segments: torch.Tensor
    evicted: dict[str, torch.Tensor] | None
    failed_keys: torch.Tensor
    failed_segments: torch.Tensor

    @property
    def ok(self) -> torch.Tensor:
        """Tensor[bool]: [U] the pair is in the table after the call."""
        return self.rows >= 0


class GroupEngine:
    """Segmented index + one row store + per-table initialisers + one fused optimizer.

    Args:
        configs: the group's tables (equal :func:`group_key`); table i is segment i.
        optimizer: shared fused optimizer, or ``None`` (frozen tables).
    """

    def __init__(self, configs: list[TableConfig], optimizer: RowOptimizer | None = None):
        first = configs[0]
        if any(group_key(c) != group_key(first) for c in configs):
            raise ValueError("configs: a group's tables must share embedding_dim, dtype, device, bucket_capacity, score_strategy, nonfinite_grads")
        self.configs = list(configs)
        self.optimizer = optimizer
        self.embedding_dim = D = first.embedding_dim
        self.state_dim = optimizer.state_dim(D) if optimizer is not None else 0
        self.width = D + self.state_dim
        self.dtype, self.device = first.dtype, first.device
        W = first.bucket_capacity
        slots = sum(-(-c.capacity // W) * W for c in configs)
        elsize = torch.empty(0, dtype=first.dtype).element_size()
        full_bytes = index_bytes(slots) + slots * self.width * elsize
        total = _device_memory(first.device)
        names = [c.name for c in configs]
        if total is not None and full_bytes > total:
            raise ValueError(f"capacity of tables {names}: full tables need {full_bytes:,} bytes, more than the {total:,} bytes of memory on {first.device}")
        try:
            self.index = SegmentedKeyIndex(
                capacities=[c.capacity for c in configs], bucket_capacity=W, score_strategy=first.score_strategy, device=first.device
            )
            init_rows = sum(c.capacity if c.init_capacity is None else c.init_capacity for c in configs)
            self.store = DeviceRowStore(self.width, self.index.capacity(), dtype=first.dtype, device=first.device, init_rows=init_rows)
        except RuntimeError as e:
            raise ValueError(f"capacity of tables {names}: allocating the tables failed (full tables need {full_bytes:,} bytes): {e}") from None
        self.initializers = [RowInitializer(c.initializer, D, c.seed, c.dtype, c.device) for c in configs]
        # Segments whose keys one initialiser call can serve (same initializer and seed).
        by_init: dict[tuple, list[int]] = {}
        for s, c in enumerate(configs):
            by_init.setdefault((c.initializer, c.seed), []).append(s)
        self._init_groups = list(by_init.values())
        self.optimizer_steps = [0] * len(configs)
        self.nonfinite_grads = [0] * len(configs)
        self.version = 0
        # Rows changed / (segment, key) pairs left since the last checkpoint (None until asked).
        self.changes: ChangeLog | None = None

    @property
    def num_tables(self) -> int:
        return len(self.configs)

    def track_changes(self) -> ChangeLog:
        """The change log (rows touched, (segment, key) pairs left) that checkpoint deltas read, started empty if none."""
        if self.changes is None:
            # Sized to every row id the index can hand out: marking rows never has to grow it.
            self.changes = ChangeLog(self.index.capacity(), self.device)
        return self.changes

    def init_embeddings(self, keys: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
        """Initial embeddings [n, D] of (segment, key) pairs [n], each by its table's initialiser."""
        if len(self._init_groups) == 1:
            return self.initializers[self._init_groups[0][0]](keys)
        out = torch.empty(keys.numel(), self.embedding_dim, dtype=self.dtype, device=self.device)
        for members in self._init_groups:
            sel = torch.isin(segments, torch.tensor(members, device=self.device)).nonzero().squeeze(1)
            if sel.numel():
                out.index_copy_(0, sel, self.initializers[members[0]](keys.index_select(0, sel)))
        return out

    def new_rows(self, keys: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
        """Initial rows [n, D+S] of pairs [n]: per-key embeddings and the optimizer's initial state."""
        return with_initial_state(self.init_embeddings(keys, segments), self.optimizer, self.width)

    def resolve(
        self,
        keys: torch.Tensor,
        segments: torch.Tensor,
        *,
        train: bool,
        now: int | None,
        counts: torch.Tensor | None = None,
        insertable: torch.Tensor | None = None,
        scores: torch.Tensor | None = None,
        evicted_contents: bool = False,
        init_rows: bool = True,
    ) -> GroupResolved:
        """Row ids of unique (segment, key) pairs; in training, missing pairs are inserted.

        Args:
            keys, segments (Tensor[int64]): [U] distinct pairs, sorted by segment, then key.
            train, now, counts, insertable, scores, evicted_contents, init_rows: as
                :meth:`dynemb.nn.functional.TableEngine.resolve`.
        """
        empty = keys.new_empty(0)
        if not train:
            rows, found = self.index.find(keys, segments=segments)
            return GroupResolved(keys, segments, rows, found, torch.zeros_like(found), empty, empty, None, empty, empty)
        with writable():
            if counts is None:
                counts = torch.ones_like(keys)
            sel = None
            if insertable is not None:
                _, found = self.index.find(keys, segments=segments)
                candidate = found | insertable
                if not bool(candidate.all()):
                    sel = candidate.nonzero().squeeze(1)
                    counts = counts.index_select(0, sel)
                    scores = None if scores is None else scores.index_select(0, sel)
            sub, sub_seg = (keys, segments) if sel is None else (keys.index_select(0, sel), segments.index_select(0, sel))
            r = self.index.upsert_unique(sub, counts, now=now, given=scores, segments=sub_seg)
            self.store.reserve(self.index.free_list.high_water)
            evicted = leaving_contents(self.store, self.embedding_dim, r) if evicted_contents and r.evicted_keys.numel() else None
            if init_rows and bool(r.inserted.any()):
                new = r.inserted.nonzero().squeeze(1)
                self.store.scatter(r.rows.index_select(0, new), self.new_rows(sub.index_select(0, new), sub_seg.index_select(0, new)))
            if self.changes is not None:
                self.changes.touch(r.rows)
                self.changes.left(r.evicted_keys, r.evicted_segments)
            self.version += 1
        if sel is None:
            rows, found, inserted = r.rows, r.found, r.inserted
        else:
            rows = torch.full_like(keys, -1).index_copy_(0, sel, r.rows)
            found = torch.zeros_like(insertable).index_copy_(0, sel, r.found)
            inserted = torch.zeros_like(insertable).index_copy_(0, sel, r.inserted)
        return GroupResolved(keys, segments, rows, found, inserted, r.evicted_keys, r.evicted_segments, evicted, r.failed_keys, r.failed_segments)

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows [U, D+S] of row ids [U] (-1 allowed: such rows hold undefined values)."""
        return self.store.gather(rows.clamp(min=0))

    def find(self, keys: torch.Tensor, segments: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Row ids of pairs [N] (-1 where absent) and whether found, without side effects."""
        return self.index.find(keys, segments=segments)

    def apply_pending(self, keys: torch.Tensor, segments: torch.Tensor, grads: torch.Tensor, *, nonfinite: NonFiniteGrads = NonFiniteGrads.SKIP) -> int:
        """One optimizer step of every table with deferred gradients [P, D] of distinct pairs
        [P]: pairs that left since are skipped; nothing at all when P = 0."""
        if keys.numel() == 0:
            return 0
        rows, _ = self.find(keys, segments)
        return self.apply_gradients(keys, segments, rows, grads, nonfinite=nonfinite)

    def apply_gradients(
        self,
        keys: torch.Tensor,
        segments: torch.Tensor,
        rows: torch.Tensor,
        grads: torch.Tensor,
        *,
        data: torch.Tensor | None = None,
        version: int | None = None,
        nonfinite: NonFiniteGrads = NonFiniteGrads.SKIP,
        stepped: list[int] | None = None,
        agree: Callable[[bool], bool] | None = None,
    ) -> int:
        """One optimizer step of every table in ``stepped`` (default: all) on the rows of pairs.

        Args:
            keys, segments (Tensor[int64]): [U] distinct pairs.
            rows (Tensor[int64]): [U] their row ids when ``data`` was read; -1 rows are skipped.
            grads (Tensor): [U, D] gradient summed per pair.
            data (Tensor | None): [U, D+S] the rows as read at ``version``.
            version: the engine version when ``rows`` / ``data`` were read (keys are found again
                if the tables changed since).
            nonfinite: what to do with pairs whose gradient, or updated row, is not finite.
            stepped: segments whose step count advances (each table steps once per call).
            agree: a sharded group's agreement under ``raise`` (see :func:`dynemb.nn.functional.screen_update`).
        Returns:
            Number of pairs skipped for a non-finite gradient or update.
        """
        if self.optimizer is None:
            return 0
        skipped = 0
        with writable():
            keep = rows >= 0
            if not bool(keep.all()):
                sel = keep.nonzero().squeeze(1)
                keys, segments, rows, grads = (t.index_select(0, sel) for t in (keys, segments, rows, grads))
                data = None if data is None else data.index_select(0, sel)
            if version is not None and version != self.version:
                rows, found = self.index.find(keys, segments=segments)
                sel = found.nonzero().squeeze(1)
                keys, segments, rows, grads = (t.index_select(0, sel) for t in (keys, segments, rows, grads))
                data = None
            if data is None:
                data = self.store.gather(rows)
            stepping = range(self.num_tables) if stepped is None else stepped
            new_steps = list(self.optimizer_steps)
            for s in stepping:
                new_steps[s] += 1
            D = self.embedding_dim
            steps = set(new_steps)
            if len(steps) == 1:
                self.optimizer.update_rows(data, D, grads, steps.pop())
            else:
                # Tables at different step counts (restored apart): one update per count.
                step_of = torch.tensor(new_steps, device=self.device).index_select(0, segments)
                for step in sorted(steps):
                    sel = (step_of == step).nonzero().squeeze(1)
                    if sel.numel():
                        part = data.index_select(0, sel)
                        self.optimizer.update_rows(part, D, grads.index_select(0, sel), step)
                        data.index_copy_(0, sel, part)
            # Raises (under 'raise') before anything is written: rows, step counts and counters.
            bad = screen_update(keys, grads, data, nonfinite, agree=agree, tables=lambda bad: sorted({self.configs[s].name for s in segments[bad].tolist()}))
            if bad is not None:
                per_table = torch.bincount(segments[bad], minlength=self.num_tables).tolist()
                for s, n in enumerate(per_table):
                    self.nonfinite_grads[s] += n
                skipped = int(bad.sum())
                sel = (~bad).nonzero().squeeze(1)
                rows, data = rows.index_select(0, sel), data.index_select(0, sel)
            self.optimizer_steps[:] = new_steps
            self.store.scatter(rows, data)
            if self.changes is not None:
                self.changes.touch(rows)
            self.version += 1
        return skipped

    def write_rows(self, keys: torch.Tensor, segments: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Overwrite the rows [N] of pairs [N] (just resolved, all placed) with ``values`` [N, D]
        or [N, D+S]: ``insert``'s write."""
        with writable():
            self.store.scatter(rows, values)

    def erase(self, keys: torch.Tensor, segments: torch.Tensor, *, evicted_contents: bool = False):
        """Remove pairs ([N] each, duplicates allowed); returns the IndexResult and the contents
        of the erased rows when asked."""
        with writable():
            r = self.index.erase(keys, segments=segments)
            if self.changes is not None:
                self.changes.left(r.evicted_keys, r.evicted_segments)
            self.version += 1
        return r, (leaving_contents(self.store, self.embedding_dim, r) if evicted_contents and r.evicted_keys.numel() else None)

    def export(self, segment: int, chunk_size: int = 1 << 16):
        """One table's keys with their rows, in chunks (as :meth:`TableEngine.export`)."""
        D = self.embedding_dim
        for keys, rows, scores in self.index.export_segment(segment, chunk_size):
            data = self.store.gather(rows)
            yield {"keys": keys, "embeddings": data[:, :D], "optimizer_state": data[:, D:], "scores": scores}

    def to(self, device: torch.device, dtype: torch.dtype) -> None:
        """Move index and rows to ``device`` and rows to ``dtype``."""
        with writable():
            self.index.to(device)
            self.store = self.store.to(device, dtype)
        self.configs = [dataclasses.replace(c, device=device, dtype=dtype) for c in self.configs]
        self.dtype, self.device = dtype, device
        self.initializers = [RowInitializer(c.initializer, self.embedding_dim, c.seed, dtype, device) for c in self.configs]
        if self.changes is not None:
            self.changes.to(device)
        self.version += 1
