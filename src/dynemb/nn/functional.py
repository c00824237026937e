"""The functional layer: one table's index, row store, initialiser and optimizer, without policy.

U unique keys in a call, E keys that leave the table, D embedding dim, S optimizer state columns.

Modules, collections, sharding and tiers all go through :class:`TableEngine`:

* :meth:`TableEngine.resolve` turns unique keys into row ids (inserting missing keys in
  training, initialising their rows) and reports which keys were inserted, evicted or failed;
* :meth:`TableEngine.apply_gradients` runs one fused optimizer step on rows given per-key
  gradients.

The engine applies no policy (check mode, admission, hooks, eval defaults: the module layer
decides those), takes the clock as an argument (``now``) and holds no lock: its owner
serialises calls (see docs/design/0008-threading.md).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable, Iterator

import torch

from dynemb.config import TableConfig
from dynemb.nn.changes import ChangeLog
from dynemb.optim.base import RowOptimizer
from dynemb.storage.base import RowStore
from dynemb.storage.device_store import DeviceRowStore
from dynemb.storage.initializers import RowInitializer
from dynemb.table.base import IndexResult
from dynemb.table.index import KeyIndex, index_bytes, rounded_capacity
from dynemb.types import NonFiniteGrads
from dynemb.workspace import Workspace, writable


@dataclasses.dataclass(frozen=True)
class Resolved:
    """Outcome of :meth:`TableEngine.resolve` over U unique keys.

    Attributes:
        keys (Tensor[int64]): [U] the keys, as given.
        rows (Tensor[int64]): [U] row id of each key, -1 where it is not in the table.
        found (Tensor[bool]): [U] the key was in the table before the call.
        inserted (Tensor[bool]): [U] the key was inserted by the call.
        evicted_keys (Tensor[int64]): [E] keys evicted to make room.
        evicted (dict[str, Tensor] | None): their ``embeddings`` [E, D], ``optimizer_state``
            [E, S] and ``scores`` [E] as they were when evicted (only when asked for).
        failed_keys (Tensor[int64]): [F] keys that should have been inserted and were not.
    """

    keys: torch.Tensor
    rows: torch.Tensor
    found: torch.Tensor
    inserted: torch.Tensor
    evicted_keys: torch.Tensor
    evicted: dict[str, torch.Tensor] | None
    failed_keys: torch.Tensor

    @property
    def ok(self) -> torch.Tensor:
        """Tensor[bool]: [U] the key is in the table after the call."""
        return self.rows >= 0


def nonfinite_rows(values: torch.Tensor) -> torch.Tensor | None:
    """Rows [K] of ``values`` [K, W] holding NaN or inf, or None if there are none.

    The sum is finite whenever every value is (a sum of finite values only overflows near
    float max, and then the exact check finds nothing): one reduction, no [K, W] temporary, and
    one host sync because the caller must know.
    """
    if bool(torch.isfinite(values.sum())):
        return None
    bad = ~torch.isfinite(values).all(1)
    return bad if bool(bad.any()) else None


def warn_nonfinite(keys: torch.Tensor, values: torch.Tensor, what: str) -> None:
    """Warn when rows ``values`` [K, W] of ``keys`` [K] hold NaN or inf; ``what`` names them
    (a table being saved or loaded). Such rows are kept as they are: whatever a save wrote, a
    load reads (docs/design/0020-nonfinite-rows.md)."""
    bad = nonfinite_rows(values)
    if bad is not None:
        warn_nonfinite_keys(keys[bad], what)


def warn_nonfinite_keys(bad: torch.Tensor, what: str) -> None:
    """The warning of :func:`warn_nonfinite` for the keys ``bad`` [n] whose rows are non-finite."""
    shown = bad[:8].tolist()
    warnings.warn(
        f"{what}: the rows of {bad.numel()} key(s) {shown}{' ...' if bad.numel() > 8 else ''} hold NaN or inf; "
        "they are kept as they are (erase or insert them to replace them)",
        RuntimeWarning,
        stacklevel=3,
    )


def _shown(keys: torch.Tensor) -> str:
    return f"{keys.numel()} key(s) {keys[:8].tolist()}{' ...' if keys.numel() > 8 else ''}"


def screen_update(
    keys: torch.Tensor,
    grads: torch.Tensor,
    data: torch.Tensor,
    policy: NonFiniteGrads,
    *,
    agree: Callable[[bool], bool] | None = None,
    tables: Callable[[torch.Tensor], list[str]] | None = None,
) -> torch.Tensor | None:
    """The ``nonfinite_grads`` policy on one update, checked after the optimizer updated ``data``
    (a gathered copy, not yet written back): a row is bad when its gradient or its updated row
    (embedding or optimizer state) holds NaN or inf (docs/design/0020-nonfinite-rows.md).

    Args:
        keys (Tensor[int64]): [U] keys of the rows (named by the error).
        grads (Tensor): [U, D] their gradients.
        data (Tensor): [U, D+S] their rows after the update.
        policy: ``apply``: no check, None. ``skip``: the bad rows, or None. ``raise``:
            FloatingPointError naming the keys when any row is bad (nothing was written yet).
        agree: a sharded table's ranks under ``raise``: called with whether this rank found a
            bad row, returns whether any rank did, so that every rank raises together.
        tables: names of the tables of the bad rows (a collection group), for the error.
    Returns:
        Tensor[bool] [U] of the rows not to write, or None when all may be written.
    """
    if policy is NonFiniteGrads.APPLY:
        return None
    # One reduction over gradient and result and one host sync, the sync the gradient check
    # alone made before: the sum is finite whenever every value is (finite values whose sum
    # overflows send it to the exact check, which then finds nothing).
    bad = grad_bad = None
    if not bool(torch.isfinite(grads.sum() + data.sum())):
        grad_bad = ~torch.isfinite(grads).all(1)
        bad = grad_bad | ~torch.isfinite(data).all(1)
        bad = bad if bool(bad.any()) else None
    if policy is NonFiniteGrads.RAISE:
        if agree is not None and agree(bad is not None) and bad is None:
            raise FloatingPointError(
                "non-finite gradient or update for keys owned by another rank (it names them): "
                "no row of this batch was updated on any rank (nonfinite_grads='raise')"
            )
        if bad is not None:
            parts = []
            if bool((bad & grad_bad).any()):
                parts.append(f"non-finite gradient for {_shown(keys[bad & grad_bad])}")
            if bool((bad & ~grad_bad).any()):
                parts.append(
                    f"the update would make the rows of {_shown(keys[bad & ~grad_bad])} non-finite "
                    "(finite gradients: the row or its optimizer state overflowed, or already held NaN or inf)"
                )
            where = "" if tables is None else f" of tables {tables(bad)}"
            raise FloatingPointError(f"{' and '.join(parts)}{where}: no row of this batch was updated (nonfinite_grads='raise')")
    return bad


def leaving_contents(store: RowStore, embedding_dim: int, result: IndexResult) -> dict[str, torch.Tensor]:
    """Contents of the rows of keys leaving the index (read before anything overwrites them):
    ``embeddings`` [E, D], ``optimizer_state`` [E, S], ``scores`` [E]."""
    data = store.gather(result.evicted_rows)
    D = embedding_dim
    return {"embeddings": data[:, :D], "optimizer_state": data[:, D:], "scores": result.evicted_scores}


def with_initial_state(embeddings: torch.Tensor, optimizer: RowOptimizer | None, width: int) -> torch.Tensor:
    """Whole new rows [n, D+S] (``width`` columns): the embeddings [n, D] and the optimizer's
    initial state; the embeddings themselves when there is no state."""
    D = embeddings.shape[1]
    if width == D:
        return embeddings
    rows = torch.empty(embeddings.shape[0], width, dtype=embeddings.dtype, device=embeddings.device)
    rows[:, :D] = embeddings
    optimizer.init_state(rows[:, D:])
    return rows


def _device_memory(device: torch.device) -> int | None:
    """Total memory of the device in bytes, or None if unknown."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


