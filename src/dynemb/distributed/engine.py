"""Sharded engines: the functional layer of a table (or group of tables) split row-wise by key.

A :class:`ShardedEngine` implements the engine contract (:mod:`dynemb.nn.base`) explicitly, so
it stands where the module expects its engine and the module's policy code stays unchanged.
Each call is collective: every rank calls it with its own unique keys, the keys travel to their
owners (:func:`dynemb.distributed.comm.owner_of`), each owner runs the local engine (the
functional layer, never the index or the store directly) on the union of the keys it received,
and the results travel back. The local engine holds only the rank's keys.

Forward (``resolve`` then ``gather``): keys (and their counts, given scores) to owners; owners
de-duplicate across ranks, resolve (inserting in training) and gather; rows and the
found / inserted / placed flags come back. Backward (``apply_gradients``): per-key gradients to
owners, summed per key across ranks, one fused step of the owner's rows. Keys an owner could
not place come back as not placed, and the asking rank reports them as its failed keys.

Each call opens with the ranks' agreement on which call they make (:meth:`Comm.begin`, folded
into the all-to-all of the call's counts) and ends (:meth:`Comm.end`) right after its last
collective. Module operations run inside :meth:`ShardedEngine.collective_op`, which tells the other
ranks when this rank raised before its first collective (docs/design/0019).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from dynemb.distributed.calls import OPS, RAISE_NONFINITE, SCORES, TRAIN, Call, Kind
from dynemb.distributed.comm import Comm, owner_of
from dynemb.nn.changes import ChangeLog
from dynemb.nn.engine import Engine, Resolved
from dynemb.table.index import unique_pairs
from dynemb.types import NonFiniteGrads


class Route:
    """Where one call's keys went: the caller's permutation by owner and the split sizes.

    Building it opens ``call`` (:meth:`Comm.begin`: the split sizes travel with the call's
    header); ``payloads`` are every rank's ``payload``. Without a call (dynemb.checkpoint's DCP
    load) the route opens an exchange of its own that is not tracked."""

    def __init__(self, comm: Comm, keys: torch.Tensor, call: Call | None = None, payload: int = 0):
        self.comm = comm
        owner = owner_of(keys, comm.world_size)
        by_owner = torch.sort(owner, stable=True)
        self.order = by_owner.indices  # [U] caller keys in owner order
        self.send = torch.bincount(by_owner.values, minlength=comm.world_size).tolist()
        self.recv, self.payloads = comm.begin(call or Call(Kind.ROWS_TO_OWNERS), self.send, payload=payload, track=call is not None)

    def out(self, t: torch.Tensor) -> torch.Tensor:
        """Rows of ``t`` [U, *] (caller order) to their owners; returns the rows this rank owns."""
        return self.comm.exchange(t.index_select(0, self.order), self.send, self.recv)

    def back(self, t: torch.Tensor) -> torch.Tensor:
        """Answers [R, *] (the rows received, in order) back to the callers, in caller order."""
        answered = self.comm.exchange(t, self.recv, self.send)
        return torch.empty_like(answered).index_copy_(0, self.order, answered)


class ShardedEngine:
    """An :class:`dynemb.nn.engine.Engine` (one table, or a collection's group) split row-wise
    over a process group: the local engine holds this rank's keys, every call is collective.

    Args:
        local: this rank's engine (its tables' capacities are this rank's share).
        comm: the process group's :class:`Comm`.
        name: this engine in errors.
        engine_id: its id in call headers (default: registered with ``comm`` now).
    """

    collective = True

    def __init__(self, local: Engine, comm: Comm, name: str = "a sharded table", *, engine_id: int | None = None):
        self.local = local
        self.comm = comm
        # This engine in call headers and errors: ids are given in shard()'s order, the same on
        # every rank.
        self.id = comm.register(name) if engine_id is None else engine_id
        self._rows_data: torch.Tensor | None = None

    @property
    def configs(self):
        """This rank's share of the tables."""
        return self.local.configs

    @property
    def optimizer(self):
        return self.local.optimizer

    @property
    def config(self):
        """This rank's share of the first table (a plain table's own)."""
        return self.local.config

    @property
    def initializers(self):
        return self.local.initializers

    @property
    def initializer(self):
        return self.local.initializer

    @property
    def optimizer_step(self) -> int:
        return self.local.optimizer_step

    @property
    def embedding_dim(self) -> int:
        return self.local.embedding_dim

    @property
    def state_dim(self) -> int:
        return self.local.state_dim

    @property
    def width(self) -> int:
        return self.local.width

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    @property
    def device(self) -> torch.device:
        return self.local.device

    @property
    def num_tables(self) -> int:
        return self.local.num_tables

    @property
    def segmented(self) -> bool:
        return self.local.segmented

    @property
    def version(self) -> int:
        return self.local.version

    @property
    def index(self):
        """This rank's key index (read it; change it through the engine's methods)."""
        return self.local.index

    @property
    def store(self):
        """This rank's row store."""
        return self.local.store

    @property
    def nonfinite_grads(self) -> list[int]:
        return self.local.nonfinite_grads

    @property
    def optimizer_steps(self) -> list[int]:
        return self.local.optimizer_steps

    def init_embeddings(self, keys: torch.Tensor, segments: torch.Tensor | None = None) -> torch.Tensor:
        """Initial embeddings of keys: a key's initial row depends on (seed, key) only, so any
        rank computes it."""
        return self.local.init_embeddings(keys, segments)

    def export(self, segment: int = 0, chunk_size: int = 1 << 16):
        """This rank's keys of one table with their rows (not collective)."""
        return self.local.export(segment, chunk_size)

    def table_stats(self, segment: int = 0) -> dict[str, int | float]:
        """This rank's figures of one table."""
        return self.local.table_stats(segment)

    def size(self) -> int:
        """Keys held by this rank."""
        return self.local.size()

    def counters(self, segment: int = 0) -> dict[str, object]:
        return self.local.counters(segment)

    def set_counters(self, segment: int = 0, *, optimizer_step=None, nonfinite_grads=None, index=None, generator_state=None) -> None:
        self.local.set_counters(segment, optimizer_step=optimizer_step, nonfinite_grads=nonfinite_grads, index=index, generator_state=generator_state)

    def fresh(self) -> ShardedEngine:
        """This sharded engine (same Comm and id) over an empty local engine (a load fills it)."""
        return self.rebuilt(self.local.fresh())

    def to(self, device: torch.device, dtype: torch.dtype) -> None:
        self.local.to(device, dtype)

    def flush(self) -> None:
        """Write this rank's cached rows back (not collective: each rank has its own store)."""
        self.local.flush()

    def retire(self, successor: ShardedEngine) -> None:
        """``successor`` replaces this engine (a load): see :meth:`Engine.retire` (not collective)."""
        self.local.retire(successor.local)

    def rebuilt(self, local) -> ShardedEngine:
        """This sharded engine (same Comm and id) over another local engine (a checkpoint load
        builds a fresh one)."""
        return type(self)(local, self.comm, engine_id=self.id)

    @contextlib.contextmanager
    def collective_op(self, op: str, undo=None):
        """Around a module operation ``op`` (an entry of :data:`dynemb.distributed.calls.OPS`)
        that makes collective calls: they carry its name, and an exception on this rank before
        the operation's first collective is announced to the other ranks (which raise too,
        naming this rank and the error) instead of leaving them waiting. ``undo()`` runs when
        the operation raised before any of its calls ended (it changed no table). Nested
        operations are the outer one's."""
        comm = self.comm
        if op not in OPS:
            raise ValueError(f"op={op!r}: not one of {OPS}")
        if comm.op:
            yield
            return
        comm.op, begun, ended = op, comm.calls, comm.ended
        try:
            yield
        except BaseException as e:
            if undo is not None and comm.ended == ended:
                undo()
            if comm.open is not None:
                comm.left(e)
            elif comm.calls == begun and comm.broken is None and isinstance(e, Exception):
                # May raise ShardingError itself (the others never come), chained to ``e``.
                comm.refuse(self.id, f"{type(e).__name__}: {e}")
            raise
        finally:
            comm.op = ""

    def _call(self, kind: Kind, flags: int = 0) -> Call:
        return Call(kind, self.id, flags)

    def __setattr__(self, name: str, value) -> None:
        # A sharded engine's state is its local engine's: a write here would go unseen by it (a
        # checkpoint once set its change log this way and every sharded delta came out empty).
        if name not in ("local", "comm", "id", "_rows_data"):
            raise AttributeError(f"{type(self).__name__}.{name}: a sharded engine's state is its local engine's; change it through that engine's methods")
        object.__setattr__(self, name, value)

    @property
    def changes(self) -> ChangeLog | None:
        """This rank's change log: rows of its keys touched and its keys that left (evicted or
        erased here, as their owner), or None when nothing tracks changes."""
        return self.local.changes

    def track_changes(self) -> ChangeLog:
        """Start (or keep) this rank's change log; a sharded delta writes every rank's part."""
        return self.local.track_changes()

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """Embeddings [U, D] of the last resolve / find (``rows``: its placeholders, -1 allowed);
        the optimizer state stays on the owners."""
        if self._rows_data is None:
            raise RuntimeError("sharded engine: gather() before resolve() or find()")
        return self._rows_data.index_select(0, rows.clamp(min=0))

    def readable_rows(self) -> None:
        """None: the rows live on their owner ranks; a lookup gathers what the resolve fetched."""
        return None

    def _dedup(self, keys: torch.Tensor, segs: torch.Tensor | None):
        """Distinct (segment, key) pairs of the keys received: (keys [R'], segs or None, inverse [R])."""
        if segs is None:
            uk, inv = torch.unique(keys, sorted=True, return_inverse=True)
            return uk, None, inv
        (us, uk), inv, _ = unique_pairs(segs, keys)
        return uk, us, inv

    def _routed(self, call: Call, keys: torch.Tensor, segs: torch.Tensor | None):
        """Open ``call`` with a Route for the caller's keys [U]; the keys (and segments) this rank owns."""
        route = Route(self.comm, keys, call)
        return route, route.out(keys), None if segs is None else route.out(segs)

    def _resolve(self, keys, segs, *, train, now, counts, insertable, scores, evicted_contents, init_rows):
        if insertable is not None:
            raise NotImplementedError("admission on a sharded table: the admission counters would be per rank (shard() refuses it)")
        call = self._call(Kind.LOOKUP, (TRAIN if train else 0) | (SCORES if scores is not None else 0))
        route, rkeys, rsegs = self._routed(call, keys, segs)
        uk, us, inv = self._dedup(rkeys, rsegs)
        ucounts = None
        if train:
            rcounts = route.out(torch.ones_like(keys) if counts is None else counts)
            ucounts = torch.zeros_like(uk).index_add_(0, inv, rcounts)
        uscores = None
        if scores is not None:
            rscores = route.out(scores)
            uscores = torch.full_like(uk, torch.iinfo(torch.int64).min).scatter_reduce_(0, inv, rscores, reduce="amax")
        r = self.local.resolve(uk, us, train=train, now=now, counts=ucounts, scores=uscores, evicted_contents=evicted_contents, init_rows=init_rows)
        # Only the embedding columns travel: the asking rank never reads optimizer state.
        data = self.local.gather(r.rows)[:, : self.local.embedding_dim]
        flags = torch.stack([r.ok, r.found, r.inserted], 1).to(torch.uint8).index_select(0, inv)  # [R, 3]
        data = route.back(data.index_select(0, inv))  # [U, D]
        ok, found, inserted = route.back(flags).bool().unbind(1)
        self.comm.end()
        self._rows_data = data
        placeholder = torch.where(ok, torch.arange(keys.numel(), device=keys.device), -1)
        failed = ~ok if train else torch.zeros_like(ok)
        return r, placeholder, found, inserted, failed

    def _find(self, keys, segs):
        route, rkeys, rsegs = self._routed(self._call(Kind.FIND), keys, segs)
        uk, us, inv = self._dedup(rkeys, rsegs)
        rows, found = self.local.find(uk, us)
        data = route.back(self.local.gather(rows)[:, : self.local.embedding_dim].index_select(0, inv))
        found = route.back(found.to(torch.uint8).index_select(0, inv)).bool()
        self.comm.end()
        self._rows_data = data
        return torch.where(found, torch.arange(keys.numel(), device=keys.device), -1), found

    def agree(self, what: str, problem: str | None, **fields) -> list[dict] | None:
        """Before a collective call with caller-checked input (``insert``, ``erase``): every
        rank's call fields, so that a rank whose input is bad never leaves the others in a
        collective it skips. Raises on every rank without a problem of its own when another rank
        has one; returns None to a rank with a ``problem`` (it raises its own error), else every
        rank's fields."""
        if self.comm.begin(self._call(Kind.INPUT_CHECK), problem=problem) is None:
            return None
        everyone = self.comm.all_gather_object(fields, header=False)
        self.comm.end()
        return everyone

    def _write_rows(self, keys, segs, values) -> None:
        """``insert``'s write: each placed key's values [N, *] to its owner, which overwrites the
        key's row (a key given by several ranks gets one of their values)."""
        route, rkeys, rsegs = self._routed(self._call(Kind.WRITE_ROWS), keys, segs)
        rvalues = route.out(values)
        rows, found = self.local.find(rkeys, rsegs)
        sel = found.nonzero().squeeze(1)
        placed_segs = None if rsegs is None else rsegs.index_select(0, sel)
        self.local.write_rows(rkeys.index_select(0, sel), rows.index_select(0, sel), rvalues.index_select(0, sel), segments=placed_segs)
        # Ended after the owner's write, as an update (a failed write leaves the ranks out of step).
        self.comm.end()

    def _erase(self, keys, segs, evicted_contents: bool):
        """Each key to its owner, which erases it (and reports it: evict hooks and
        ``last_evicted_keys`` of the owning rank, as for evictions); ``found`` [N] comes back to
        the rank that asked."""
        route, rkeys, rsegs = self._routed(self._call(Kind.ERASE), keys, segs)
        r, contents = self.local.erase(rkeys, rsegs, evicted_contents=evicted_contents)
        found = route.back(r.found.to(torch.uint8)).bool()
        self.comm.end()
        return dataclasses.replace(r, found=found), contents

    def _apply(self, keys, segs, rows, grads, nonfinite: NonFiniteGrads, stepped=None, kind: Kind = Kind.GRADIENTS) -> int:
        """Send each placed key's gradient to its owner; owners sum per key and step once.
        ``Kind.PENDING`` (a deferred step): nothing at all when no rank has a key."""
        keep = (rows >= 0).nonzero().squeeze(1)
        if keep.numel() != keys.numel():
            keys, grads = keys.index_select(0, keep), grads.index_select(0, keep)
            segs = None if segs is None else segs.index_select(0, keep)
        raising = nonfinite is NonFiniteGrads.RAISE
        route = Route(self.comm, keys, self._call(kind, RAISE_NONFINITE if raising else 0), payload=keys.numel())
        if kind is Kind.PENDING and not any(route.payloads):
            self.comm.end()
            return 0
        rkeys, rsegs = route.out(keys), None if segs is None else route.out(segs)
        rgrads = route.out(grads)
        uk, us, inv = self._dedup(rkeys, rsegs)
        gsum = grads.new_zeros((uk.numel(), grads.shape[1])).index_add_(0, inv, rgrads)
        found_rows, _ = self.local.find(uk, us)
        kw = {"segments": us, "nonfinite": nonfinite, "stepped": stepped}
        if not raising:
            # The call ends after the owner's update: an update that fails leaves this shard
            # behind the others', so the ranks are out of step (Comm.left, by collective_op).
            skipped = self.local.apply_gradients(uk, found_rows, gsum, **kw)
            self.comm.end()
            return skipped
        ended = []

        def agree(bad: bool) -> bool:
            # Every rank must raise together (a rank that raised alone would leave the others
            # waiting in the next collective): the owners screen their updated rows, all agree
            # (one all-reduce, the call's last collective) before any writes, and the owner of
            # the bad keys names them.
            anyone = bool(self.comm.all_reduce_max(int(bad)))
            self.comm.end()
            ended.append(True)
            return anyone

        kw["agree"] = agree
        skipped = self.local.apply_gradients(uk, found_rows, gsum, **kw)
        if not ended:
            # The local engine returned before screening (a frozen table): so did every rank.
            self.comm.end()
        return skipped

    def resolve(self, keys, segments=None, *, train, now, counts=None, insertable=None, scores=None, evicted_contents=False, init_rows=True) -> Resolved:
        """The contract's resolve, collectively: each key resolved by its owner."""
        r, rows, found, inserted, failed = self._resolve(
            keys, segments, train=train, now=now, counts=counts, insertable=insertable, scores=scores, evicted_contents=evicted_contents, init_rows=init_rows
        )
        # Evicted keys are the owner's (its hooks and last_evicted_keys report them).
        failed_segments = None if segments is None else segments[failed]
        return Resolved(keys, rows, found, inserted, r.evicted_keys, r.evicted, keys[failed], segments, r.evicted_segments, failed_segments)

    def find(self, keys: torch.Tensor, segments: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self._find(keys, segments)

    def write_rows(self, keys, rows, values, *, segments=None) -> None:
        self._write_rows(keys, segments, values)

    def erase(self, keys, segments=None, *, evicted_contents=False):
        return self._erase(keys, segments, evicted_contents)

    def apply_gradients(self, keys, rows, grads, *, segments=None, data=None, version=None, nonfinite=NonFiniteGrads.SKIP, stepped=None) -> int:
        return self._apply(keys, segments, rows, grads, nonfinite, stepped)

    def apply_pending(self, keys, grads, *, segments=None, nonfinite=NonFiniteGrads.SKIP) -> int:
        if segments is None and self.segmented:
            # An empty accumulator has no segments yet: every rank must still send them.
            segments = torch.zeros_like(keys)
        rows = torch.zeros_like(keys)
        return self._apply(keys, segments, rows, grads, nonfinite, kind=Kind.PENDING)


# The former twins' names.
ShardedTableEngine = ShardedEngine
ShardedGroupEngine = ShardedEngine
