"""Collections of dynamic tables fed by many features at once.

F features, T tables, B samples (the batch), N_f ids of feature f, U unique (table, key) pairs of
a group, D a table's embedding dim.

:class:`DynamicEmbeddingBagCollection` (pooled, ``feature -> [B, D]``) and
:class:`DynamicEmbeddingCollection` (sequence, ``feature -> (values [N_f, D], lengths [B])``)
take a KeyedJaggedTensor (duck-typed) or a dict ``feature -> (values, lengths[, weights])``.
Tables that share embedding dim, dtype, device, bucket width, score strategy and non-finite
policy form a group, looked up and updated in one pass: one de-duplication of (table, key)
pairs, one index call, one gather and one fused optimizer step per batch
(:class:`dynemb.nn.group.GroupEngine`). A table read by several features takes one step per
batch, its features' gradients summed per key first. See docs/design/0013-collections.md.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
import warnings
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch.utils.hooks import RemovableHandle

from dynemb.config import TableConfig
from dynemb.errors import InsertionError
from dynemb.nn.admission import FrequencyAdmission
from dynemb.nn.autograd import FusedEmbeddings, Lookup
from dynemb.nn.collective import collective
from dynemb.nn.deferred import GradAccumulator
from dynemb.nn.group import GroupEngine, GroupResolved, group_key
from dynemb.nn.moves import conversion_target
from dynemb.nn.units import UnitLayout, group_gradient, pool
from dynemb.optim.base import RowOptimizer
from dynemb.table.index import unique_pairs
from dynemb.types import CheckMode, PoolingMode, ScoreStrategy
from dynemb.workspace import Recycler, Workspace, writable

_UPDATES = ("fused", "deferred")


class GroupLookup(Lookup):
    """A group's lookup: :class:`Lookup` plus the segment of each unique key and the group."""

    __slots__ = ("group", "grouping", "segments")

    def __init__(self, owner, group: int, keys, segments, rows, data, version: int, repeatable: bool = False, grouping: tuple | None = None):
        super().__init__(owner, keys, rows, data, version, repeatable)
        self.group, self.segments = group, segments
        # (order [N], starts [U]): ids grouped by key, when the dedup's sort gives it.
        self.grouping = grouping


class _PooledBags(torch.autograd.Function):
    """Pooled bags of a group [F_g * B, D] straight from its lookup's rows; backward sums the
    bags' gradient per unique key (one index_add_) and hands it to the fused update.

    Args of forward: trigger, lookup, inverse [N] (unique key of each id), offsets [F_g * B],
    lengths [F_g * B], weights [N] or None, divisor [F_g * B] (mean bags) or None, D.
    """

    @staticmethod
    def forward(ctx, trigger, lookup, inverse, offsets, lengths, weights, divisor, embedding_dim):
        pooled = F.embedding_bag(inverse, lookup.data[:, :embedding_dim], offsets, mode="sum", per_sample_weights=weights)
        if divisor is not None:
            pooled.div_(divisor[:, None])
        ctx.lookup, ctx.inverse, ctx.lengths, ctx.weights, ctx.divisor = lookup, inverse, lengths, weights, divisor
        return pooled

    @staticmethod
    def backward(ctx, grad):
        if ctx.divisor is not None:
            grad = grad / ctx.divisor[:, None]
        n = ctx.inverse.numel()
        # The gradient of each id is its bag's: one row per id, in id order.
        if n == ctx.lengths.numel() and bool((ctx.lengths == 1).all()):
            per_id = grad
        else:
            bag_of_id = torch.repeat_interleave(torch.arange(ctx.lengths.numel(), device=grad.device), ctx.lengths, output_size=n)
            per_id = grad.index_select(0, bag_of_id)
        if ctx.weights is not None:
            per_id = per_id * ctx.weights[:, None]
        ctx.lookup.apply(inverse=ctx.inverse, grad=per_id)
        return (None,) * 8


class _PooledUnits(torch.autograd.Function):
    """Every group's pooled bags at once, written into the concat [B, sum D_f] (dynemb.nn.units);
    backward sums each group's gradient per unique row from the concat's and applies it.

    Args of forward: trigger, the collection, the batch, its groups' (lookup, inverse, totals).
    """

    @staticmethod
    def forward(ctx, trigger, owner, batch, looked):
        out, grads = owner._pool_units(batch, looked)
        ctx.layout, ctx.looked, ctx.grads = owner._units, looked, grads
        return out

    @staticmethod
    def backward(ctx, grad):
        layout = ctx.layout
        grad_rows = grad.contiguous().view(-1, layout.unit)  # [B * K, u]
        arange = layout.on(grad.device)["arange"]
        for (lookup, inverse, _totals), info, k in zip(ctx.looked, ctx.grads, layout.group_k):
            num_unique = lookup.keys.numel()
            if lookup.grouping is not None:
                order, starts = lookup.grouping
            else:
                # Keys read through two tables: the dedup gave no grouping; group the ids here.
                order = torch.argsort(inverse, stable=True)
                counts = torch.bincount(inverse, minlength=num_unique)
                starts = torch.cumsum(counts, 0).sub_(counts)
            lookup.apply(grad_u=group_gradient(grad_rows, info, order, starts, num_unique, k, arange))
        return None, None, None, None


