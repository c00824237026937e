"""The engine contract: what an engine offers the modules, the distributed layer and checkpoints.

T tables of the engine (segments of its index), U unique keys of a call, N keys, E keys that
leave, K keys held, D embedding dim, S optimizer state columns (W = D + S).

An engine holds one or more tables that share embedding dim, dtype, device, bucket width, score
strategy and non-finite policy: one index (each table a segment), one row store, one fused
optimizer with a step count per table. A plain table is an engine of one table. Keys of a call
are given with their ``segments`` ([N] int64, the table of each key); ``None`` means table 0
and is the fast path of a one-table engine.

Two classes implement it: :class:`dynemb.nn.engine.Engine` (this process holds every key) and
:class:`dynemb.distributed.engine.ShardedEngine` (keys split row-wise over a process group; every
call is collective). Modules, checkpoints and the distributed layer use only these names; none
reaches into an engine's index, store or private attributes to change them.

An engine applies no policy (check mode, admission, hooks, eval defaults are the module's),
takes the clock as an argument (``now``) and holds no lock: its owner serialises calls
(docs/design/0008-threading.md). See docs/design/0024-one-engine.md for the picture.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Protocol, runtime_checkable

import torch

from dynemb.config import TableConfig
from dynemb.nn.changes import ChangeLog
from dynemb.optim.base import RowOptimizer
from dynemb.types import NonFiniteGrads


@dataclasses.dataclass(frozen=True)
class Resolved:
    """Outcome of ``resolve`` over U unique (segment, key) pairs.

    Attributes:
        keys (Tensor[int64]): [U] the keys, as given.
        rows (Tensor[int64]): [U] row id of each key, -1 where it is not in the table.
        found (Tensor[bool]): [U] the key was in the table before the call.
        inserted (Tensor[bool]): [U] the key was inserted by the call.
        evicted_keys (Tensor[int64]): [E] keys evicted to make room.
        evicted (dict[str, Tensor] | None): their ``embeddings`` [E, D], ``optimizer_state``
            [E, S] and ``scores`` [E] as they were when evicted (only when asked for).
        failed_keys (Tensor[int64]): [F] keys that should have been inserted and were not.
        segments, evicted_segments, failed_segments (Tensor[int64] | None): [U], [E], [F] the
            table of each key; None for a call without segments (table 0).
    """

    keys: torch.Tensor
    rows: torch.Tensor
    found: torch.Tensor
    inserted: torch.Tensor
    evicted_keys: torch.Tensor
    evicted: dict[str, torch.Tensor] | None
    failed_keys: torch.Tensor
    segments: torch.Tensor | None = None
    evicted_segments: torch.Tensor | None = None
    failed_segments: torch.Tensor | None = None

    @property
    def ok(self) -> torch.Tensor:
        """Tensor[bool]: [U] the key is in the table after the call."""
        return self.rows >= 0


@runtime_checkable
class EngineContract(Protocol):
    """The one door to a group of tables' keys and rows.

    Attributes:
        configs (list[TableConfig]): [T] the tables (on a sharded engine: this rank's share).
        optimizer (RowOptimizer | None): the fused optimizer (None: frozen tables).
        embedding_dim, state_dim, width (int): D, S and W = D + S.
        dtype, device: of the rows.
        version (int): bumped by every write to rows or index (a backward re-finds its keys
            when it changed since its forward).
        collective (bool): every call is a collective over a process group (sharded).
    """

    configs: list[TableConfig]
    optimizer: RowOptimizer | None
    embedding_dim: int
    state_dim: int
    width: int
    version: int
    collective: bool

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def num_tables(self) -> int: ...

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
    ):
        """Row ids of unique (segment, key) pairs ``keys`` [U] (sorted by segment, then key);
        in training, missing keys are inserted (``insertable`` [U] bool: admission) and
        initialised. Returns a :class:`Resolved`."""

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows [U, W] of row ids [U] of the last resolve / find (-1: undefined values); a
        sharded engine returns the embeddings [U, D] only."""

    def readable_rows(self) -> torch.Tensor | None:
        """The rows [C, W] a lookup may copy from in place at its row ids instead of gathering
        them first, valid until the table next changes; None where the engine has no such
        tensor (tiers, a cache, another device, rows on other ranks)."""

    def init_embeddings(self, keys: torch.Tensor, segments: torch.Tensor | None = None) -> torch.Tensor:
        """Initial embeddings [N, D] of keys [N], each by its table's initialiser."""

    def find(self, keys: torch.Tensor, segments: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Row ids [N] (-1 where absent) and found [N] of keys [N], without side effects."""

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
    ) -> int:
        """One fused optimizer step on the rows [U] of distinct keys [U] with gradients [U, D]
        (the local :class:`dynemb.nn.engine.Engine` also takes a bag collection's
        :class:`dynemb.nn.units.BagGradients`, which every other engine is handed summed);
        returns the number of keys skipped for a non-finite gradient or update."""

    def apply_pending(
        self, keys: torch.Tensor, grads: torch.Tensor, *, segments: torch.Tensor | None = None, nonfinite: NonFiniteGrads = NonFiniteGrads.SKIP
    ) -> int:
        """One optimizer step with deferred gradients [P, D] of distinct keys [P]; keys that
        left since are skipped; nothing at all (not even a step count) when no key is given."""

    def write_rows(self, keys: torch.Tensor, rows: torch.Tensor, values: torch.Tensor, *, segments: torch.Tensor | None = None) -> None:
        """Overwrite the rows [N] of keys [N] (just resolved) with values [N, D] or [N, W]."""

    def erase(self, keys: torch.Tensor, segments: torch.Tensor | None = None, *, evicted_contents: bool = False):
        """Remove keys [N]; returns the index result (``found`` [N], keys that left [E]) and
        the contents of their rows when asked."""

    def export(self, segment: int = 0, chunk_size: int = 1 << 16) -> Iterator[dict[str, torch.Tensor]]:
        """One table's keys [K] with ``embeddings`` [K, D], ``optimizer_state`` [K, S] and
        ``scores`` [K], in chunks (this rank's keys on a sharded engine)."""

    def table_stats(self, segment: int = 0) -> dict[str, int | float]:
        """One table's index figures: size, capacity, current_capacity, load_factor, inserts,
        evictions, failed_inserts (and growths / erased)."""

    def counters(self, segment: int = 0) -> dict[str, object]:
        """One table's counters for a checkpoint: optimizer_step, nonfinite_grads, index (the
        four index counters), generator (the initialiser's generator)."""

    @property
    def changes(self) -> ChangeLog | None:
        """Rows touched and keys that left since the last checkpoint, None when not tracked."""

    def track_changes(self) -> ChangeLog:
        """Start (or keep) the change log that checkpoint deltas read."""

    def agree(self, what: str, problem: str | None, **fields) -> list[dict] | None:
        """Every rank's ``fields`` of a call with caller-checked input (sharded); None when local."""

    def collective_op(self, op: str, undo: Callable[[], None] | None = None) -> contextlib.AbstractContextManager:
        """Context of a module operation that makes collective calls (a null context when local)."""

    def to(self, device: torch.device, dtype: torch.dtype) -> None:
        """Move index and rows to ``device`` and rows to ``dtype``."""

    def flush(self) -> None:
        """Write rows held in a faster layer back to their home (a caching table's dirty cached
        rows to its external store); nothing for other stores."""

    def retire(self, successor) -> None:
        """``successor`` (an engine of the same tables, built by a load) replaces this one."""
