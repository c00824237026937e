"""DynamicTables: the one module base of dynemb's tables and collections, holding their policy.

T tables, G engines (groups of tables sharing dim, dtype, device, bucket width, score strategy
and non-finite policy; a plain table is one group of one), U unique (table, key) pairs of a
group in a call, E keys leaving, D embedding dim, S optimizer state columns, P keys with a
pending (deferred) gradient.

The engines (:class:`dynemb.nn.engine.Engine`, or a sharded one) do the work through the
engine contract (:mod:`dynemb.nn.base`); this layer decides: check mode, admission, eval
defaults, reporting of keys that fail or leave (evict hooks), the clock, deferred gradients,
thread safety (one lock per module), moves and conversions (``.to()``). ``DynamicTable`` (one
table) and the collections (many, fed by features) are thin front-ends over it.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import warnings
from collections.abc import Callable, Iterator

import torch
from torch.utils.hooks import RemovableHandle

from dynemb.config import TableConfig
from dynemb.errors import InsertionError
from dynemb.nn.admission import FrequencyAdmission
from dynemb.nn.autograd import Lookup
from dynemb.nn.clock import TimestampClock
from dynemb.nn.collective import collective
from dynemb.nn.deferred import GradAccumulator
from dynemb.nn.engine import Engine, Resolved, group_key
from dynemb.nn.functional import sum_per_key
from dynemb.nn.inputs import agreed_input, as_ids, checked_insert
from dynemb.nn.moves import conversion_target
from dynemb.nn.units import dense_gradient
from dynemb.optim.base import RowOptimizer
from dynemb.storage.base import RowStore
from dynemb.types import CheckMode, ScoreStrategy, UpdateMode
from dynemb.workspace import Recycler, Workspace, writable

_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


class TableGroup:
    """Static layout of one engine: its tables (segments) and the features that read them."""

    def __init__(self, index: int, tables: list[int]):
        self.index = index
        self.tables = tables  # module table indices, segment s = tables[s]
        self.features: list[int] = []  # feature indices (collections), in feature order
        self.feature_segments: list[int] = []
        # (ids per feature, segment of each id [N]) of the last batch shape: a batch of the same
        # shape reuses it (collection dedup).
        self.value_segments: tuple[tuple[int, ...], torch.Tensor] | None = None


class DynamicTables(torch.nn.Module):
    """Tables of int64 keys -> rows of embedding and optimizer state, with their policy.

    Args:
        tables: the tables' :class:`dynemb.TableConfig`, names distinct (``name`` or ``t<i>``).
        optimizer: row-wise optimizer shared by every table (each keeps its own state and step
            count); ``None`` makes the tables frozen.
        update: ``"fused"`` (rows update in backward) or ``"deferred"`` (backward sums the
            gradient per key; ``optimizer.step()`` applies it, ``zero_grad()`` drops it).
        store: the row store of a single table's engine (default: one tensor on its device).

    Training-mode lookups insert missing keys (subject to admission); eval-mode lookups never
    insert and give ``eval_default`` for missing keys. Every public method is safe to call from
    several threads: one lock per module serialises them (docs/design/0008-threading.md).
    """

    # Keys of a group come with their table (segment); a plain DynamicTable's engine takes none.
    segmented = True

    def __init__(
        self, tables: list[TableConfig], optimizer: RowOptimizer | None = None, *, update: UpdateMode | str = UpdateMode.FUSED, store: RowStore | None = None
    ):
        super().__init__()
        if optimizer is not None and not isinstance(optimizer, RowOptimizer):
            raise TypeError(f"optimizer={optimizer!r}: must be a dynemb.optim optimizer (SGD, Adagrad, RowWiseAdagrad, Adam) or None")
        self.update_mode = UpdateMode.parse(update, "update")
        if self.update_mode is UpdateMode.DEFERRED and optimizer is None:
            raise ValueError("update='deferred' needs an optimizer: optimizer.step() applies the accumulated gradient")
        self.table_configs = list(tables)
        self.table_names = [t.name if t.name is not None else f"t{i}" for i, t in enumerate(tables)]
        # Engines: tables sharing a group key, in order of first appearance.
        by_key: dict[tuple, list[int]] = {}
        for i, t in enumerate(tables):
            by_key.setdefault(group_key(t), []).append(i)
        self.groups = [TableGroup(g, members) for g, members in enumerate(by_key.values())]
        self.table_group: list[tuple[int, int]] = [(0, 0)] * len(tables)
        for group in self.groups:
            for s, t in enumerate(group.tables):
                self.table_group[t] = (group.index, s)
        if store is not None and self.segmented:
            raise ValueError("store=: a custom row store serves a DynamicTable's engine only")
        self.engines = [Engine([tables[t] for t in g.tables] if self.segmented else tables[0], optimizer, store) for g in self.groups]
        self.optimizer = optimizer
        self.admissions = [FrequencyAdmission(t.admission, t.device) if t.admission else None for t in tables]
        self.step = 0
        self.custom_score: int | None = None
        # The id of the checkpoint these tables hold exactly (a delta may follow it), or None.
        self.checkpoint_id: str | None = None
        self._timestamps = TimestampClock()
        self._lock = threading.RLock()
        device = tables[0].device
        self._workspace = Workspace(device)
        self._recycler = Recycler()
        self._evict_hooks: collections.OrderedDict[int, Callable] = collections.OrderedDict()
        self._failed = [torch.empty(0, dtype=torch.int64, device=device) for _ in tables]
        self._evicted = [torch.empty(0, dtype=torch.int64, device=device) for _ in tables]
        self._erased = [0] * len(tables)
        # One pending gradient per engine, keyed by (table, key); None when fused.
        self._pending: list[GradAccumulator] | None = None
        if self.update_mode is UpdateMode.DEFERRED:
            self._pending = [GradAccumulator(e.embedding_dim, e.dtype, e.device) for e in self.engines]
            for acc in self._pending:
                optimizer.register_deferred(self, acc.param)

    @property
    def update(self) -> str:
        """``"fused"`` or ``"deferred"``."""
        return str(self.update_mode)

    @property
    def lock(self) -> threading.RLock:
        """The module's lock: hold it to read or replace several tables consistently."""
        return self._lock

    def location(self, table: str) -> tuple[Engine, int, int]:
        """(engine, segment, table index) of a table name; KeyError naming it when unknown."""
        if table not in self.table_names:
            raise KeyError(f"table={table!r}: not a table of this module ({self.table_names})")
        t = self.table_names.index(table)
        g, s = self.table_group[t]
        return self.engines[g], s, t

    def _segments(self, group: int, s: int, keys: torch.Tensor) -> torch.Tensor | None:
        """The segments argument for keys [N] of one table: None when its engine has one table."""
        return torch.full_like(keys, s) if self.engines[group].segmented else None

    def _now(self, g: int) -> int:
        """The clock for engine g's index: the call's timestamp (:mod:`dynemb.nn.clock`) or the step."""
        timestamp = self.table_configs[self.groups[g].tables[0]].score_strategy is ScoreStrategy.TIMESTAMP
        return self._timestamps.now() if timestamp else self.step

    def clock(self) -> dict[str, int]:
        """The module's clock: ``step`` (training lookups) and ``last_timestamp`` (seconds since 2025-01-01 UTC, or later; nn/clock.py)."""
        return {"step": self.step, "last_timestamp": self._timestamps.last}

    def set_clock(self, step: int, last_timestamp: int) -> None:
        """Restore the clock (a load); a nanosecond ``last_timestamp`` (before 0036) is converted."""
        self.step = step
        self._timestamps.restore(last_timestamp)

    def _given_scores(self, n: int) -> torch.Tensor | None:
        if self.table_configs[0].score_strategy is not ScoreStrategy.CUSTOMIZED:
            return None
        if self.custom_score is None:
            raise ValueError("score_strategy='customized': call set_score(score) before training lookups")
        return torch.full((n,), self.custom_score, dtype=torch.int64, device=self.engines[0].device)

    def set_score(self, score: int) -> None:
        """Score given to keys used from now on (``customized`` strategy only; an int64)."""
        strategy = self.table_configs[0].score_strategy
        if strategy is not ScoreStrategy.CUSTOMIZED:
            raise ValueError(f"set_score needs score_strategy='customized', this table uses '{strategy}'")
        if not isinstance(score, int) or isinstance(score, bool) or not _INT64_MIN <= score <= _INT64_MAX:
            raise ValueError(f"score={score!r}: must be an int in the int64 range [-2**63, 2**63 - 1]")
        self.custom_score = score

    def _register_evict_hook(self, fn: Callable) -> RemovableHandle:
        handle = RemovableHandle(self._evict_hooks)
        self._evict_hooks[handle.id] = fn
        return handle

    def _resolve_train(self, g: int, keys: torch.Tensor, segs: torch.Tensor | None, counts: torch.Tensor, *, scores=None, admit: bool = True, **kw) -> Resolved:
        """Insert (subject to admission unless ``admit=False``) and return the resolution of one
        engine's unique keys [U]; failures and evictions are not reported yet."""
        engine, group = self.engines[g], self.groups[g]
        given = scores if scores is not None else self._given_scores(keys.numel())
        insertable = None
        admitting = [s for s, t in enumerate(group.tables) if self.admissions[t] is not None]
        if admitting and admit:
            _, found = engine.find(keys, segs)
            # Keys of the group's tables without admission stay insertable.
            insertable = torch.ones_like(found)
            for s in admitting:
                missing = ~found if segs is None else ~found & (segs == s)
                sel = missing.nonzero().squeeze(1)
                if sel.numel():
                    adm = self.admissions[group.tables[s]]
                    insertable.index_copy_(0, sel, adm.admit(keys.index_select(0, sel), counts.index_select(0, sel), self.step))
        r = engine.resolve(
            keys, segs, train=True, now=self._now(g), counts=counts, insertable=insertable, scores=given, evicted_contents=bool(self._evict_hooks), **kw
        )
        # Keys now in their table leave the admission counter (an insert's too: a key erased
        # later starts counting afresh).
        for s in admitting:
            self.admissions[group.tables[s]].forget(keys[r.inserted if segs is None else r.inserted & (segs == s)])
        return r

    def _report(self, g: int, r: Resolved) -> list:
        """The one exit of keys that leave or fail: record them per table, run evict hooks;
        returns the failures (table, keys, total) that the tables' check modes raise or warn about."""
        out = []
        for s, t in enumerate(self.groups[g].tables):
            name = self.table_names[t]
            if r.segments is None:
                failed, evicted, evicted_sel = r.failed_keys, r.evicted_keys, None
            else:
                failed = r.failed_keys[r.failed_segments == s] if r.failed_keys.numel() else r.failed_keys
                evicted_sel = (r.evicted_segments == s).nonzero().squeeze(1) if r.evicted_keys.numel() else None
                evicted = r.evicted_keys.index_select(0, evicted_sel) if evicted_sel is not None else r.evicted_keys
            self._failed[t], self._evicted[t] = failed, evicted
            if r.evicted is not None and evicted.numel():
                rows = r.evicted if evicted_sel is None else {k: v.index_select(0, evicted_sel) for k, v in r.evicted.items()}
                for fn in list(self._evict_hooks.values()):
                    fn(name, evicted, rows)
            if failed.numel() and self.table_configs[t].check_mode is not CheckMode.COUNT:
                # The table's keys in the call (a host sync per table: only when reporting).
                total = r.keys.numel() if r.segments is None else int((r.segments == s).sum())
                out.append((t, failed, total))
        return out

    def _raise_failures(self, failures: list) -> None:
        for t, failed, total in failures:
            engine, s, _ = self.location(self.table_names[t])
            where = ""
            if engine.collective:
                where = " of this rank's shard; the keys were refused by the shards that own them, which count them in their stats()"
            figures = engine.table_stats(s)
            tiers = "".join(f", {x['kind']} tier {x['rows']} of {x['capacity']} rows" for x in figures.get("tiers", ()))
            table = f"table {self.table_names[t]!r}: " if self.segmented else ""
            message = (
                f"{table}{failed.numel()} of {total} keys could not be inserted: both their buckets hold only keys used in this batch "
                f"or scored higher (score_strategy='{self.table_configs[t].score_strategy}', size={figures['size']}, "
                f"capacity={figures['capacity']}{tiers}{where}). Increase its capacity, or set check_mode='warn' or 'count' to continue; "
                "failed keys get their initial value and are not trained."
            )
            if self.table_configs[t].check_mode is CheckMode.RAISE:
                raise InsertionError(message + " The keys are on this exception's .failed_keys.", failed)
            warnings.warn(message, RuntimeWarning, stacklevel=4)

    def _trains(self) -> bool:
        return self.training and self.optimizer is not None and torch.is_grad_enabled()

    def _check_row_dtypes(self) -> None:
        """Refused before a training step changes anything (Adam on float16 rows, docs/design/0021)."""
        if self._trains():
            for group, engine in zip(self.groups, self.engines):
                what = None if not self.segmented else f"tables {[self.table_names[t] for t in group.tables]}"
                self.optimizer.check_row_dtype(engine.dtype, *(() if what is None else (what,)))

    def _lookup_unique(
        self, g: int, keys: torch.Tensor, segs: torch.Tensor | None, counts: torch.Tensor, failures: list, grouping=None, gather: bool = True
    ) -> Lookup:
        """Resolve one engine's unique keys [U] (inserting in training), gather their rows
        [U, D+S] with the missing keys' initial value (training) or eval default, and record the
        keys that failed or left (under the lock).

        ``gather=False``: the caller reads the rows straight from the store
        (:meth:`Engine.readable_rows`) before the table next changes; where it can (the store
        allows it, every key has its row) the Lookup's ``data`` is then None, not gathered."""
        engine = self.engines[g]
        D = engine.embedding_dim
        if self.training:
            r = self._resolve_train(g, keys, segs, counts)
        else:
            r = engine.resolve(keys, segs, train=False, now=None)
        missing = (~r.ok).nonzero().squeeze(1)
        in_place = not gather and missing.numel() == 0 and engine.readable_rows() is not None
        data = None if in_place else engine.gather(r.rows)  # [U, D+S]
        if missing.numel():
            if self.training:
                fill = engine.init_embeddings(keys.index_select(0, missing), None if segs is None else segs.index_select(0, missing))
            elif segs is None:
                fill = torch.full((missing.numel(), D), self.table_configs[self.groups[g].tables[0]].eval_default, dtype=data.dtype, device=data.device)
            else:
                defaults = torch.tensor([self.table_configs[t].eval_default for t in self.groups[g].tables], dtype=data.dtype, device=data.device)
                fill = defaults.index_select(0, segs.index_select(0, missing))[:, None].expand(-1, D)
            data[:, :D].index_copy_(0, missing, fill)
        lookup = Lookup(self, keys, r.rows, data, engine.version, repeatable=self._pending is not None, group=g, segments=segs, grouping=grouping)
        if self.training:
            failures.extend(self._report(g, r))
        return lookup

    @collective("backward")
    def apply_lookup_gradients(self, lookup: Lookup, grad_u, inverse, grad) -> None:
        """Backward of one lookup: sum per key if needed, then one fused optimizer step of its
        engine's tables (or add to the pending gradient when deferred). Called by the lookup."""
        with self._lock:
            engine = self.engines[lookup.group]
            if grad_u is None:
                # Into a buffer kept between steps, consumed before the lock is released.
                grad_u = sum_per_key(grad, inverse, lookup.grouping, self._workspace, f"grad{lookup.group}", lookup.keys.numel())
            if self._pending is not None or type(engine) is not Engine:
                # Only a local engine's update sums a bag collection's gradient itself (a
                # sharded engine, or any other, is handed a tensor).
                grad_u = dense_gradient(grad_u)
            if self._pending is not None:
                keys, segs = lookup.keys, lookup.segments
                ok = lookup.rows >= 0
                # Keys not in their table at the lookup (not admitted, failed) are not trained, as
                # with the fused update; one host sync, as the fused update's.
                if not bool(ok.all()):
                    sel = ok.nonzero().squeeze(1)
                    keys, grad_u = keys.index_select(0, sel), grad_u.index_select(0, sel)
                    segs = None if segs is None else segs.index_select(0, sel)
                self._pending[lookup.group].add(keys, grad_u, segments=segs)
                return
            engine.apply_gradients(
                lookup.keys,
                lookup.rows,
                grad_u,
                segments=lookup.segments,
                data=lookup.data,
                version=lookup.version,
                nonfinite=engine.configs[0].nonfinite_grads,
            )

    @collective("optimizer.step()")
    def deferred_step(self) -> None:
        """One optimizer step of every engine with a pending gradient, then clear it; keys that
        left their table since the lookup are skipped. Nothing (not even a step count) where
        nothing is pending. Called by ``optimizer.step()`` (a collective call when sharded)."""
        with self._lock:
            for engine, acc in zip(self.engines, self._pending or []):
                # Raises before any row changes with nonfinite_grads="raise": the gradient stays pending.
                engine.apply_pending(acc.keys, acc.grad, segments=acc.segments, nonfinite=engine.configs[0].nonfinite_grads)
                acc.clear()

    def deferred_clear(self) -> None:
        """Drop every pending gradient. Called by ``optimizer.zero_grad()``."""
        with self._lock:
            for acc in self._pending or []:
                acc.clear()

    def deferred_grad(self) -> list[torch.Tensor] | None:
        """The pending gradients ([P_g, D_g] per engine, live tensors: scaling one in place scales
        the next step), None when fused."""
        with self._lock:
            return None if self._pending is None else [acc.grad for acc in self._pending]

    def _pending_keys(self, t: int) -> torch.Tensor:
        engine, s, _ = self.location(self.table_names[t])
        with self._lock:
            if self._pending is None:
                return torch.empty(0, dtype=torch.int64, device=engine.device)
            acc = self._pending[self.table_group[t][0]]
            if not len(acc) or acc.segments is None:
                return acc.keys.clone()
            return acc.keys[acc.segments == s]

    def _find(self, t: int, keys) -> tuple[torch.Tensor, torch.Tensor]:
        engine, s, _ = self.location(self.table_names[t])
        keys = as_ids(keys, "keys", engine.device)
        flat = keys.reshape(-1)
        with self._lock:
            rows, found = engine.find(flat, self._segments(self.table_group[t][0], s, flat))
            values = engine.gather(rows)[:, : engine.embedding_dim]
        values.masked_fill_(~found[:, None], self.table_configs[t].eval_default)
        return values.view(*keys.shape, engine.embedding_dim), found.view(keys.shape)

    def _contains(self, t: int, keys) -> torch.Tensor:
        engine, s, _ = self.location(self.table_names[t])
        keys = as_ids(keys, "keys", engine.device)
        flat = keys.reshape(-1)
        with self._lock:
            return engine.find(flat, self._segments(self.table_group[t][0], s, flat))[1].view(keys.shape)

    def _insert(self, t: int, keys, values: torch.Tensor, scores, *, table: str | None) -> torch.Tensor:
        g, s = self.table_group[t]
        engine = self.engines[g]
        unique, inverse, counts, values, given = checked_insert(engine, table, keys, values, scores, require_float=True)
        with self._lock, writable():
            segs = self._segments(g, s, unique)
            # A warm start bypasses admission: the caller decides which keys belong.
            self._timestamps.start_call()
            r = self._resolve_train(g, unique, segs, counts, scores=given, admit=False, init_rows=values.shape[1] != engine.width)
            ok = r.ok.nonzero().squeeze(1)
            engine.write_rows(
                unique.index_select(0, ok), r.rows.index_select(0, ok), values.index_select(0, ok), segments=None if segs is None else segs.index_select(0, ok)
            )
            # Keys that did fit hold the caller's values before a failure is raised.
            failures = self._report(g, r)
        self._raise_failures(failures)
        return r.ok.index_select(0, inverse)

    def _erase(self, t: int, keys) -> torch.Tensor:
        g, s = self.table_group[t]
        engine = self.engines[g]
        keys, _ = agreed_input(engine, "erase", lambda: as_ids(keys, "keys", engine.device), lambda k: {})
        flat = keys.reshape(-1)
        with self._lock:
            segs = self._segments(g, s, flat)
            r, contents = engine.erase(flat, segs, evicted_contents=bool(self._evict_hooks))
            self._erased[t] += r.evicted_keys.numel()
            empty = r.evicted_keys.new_empty(0)
            # Reported as the erased table's alone (its segment), through the one exit.
            left = None if segs is None else r.evicted_segments
            self._report(g, Resolved(flat, empty, empty, empty, r.evicted_keys, contents, empty, segs, left, None if segs is None else empty))
        return r.found.view(keys.shape)

    def _export(self, t: int, chunk_size: int) -> Iterator[dict[str, torch.Tensor]]:
        if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
            raise ValueError(f"chunk_size={chunk_size!r}: must be an int >= 1")
        engine, s, _ = self.location(self.table_names[t])
        with self._lock:
            version = engine.version
            chunks = engine.export(s, chunk_size)
        while True:
            with self._lock:
                if engine.version != version:
                    raise RuntimeError("the table changed while export() was iterating; export again")
                chunk = next(chunks, None)
            if chunk is None:
                return
            yield chunk

    def _table_stats(self, t: int) -> dict[str, int | float]:
        engine, s, _ = self.location(self.table_names[t])
        with self._lock:
            entry = dict(engine.table_stats(s))
            # The engine's config: a sharded table's is this rank's share.
            entry["requested_capacity"] = engine.configs[s].capacity
            entry["erased"] = self._erased[t]
            entry["admission_rejections"] = self.admissions[t].rejections if self.admissions[t] else 0
            entry["nonfinite_grads"] = engine.nonfinite_grads[s]
            entry["step"] = self.step
            entry["optimizer_step"] = engine.optimizer_steps[s]
            entry["pending_grad_keys"] = self._pending_keys(t).numel()
            entry["scratch_bytes"] = self._workspace.nbytes() + sum(a.nbytes() for a in self._pending or [])
        return entry

    def table_counters(self, table: str) -> dict[str, object]:
        """One table's counters for a checkpoint: the module's :meth:`clock`, ``erased`` and the engine's (:meth:`Engine.counters`)."""
        engine, s, t = self.location(table)
        return {**self.clock(), "erased": self._erased[t], **engine.counters(s)}

    def restore_table(self, table: str, *, erased: int, admission: FrequencyAdmission | None) -> None:
        """Restore a table's module counters (a load): ``erased`` and its admission counter."""
        _, _, t = self.location(table)
        self._erased[t] = erased
        if self.admissions[t] is not None:
            self.admissions[t] = admission

    def flush(self) -> None:
        """Caching tables: write every dirty cached row back to the external store (checkpoint saves flush first)."""
        with self._lock:
            for engine in self.engines:
                engine.flush()

    def install_engine(self, group: int, engine) -> None:
        """Swap in engine ``group`` (a load built it on the side); its pending gradient, computed against the old rows, is dropped."""
        self.engines[group].retire(engine)
        self.engines[group] = engine
        if self._pending is not None:
            self._pending[group].clear()

    def _apply(self, fn, recurse=True):
        """``.to()``, ``.cuda()``, ``.cpu()``, ``.half()``, ``.double()``... move or convert every
        engine (rows with their optimizer state, docs/design/0021-dtype-moves.md; index), the
        admission counters, pending gradients and buffers."""
        # Every engine's target, checked before any engine changes.
        targets = [conversion_target(fn, e.device, e.dtype) for e in self.engines]
        super()._apply(fn, recurse)
        if all(t is None for t in targets):
            return self
        with self._lock:
            for g, (engine, target) in enumerate(zip(self.engines, targets)):
                if target is not None:
                    engine.to(*target)
                    if self._pending is not None:
                        self._pending[g].to(*target)
            engine_of = [self.engines[g] for g, _ in self.table_group]
            self.table_configs = [dataclasses.replace(c, device=e.device, dtype=e.dtype) for c, e in zip(self.table_configs, engine_of)]
            for admission, e in zip(self.admissions, engine_of):
                if admission is not None:
                    admission.to(e.device)
            # The module's own tensors live where its first table does (as when built).
            device = self.table_configs[0].device
            self._workspace.to(device)
            self._recycler.clear()
            self._failed = [k.to(device) for k in self._failed]
            self._evicted = [k.to(device) for k in self._evicted]
            self._derive_layout()
        return self

    def _derive_layout(self) -> None:
        """Called (under the lock) once the engines were moved or converted."""

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_lock"] = None
        state["_recycler"] = Recycler()  # a copy never shares output memory with the original
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.RLock()
        # A copy (deepcopy, pickle) registers with its optimizer (a copy's forgets the original's
        # tables; a shared one ignores a second registration).
        for acc in self._pending or []:
            self.optimizer.register_deferred(self, acc.param)
