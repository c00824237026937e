"""DynamicTable: one table, the front-end of :class:`dynemb.nn.tables.DynamicTables` over one engine.

N ids in a batch, U unique ids, E keys leaving, D embedding dim, S optimizer state columns,
K keys held, P keys with a pending (deferred) gradient.

Forward: de-duplicate ids -> resolve (insert in training, subject to admission) -> gather rows
[U, D+S] -> embeddings [U, D], which torch's own embedding / embedding_bag expand and pool.
Backward: torch reduces the output gradient to one [U, D] gradient per unique key; the engine's
fused optimizer updates those rows (``update="fused"``), or the table adds it to its pending
gradient [P, D], applied at ``optimizer.step()`` (``update="deferred"``, see
docs/design/0011-deferred-updates.md). The policy (check mode, admission, eval defaults,
reporting of keys that fail or leave, the clock, thread safety) is the module base's; this file
gives it a single table's API and state_dict.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import torch
from torch.utils.hooks import RemovableHandle

from dynemb.config import TableConfig
from dynemb.kernels.dedup import dedup
from dynemb.nn.autograd import FusedEmbeddings, FusedSequence, Lookup, expand_rows
from dynemb.nn.collective import collective
from dynemb.nn.inputs import as_ids
from dynemb.nn.state import expected_table_entries, load_own_entries, load_table_entries, table_entries
from dynemb.nn.tables import DynamicTables
from dynemb.optim.base import RowOptimizer
from dynemb.storage.base import RowStore
from dynemb.types import UpdateMode

EvictHook = Callable[[torch.Tensor, dict], None]


class DynamicTable(DynamicTables):
    """A dynamic embedding table: int64 keys -> rows of embedding and optimizer state.

    Args:
        config: the table's :class:`dynemb.TableConfig`.
        optimizer: row-wise optimizer (``dynemb.optim``); ``None`` makes the table frozen (its
            outputs do not require grad).
        store: optional row store (a :class:`dynemb.storage.base.RowStore`); default: rows in
            one tensor on ``config.device``.
        update: ``"fused"`` (default): each backward applies one optimizer step at once;
            ``"deferred"``: backward sums the gradient per key, ``optimizer.step()`` applies one
            step with the sum and ``optimizer.zero_grad()`` drops it (needs an optimizer). See
            :class:`dynemb.types.UpdateMode`.

    Training-mode lookups insert missing keys (subject to admission); eval-mode lookups never
    insert and give ``eval_default`` for missing keys. As with BatchNorm's running statistics,
    the module's mode decides, not the grad mode: a training-mode lookup under ``torch.no_grad()``
    or ``torch.inference_mode()`` inserts keys and advances the step, but updates no row. Keys
    that are not in the table in training (not admitted, or failed) get their initial value and
    are not trained.

    Every public method is safe to call from several threads: one lock per table serialises
    them (docs/design/0008-threading.md).
    """

    segmented = False

    def __init__(
        self,
        config: TableConfig,
        optimizer: RowOptimizer | None = None,
        store: RowStore | None = None,
        *,
        update: UpdateMode | str = UpdateMode.FUSED,
    ):
        super().__init__([config], optimizer, update=update, store=store)
        self.embedding_dim = config.embedding_dim
        self.state_dim = self.engine.state_dim

    @property
    def engine(self):
        """The table's engine (:mod:`dynemb.nn.base`'s contract)."""
        return self.engines[0]

    @property
    def config(self) -> TableConfig:
        return self.engine.configs[0]

    @property
    def admission(self):
        return self.admissions[0]

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def index(self):
        return self.engine.index

    @property
    def store(self) -> RowStore:
        return self.engine.store

    @property
    def optimizer_step(self) -> int:
        return self.engine.optimizer_steps[0]

    @property
    def last_failed_keys(self) -> torch.Tensor:
        """Tensor[int64]: [F] keys the last training lookup or insert could not place."""
        return self._failed[0]

    @property
    def last_evicted_keys(self) -> torch.Tensor:
        """Tensor[int64]: [E] keys that left the table in the last call that inserted or erased."""
        return self._evicted[0]

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"embedding_dim={c.embedding_dim}, capacity={self.capacity()}, "
            f"score_strategy='{c.score_strategy}', optimizer={self.optimizer!r}, update='{self.update_mode}', device='{c.device}'"
        )

    def register_evict_hook(self, fn: EvictHook) -> RemovableHandle:
        """Call ``fn(keys, rows)`` for every key that leaves the table (evicted or erased).

        ``keys`` (Tensor[int64]) [E]; ``rows`` a dict of ``embeddings`` [E, D],
        ``optimizer_state`` [E, S] and ``scores`` [E] (int64) as they were when the keys left.
        Hooks run in registration order, inside the call that evicts (under the table's lock),
        before a failed insert is raised. Returns a handle whose ``remove()`` unregisters ``fn``.
        """
        if not callable(fn):
            raise TypeError(f"fn={fn!r}: must be callable as fn(keys, rows)")
        return self._register_evict_hook(lambda _name, keys, rows: fn(keys, rows))

    def _gather(self, ids, gather: bool = True) -> tuple[Lookup, torch.Tensor]:
        """De-duplicate ids, resolve them (inserting in training) and gather their rows.

        Returns the lookup (unique keys [U], rows [U], rows data [U, D+S]) and the inverse ([*],
        ids' shape) of each id into the unique keys. ``gather=False``: the caller reads the rows
        from the store in place where it can (then the lookup's data is None).
        """
        ids = as_ids(ids, "ids", self.device)
        self._check_row_dtypes()
        failures: list = []
        with self._lock:
            keys, _, inverse, counts, grouping = dedup(ids.reshape(-1), native=self.engines[0].index.native, grouping=True, workspace=self._workspace)
            if self.training:
                self.step += 1
                self._timestamps.start_call()
            lookup = self._lookup_unique(0, keys, None, counts, failures, grouping, gather=gather)
        self._raise_failures(failures)
        return lookup, inverse.view(ids.shape)

    @collective("forward")
    def lookup(self, ids) -> tuple[torch.Tensor, torch.Tensor]:
        """Embeddings of the unique ids and how to expand them.

        Args:
            ids (Tensor[int64]): [*] any shape.
        Returns:
            embeddings (Tensor): [U, D], requiring grad when training with an optimizer.
            inverse (Tensor[int64]): [*] (ids' shape) index of each id into ``embeddings``.
        """
        lookup, inverse = self._gather(ids)
        if self._trains():
            trigger = torch.empty(0, device=self.device, requires_grad=True)
            return FusedEmbeddings.apply(trigger, lookup, self.embedding_dim), inverse
        return lookup.data[:, : self.embedding_dim], inverse

    @collective("forward")
    def lookup_sequence(self, ids) -> torch.Tensor:
        """One embedding per id: ids [*] -> [*, D]; in training, backward updates the rows."""
        # Each id's row is copied straight from the store where it can be (no gather of the
        # unique rows first): the ids then point at their row ids (docs/design/0042). The lock
        # is held until the copy is made, so no other thread's lookup changes the rows between.
        with self._lock:
            lookup, inverse = self._gather(ids, gather=False)
            source, at = lookup.data, inverse
            if source is None:
                source, at = self.engines[0].readable_rows(), lookup.rows.index_select(0, inverse.reshape(-1)).view(inverse.shape)
            # The [*, D] output in recycled memory on CPU (a fresh one page-faults every step).
            out = functools.partial(self._recycler.get, "sequence")
            if self._trains():
                trigger = torch.empty(0, device=self.device, requires_grad=True)
                return FusedSequence.apply(trigger, lookup, inverse, self.embedding_dim, out, source, at)
            return expand_rows(source, at, self.embedding_dim, out)

    def deferred_grad(self) -> torch.Tensor | None:
        """The pending gradient [P, D] (the live tensor: scaling it in place scales the next
        step), or None for a fused table."""
        grads = super().deferred_grad()
        return None if grads is None else grads[0]

    def pending_keys(self) -> torch.Tensor:
        """Tensor[int64]: [P] keys with a pending (deferred) gradient, sorted; empty when fused."""
        return self._pending_keys(0)

    @collective("find() / contains()")
    def find(self, keys) -> tuple[torch.Tensor, torch.Tensor]:
        """Embeddings of keys without side effects.

        Args:
            keys (Tensor[int64]): [*] any shape.
        Returns:
            values (Tensor): [*, D], ``eval_default`` where missing.
            found (Tensor[bool]): [*]
        """
        return self._find(0, keys)

    @collective("find() / contains()")
    def contains(self, keys) -> torch.Tensor:
        """Membership without side effects: keys (Tensor[int64]) [*] -> Tensor[bool] [*]."""
        return self._contains(0, keys)

    def __contains__(self, key) -> bool:
        """``key in table`` for one key (an int or a one-element tensor); use :meth:`contains`
        for a batch (Python turns ``in`` into a single bool)."""
        if isinstance(key, torch.Tensor) and key.numel() != 1:
            raise TypeError(f"`key in table` takes one key, got a tensor of {key.numel()}; use table.contains(keys) for a batch")
        if not isinstance(key, (int, torch.Tensor)) or isinstance(key, bool):
            raise TypeError(f"key={key!r}: must be an int or a one-element int64 tensor")
        return bool(self.contains(torch.as_tensor([key], device=self.device).reshape(1) if isinstance(key, int) else key.reshape(1)))

    def __len__(self) -> int:
        return self.engine.size()

    @collective("insert()")
    def insert(self, keys, values: torch.Tensor, scores: torch.Tensor | None = None) -> torch.Tensor:
        """Assign rows to keys, inserting missing ones (warm start, restore from ``export()``).

        Args:
            keys (Tensor[int64]): [N] distinct keys.
            values (Tensor): [N, D] embeddings (optimizer state kept for existing keys, initial
                for new ones) or [N, D+S] whole rows including optimizer state.
            scores (Tensor[int64] | None): [N] scores to assign; default: the strategy's.
        Returns:
            Tensor[bool]: [N] the key is in the table now (see check_mode for failures).
        """
        return self._insert(0, keys, values, scores, table=None)

    @collective("erase()")
    def erase(self, keys) -> torch.Tensor:
        """Remove keys ([*] int64) and free their rows; returns found ([*] bool). Erased keys
        leave through the same exit as evicted ones (``last_evicted_keys``, evict hooks)."""
        return self._erase(0, keys)

    def export(self, chunk_size: int = 1 << 16) -> Iterator[dict[str, torch.Tensor]]:
        """Yield every key with its row, in chunks: dicts of ``keys`` [K] int64, ``embeddings``
        [K, D], ``optimizer_state`` [K, S], ``scores`` [K] int64.

        Each chunk is read under the table's lock; if the table changes between chunks the
        iterator raises RuntimeError instead of yielding an inconsistent mix.
        """
        return self._export(0, chunk_size)

    def size(self) -> int:
        """Keys held."""
        return self.engine.size()

    def capacity(self) -> int:
        """Most keys held (the configured capacity rounded up to whole buckets, at most 2x)."""
        return self.engine.table_stats()["capacity"]

    def load_factor(self) -> float:
        """size / currently allocated capacity."""
        return self.engine.table_stats()["load_factor"]

    def stats(self) -> dict[str, int | float]:
        """size, capacity (real, after rounding), requested_capacity, current_capacity,
        load_factor, inserts, evictions, erased, failed_inserts, admission_rejections, growths,
        nonfinite_grads, step, optimizer_step, pending_grad_keys (deferred: keys whose gradient
        waits for ``optimizer.step()``), scratch_bytes; with tiers, ``tiers``: one dict per tier
        (kind, rows, capacity, hits, misses, promotions, demotions, bytes, placement_bytes;
        docs/design/0032-tiers.md)."""
        return self._table_stats(0)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for name, value in self.table_state().items():
            destination[prefix + name] = value

    def table_state(self) -> dict[str, torch.Tensor]:
        """The whole table as plain tensors (the entries of ``state_dict()``, without prefix)."""
        with self._lock:
            return table_entries(self)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        load_own_entries(self, expected_table_entries(self), self.load_table_state, state_dict, prefix, strict, missing_keys, unexpected_keys, error_msgs)

    def load_table_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore the table from :meth:`table_state` entries; validates everything first and
        raises ValueError (naming the entry) without changing the table on any problem. A
        deferred table's pending gradient (computed against the old rows) is dropped."""
        with self._lock:
            load_table_entries(self, state)