class PooledEmbeddings(dict):
    """``feature -> Tensor [B, D_f]``, every value a view of :attr:`concat`.

    Attributes:
        concat (Tensor): [B, sum D_f], features in the collection's ``feature_names`` order.
        feature_names (list[str]): that order.
    """

    def __init__(self, concat: torch.Tensor, feature_names: list[str], dims: list[int]):
        super().__init__(zip(feature_names, torch.split(concat, dims, dim=1)))
        self.concat = concat
        self.feature_names = list(feature_names)


class _Group:
    """Static layout of one group: its tables (segments) and features."""

    def __init__(self, index: int, tables: list[int]):
        self.index = index
        self.tables = tables  # collection table indices, segment s = tables[s]
        self.features: list[int] = []  # collection feature indices, in collection order
        self.feature_segments: list[int] = []

    def dedup(self, vals: list[torch.Tensor], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, tuple | None]:
        """Distinct (table, key) pairs of the group's feature values ``vals`` (its features'
        order): segments [U], keys [U], inverse [N_g], counts [U] (each table's keys ascending)
        and the grouping (order [N_g], starts [U]) of the ids by pair, or None.

        One stable sort of the raw keys. When no key is read through two tables (the usual
        case: tables hold different id spaces) its runs are the distinct pairs, sorted by key,
        and the sort's permutation groups the ids by pair, so the backward sums their gradients
        with one gather-sum instead of a serial scatter-add. Otherwise pairs are formed
        (:func:`unique_pairs`), sorted by segment, then key, and the grouping is None."""
        values = torch.cat(vals) if len(vals) > 1 else vals[0]
        n = values.numel()
        sorted_values, order = torch.sort(values, stable=True)
        new = torch.ones(n, dtype=torch.bool, device=device)
        if n > 1:
            torch.ne(sorted_values[1:], sorted_values[:-1], out=new[1:])
        starts = new.nonzero().squeeze(1)
        keys = sorted_values.index_select(0, starts)
        counts = torch.diff(starts, append=starts.new_tensor([n]))
        inverse = torch.empty_like(order).scatter_(0, order, new.cumsum(0).sub_(1))
        if len(self.tables) == 1:
            return torch.zeros_like(keys), keys, inverse, counts, (order, starts)
        seg_of_value = torch.repeat_interleave(
            torch.tensor(self.feature_segments, device=device), torch.tensor([v.numel() for v in vals], device=device), output_size=n
        )
        seg_sorted = seg_of_value.index_select(0, order)
        if n > 1 and bool(((seg_sorted[1:] != seg_sorted[:-1]) & ~new[1:]).any()):
            (segments, keys), inverse, counts = unique_pairs(seg_of_value, values)
            return segments, keys, inverse, counts, None
        return seg_sorted.index_select(0, starts), keys, inverse, counts, (order, starts)


class _Batch:
    """Validated input: per feature (collection order) its values [N_f], lengths [B] and weights."""

    def __init__(self, values: list[torch.Tensor], lengths: list[torch.Tensor], weights: list[torch.Tensor | None], batch: int, stacked: torch.Tensor):
        self.values, self.lengths, self.weights, self.batch = values, lengths, weights, batch
        self.stacked = stacked  # lengths [F, B]


