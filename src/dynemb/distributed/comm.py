"""Collectives of sharded tables: all-to-all by owner rank, bounded waits, failures that name the rank.

Every collective of a sharded table goes through :class:`Comm`. Before collective n a rank
records n in the process group's store; when a collective fails (a peer's connection reset) or
times out, each surviving rank records that it failed at n and waits a short grace period for
the others to do the same. The ranks that never reached n, or reached it but neither finished
nor reported the failure (died or hung inside it), are named in the error every survivor raises.

Every call of a sharded table opens with :meth:`Comm.begin`: the ranks exchange a fixed-size
header saying which call each makes (:mod:`dynemb.distributed.calls`) before any data moves.
Different calls on different ranks, or a rank that raised before its first collective
(:meth:`Comm.refuse`), make every rank raise, in step, with no table changed. A rank that leaves
a call half-way (a failed collective, an exception between two of its collectives) leaves the
ranks out of step: from then on the Comm refuses every collective, with an error saying to
restore from a checkpoint (docs/design/0019-collective-agreement.md).
"""

from __future__ import annotations

import datetime
import time
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.distributed as dist

from dynemb.distributed.calls import OPS, Call, Kind
from dynemb.hashing import mix64, rank_of

# Int64s each rank sends each other rank in a call's header: the count, six header fields, the payload.
_HEADER = 8
# Seconds a failed rank waits for the others to report the same failure before naming culprits.
_GRACE = 2.0


_RESTORE = (
    "To go on, restore every rank from a checkpoint: restart the job (a dead rank) or build the model again on every rank, "
    "shard() it and dynemb.checkpoint.load() the last checkpoint."
)


class ShardingError(RuntimeError):
    """A collective of a sharded table failed or timed out; ``ranks`` are the ranks to blame
    (those that did not take part), empty if they could not be told."""

    def __init__(self, message: str, ranks: list[int]):
        super().__init__(message)
        self.ranks = ranks


def owner_of(keys: torch.Tensor, world_size: int) -> torch.Tensor:
    """Owner rank of each key ([N] int64 -> [N] int64): the low 32 bits of the mixed key, which
    bucket choice does not use, so every rank's buckets fill evenly."""
    return rank_of(mix64(keys), world_size)


