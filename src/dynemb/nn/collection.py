"""Collections of dynamic tables fed by many features at once.

F features, T tables, B samples (the batch), N_f ids of feature f, U unique (table, key) pairs of
a group, D a table's embedding dim.

:class:`DynamicEmbeddingBagCollection` (pooled, ``feature -> [B, D]``) and
:class:`DynamicEmbeddingCollection` (sequence, ``feature -> (values [N_f, D], lengths [B])``)
take a KeyedJaggedTensor (duck-typed) or a dict ``feature -> (values, lengths[, weights])``.
Tables that share embedding dim, dtype, device, bucket width, score strategy and non-finite
policy form a group, looked up and updated in one pass: one de-duplication of (table, key)
pairs, one index call, one gather and one fused optimizer step per batch
(one :class:`dynemb.nn.engine.Engine` per group). A table read by several features takes one step per
batch, its features' gradients summed per key first. See docs/design/0013-collections.md.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.hooks import RemovableHandle

from dynemb.config import TableConfig
from dynemb.kernels.dedup import sort_unique_native
from dynemb.nn.autograd import FusedEmbeddings, Lookup
from dynemb.nn.collective import collective
from dynemb.nn.features import Batch, parse_features
from dynemb.nn.state import collection_entries, expected_collection_entries, load_collection_entries, load_own_entries
from dynemb.nn.tables import DynamicTables, TableGroup
from dynemb.nn.units import UnitLayout, group_gradient, one_id_per_bag, pool
from dynemb.optim.base import RowOptimizer
from dynemb.table.index import unique_pairs
from dynemb.types import PoolingMode, ScoreStrategy
from dynemb.workspace import writable

_UPDATES = ("fused", "deferred")


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
        ctx.native = owner._compiled_cpu()
        return out

    @staticmethod
    def backward(ctx, grad):
        layout = ctx.layout
        grad_rows = grad.contiguous().view(-1, layout.unit)  # [B * K, u]
        for (lookup, inverse, _totals), info, k in zip(ctx.looked, ctx.grads, layout.group_k):
            num_unique = lookup.keys.numel()
            if lookup.grouping is not None:
                order, starts = lookup.grouping
            else:
                # Keys read through two tables: the dedup gave no grouping; group the ids here.
                order = torch.argsort(inverse, stable=True)
                counts = torch.bincount(inverse, minlength=num_unique)
                starts = torch.cumsum(counts, 0).sub_(counts)
            lookup.apply(grad_u=group_gradient(grad_rows, info, order, starts, num_unique, k, ctx.native))
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


def dedup(
    group: TableGroup, vals: list[torch.Tensor], device, *, native: bool = False, workspace=None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, tuple | None]:
    """Distinct (table, key) pairs of a group's feature values ``vals`` (its features'
    order): segments [U], keys [U], inverse [N_g], counts [U] (each table's keys ascending)
    and the grouping (order [N_g], starts [U]) of the ids by pair, or None.

    One stable sort of the raw keys (``native``: the compiled parallel sort of
    :func:`dynemb.kernels.dedup.sort_unique_native`, bitwise the same outputs, its scratch in
    ``workspace``). When no key is read through two tables (the usual case: tables hold
    different id spaces) its runs are the distinct pairs, sorted by key, and the sort's
    permutation groups the ids by pair, so the backward sums their gradients with one
    gather-sum instead of a serial scatter-add. Otherwise pairs are formed
    (:func:`unique_pairs`), sorted by segment, then key, and the grouping is None."""
    values = torch.cat(vals) if len(vals) > 1 else vals[0]
    n = values.numel()
    seg_of_value = None
    if len(group.tables) > 1:
        sizes = tuple(v.numel() for v in vals)
        cached = group.value_segments
        if cached is not None and cached[0] == sizes and cached[1].device == device:
            seg_of_value = cached[1]
        else:
            with torch.inference_mode(False):  # kept between calls: never an inference tensor
                seg_of_value = torch.repeat_interleave(torch.tensor(group.feature_segments, device=device), torch.tensor(sizes, device=device), output_size=n)
            group.value_segments = (sizes, seg_of_value)
    if native:
        # The kernel also labels each distinct key with its first id's segment, and says
        # (seg_first None) when a key is read through two tables.
        keys, seg_first, inverse, counts, order = sort_unique_native(values, grouping=True, workspace=workspace, segments=seg_of_value)
        starts = counts.cumsum(0).sub_(counts)
        mixed = seg_of_value is not None and seg_first is None
    else:
        sorted_values, order = torch.sort(values, stable=True)
        new = torch.ones(n, dtype=torch.bool, device=device)
        if n > 1:
            torch.ne(sorted_values[1:], sorted_values[:-1], out=new[1:])
        starts = new.nonzero().squeeze(1)
        keys = sorted_values.index_select(0, starts)
        counts = torch.diff(starts, append=starts.new_tensor([n]))
        inverse = torch.empty_like(order).scatter_(0, order, new.cumsum(0).sub_(1))
        seg_first = mixed = None
        if seg_of_value is not None:
            # The segment of each distinct key's first id; a key read through two tables has ids
            # of another segment in its run.
            seg_first = seg_of_value.index_select(0, order.index_select(0, starts))
            mixed = n > 1 and bool((seg_of_value != seg_first.index_select(0, inverse)).any())
    if seg_of_value is None:
        return torch.zeros_like(keys), keys, inverse, counts, (order, starts)
    if mixed:
        (segments, keys), inverse, counts = unique_pairs(seg_of_value, values)
        return segments, keys, inverse, counts, None
    return seg_first, keys, inverse, counts, (order, starts)


class _DynamicCollection(DynamicTables):
    """What both collections share: tables named and read by features, lookups by group."""

    pooled = False
    is_weighted = False

    def __init__(self, tables: list[TableConfig], optimizer: RowOptimizer | None = None, *, update: str = "fused"):
        if not isinstance(tables, (list, tuple)) or not tables or not all(isinstance(t, TableConfig) for t in tables):
            raise TypeError(f"tables={tables!r}: must be a non-empty list of dynemb.TableConfig")
        if update not in _UPDATES:
            raise ValueError(f"update={update!r}: must be 'fused' or 'deferred'")
        names: list[str] = []
        for i, t in enumerate(tables):
            name = t.name if t.name is not None else f"t{i}"
            if name in names:
                raise ValueError(f"tables[{i}].name={name!r}: table names must be distinct")
            if t.score_strategy is ScoreStrategy.CUSTOMIZED:
                raise ValueError(f"tables[{i}].score_strategy='customized': not supported in collections yet; use a DynamicTable")
            if "." in name:
                raise ValueError(f"tables[{i}].name={name!r}: must not contain '.' (it separates state_dict entries)")
            names.append(name)
        feature_names: list[str] = []
        feature_table: list[int] = []
        for i, t in enumerate(tables):
            for f in t.feature_names or (names[i],):
                if f in feature_names:
                    other = names[feature_table[feature_names.index(f)]]
                    raise ValueError(f"feature {f!r} is listed by tables {other!r} and {names[i]!r}: a feature reads one table")
                feature_names.append(f)
                feature_table.append(i)
        super().__init__(list(tables), optimizer, update=update)
        self.feature_names = feature_names
        self.feature_table = feature_table
        self.feature_dims = [tables[t].embedding_dim for t in feature_table]
        for j, t in enumerate(feature_table):
            g, s = self.table_group[t]
            self.groups[g].features.append(j)
            self.groups[g].feature_segments.append(s)

    @property
    def last_failed_keys(self) -> dict[str, torch.Tensor]:
        """Per table name: [F] keys the last training lookup or insert could not place."""
        return dict(zip(self.table_names, self._failed))

    @property
    def last_evicted_keys(self) -> dict[str, torch.Tensor]:
        """Per table name: [E] keys that left the table in the last call that inserted or erased."""
        return dict(zip(self.table_names, self._evicted))

    def extra_repr(self) -> str:
        tables = ", ".join(f"{n}(dim={c.embedding_dim}, capacity={c.capacity})" for n, c in zip(self.table_names, self.table_configs))
        return f"tables=[{tables}], groups={len(self.groups)}, optimizer={self.optimizer!r}, update='{self.update}'"

    def stats(self) -> dict[str, dict[str, int | float]]:
        """Per table name: size, capacity, requested_capacity, current_capacity, load_factor,
        inserts, evictions, erased, failed_inserts, admission_rejections, nonfinite_grads, step,
        optimizer_step, pending_grad_keys, scratch_bytes; with tiers, ``tiers`` (one dict per
        tier of the table's group: a group's tables share one tiered store, so they show the
        group's figures; docs/design/0032-tiers.md)."""
        with self._lock:
            return {name: self._table_stats(t) for t, name in enumerate(self.table_names)}

    def register_evict_hook(self, fn: Callable) -> RemovableHandle:
        """Call ``fn(table_name, keys, rows)`` for every key that leaves a table (evicted or
        erased); ``rows`` as for :meth:`DynamicTable.register_evict_hook`."""
        if not callable(fn):
            raise TypeError(f"fn={fn!r}: must be callable as fn(table_name, keys, rows)")
        return self._register_evict_hook(fn)

    def _table(self, table: str) -> int:
        return self.location(table)[2]

    def _lookup_group(self, group: TableGroup, batch: Batch, failures: list, pooled: bool = False, in_place: bool = False):
        """Dedup, resolve and gather one group's ids. Returns embeddings [U, D] (fused-update
        autograd when training; with ``pooled``, the lookup itself, for :class:`_PooledBags`),
        the inverse [N_g] of each id and the ids per feature. ``in_place`` (pooled, training):
        the caller copies the rows from the store itself where it can (the lookup's ``data``
        is then None: no gather)."""
        engine = self.engines[group.index]
        vals = [batch.values[j] for j in group.features]
        totals = [v.numel() for v in vals]
        # The compiled sort takes CPU keys only (a collection's tables may live on several devices).
        native = engine.device.type == "cpu" and engine.index.native and all(v.device.type == "cpu" for v in vals)
        segs, keys, inverse, counts, grouping = dedup(group, vals, engine.device, native=native, workspace=self._workspace)
        trains = self._trains()
        lookup = self._lookup_unique(group.index, keys, segs, counts, failures, grouping, gather=not (in_place and pooled and trains))
        if trains:
            if pooled:
                return lookup, inverse, totals
            trigger = torch.empty(0, device=engine.device, requires_grad=True)
            return FusedEmbeddings.apply(trigger, lookup, engine.embedding_dim), inverse, totals
        return lookup.data[:, : engine.embedding_dim], inverse, totals

    @collective("forward")
    def _lookup(self, features, pooled: bool = False):
        batch = parse_features(features, self.feature_names, self.table_configs[0].device, pooled=self.pooled, weighted=self.is_weighted)
        self._check_row_dtypes()
        failures: list = []
        with self._lock:
            if self.training:
                self.step += 1
                self._timestamps.start_call()
            in_place = pooled and self._pools_in_place(batch)
            looked = [self._lookup_group(group, batch, failures, pooled, in_place) for group in self.groups]
        self._raise_failures(failures)
        return batch, looked

    def _pools_in_place(self, batch: Batch) -> bool:
        """Whether the pooled output of ``batch`` is copied from the stores' rows in place
        (a bag collection's one-id-per-bag compiled path); see DynamicEmbeddingBagCollection."""
        return False

    def pending_keys(self, table: str) -> torch.Tensor:
        """Tensor[int64]: [P] keys of one table with a pending (deferred) gradient."""
        return self._pending_keys(self._table(table))

    @collective("find() / contains()")
    def find(self, table: str, keys) -> tuple[torch.Tensor, torch.Tensor]:
        """Embeddings of one table's keys without side effects: keys [*] -> values [*, D]
        (eval_default where missing), found [*]."""
        return self._find(self._table(table), keys)

    @collective("find() / contains()")
    def contains(self, table: str, keys) -> torch.Tensor:
        """Membership of one table's keys without side effects: keys [*] -> Tensor[bool] [*]."""
        return self._contains(self._table(table), keys)

    def export(self, table: str, chunk_size: int = 1 << 16):
        """One table's keys with their rows, in chunks (see :meth:`DynamicTable.export`)."""
        return self._export(self._table(table), chunk_size)

    @collective("insert()")
    def insert(self, table: str, keys, values: torch.Tensor, scores: torch.Tensor | None = None) -> torch.Tensor:
        """Assign rows to one table's keys ([N] distinct), inserting missing ones; ``values``
        [N, D] (embeddings) or [N, D+S] (whole rows). Returns found-after ([N] bool)."""
        return self._insert(self._table(table), keys, values, scores, table=table)

    @collective("erase()")
    def erase(self, table: str, keys) -> torch.Tensor:
        """Remove one table's keys ([*] int64) and free their rows; returns found ([*] bool).
        Erased keys leave through the same exit as evicted ones (evict hooks)."""
        return self._erase(self._table(table), keys)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        with self._lock:
            for name, value in collection_entries(self).items():
                destination[prefix + name] = value

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        def load(entries):
            with self._lock:
                load_collection_entries(self, entries)

        load_own_entries(self, expected_collection_entries(self), load, state_dict, prefix, strict, missing_keys, unexpected_keys, error_msgs)


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
            [g.features for g in self.groups],
            [e.embedding_dim for e in self.engines],
            [self.table_configs[t].pooling is PoolingMode.MEAN for t in self.feature_table],
            {e.dtype for e in self.engines},
            {str(e.device) for e in self.engines},
        )

    def forward(self, features) -> PooledEmbeddings:
        # The lock (re-entrant) is held from the lookups to the pooled output: lookups that
        # leave their rows in the stores (docs/design/0042) are copied before any other
        # thread's lookup can change them.
        with self._lock:
            batch, looked = self._lookup(features, pooled=True)
            # Every rank of a sharded collection takes the same path (its backward's collectives
            # follow it), so an empty batch goes through the units path too.
            if self._units is not None:
                if isinstance(looked[0][0], Lookup):
                    trigger = torch.empty(0, device=self.engines[0].device, requires_grad=True)
                    concat = _PooledUnits.apply(trigger, self, batch, looked)
                else:
                    concat, _ = self._pool_units(batch, looked)
                return PooledEmbeddings(concat, self.feature_names, self.feature_dims)
            return self._pool_by_group(batch, looked)

    def _compiled_cpu(self) -> bool:
        """Whether every group runs the compiled CPU kernels (the units path's copy and sums)."""
        return all(e.device.type == "cpu" and e.index.native for e in self.engines)

    def _pools_in_place(self, batch: Batch) -> bool:
        # One id per bag on the compiled path: pool copies each id's row straight from its
        # store, so the lookups skip gathering their unique rows (docs/design/0042).
        if self._units is None or not self._compiled_cpu():
            return False
        batch.one_id_per_bag = one_id_per_bag(batch.stacked, sum(v.numel() for v in batch.values), self.is_weighted, batch.uniform_length)
        return batch.one_id_per_bag

    def _pool_units(self, batch: Batch, looked: list):
        """The concat [B, sum D_f] through :func:`dynemb.nn.units.pool`, and each group's
        backward info. A lookup without gathered rows (``data`` None) is read from its store:
        its ids point at their row ids there."""
        layout = self._units
        rows, inverses, weights = [], [], None
        for group, (emb, inverse, _totals) in zip(self.groups, looked):
            engine = self.engines[group.index]
            D = engine.embedding_dim
            if isinstance(emb, Lookup) and emb.data is None:
                rows.append(engine.readable_rows()[:, :D])
                inverses.append(emb.rows.index_select(0, inverse))
                continue
            rows.append(emb.data[:, :D] if isinstance(emb, Lookup) else emb)
            inverses.append(inverse)
        if self.is_weighted:
            weights = [torch.cat([batch.weights[j] for j in g.features]) if len(g.features) > 1 else batch.weights[g.features[0]] for g in self.groups]
        units = sum(r.shape[0] * k for r, k in zip(rows, layout.group_k))
        with self._lock, writable():
            # The unit table is scratch kept between calls (under the lock: one user at a time),
            # asked for only by the paths that use it.
            dtype = self.engines[0].dtype
            native = self._compiled_cpu()
            scratch = lambda: self._workspace.get("units", units, (layout.unit,), dtype)
            return pool(layout, batch.stacked, rows, inverses, weights, scratch, self._recycler, native, single=batch.one_id_per_bag)

    def _pool_by_group(self, batch: Batch, looked: list) -> PooledEmbeddings:
        """Pool each group into [F_g * B, D] and concatenate (tables of several dtypes or
        devices, or narrow units)."""
        B = batch.batch
        pooled_of: list[torch.Tensor | None] = [None] * len(self.feature_names)
        for group, (emb, inverse, _totals) in zip(self.groups, looked):
            feats = group.features
            engine = self.engines[group.index]
            lengths = torch.cat([batch.lengths[j] for j in feats]) if len(feats) > 1 else batch.lengths[feats[0]]  # [F_g * B]
            offsets = torch.cumsum(lengths, 0) - lengths
            weights = None
            if self.is_weighted:
                ws = [batch.weights[j] for j in feats]
                weights = (torch.cat(ws) if len(ws) > 1 else ws[0]).to(engine.dtype)
            divisor = None
            means = [self.table_configs[self.feature_table[j]].pooling is PoolingMode.MEAN for j in feats]
            if any(means):
                is_mean = torch.tensor(means, device=engine.device).repeat_interleave(B)
                divisor = torch.where(is_mean, lengths.clamp(min=1), 1).to(engine.dtype)
            if isinstance(emb, Lookup):
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
        for group, (emb, inverse, totals) in zip(self.groups, looked):
            rows = F.embedding(inverse, emb)  # [N_g, D]
            for j, part in zip(group.features, torch.split(rows, totals)):
                per_feature[j] = part
        for j, f in enumerate(self.feature_names):
            out[f] = (per_feature[j], batch.lengths[j])
        return out