class _DynamicCollection(torch.nn.Module):
    """What both collections share: tables, groups, input parsing, lookups, policy and state."""

    pooled = False

    def __init__(self, tables: list[TableConfig], optimizer: RowOptimizer | None = None, *, update: str = "fused"):
        super().__init__()
        if not isinstance(tables, (list, tuple)) or not tables or not all(isinstance(t, TableConfig) for t in tables):
            raise TypeError(f"tables={tables!r}: must be a non-empty list of dynemb.TableConfig")
        if optimizer is not None and not isinstance(optimizer, RowOptimizer):
            raise TypeError(f"optimizer={optimizer!r}: must be a dynemb.optim optimizer (SGD, Adagrad, RowWiseAdagrad, Adam) or None")
        if update not in _UPDATES:
            raise ValueError(f"update={update!r}: must be 'fused' or 'deferred'")
        if update == "deferred" and optimizer is None:
            raise ValueError("update='deferred' needs an optimizer (its step() applies the accumulated gradients)")
        self.update = update
        self.table_configs = list(tables)
        self.table_names: list[str] = []
        for i, t in enumerate(tables):
            name = t.name if t.name is not None else f"t{i}"
            if name in self.table_names:
                raise ValueError(f"tables[{i}].name={name!r}: table names must be distinct")
            if t.score_strategy is ScoreStrategy.CUSTOMIZED:
                raise ValueError(f"tables[{i}].score_strategy='customized': not supported in collections yet; use a DynamicTable")
            if "." in name:
                raise ValueError(f"tables[{i}].name={name!r}: must not contain '.' (it separates state_dict entries)")
            self.table_names.append(name)
        self.feature_names: list[str] = []
        self._feature_table: list[int] = []
        for i, t in enumerate(tables):
            for f in t.feature_names or (self.table_names[i],):
                if f in self.feature_names:
                    other = self.table_names[self._feature_table[self.feature_names.index(f)]]
                    raise ValueError(f"feature {f!r} is listed by tables {other!r} and {self.table_names[i]!r}: a feature reads one table")
                self.feature_names.append(f)
                self._feature_table.append(i)
        self._feature_pos = {f: j for j, f in enumerate(self.feature_names)}
        self.feature_dims = [tables[t].embedding_dim for t in self._feature_table]
        # Groups: tables sharing a group key, in order of first appearance.
        keys: dict[tuple, list[int]] = {}
        for i, t in enumerate(tables):
            keys.setdefault(group_key(t), []).append(i)
        self._groups = [_Group(g, members) for g, members in enumerate(keys.values())]
        self._table_group: list[tuple[int, int]] = [(0, 0)] * len(tables)
        for group in self._groups:
            for s, t in enumerate(group.tables):
                self._table_group[t] = (group.index, s)
        for j, t in enumerate(self._feature_table):
            g, s = self._table_group[t]
            self._groups[g].features.append(j)
            self._groups[g].feature_segments.append(s)
        self.engines = [GroupEngine([tables[t] for t in group.tables], optimizer) for group in self._groups]
        self.optimizer = optimizer
        self.admissions = [FrequencyAdmission(t.admission, t.device) if t.admission else None for t in tables]
        self.step = 0
        self._last_timestamp = 0
        self._lock = threading.RLock()
        self._workspace = Workspace(tables[0].device)
        self._recycler = Recycler()
        self._evict_hooks: collections.OrderedDict[int, Callable] = collections.OrderedDict()
        device = tables[0].device
        self.last_failed_keys = {n: torch.empty(0, dtype=torch.int64, device=device) for n in self.table_names}
        self.last_evicted_keys = {n: torch.empty(0, dtype=torch.int64, device=device) for n in self.table_names}
        self._erased = [0] * len(tables)
        self._pending: list[GradAccumulator] | None = None
        if update == "deferred":
            self._pending = [GradAccumulator(e.embedding_dim, e.dtype, e.device) for e in self.engines]
            for acc in self._pending:
                optimizer.register_deferred(self, acc.param)

    # -- introspection -----------------------------------------------------------------------

    def extra_repr(self) -> str:
        tables = ", ".join(f"{n}(dim={c.embedding_dim}, capacity={c.capacity})" for n, c in zip(self.table_names, self.table_configs))
        return f"tables=[{tables}], groups={len(self._groups)}, optimizer={self.optimizer!r}, update='{self.update}'"

    def _engine_of(self, table: str) -> tuple[GroupEngine, int, int]:
        if table not in self.table_names:
            raise KeyError(f"table={table!r}: not a table of this collection ({self.table_names})")
        t = self.table_names.index(table)
        g, s = self._table_group[t]
        return self.engines[g], s, t

    def stats(self) -> dict[str, dict[str, int | float]]:
        """Per table name: size, capacity, requested_capacity, load_factor, inserts, evictions,
        erased, failed_inserts, admission_rejections, nonfinite_grads, step, optimizer_step."""
        with self._lock:
            out = {}
            per_group = [e.index.segment_stats() for e in self.engines]
            for t, name in enumerate(self.table_names):
                g, s = self._table_group[t]
                entry = dict(per_group[g][s])
                # The engine's config: a sharded table's is this rank's share.
                entry["requested_capacity"] = self.engines[g].configs[s].capacity
                entry["admission_rejections"] = self.admissions[t].rejections if self.admissions[t] else 0
                entry["nonfinite_grads"] = self.engines[g].nonfinite_grads[s]
                entry["step"] = self.step
                entry["optimizer_step"] = self.engines[g].optimizer_steps[s]
                out[name] = entry
            return out

    def register_evict_hook(self, fn: Callable) -> RemovableHandle:
        """Call ``fn(table_name, keys, rows)`` for every key that leaves a table (evicted or
        erased); ``rows`` as for :meth:`DynamicTable.register_evict_hook`."""
        if not callable(fn):
            raise TypeError(f"fn={fn!r}: must be callable as fn(table_name, keys, rows)")
        handle = RemovableHandle(self._evict_hooks)
        self._evict_hooks[handle.id] = fn
        return handle

    # -- input -------------------------------------------------------------------------------

    def _parse(self, features) -> _Batch:
        """Check the input and split it per feature (collection order); raises naming the feature."""
        device = self.table_configs[0].device
        if isinstance(features, Mapping):
            per = {}
            for f, item in features.items():
                if not isinstance(item, (tuple, list)) or len(item) not in (2, 3):
                    raise ValueError(f"feature {f!r}: expected (values, lengths) or (values, lengths, weights), got {type(item).__name__}")
                per[f] = (item[0], item[1], item[2] if len(item) == 3 else None)
            names = list(per)
        elif all(hasattr(features, a) for a in ("keys", "values", "lengths")):
            if callable(getattr(features, "variable_stride_per_key", None)) and features.variable_stride_per_key():
                raise ValueError("a variable-batch KeyedJaggedTensor (stride per feature) is not supported: give every feature the same batch size")
            names = list(features.keys())
            values, lengths = features.values(), features.lengths()
            weights = features.weights_or_none() if hasattr(features, "weights_or_none") else None
            if not isinstance(lengths, torch.Tensor) or lengths.dim() != 1 or (names and lengths.numel() % len(names)):
                raise ValueError(f"KeyedJaggedTensor: lengths of shape {tuple(lengths.shape)} do not split into {len(names)} features")
            per_feature = lengths.view(len(names), -1) if names else lengths.view(0, 0)
            totals = per_feature.sum(1).tolist()
            if sum(totals) != values.numel():
                raise ValueError(f"KeyedJaggedTensor: lengths sum to {sum(totals)} but values has {values.numel()} entries")
            vs = torch.split(values, totals)
            ws = torch.split(weights, totals) if weights is not None else [None] * len(names)
            per = {f: (vs[j], per_feature[j], ws[j]) for j, f in enumerate(names)}
        else:
            raise TypeError(f"features: expected a KeyedJaggedTensor or a dict feature -> (values, lengths), got {type(features).__name__}")
        unknown = [f for f in names if f not in self._feature_pos]
        if unknown:
            raise ValueError(f"features {unknown}: unknown to this collection (its features: {self.feature_names})")
        missing = [f for f in self.feature_names if f not in per]
        if missing:
            raise ValueError(f"features {missing}: missing from the input (every feature of the collection is needed)")
        out_v, out_l, out_w, batch = [], [], [], None
        for f in self.feature_names:
            v, ln, w = per[f]
            if not isinstance(v, torch.Tensor) or v.dim() != 1 or v.dtype not in (torch.int64, torch.int32):
                raise ValueError(f"feature {f!r}: values must be a 1-D int64 tensor, got {_describe(v)}")
            if not isinstance(ln, torch.Tensor) or ln.dim() != 1 or ln.dtype not in (torch.int64, torch.int32):
                raise ValueError(f"feature {f!r}: lengths must be a 1-D int tensor, got {_describe(ln)}")
            if v.device != device or ln.device != device:
                raise ValueError(f"feature {f!r}: values on {v.device}, lengths on {ln.device}; the tables live on {device}")
            if batch is None:
                batch, first = ln.numel(), f
            elif ln.numel() != batch:
                raise ValueError(
                    f"feature {f!r}: {ln.numel()} lengths, but feature {first!r} has {batch} (one length per sample; variable batch sizes are not supported)"
                )
            ln = ln.to(torch.int64)
            if w is not None:
                if not self.pooled or not self.is_weighted:
                    raise ValueError(f"feature {f!r}: weights given to an unweighted collection (build it with is_weighted=True)")
                if not isinstance(w, torch.Tensor) or w.shape != v.shape or not w.is_floating_point() or w.device != device:
                    raise ValueError(f"feature {f!r}: weights must be a float tensor shaped like values {tuple(v.shape)} on {device}, got {_describe(w)}")
            elif self.pooled and self.is_weighted:
                raise ValueError(f"feature {f!r}: no weights, but the collection is weighted (is_weighted=True)")
            out_v.append(v.to(torch.int64))
            out_l.append(ln)
            out_w.append(w)
        if batch:
            # Every feature's lengths at once (one reduction each instead of one per feature).
            stacked = torch.stack(out_l)  # [F, B]
            negative = (stacked < 0).any(1)
            if bool(negative.any()):
                raise ValueError(f"feature {self.feature_names[int(negative.nonzero()[0])]!r}: lengths must be >= 0")
            for f, total, v in zip(self.feature_names, stacked.sum(1).tolist(), out_v):
                if total != v.numel():
                    raise ValueError(f"feature {f!r}: lengths sum to {total} but values has {v.numel()} entries")
        else:
            stacked = torch.zeros(len(self.feature_names), 0, dtype=torch.int64, device=device)
            for f, v in zip(self.feature_names, out_v):
                if v.numel():
                    raise ValueError(f"feature {f!r}: lengths sum to 0 but values has {v.numel()} entries")
        return _Batch(out_v, out_l, out_w, batch or 0, stacked)

    # -- lookups -----------------------------------------------------------------------------

    def _now(self) -> int:
        if self.table_configs[0].score_strategy is ScoreStrategy.TIMESTAMP:
            self._last_timestamp = max(time.time_ns(), self._last_timestamp + 1)
            return self._last_timestamp
        return self.step

    def _lookup_group(self, group: _Group, batch: _Batch, failures: list, pooled: bool = False):
        """Dedup, resolve and gather one group's ids. Returns embeddings [U, D] (fused-update
        autograd when training; with ``pooled``, the lookup itself, for :class:`_PooledBags`),
        the inverse [N_g] of each id and the ids per feature."""
        engine = self.engines[group.index]
        device = engine.device
        vals = [batch.values[j] for j in group.features]
        totals = [v.numel() for v in vals]
        segs, keys, inverse, counts, grouping = group.dedup(vals, device)
        D = engine.embedding_dim
        if self.training:
            r = self._resolve_train(group, engine, keys, segs, counts)
        else:
            r = engine.resolve(keys, segs, train=False, now=None)
        data = engine.gather(r.rows)
        missing = (~r.ok).nonzero().squeeze(1)
        if missing.numel():
            if self.training:
                fill = engine.init_embeddings(keys.index_select(0, missing), segs.index_select(0, missing))
            else:
                defaults = torch.tensor([self.table_configs[t].eval_default for t in group.tables], dtype=data.dtype, device=device)
                fill = defaults.index_select(0, segs.index_select(0, missing))[:, None].expand(-1, D)
            data[:, :D].index_copy_(0, missing, fill)
        lookup = GroupLookup(self, group.index, keys, segs, r.rows, data, engine.version, repeatable=self._pending is not None, grouping=grouping)
        if self.training:
            failures.extend(self._report(group, r))
        if self.training and self.optimizer is not None and torch.is_grad_enabled():
            if pooled:
                return lookup, inverse, totals
            trigger = torch.empty(0, device=device, requires_grad=True)
            emb = FusedEmbeddings.apply(trigger, lookup, D)
        else:
            emb = data[:, :D]
        return emb, inverse, totals

    def _resolve_train(self, group: _Group, engine: GroupEngine, keys, segs, counts) -> GroupResolved:
        insertable = None
        admitting = [s for s, t in enumerate(group.tables) if self.admissions[t] is not None]
        if admitting:
            _, found = engine.index.find(keys, segments=segs)
            insertable = torch.ones_like(found)
            for s in admitting:
                sel = (~found & (segs == s)).nonzero().squeeze(1)
                if sel.numel():
                    adm = self.admissions[group.tables[s]]
                    insertable.index_copy_(0, sel, adm.admit(keys.index_select(0, sel), counts.index_select(0, sel), self.step))
        r = engine.resolve(keys, segs, train=True, now=self._now(), counts=counts, insertable=insertable, evicted_contents=bool(self._evict_hooks))
        for s in admitting:
            self.admissions[group.tables[s]].forget(keys[r.inserted & (segs == s)])
        return r

    def _report(self, group: _Group, r: GroupResolved) -> list:
        """Record failed and evicted keys per table and run evict hooks; returns the failures
        that the tables' check modes raise or warn about."""
        out = []
        for s, t in enumerate(group.tables):
            name = self.table_names[t]
            failed = r.failed_keys[r.failed_segments == s] if r.failed_keys.numel() else r.failed_keys
            evicted_sel = (r.evicted_segments == s).nonzero().squeeze(1) if r.evicted_keys.numel() else None
            evicted = r.evicted_keys.index_select(0, evicted_sel) if evicted_sel is not None else r.evicted_keys
            self.last_failed_keys[name] = failed
            self.last_evicted_keys[name] = evicted
            if r.evicted is not None and evicted.numel():
                rows = {k: v.index_select(0, evicted_sel) for k, v in r.evicted.items()}
                for fn in list(self._evict_hooks.values()):
                    fn(name, evicted, rows)
            if failed.numel() and self.table_configs[t].check_mode is not CheckMode.COUNT:
                out.append((t, failed, int((r.segments == s).sum())))
        return out

    def _raise_failures(self, failures: list) -> None:
        for t, failed, total in failures:
            name = self.table_names[t]
            engine, s, _ = self._engine_of(name)
            where = ""
            if getattr(engine, "collective", False):
                where = " of this rank's shard; the keys were refused by the shards that own them, which count them in their stats()"
            message = (
                f"table {name!r}: {failed.numel()} of {total} keys could not be inserted: both their buckets hold only keys used "
                f"in this batch or scored higher (capacity={engine.index.segment_capacity(s)}{where}). Increase its capacity, or set "
                "check_mode='warn' or 'count'; failed keys get their initial value and are not trained."
            )
            if self.table_configs[t].check_mode is CheckMode.RAISE:
                raise InsertionError(message + " The keys are on this exception's .failed_keys.", failed)
            warnings.warn(message, RuntimeWarning, stacklevel=4)

    @collective("forward")
    def _lookup(self, features, pooled: bool = False):
        batch = self._parse(features)
        if self.training and self.optimizer is not None and torch.is_grad_enabled():
            # Refused before the step changes anything (Adam on float16 rows, docs/design/0021).
            for group, engine in zip(self._groups, self.engines):
                self.optimizer.check_row_dtype(engine.dtype, f"tables {[self.table_names[t] for t in group.tables]}")
        failures: list = []
        with self._lock:
            if self.training:
                self.step += 1
            looked = [self._lookup_group(group, batch, failures, pooled) for group in self._groups]
        self._raise_failures(failures)
        return batch, looked

    @collective("backward")
    def _apply_lookup_gradients(self, lookup: GroupLookup, grad_u, inverse, grad) -> None:
        """Backward of one group's lookup: one fused step of its tables (or accumulate, deferred)."""
        with self._lock:
            engine = self.engines[lookup.group]
            if grad_u is None and lookup.grouping is not None:
                # The ids in key order (the dedup's sort): one parallel gather-sum per key.
                order, starts = lookup.grouping
                grad_u = F.embedding_bag(order, grad, starts, mode="sum")
            elif grad_u is None:
                # Summed into a buffer kept between steps (a fresh [U, D] page-faults on CPU).
                buf = self._workspace.get(f"grad{lookup.group}", lookup.keys.numel(), (engine.embedding_dim,), grad.dtype)
                grad_u = buf.zero_().index_add_(0, inverse, grad)
            if self._pending is not None:
                ok = lookup.rows >= 0
                keys, segs = lookup.keys, lookup.segments
                # Keys not in their table at the lookup (not admitted, failed) are not trained.
                if not bool(ok.all()):
                    sel = ok.nonzero().squeeze(1)
                    keys, segs, grad_u = keys.index_select(0, sel), segs.index_select(0, sel), grad_u.index_select(0, sel)
                self._pending[lookup.group].add(keys, grad_u, segments=segs)
                return
            engine.apply_gradients(
                lookup.keys,
                lookup.segments,
                lookup.rows,
                grad_u,
                data=lookup.data,
                version=lookup.version,
                nonfinite=engine.configs[0].nonfinite_grads,
            )

    # -- deferred updates --------------------------------------------------------------------

    # The DeferredOwner protocol of dynemb.optim.base (docs/design/0011-deferred-updates.md): one
    # pending gradient per group, keyed by (table, key).

    @collective("optimizer.step()")
    def _deferred_apply(self) -> None:
        """One optimizer step of every group with a pending gradient, then clear it; keys that
        left their table since the lookup are skipped. Called by ``optimizer.step()``."""
        with self._lock:
            for engine, acc in zip(self.engines, self._pending or []):
                engine.apply_pending(acc.keys, acc.segments, acc.grad, nonfinite=engine.configs[0].nonfinite_grads)
                acc.clear()

    def _deferred_clear(self) -> None:
        """Drop every pending gradient. Called by ``optimizer.zero_grad()``."""
        with self._lock:
            for acc in self._pending or []:
                acc.clear()

    def _deferred_grad(self) -> list[torch.Tensor] | None:
        """The pending gradients ([P_g, D_g] per group, live tensors), None when fused."""
        with self._lock:
            return None if self._pending is None else [acc.grad for acc in self._pending]

    def pending_keys(self, table: str) -> torch.Tensor:
        """Tensor[int64]: [P] keys of one table with a pending (deferred) gradient."""
        engine, s, _ = self._engine_of(table)
        with self._lock:
            if self._pending is None:
                return torch.empty(0, dtype=torch.int64, device=engine.device)
            acc = self._pending[self.engines.index(engine)]
            if not len(acc):
                return acc.keys
            return acc.keys[acc.segments == s]

    # -- direct access -----------------------------------------------------------------------

    @collective("find() / contains()")
    def find(self, table: str, keys) -> tuple[torch.Tensor, torch.Tensor]:
        """Embeddings of one table's keys without side effects: keys [*] -> values [*, D]
        (eval_default where missing), found [*]."""
        from dynemb.nn.module import as_ids

        engine, s, t = self._engine_of(table)
        keys = as_ids(keys, "keys", engine.device)
        flat = keys.reshape(-1)
        with self._lock:
            rows, found = engine.find(flat, torch.full_like(flat, s))
            values = engine.gather(rows)[:, : engine.embedding_dim]
        values.masked_fill_(~found[:, None], self.table_configs[t].eval_default)
        return values.view(*keys.shape, engine.embedding_dim), found.view(keys.shape)

    def export(self, table: str, chunk_size: int = 1 << 16):
        """One table's keys with their rows, in chunks (see :meth:`DynamicTable.export`)."""
        engine, s, _ = self._engine_of(table)
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

    @collective("insert()")
    def insert(self, table: str, keys, values: torch.Tensor, scores: torch.Tensor | None = None) -> torch.Tensor:
        """Assign rows to one table's keys ([N] distinct), inserting missing ones; ``values``
        [N, D] (embeddings) or [N, D+S] (whole rows). Returns found-after ([N] bool)."""
        from dynemb.nn.module import checked_insert

        engine, s, t = self._engine_of(table)
        unique, inverse, _counts, values, given = checked_insert(engine, table, keys, values, scores)
        with self._lock, writable():
            segs = torch.full_like(unique, s)
            now = self._now()
            r = engine.resolve(
                unique, segs, train=True, now=now, scores=given, evicted_contents=bool(self._evict_hooks), init_rows=values.shape[1] != engine.width
            )
            ok = r.ok.nonzero().squeeze(1)
            engine.write_rows(unique.index_select(0, ok), segs.index_select(0, ok), r.rows.index_select(0, ok), values.index_select(0, ok))
            failures = self._report(self._groups[self._table_group[t][0]], r)
        self._raise_failures(failures)
        return r.ok.index_select(0, inverse)

    # -- torch.nn.Module behaviour -----------------------------------------------------------

    def _apply(self, fn, recurse=True):
        """``.to()``, ``.cuda()``, ``.cpu()``, ``.half()``, ``.double()``... move or convert every
        group (rows, index, pending gradients), the admission counters and the buffers
        (docs/design/0021-dtype-moves.md)."""
        # Every group's target, checked before any group changes.
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
            engine_of = [self.engines[g] for g, _ in self._table_group]
            self.table_configs = [dataclasses.replace(c, device=e.device, dtype=e.dtype) for c, e in zip(self.table_configs, engine_of)]
            for admission, e in zip(self.admissions, engine_of):
                if admission is not None:
                    admission.to(e.device)
            # The collection's own tensors live where its first table does (as when built).
            device = self.table_configs[0].device
            self._workspace.to(device)
            self._recycler.clear()
            self.last_failed_keys = {n: k.to(device) for n, k in self.last_failed_keys.items()}
            self.last_evicted_keys = {n: k.to(device) for n, k in self.last_evicted_keys.items()}
            self._derive_layout()
        return self

    def _derive_layout(self) -> None:
        """Called (under the lock) once the groups were moved or converted."""

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_lock"] = None
        state["_recycler"] = Recycler()  # a copy never shares output memory with the original
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.RLock()

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        from dynemb.nn.collection_state import collection_state

        for name, value in collection_state(self).items():
            destination[prefix + name] = value

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        from dynemb.nn.collection_state import expected_entries, load_collection_state
        from dynemb.nn.module import load_own_entries

        def load(entries):
            with self._lock:
                load_collection_state(self, entries)

        load_own_entries(self, expected_entries(self), load, state_dict, prefix, strict, missing_keys, unexpected_keys, error_msgs)


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dim()}-D {value.dtype} tensor on {value.device}"
    return type(value).__name__