class Comm:
    """The process group of a sharded module and its failure-aware all-to-all.

    Args:
        group: the process group (None: the default one).
        timeout: longest wait of one collective.
    """

    def __init__(self, group=None, timeout: datetime.timedelta = datetime.timedelta(seconds=60)):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("dynemb.distributed.shard: torch.distributed is not initialised (call torch.distributed.init_process_group first)")
        if not isinstance(timeout, datetime.timedelta) or timeout.total_seconds() <= 0:
            raise ValueError(f"timeout={timeout!r}: must be a positive datetime.timedelta")
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.timeout = timeout
        self.backend = dist.get_backend(group)
        # A group of our own whose backend times out with ``timeout`` too: a collective stuck on
        # a hung peer is then aborted by gloo / NCCL themselves, so the survivors can exit after
        # raising (the default group's timeout is 30 minutes).
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        self.group = dist.new_group(ranks=ranks, timeout=timeout, backend=self.backend, use_local_synchronization=True)
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        self._store = dist.distributed_c10d._get_default_store()
        self._prefix = f"dynemb/comm/{id(self):x}/"
        # One id per Comm shared by all ranks: the ranks build Comms in the same order.
        self._seq = 0
        self._ident = self._agree_ident()
        # Bytes this rank sent to other ranks through all-to-alls (benchmarks read it).
        self.bytes_sent = 0
        # Names of the engines (index = the engine id in call headers; shard() registers them
        # in the same order on every rank).
        self.names: list[str] = []
        # The module operation under way (an entry of calls.OPS; set by the engines' guard).
        self.op = ""
        # Calls begun / ended on this rank, the call begun and not yet ended, and why the ranks
        # are out of step (None while they are in step).
        self.calls = 0
        self.ended = 0
        self.open: tuple[Call, int, str] | None = None  # (call, sequence number, operation)
        self.broken: str | None = None

    def _agree_ident(self) -> str:
        """A name for this Comm that every rank agrees on (rank 0's choice)."""
        names = [self._prefix]
        dist.broadcast_object_list(names, src=dist.get_global_rank(self.group, 0), group=self.group)
        return names[0]

    def register(self, name: str) -> int:
        """A new engine's id in call headers; ``name`` names it in errors ("table 'user'")."""
        self.names.append(name)
        return len(self.names) - 1

    def describe(self, call: Call, seq: int, op: str | None = None) -> str:
        """A call in words: operation (default: the one under way), table, exchange and sequence number."""
        op = (self.op if op is None else op) or call.kind.default_op
        where = f" of {self.names[call.engine]}" if call.engine >= 0 else ""
        what = "" if call.kind is Kind.REFUSED else f": {call.kind.describe(call.flags)}"
        return f"{op}{where} (call #{seq}{what})"

    def begin(self, call: Call, send: list[int] | None = None, *, payload: int = 0, problem: str | None = None, track: bool = True):
        """Open ``call`` on every rank: one all-to-all of ``send[r]`` (a count) and this rank's
        header to each rank r. Returns (the counts each rank sent here, each rank's ``payload``)
        when every rank makes the same call and none has a problem; the call is then open
        (``track``) until :meth:`end`. Otherwise every rank exchanges what it was doing and
        raises (ValueError when other ranks had a ``problem``, ShardingError when the calls
        differ), the ranks still in step; a rank with a ``problem`` gets None and raises its own.
        """
        if self.broken is not None:
            raise self._out_of_step(call)
        if self.open is not None:
            self._leave(f"rank {self.rank} began a new call while {self.describe(*self.open)} was still exchanging data")
            raise self._out_of_step(call)
        self.calls += 1
        seq, W, op = self.calls, self.world_size, self.op
        head = [OPS.index(op), int(call.kind), call.engine, call.flags, seq, int(problem is None)]
        # [W * 8]: rank r's slice is (send[r], *head, payload); a flat list is the cheapest to build.
        flat: list[int] = []
        for n in send or [0] * W:
            flat.append(n)
            flat += head
            flat.append(payload)
        inp = torch.tensor(flat, dtype=torch.int64)
        if self.device.type != "cpu":
            inp = inp.to(self.device)
        out = torch.empty_like(inp)
        self.bytes_sent += 8 * _HEADER * (W - 1)
        self._run(lambda: f"header of {self.describe(call, seq, op)}", lambda: dist.all_to_all_single(out, inp, group=self.group, async_op=True))
        got = out.tolist()
        if all(got[i + 1 : i + 7] == head for i in range(0, W * _HEADER, _HEADER)):
            if track:
                self.open = (call, seq, op)
            return got[0::_HEADER], got[_HEADER - 1 :: _HEADER]
        self._disagree(self.describe(call, seq), problem)
        return None

    def end(self) -> None:
        """The open call made its last collective: an error after this leaves the ranks in step."""
        self.open = None
        self.ended += 1

    def refuse(self, engine: int, problem: str) -> None:
        """This rank raised before the first collective of a call: tell the other ranks (they
        raise, naming this rank and its ``problem``); the caller raises its own error."""
        self.begin(Call(Kind.REFUSED, engine), problem=problem, track=False)

    def left(self, error: BaseException) -> None:
        """``error`` left the open call on this rank before its last collective: the other ranks
        wait in that collective, so the ranks are out of step."""
        self._leave(f"rank {self.rank} raised {type(error).__name__} in the middle of {self.describe(*self.open)}")

    def _leave(self, why: str) -> None:
        """Mark the ranks out of step (and tell the others through the store, for their errors)."""
        self.broken, self.open = why, None
        try:
            self._store.set(f"{self._ident}left/{self.rank}", why)
        except Exception:
            pass

    def _out_of_step(self, call: Call) -> ShardingError:
        return ShardingError(
            f"dynemb.distributed: {self.describe(call, self.calls + 1)} refused on rank {self.rank}: the sharded tables of this "
            f"process group are out of step since {self.broken}. No further collective runs on them (the ranks would exchange "
            f"data of different calls). {_RESTORE}",
            [],
        )

    def _disagree(self, mine: str, problem: str | None) -> None:
        """The headers differ: every rank gathers what each was doing, then raises (a rank with
        a problem returns and raises its own)."""
        everyone: list = [None] * self.world_size
        self._run("all_gather_object of the ranks' calls", lambda: dist.all_gather_object(everyone, (mine, problem), group=self.group))
        if problem is not None:
            return
        refused = [f"rank {r} raised {p} in {call}" for r, (call, p) in enumerate(everyone) if p is not None]
        if refused:
            raise ValueError(
                f"dynemb.distributed: {mine} refused on rank {self.rank}: bad input on another rank, so no rank changed a table "
                f"({'; '.join(refused)}). The ranks are still in step: fix the input (or the error) on that rank, then make the call again on every rank."
            )
        by_call: dict[str, list[int]] = defaultdict(list)
        for r, (call, _) in enumerate(everyone):
            by_call[call].append(r)
        calls = "; ".join(f"{'rank' if len(rs) == 1 else 'ranks'} {rs[0] if len(rs) == 1 else rs}: {call}" for call, rs in by_call.items())
        raise ShardingError(
            f"dynemb.distributed: {mine} refused on rank {self.rank}: the ranks make different collective calls ({calls}), so none "
            "ran and no rank changed a table; the ranks are still in step. Every rank must make the same collective calls on the same "
            "sharded tables, in the same order (forward, backward, optimizer.step(), find / contains, insert, erase, checkpoint "
            "save / load): find where the ranks' code paths part (an error caught on some ranks only, a branch on the rank or "
            "on the data) and make every rank take the same path.",
            [r for call, rs in by_call.items() if call != mine for r in rs],
        )

    def _run(self, what: str | Callable[[], str], start):
        """Run one collective (``start()`` returns its Work) with a bounded wait; ``what`` names
        it in errors (a callable: built only then)."""
        self._seq += 1
        seq = self._seq
        try:
            self._store.set(f"{self._ident}seq/{self.rank}", str(seq))
        except Exception:
            pass
        t0 = time.monotonic()
        try:
            work = start()
            if work is not None and not work.wait(self.timeout):
                raise TimeoutError(f"no answer within {self.timeout.total_seconds():g} s")
        except Exception as e:
            raise self._failure(what, seq, e, time.monotonic() - t0) from e

    def _failure(self, what: str | Callable[[], str], seq: int, cause: Exception, waited: float) -> ShardingError:
        """Name the ranks that did not take part in collective ``seq``."""
        culprits: list[int] = []
        try:
            self._store.set(f"{self._ident}failed/{self.rank}", str(seq))
            deadline = time.monotonic() + _GRACE
            while True:
                culprits = []
                for r in range(self.world_size):
                    if r == self.rank:
                        continue
                    reached = self._read(f"seq/{r}")
                    failed = self._read(f"failed/{r}")
                    if reached < seq or failed != seq:
                        culprits.append(r)
                if not culprits or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            store_ok = True
        except Exception:
            culprits, store_ok = [], False
        if culprits:
            who = (f"rank {culprits[0]}" if len(culprits) == 1 else f"ranks {culprits}") + " did not take part (it died, raised, or is stuck)"
            said = [text for text in map(self._said, culprits) if text]
            if said:
                who += f": {'; '.join(said)}"
        elif store_ok:
            who = "every rank reports this collective failed, so none can be blamed (see the cause)"
        elif self.rank == 0:
            who = "the failing rank could not be told (the store is unreachable)"
        else:
            who = "the failing rank could not be told (the store is unreachable: its host, rank 0 unless torchrun hosts it, may have died)"
        # The call, when one is open: the collective's own name means little to a user.
        what = what() if callable(what) else what
        what = f"{self.describe(*self.open)}, its {what}" if self.open else what
        message = (
            f"dynemb.distributed: {what} (collective #{seq} of this sharded module) failed on rank {self.rank} "
            f"after {waited:.1f} s: {who}. Cause: {type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}. {_RESTORE}"
        )
        self.broken, self.open = f"{what} (collective #{seq}) failed on rank {self.rank}: {who}", None
        return ShardingError(message, culprits)

    def _said(self, rank: int) -> str:
        """Why ``rank`` left the ranks out of step, if it wrote it to the store ("" if not)."""
        try:
            key = f"{self._ident}left/{rank}"
            return self._store.get(key).decode() if self._store.check([key]) else ""
        except Exception:
            return ""

    def _read(self, key: str) -> int:
        full = f"{self._ident}{key}"
        if not self._store.check([full]):
            return 0
        return int(self._store.get(full))

    def exchange(self, tensor: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        """All-to-all of the rows of ``tensor`` [sum(send), *]: ``send[r]`` rows to rank r;
        returns the rows received [sum(recv), *], rank 0's first."""
        inp = tensor.to(self.device).contiguous()
        out = inp.new_empty((sum(recv), *inp.shape[1:]))
        row = inp[:1].numel() * inp.element_size()
        self.bytes_sent += (sum(send) - send[self.rank]) * row
        self._run(
            f"all_to_all of {tuple(inp.shape[1:]) or 'scalar'} rows",
            lambda: dist.all_to_all_single(out, inp, output_split_sizes=recv, input_split_sizes=send, group=self.group, async_op=True),
        )
        return out.to(tensor.device)

    def all_reduce_max(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        self._run("all_reduce", lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True))
        return int(t.item())

    def all_gather_object(self, obj, *, header: bool = True) -> list:
        """Every rank's ``obj`` (picklable), rank 0's first. With ``header`` (a call of its own,
        as dynemb.checkpoint's; not inside an open call) it opens with a header exchange."""
        if header:
            self.begin(Call(Kind.OBJECTS), track=False)
        out = [None] * self.world_size
        self._run("all_gather_object", lambda: dist.all_gather_object(out, obj, group=self.group))
        return out
