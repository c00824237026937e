"""The engine: index + row store + initialisers + fused optimizer of one or more tables.

T tables (segments of one index), U unique (segment, key) pairs in a call, E pairs that leave,
D embedding dim (shared), S optimizer state columns (shared), W = D + S.

A plain table is an engine of one table; a collection has one engine per group of tables that
share :func:`group_key`. Both go through the same two calls:

* :meth:`Engine.resolve` turns unique keys into row ids (inserting missing keys in training,
  initialising their rows) and reports which keys were inserted, evicted or failed;
* :meth:`Engine.apply_gradients` runs one fused optimizer step on rows given per-key gradients.

The engine implements :class:`dynemb.nn.base.EngineContract`: it applies no policy, takes the
clock as an argument (``now``) and holds no lock (its owner serialises calls).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

import torch

from dynemb.config import TableConfig
from dynemb.kernels.update import update_rows_native
from dynemb.nn.base import Resolved
from dynemb.nn.changes import ChangeLog
from dynemb.nn.functional import init_rows_in_place, leaving_contents, native_update_spec, screen_update, update_by_step, with_initial_state
from dynemb.nn.tiering import check_memory, default_store, group_key, touch_resolved
from dynemb.nn.units import BagGradients, dense_gradient
from dynemb.optim.base import RowOptimizer
from dynemb.storage.base import FlushableStore, KeyedRowStore, RowStore, TierStats, Touchable
from dynemb.storage.caching import CachingRowStore, caching_problem
from dynemb.storage.device_store import DeviceRowStore
from dynemb.storage.initializers import RowInitializer
from dynemb.table.index import KeyIndex, rounded_capacity
from dynemb.types import NonFiniteGrads
from dynemb.workspace import writable


def _select(t: torch.Tensor | None, sel: torch.Tensor) -> torch.Tensor | None:
    return None if t is None else t.index_select(0, sel)


class Engine:
    """Index + row store + per-table initialisers + one fused optimizer (the engine contract).

    Args:
        configs: one :class:`dynemb.TableConfig` (a plain table: its index grows and its keys
            take no segments) or the list of a group's tables (equal :func:`group_key`; table i
            is segment i of the index, a list of one included).
        optimizer: shared fused optimizer, or ``None`` (frozen tables: rows hold embeddings only).
        store: where rows live (default: a :class:`DeviceRowStore` on the tables' device, a
            :class:`CachingRowStore` when ``caching``); any :class:`dynemb.storage.base.RowStore`
            of width D + S and at least the index's capacity in rows.
    """

    collective = False

    def __init__(self, configs: TableConfig | list[TableConfig], optimizer: RowOptimizer | None = None, store: RowStore | None = None):
        # Whether keys come with segments (a group's engine): decides the index and state layout.
        self.segmented = not isinstance(configs, TableConfig)
        configs = list(configs) if self.segmented else [configs]
        first = configs[0]
        if any(group_key(c) != group_key(first) for c in configs):
            raise ValueError(
                "configs: a group's tables must share embedding_dim, dtype, device, bucket_capacity, score_strategy, nonfinite_grads, tier kinds and paths, backend"
            )
        if first.caching and (len(configs) > 1 or store is not None):
            raise ValueError(caching_problem(configs, store))
        self.configs = configs
        self.optimizer = optimizer
        self.embedding_dim = D = first.embedding_dim
        self.state_dim = optimizer.state_dim(D) if optimizer is not None else 0
        self.width = D + self.state_dim
        if not self.segmented:
            slots = rounded_capacity(first.capacity, first.init_capacity, first.bucket_capacity)
            what = f"capacity={first.capacity}: a full table needs"
        else:
            W = first.bucket_capacity
            slots = sum(-(-c.capacity // W) * W for c in configs)
            what = f"capacity of tables {[c.name for c in configs]}: full tables need"
        # A caching table holds only its cache's rows in memory.
        self.cache_rows = min(first.cache_rows or first.capacity, slots) if first.caching else None
        full_bytes = check_memory(configs, slots, self.width, what, self.cache_rows)
        # A store the caller gave (a DynamicTable's ``store=``) is kept by a load (:meth:`fresh`).
        self.given_store = store is not None
        try:
            self.index = self._new_index()
            if store is None:
                store = default_store(configs, self.width, self.index.capacity(), self.index.current_capacity(), self.cache_rows)
        except RuntimeError as e:
            raise ValueError(f"{what} {full_bytes:,} bytes; allocating them failed: {e}") from None
        if not isinstance(store, RowStore) or store.width != self.width or store.capacity < self.index.capacity():
            raise ValueError(f"store={store!r}: must be a RowStore of width {self.width} and capacity >= {self.index.capacity()}")
        # Row 0 stays addressable: gather reads it for keys not in the table (-1 rows).
        store.reserve(1)
        self.store, self.keyed = store, isinstance(store, KeyedRowStore)
        # A tiered store places rows by the scores of the rows each call uses.
        self.tiered = isinstance(store, Touchable)
        self.initializers = [RowInitializer(c.initializer, D, c.seed, c.dtype, c.device) for c in configs]
        # Tables whose keys one initialiser call can serve (same initializer and seed).
        by_init: dict[tuple, list[int]] = {}
        for s, c in enumerate(configs):
            by_init.setdefault((c.initializer, c.seed), []).append(s)
        self.init_groups = list(by_init.values())
        self.optimizer_steps = [0] * len(configs)
        self.nonfinite_grads = [0] * len(configs)
        # Bumped by every write to rows or index; a backward re-finds its keys when it changed.
        self.version = 0
        # Rows changed / keys left since the last checkpoint (None until a save asks for it).
        self.changes: ChangeLog | None = None

    def _new_index(self) -> KeyIndex:
        c = self.configs[0]
        if not self.segmented:
            return KeyIndex(
                capacity=c.capacity,
                init_capacity=c.init_capacity,
                bucket_capacity=c.bucket_capacity,
                max_load_factor=c.max_load_factor,
                score_strategy=c.score_strategy,
                device=c.device,
                backend=c.backend,
            )
        # A group's tables grow each from its own init_capacity (docs/design/0025); the first
        # table's max_load_factor serves the group.
        return KeyIndex(
            capacities=[t.capacity for t in self.configs],
            init_capacities=[t.init_capacity for t in self.configs],
            bucket_capacity=c.bucket_capacity,
            max_load_factor=c.max_load_factor,
            score_strategy=c.score_strategy,
            device=c.device,
            backend=c.backend,
        )

    def fresh(self, *, share_store: bool = False) -> Engine:
        """An empty engine of the same tables and optimizer (a load builds one, then swaps it in).

        ``share_store``: a store the caller gave this engine serves the new one too (its rows are
        overwritten as the new engine writes them: only for a load that cannot fail once it
        writes rows); otherwise the new engine gets a default store."""
        store = self.store if share_store and self.given_store else None
        return Engine(self.configs if self.segmented else self.configs[0], self.optimizer, store)

    def adopt_store(self, store: RowStore, chunk_rows: int = 1 << 16) -> None:
        """Copy the rows this engine's index hands out into ``store`` (of the same width and
        capacity) and keep them there: a checkpoint load gives a table its own store back."""
        n = self.index.free_list.high_water
        with writable():
            store.reserve(max(n, 1))
            for lo in range(0, n, chunk_rows):
                ids = torch.arange(lo, min(n, lo + chunk_rows), device=self.device)
                store.scatter(ids, self.store.gather(ids))
        self.store, self.given_store, self.keyed = store, True, isinstance(store, KeyedRowStore)
        self.tiered = isinstance(store, Touchable)

    @property
    def num_tables(self) -> int:
        return len(self.configs)

    @property
    def config(self) -> TableConfig:
        """The first table's config (a plain table's own)."""
        return self.configs[0]

    @property
    def device(self) -> torch.device:
        return self.configs[0].device

    @property
    def dtype(self) -> torch.dtype:
        return self.configs[0].dtype

    @property
    def initializer(self) -> RowInitializer:
        """The first table's initialiser (a plain table's own)."""
        return self.initializers[0]

    @property
    def optimizer_step(self) -> int:
        """The first table's optimizer step count (a plain table's own)."""
        return self.optimizer_steps[0]

    def track_changes(self) -> ChangeLog:
        """The change log (rows touched, keys left) that checkpoint deltas read, started empty if none."""
        if self.changes is None:
            # Sized to every row id the index can hand out: marking rows never has to grow it.
            self.changes = ChangeLog(self.index.capacity(), self.device)
        return self.changes

    def agree(self, what: str, problem: str | None, **fields) -> list[dict] | None:
        """Nothing to agree on in one process."""
        return None

    def collective_op(self, op: str, undo: Callable[[], None] | None = None) -> contextlib.AbstractContextManager:
        """Nothing collective in one process."""
        return contextlib.nullcontext()

    def init_embeddings(self, keys: torch.Tensor, segments: torch.Tensor | None = None) -> torch.Tensor:
        """Initial embeddings [n, D] of keys [n] (of tables ``segments`` [n]), each by its table's initialiser."""
        if len(self.init_groups) == 1:
            return self.initializers[0](keys)
        out = torch.empty(keys.numel(), self.embedding_dim, dtype=self.dtype, device=self.device)
        for members in self.init_groups:
            sel = torch.isin(segments, torch.tensor(members, device=self.device)).nonzero().squeeze(1)
            if sel.numel():
                out.index_copy_(0, sel, self.initializers[members[0]](keys.index_select(0, sel)))
        return out

    def new_rows(self, keys: torch.Tensor, segments: torch.Tensor | None = None) -> torch.Tensor:
        """Initial rows [n, D+S] of keys [n]: per-key embeddings and the optimizer's initial state."""
        return with_initial_state(self.init_embeddings(keys, segments), self.optimizer, self.width)

    def _leaving(self, result) -> dict[str, torch.Tensor]:
        return leaving_contents(self.store, self.embedding_dim, result)

    def flush(self) -> None:
        """Write rows held in a faster layer back home (caching: dirty cached rows to the external store)."""
        if isinstance(self.store, FlushableStore):
            self.store.flush()

    def retire(self, successor) -> None:
        """``successor`` replaces this engine (a load): a caching store's keys it lacks leave the external store."""
        if isinstance(self.store, CachingRowStore):
            self.store.retire(successor.store, lambda keys: successor.find(keys, torch.zeros_like(keys) if successor.segmented else None)[1])

    def resolve(
        self,
        keys: torch.Tensor,
        segments: torch.Tensor | None = None,
        *,
        train: bool,
        now: int | None,
        counts: torch.Tensor | None = None,
        insertable: torch.Tensor | None = None,
        scores: torch.Tensor | None = None,
        evicted_contents: bool = False,
        init_rows: bool = True,
    ) -> Resolved:
        """Row ids of unique keys; in training, missing keys are inserted and initialised.

        Args:
            keys (Tensor[int64]): [U] distinct (segment, key) pairs, sorted by segment, then key.
            segments (Tensor[int64] | None): [U] the table of each key (None: table 0).
            train: insert missing keys (else only find them).
            now: the clock (timestamp or step) that scores touched keys, see ScoreStrategy.
            counts (Tensor[int64] | None): [U] occurrences in the batch (lfu); default ones.
            insertable (Tensor[bool] | None): [U] which missing keys may be inserted (admission);
                default all.
            scores (Tensor[int64] | None): [U] scores to assign (``customized``).
            evicted_contents: also return the evicted keys' rows (for evict hooks).
            init_rows: write initial rows of inserted keys (``False`` when the caller writes them).
        Returns:
            :class:`Resolved`.
        """
        empty = keys.new_empty(0)
        seg_kw = {} if segments is None else {"segments": segments}
        if not train:
            rows, found = self.index.find(keys, **seg_kw)
            if self.tiered:
                with writable():
                    touch_resolved(self.index, self.store, keys, rows, segments)
            no_seg = None if segments is None else empty
            return Resolved(keys, rows, found, torch.zeros_like(found), empty, None, empty, segments, no_seg, no_seg)
        with writable():
            if counts is None:
                counts = torch.ones_like(keys)
            sel = None
            if insertable is not None:
                _, found = self.index.find(keys, **seg_kw)
                candidate = found | insertable
                if not bool(candidate.all()):
                    sel = candidate.nonzero().squeeze(1)
                    counts = counts.index_select(0, sel)
                    scores = _select(scores, sel)
            sub, sub_seg = (keys, segments) if sel is None else (keys.index_select(0, sel), _select(segments, sel))
            r = self.index.upsert_unique(sub, counts, now=now, given=scores, **({} if sub_seg is None else {"segments": sub_seg}))
            self.store.reserve(self.index.free_list.high_water)
            evicted = self._leaving(r) if evicted_contents and r.evicted_keys.numel() else None
            if self.keyed:
                new = r.inserted.nonzero().squeeze(1)
                self.store.release(r.evicted_rows)
                self.store.bind(r.rows.index_select(0, new), sub.index_select(0, new))
            if self.tiered:
                # Before the new rows are written: they land in the tier they move to.
                touch_resolved(self.index, self.store, sub, r.rows, sub_seg)
            new = r.inserted.nonzero().squeeze(1) if init_rows else None  # one host sync
            if new is not None and new.numel():
                rows, new_keys, new_segs = r.rows.index_select(0, new), sub.index_select(0, new), _select(sub_seg, new)
                if not init_rows_in_place(self, rows, new_keys, new_segs):
                    self.store.scatter(rows, self.new_rows(new_keys, new_segs))
            evicted_segments = None if segments is None else r.evicted_segments
            if self.changes is not None:
                self.changes.touch(r.rows)
                self.changes.left(r.evicted_keys, evicted_segments)
            self.version += 1
        failed_segments = None if segments is None else r.failed_segments
        if sel is None:
            return Resolved(keys, r.rows, r.found, r.inserted, r.evicted_keys, evicted, r.failed_keys, segments, evicted_segments, failed_segments)
        rows = torch.full_like(keys, -1).index_copy_(0, sel, r.rows)
        found = torch.zeros_like(insertable).index_copy_(0, sel, r.found)
        inserted = torch.zeros_like(insertable).index_copy_(0, sel, r.inserted)
        return Resolved(keys, rows, found, inserted, r.evicted_keys, evicted, r.failed_keys, segments, evicted_segments, failed_segments)

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows [U, D+S] of row ids [U] (-1 allowed: such rows hold undefined values)."""
        return self.store.gather(rows.clamp(min=0))

    def readable_rows(self) -> torch.Tensor | None:
        """The store's rows [C, D+S] where a lookup may copy from them in place instead of
        gathering its rows first (a compiled CPU table whose rows are one contiguous tensor,
        no tiers or cache), else None. Valid until the table next changes."""
        store = self.store
        if not self.index.compiled or type(store) is not DeviceRowStore or store.data.device.type != "cpu" or not store.data.is_contiguous():
            return None
        return store.data

    def find(self, keys: torch.Tensor, segments: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Row ids of keys [N] (-1 where absent) and whether found, without side effects."""
        return self.index.find(keys) if segments is None else self.index.find(keys, segments=segments)

    def apply_pending(
        self, keys: torch.Tensor, grads: torch.Tensor, *, segments: torch.Tensor | None = None, nonfinite: NonFiniteGrads = NonFiniteGrads.SKIP
    ) -> int:
        """One optimizer step with deferred gradients [P, D] of distinct keys [P]: keys that left
        the table since are skipped; nothing at all (not even a step count) when P = 0."""
        if keys.numel() == 0:
            return 0
        rows, _ = self.find(keys, segments)
        return self.apply_gradients(keys, rows, grads, segments=segments, nonfinite=nonfinite)

    def apply_gradients(
        self,
        keys: torch.Tensor,
        rows: torch.Tensor,
        grads: torch.Tensor,
        *,
        segments: torch.Tensor | None = None,
        data: torch.Tensor | None = None,
        version: int | None = None,
        nonfinite: NonFiniteGrads = NonFiniteGrads.SKIP,
        stepped: list[int] | None = None,
        agree: Callable[[bool], bool] | None = None,
    ) -> int:
        """One optimizer step of every table in ``stepped`` (default: all) on the rows of keys.

        Args:
            keys (Tensor[int64]): [U] distinct keys.
            rows (Tensor[int64]): [U] their row ids when ``data`` was read; -1 rows are skipped.
            grads (Tensor | BagGradients): [U, D] gradient summed per key, or a bag
                collection's gradient to sum (in the update's own pass where the compiled
                kernel updates the rows in place, no key failed and the table is unchanged
                since the lookup; else summed first).
            segments (Tensor[int64] | None): [U] the table of each key (None: table 0).
            data (Tensor | None): [U, D+S] the rows as read at ``version`` (saves a gather).
            version: the engine version when ``rows`` / ``data`` were read; if the table changed
                since, keys are found again and keys that left meanwhile are skipped.
            nonfinite: what to do with keys whose gradient, or whose updated row (embedding or
                optimizer state), is not finite: skip them, raise before any row changes (and
                before the step count advances), or apply (see :func:`screen_update`).
            stepped: tables whose step count advances (each table steps once per call).
            agree: a sharded table's agreement under ``raise`` (see :func:`screen_update`).
        Returns:
            Number of keys skipped for a non-finite gradient or update.
        """
        if self.optimizer is None:
            return 0
        skipped = 0
        with writable():
            keep = rows >= 0
            if not bool(keep.all()):
                grads = dense_gradient(grads)
                sel = keep.nonzero().squeeze(1)
                keys, rows, grads, segments = keys.index_select(0, sel), rows.index_select(0, sel), grads.index_select(0, sel), _select(segments, sel)
                data = _select(data, sel)
            if version is not None and version != self.version:
                # Rows were written since they were read (another lookup, insert or update): find
                # the keys again and skip those evicted or erased meanwhile.
                grads = dense_gradient(grads)
                rows, found = self.find(keys, segments)
                sel = found.nonzero().squeeze(1)
                keys, rows, grads, segments = keys.index_select(0, sel), rows.index_select(0, sel), grads.index_select(0, sel), _select(segments, sel)
                data = None
            new_steps = list(self.optimizer_steps)
            for s in range(self.num_tables) if stepped is None else stepped:
                new_steps[s] += 1
            D = self.embedding_dim
            steps = set(new_steps)
            spec = native_update_spec(self.index.compiled, self.optimizer, self.store, grads, steps, nonfinite)
            check = nonfinite is NonFiniteGrads.SKIP
            if spec is not None and isinstance(grads, BagGradients):
                # The compiled kernel sums each row's gradient from the bags in the same pass.
                bad = grads.update_rows(self.store.data, rows, spec, check=check)
            elif spec is not None:
                # The compiled kernel: one pass over the rows in the store, non-finite rows kept.
                bad = update_rows_native(self.store.data, rows, grads, spec, check=check)
            else:
                grads = dense_gradient(grads)
                if data is None:
                    data = self.store.gather(rows)
                update_by_step(self.optimizer, data, D, grads, new_steps, segments, self.index.compiled)
                tables = None if segments is None else (lambda bad: sorted({self.configs[s].name for s in segments[bad].tolist()}))
                # Raises (under 'raise') before anything is written: rows, step counts and counters.
                bad = screen_update(keys, grads, data, nonfinite, agree=agree, tables=tables)
            if bad is not None:
                skipped = int(bad.sum())
                if segments is None:
                    self.nonfinite_grads[0] += skipped
                else:
                    for s, n in enumerate(torch.bincount(segments[bad], minlength=self.num_tables).tolist()):
                        self.nonfinite_grads[s] += n
                sel = (~bad).nonzero().squeeze(1)
                rows, data = rows.index_select(0, sel), _select(data, sel)
            self.optimizer_steps[:] = new_steps
            if spec is None:
                self.store.scatter(rows, data)
            if self.changes is not None:
                self.changes.touch(rows)
            self.version += 1
        return skipped

    def write_rows(self, keys: torch.Tensor, rows: torch.Tensor, values: torch.Tensor, *, segments: torch.Tensor | None = None) -> None:
        """Overwrite the rows [N] of keys [N] (just resolved, all placed) with ``values`` [N, D]
        (embeddings) or [N, D+S] (whole rows): ``insert``'s write."""
        with writable():
            self.store.scatter(rows, values)

    def erase(self, keys: torch.Tensor, segments: torch.Tensor | None = None, *, evicted_contents: bool = False):
        """Remove keys ([N] int64, duplicates allowed); returns the IndexResult and the contents
        of the erased rows when asked."""
        with writable():
            r = self.index.erase(keys) if segments is None else self.index.erase(keys, segments=segments)
            if self.changes is not None:
                self.changes.left(r.evicted_keys, None if segments is None else r.evicted_segments)
            self.version += 1
            contents = self._leaving(r) if evicted_contents and r.evicted_keys.numel() else None
            if self.keyed:
                self.store.release(r.evicted_rows)
        return r, contents

    def export(self, segment: int = 0, chunk_size: int = 1 << 16) -> Iterator[dict[str, torch.Tensor]]:
        """One table's keys with their rows, in chunks: ``keys`` [K], ``embeddings`` [K, D],
        ``optimizer_state`` [K, S], ``scores`` [K]."""
        D = self.embedding_dim
        chunks = self.index.export_segment(segment, chunk_size) if self.segmented else self.index.export(chunk_size)
        for keys, rows, scores in chunks:
            data = self.store.gather(rows)
            yield {"keys": keys, "embeddings": data[:, :D], "optimizer_state": data[:, D:], "scores": scores}

    def table_stats(self, segment: int = 0) -> dict[str, int | float]:
        """One table's index figures (see :meth:`dynemb.table.index.KeyIndex.stats` /
        ``segment_stats``), with tiers ``tiers`` (the store's :meth:`tier_stats`; a group's tiers
        are the group's: every table of it shows the same list) and, caching, ``cache``
        (:meth:`CachingRowStore.cache_stats`)."""
        figures = self.index.stats() if not self.segmented else self.index.segment_stats()[segment]
        if isinstance(self.store, TierStats):
            figures = {**figures, "tiers": self.store.tier_stats()}
        if isinstance(self.store, CachingRowStore):
            figures = {**figures, "cache": self.store.cache_stats()}
        return figures

    def size(self) -> int:
        """Keys held by every table together."""
        return self.index.size()

    def counters(self, segment: int = 0) -> dict[str, object]:
        """One table's counters: ``optimizer_step``, ``nonfinite_grads``, ``index`` (inserts,
        evictions, failed_inserts and growths for a plain table, erased for a group's) and the
        initialiser's ``generator``."""
        s = self.table_stats(segment)
        last = "erased" if self.segmented else "growths"
        return {
            "optimizer_step": self.optimizer_steps[segment],
            "nonfinite_grads": self.nonfinite_grads[segment],
            "index": [s["inserts"], s["evictions"], s["failed_inserts"], s[last]],
            "generator": self.initializers[segment].generator,
        }

    def set_counters(
        self,
        segment: int = 0,
        *,
        optimizer_step: int | None = None,
        nonfinite_grads: int | None = None,
        index: list[int] | None = None,
        generator_state: torch.Tensor | None = None,
    ) -> None:
        """Restore one table's counters (a load; see :meth:`counters`); None keeps a value."""
        if optimizer_step is not None:
            self.optimizer_steps[segment] = optimizer_step
        if nonfinite_grads is not None:
            self.nonfinite_grads[segment] = nonfinite_grads
        if index is not None:
            self.index.set_counters(index, segment=segment if self.segmented else None)
        if generator_state is not None:
            self.initializers[segment].generator.set_state(generator_state)
        self.version += 1

    def to(self, device: torch.device, dtype: torch.dtype) -> None:
        """Move index, rows and buffers to ``device`` and rows to ``dtype``."""
        with writable():
            self.index.to(device)
            self.store = self.store.to(device, dtype)
        self.configs = [dataclasses.replace(c, device=device, dtype=dtype) for c in self.configs]
        self.initializers = [RowInitializer(c.initializer, self.embedding_dim, c.seed, dtype, device) for c in self.configs]
        if self.changes is not None:
            self.changes.to(device)
        self.version += 1


# The former twins' names: a table's engine and a group's are one class.
TableEngine = Engine
GroupEngine = Engine
GroupResolved = Resolved