class TableEngine:
    """Index + row store + initialiser + optimizer of one table.

    Args:
        config: the table's :class:`dynemb.TableConfig`.
        optimizer: fused optimizer, or ``None`` (frozen table: rows hold embeddings only).
        store: where rows live (default: a :class:`DeviceRowStore` on ``config.device``); any
            :class:`dynemb.storage.base.RowStore` of width D + S and at least the index's
            capacity in rows.
    """

    def __init__(self, config: TableConfig, optimizer: RowOptimizer | None = None, store: RowStore | None = None):
        self.config = config
        self.optimizer = optimizer
        self.embedding_dim = D = config.embedding_dim
        self.state_dim = optimizer.state_dim(D) if optimizer is not None else 0
        self.width = D + self.state_dim
        capacity = rounded_capacity(config.capacity, config.init_capacity, config.bucket_capacity)
        elsize = torch.empty(0, dtype=config.dtype).element_size()
        full_bytes = index_bytes(capacity) + capacity * self.width * elsize
        total = _device_memory(config.device)
        if total is not None and full_bytes > total:
            raise ValueError(
                f"capacity={config.capacity}: a full table needs {full_bytes:,} bytes (index and rows of "
                f"{self.width} x {config.dtype} columns), more than the {total:,} bytes of memory on {config.device}"
            )
        try:
            self.index = KeyIndex(
                capacity=config.capacity,
                init_capacity=config.init_capacity,
                bucket_capacity=config.bucket_capacity,
                max_load_factor=config.max_load_factor,
                score_strategy=config.score_strategy,
                device=config.device,
            )
            if store is None:
                store = DeviceRowStore(
                    self.width,
                    self.index.capacity(),
                    dtype=config.dtype,
                    device=config.device,
                    init_rows=self.index.current_capacity(),
                )
        except RuntimeError as e:
            raise ValueError(
                f"capacity={config.capacity}, init_capacity={config.init_capacity}: allocating the table failed (a full table needs {full_bytes:,} bytes): {e}"
            ) from None
        if not isinstance(store, RowStore) or store.width != self.width or store.capacity < self.index.capacity():
            raise ValueError(f"store={store!r}: must be a RowStore of width {self.width} and capacity >= {self.index.capacity()}")
        self.store = store
        self.initializer = RowInitializer(config.initializer, D, config.seed, config.dtype, config.device)
        self.optimizer_step = 0
        self.nonfinite_grads = 0
        # Bumped by every write to rows or index; a backward re-finds its keys when it changed.
        self.version = 0
        self._workspace = Workspace(config.device)
        # Rows changed / keys left since the last checkpoint (None until a save asks for it).
        self.changes: ChangeLog | None = None

    @property
    def device(self) -> torch.device:
        return self.config.device

    @property
    def dtype(self) -> torch.dtype:
        return self.config.dtype

    def track_changes(self) -> ChangeLog:
        """The change log (rows touched, keys left) that checkpoint deltas read, started empty if none."""
        if self.changes is None:
            # Sized to every row id the index can hand out: marking rows never has to grow it.
            self.changes = ChangeLog(self.index.capacity(), self.device)
        return self.changes

    def new_rows(self, keys: torch.Tensor) -> torch.Tensor:
        """Initial rows [n, D+S] of keys [n]: per-key embeddings and the optimizer's initial state."""
        return with_initial_state(self.initializer(keys), self.optimizer, self.width)

    def _leaving(self, result: IndexResult) -> dict[str, torch.Tensor]:
        return leaving_contents(self.store, self.embedding_dim, result)

    def resolve(
        self,
        keys: torch.Tensor,
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
            keys (Tensor[int64]): [U] distinct keys, sorted ascending.
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
        if not train:
            rows, found = self.index.find(keys)
            return Resolved(keys, rows, found, torch.zeros_like(found), empty, None, empty)
        with writable():
            if counts is None:
                counts = torch.ones_like(keys)
            sel = None
            if insertable is not None:
                _, found = self.index.find(keys)
                candidate = found | insertable
                if not bool(candidate.all()):
                    sel = candidate.nonzero().squeeze(1)
                    counts = counts.index_select(0, sel)
                    scores = None if scores is None else scores.index_select(0, sel)
            sub = keys if sel is None else keys.index_select(0, sel)
            r = self.index.upsert_unique(sub, counts, now=now, given=scores)
            self.store.reserve(self.index.free_list.high_water)
            evicted = self._leaving(r) if evicted_contents and r.evicted_keys.numel() else None
            if init_rows and bool(r.inserted.any()):
                new = r.inserted.nonzero().squeeze(1)
                self.store.scatter(r.rows.index_select(0, new), self.new_rows(sub.index_select(0, new)))
            if self.changes is not None:
                self.changes.touch(r.rows)
                self.changes.left(r.evicted_keys)
            self.version += 1
        if sel is None:
            return Resolved(keys, r.rows, r.found, r.inserted, r.evicted_keys, evicted, r.failed_keys)
        rows = torch.full_like(keys, -1).index_copy_(0, sel, r.rows)
        found = torch.zeros_like(insertable).index_copy_(0, sel, r.found)
        inserted = torch.zeros_like(insertable).index_copy_(0, sel, r.inserted)
        return Resolved(keys, rows, found, inserted, r.evicted_keys, evicted, r.failed_keys)

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows [U, D+S] of row ids [U] (-1 allowed: such rows hold undefined values)."""
        return self.store.gather(rows.clamp(min=0))

    def find(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Row ids of keys [N] (-1 where absent) and whether found, without side effects."""
        return self.index.find(keys)

    def apply_pending(self, keys: torch.Tensor, grads: torch.Tensor, *, nonfinite: NonFiniteGrads = NonFiniteGrads.SKIP) -> int:
        """One optimizer step with deferred gradients [P, D] of keys [P] (distinct): keys that left
        the table since are skipped; nothing at all (not even a step count) when P = 0."""
        if keys.numel() == 0:
            return 0
        rows, _ = self.find(keys)
        return self.apply_gradients(keys, rows, grads, nonfinite=nonfinite)

    def apply_gradients(
        self,
        keys: torch.Tensor,
        rows: torch.Tensor,
        grads: torch.Tensor,
        *,
        data: torch.Tensor | None = None,
        version: int | None = None,
        nonfinite: NonFiniteGrads = NonFiniteGrads.SKIP,
        agree: Callable[[bool], bool] | None = None,
    ) -> int:
        """One optimizer step on the rows of keys, with one gradient per key.

        Args:
            keys (Tensor[int64]): [U] distinct keys.
            rows (Tensor[int64]): [U] their row ids when ``data`` was read; -1 rows are skipped.
            grads (Tensor): [U, D] gradient summed per key.
            data (Tensor | None): [U, D+S] the rows as read at ``version`` (saves a gather).
            version: the engine version when ``rows`` / ``data`` were read; if the table changed
                since, keys are found again and keys that left meanwhile are skipped.
            nonfinite: what to do with keys whose gradient, or whose updated row (embedding or
                optimizer state), is not finite: skip them, raise before any row changes (and
                before the step count advances), or apply (see :func:`screen_update`).
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
                sel = keep.nonzero().squeeze(1)
                keys, rows, grads = keys.index_select(0, sel), rows.index_select(0, sel), grads.index_select(0, sel)
                data = None if data is None else data.index_select(0, sel)
            if version is not None and version != self.version:
                # Rows were written since they were read (another lookup, insert or update): find
                # the keys again and skip those evicted or erased meanwhile.
                rows, found = self.index.find(keys)
                sel = found.nonzero().squeeze(1)
                keys, rows, grads = keys.index_select(0, sel), rows.index_select(0, sel), grads.index_select(0, sel)
                data = None
            if data is None:
                data = self.store.gather(rows)
            D = self.embedding_dim
            self.optimizer.update_rows(data, D, grads, self.optimizer_step + 1)
            # Raises (under 'raise') before anything is written: rows, step count and counters.
            bad = screen_update(keys, grads, data, nonfinite, agree=agree)
            if bad is not None:
                skipped = int(bad.sum())
                self.nonfinite_grads += skipped
                sel = (~bad).nonzero().squeeze(1)
                rows, data = rows.index_select(0, sel), data.index_select(0, sel)
            self.optimizer_step += 1
            self.store.scatter(rows, data)
            if self.changes is not None:
                self.changes.touch(rows)
            self.version += 1
        return skipped

    def write_rows(self, keys: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Overwrite the rows [N] of keys [N] (just resolved, all placed) with ``values`` [N, D]
        (embeddings) or [N, D+S] (whole rows): ``insert``'s write."""
        with writable():
            self.store.scatter(rows, values)

    def erase(self, keys: torch.Tensor, *, evicted_contents: bool = False) -> tuple[IndexResult, dict[str, torch.Tensor] | None]:
        """Remove keys ([N] int64, duplicates allowed); the contents of their rows when asked."""
        with writable():
            r = self.index.erase(keys)
            if self.changes is not None:
                self.changes.left(r.evicted_keys)
            self.version += 1
        return r, (self._leaving(r) if evicted_contents and r.evicted_keys.numel() else None)

    def export(self, chunk_size: int = 1 << 16) -> Iterator[dict[str, torch.Tensor]]:
        """Every key with its row, in chunks: ``keys`` [K], ``embeddings`` [K, D],
        ``optimizer_state`` [K, S], ``scores`` [K]."""
        D = self.embedding_dim
        for keys, rows, scores in self.index.export(chunk_size):
            data = self.store.gather(rows)
            yield {"keys": keys, "embeddings": data[:, :D], "optimizer_state": data[:, D:], "scores": scores}

    def to(self, device: torch.device, dtype: torch.dtype) -> None:
        """Move index, rows and buffers to ``device`` and rows to ``dtype``."""
        with writable():
            self.index.to(device)
            self.store = self.store.to(device, dtype)
        self.config = dataclasses.replace(self.config, device=device, dtype=dtype)
        self.initializer = RowInitializer(self.config.initializer, self.embedding_dim, self.config.seed, dtype, device)
        self._workspace.to(device)
        if self.changes is not None:
            self.changes.to(device)
        self.version += 1