class DynamicEmbeddingBagCollection(_DynamicCollection):
    """Pooled lookups of many features in tables of dynamic int64 keys: ``features -> {feature: [B, D]}``.

    Args:
        tables: one :class:`dynemb.TableConfig` per table, each with ``name``, ``feature_names``
            (default: the name), ``embedding_dim``, ``capacity``, ``pooling`` (``sum`` | ``mean``)
            and any other table option (score strategy, admission, initializer, check mode...).
        optimizer: fused optimizer shared by every table (each keeps its own state and step
            count), or ``None`` for frozen tables.
        update: ``"fused"`` (default: rows update in backward) or ``"deferred"`` (gradients
            accumulate until ``optimizer.step()``).
        is_weighted: every feature comes with per-id weights (``sum`` pooling only).

    ``forward(features)``: a KeyedJaggedTensor (duck-typed: ``keys()``, ``values()``,
    ``lengths()``, ``weights_or_none()``) or a dict ``feature -> (values [N_f], lengths [B])``
    (``(values, lengths, weights)`` when weighted) -> :class:`PooledEmbeddings`, a dict
    ``feature -> [B, D_f]`` whose ``.concat`` is ``[B, sum D_f]`` in ``feature_names`` order.
    Empty bags pool to zeros.

    Example::

        ebc = dynemb.DynamicEmbeddingBagCollection(
            tables=[dynemb.TableConfig(name="user", feature_names=["user_id"], embedding_dim=16, capacity=1 << 16),
                    dynemb.TableConfig(name="item", feature_names=["item_id", "last_item"], embedding_dim=16, capacity=1 << 16)],
            optimizer=dynemb.optim.Adagrad(lr=0.05))
        out = ebc({"user_id": (torch.tensor([7, -3]), torch.tensor([1, 1])),
                   "item_id": (torch.tensor([2**40, 5, 5]), torch.tensor([2, 1])),
                   "last_item": (torch.tensor([5]), torch.tensor([0, 1]))})
        out["item_id"].shape, out.concat.shape        # [2, 16], [2, 48]
    """

    pooled = True

    def __init__(self, tables: list[TableConfig], optimizer: RowOptimizer | None = None, *, update: str = "fused", is_weighted: bool = False):
        self.is_weighted = bool(is_weighted)
        super().__init__(tables, optimizer, update=update)
        if self.is_weighted:
            mean = [n for n, t in zip(self.table_names, tables) if t.pooling is PoolingMode.MEAN]
            if mean:
                raise ValueError(f"is_weighted=True: tables {mean} pool by 'mean'; weights need pooling='sum'")
        self._derive_layout()

    def _derive_layout(self) -> None:
        # The unit layout needs one dtype and device: after a conversion groups may share them.
        self._units = UnitLayout.of(
            self.feature_dims,
            [g.features for g in self._groups],
            [e.embedding_dim for e in self.engines],
            [self.table_configs[t].pooling is PoolingMode.MEAN for t in self._feature_table],
            {e.dtype for e in self.engines},
            {str(e.device) for e in self.engines},
        )

    def forward(self, features) -> PooledEmbeddings:
        batch, looked = self._lookup(features, pooled=True)
        # Every rank of a sharded collection takes the same path (its backward's collectives
        # follow it), so an empty batch goes through the units path too.
        if self._units is not None:
            if isinstance(looked[0][0], GroupLookup):
                trigger = torch.empty(0, device=self.engines[0].device, requires_grad=True)
                concat = _PooledUnits.apply(trigger, self, batch, looked)
            else:
                concat, _ = self._pool_units(batch, looked)
            return PooledEmbeddings(concat, self.feature_names, self.feature_dims)
        return self._pool_by_group(batch, looked)

    def _pool_units(self, batch: _Batch, looked: list):
        """The concat [B, sum D_f] through :func:`dynemb.nn.units.pool`, and each group's
        backward info."""
        layout = self._units
        rows, inverses, weights = [], [], None
        for group, (emb, inverse, _totals) in zip(self._groups, looked):
            D = self.engines[group.index].embedding_dim
            rows.append(emb.data[:, :D] if isinstance(emb, GroupLookup) else emb)
            inverses.append(inverse)
        if self.is_weighted:
            weights = [torch.cat([batch.weights[j] for j in g.features]) if len(g.features) > 1 else batch.weights[g.features[0]] for g in self._groups]
        units = sum(r.shape[0] * k for r, k in zip(rows, layout.group_k))
        with self._lock, writable():
            # The unit table is scratch kept between calls (under the lock: one user at a time).
            table = self._workspace.get("units", units, (layout.unit,), self.engines[0].dtype)
            return pool(layout, batch.stacked, rows, inverses, weights, table, self._recycler)

    def _pool_by_group(self, batch: _Batch, looked: list) -> PooledEmbeddings:
        """Pool each group into [F_g * B, D] and concatenate (tables of several dtypes or
        devices, or narrow units)."""
        B = batch.batch
        pooled_of: list[torch.Tensor | None] = [None] * len(self.feature_names)
        for group, (emb, inverse, _totals) in zip(self._groups, looked):
            feats = group.features
            engine = self.engines[group.index]
            lengths = torch.cat([batch.lengths[j] for j in feats]) if len(feats) > 1 else batch.lengths[feats[0]]  # [F_g * B]
            offsets = torch.cumsum(lengths, 0) - lengths
            weights = None
            if self.is_weighted:
                ws = [batch.weights[j] for j in feats]
                weights = (torch.cat(ws) if len(ws) > 1 else ws[0]).to(engine.dtype)
            divisor = None
            means = [self.table_configs[self._feature_table[j]].pooling is PoolingMode.MEAN for j in feats]
            if any(means):
                is_mean = torch.tensor(means, device=engine.device).repeat_interleave(B)
                divisor = torch.where(is_mean, lengths.clamp(min=1), 1).to(engine.dtype)
            if isinstance(emb, GroupLookup):
                trigger = torch.empty(0, device=engine.device, requires_grad=True)
                pooled = _PooledBags.apply(trigger, emb, inverse, offsets, lengths, weights, divisor, engine.embedding_dim)
            else:
                pooled = F.embedding_bag(inverse, emb, offsets, mode="sum", per_sample_weights=weights)  # [F_g * B, D]
                if divisor is not None:
                    pooled = pooled / divisor[:, None]
            # One view per feature (unbind: its backward stacks the features' gradients at once).
            for j, part in zip(feats, pooled.view(len(feats), B, engine.embedding_dim).unbind(0)):
                pooled_of[j] = part
        concat = torch.cat(pooled_of, dim=1) if len(pooled_of) > 1 else pooled_of[0]
        return PooledEmbeddings(concat, self.feature_names, self.feature_dims)


class DynamicEmbeddingCollection(_DynamicCollection):
    """Sequence lookups of many features: ``features -> {feature: (values [N_f, D], lengths [B])}``.

    Args:
        tables, optimizer, update: as :class:`DynamicEmbeddingBagCollection` (``pooling`` is
            not used).

    ``forward(features)``: a KeyedJaggedTensor (duck-typed) or a dict ``feature -> (values
    [N_f], lengths [B])`` -> dict ``feature -> (embeddings [N_f, D_f], lengths [B])``, one
    embedding per id, in the input's order.
    """

    def forward(self, features) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        batch, looked = self._lookup(features)
        out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        per_feature: list[torch.Tensor | None] = [None] * len(self.feature_names)
        for group, (emb, inverse, totals) in zip(self._groups, looked):
            rows = F.embedding(inverse, emb)  # [N_g, D]
            for j, part in zip(group.features, torch.split(rows, totals)):
                per_feature[j] = part
        for j, f in enumerate(self.feature_names):
            out[f] = (per_feature[j], batch.lengths[j])
        return out
