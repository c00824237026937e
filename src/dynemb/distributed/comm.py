"""Collectives of sharded tables: all-to-all by owner rank, bounded waits, failures that name the rank.

Every collective of a sharded table goes through :class:`Comm`. Before collective n a rank
records n in the process group's store; when a collective fails (a peer's connection reset) or
times out, each surviving rank records that it failed at n and waits a short grace period for
the others to do the same. The ranks that never reached n, or reached it but neither finished
nor reported the failure (died or hung inside it), are named in the error every survivor raises.
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from dynemb.hashing import mix64, rank_of

# Seconds a failed rank waits for the others to report the same failure before naming culprits.
_GRACE = 2.0


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

    def _agree_ident(self) -> str:
        """A name for this Comm that every rank agrees on (rank 0's choice)."""
        names = [self._prefix]
        dist.broadcast_object_list(names, src=dist.get_global_rank(self.group, 0), group=self.group)
        return names[0]

    # -- failure-aware waiting -----------------------------------------------------------------

    def _run(self, what: str, start):
        """Run one collective (``start()`` returns its Work) with a bounded wait."""
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

    def _failure(self, what: str, seq: int, cause: Exception, waited: float) -> ShardingError:
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
        except Exception:
            culprits = []
        who = (
            (f"rank {culprits[0]}" if len(culprits) == 1 else f"ranks {culprits}") + " did not take part (it died, raised, or is stuck)"
            if culprits
            else "the failing rank could not be told (the store on rank 0 is unreachable: rank 0 may have died)"
        )
        message = (
            f"dynemb.distributed: {what} (collective #{seq} of this sharded module) failed on rank {self.rank} "
            f"after {waited:.1f} s: {who}. Cause: {type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
        )
        return ShardingError(message, culprits)

    def _read(self, key: str) -> int:
        full = f"{self._ident}{key}"
        if not self._store.check([full]):
            return 0
        return int(self._store.get(full))

    # -- collectives -----------------------------------------------------------------------------

    def counts(self, send: list[int]) -> list[int]:
        """All-to-all of one count per peer: ``send[r]`` goes to rank r; returns what each sent."""
        inp = torch.tensor(send, dtype=torch.int64, device=self.device)
        out = torch.empty_like(inp)
        self.bytes_sent += 8 * (self.world_size - 1)
        self._run("all_to_all of counts", lambda: dist.all_to_all_single(out, inp, group=self.group, async_op=True))
        return out.tolist()

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

    def all_gather_object(self, obj) -> list:
        out = [None] * self.world_size
        self._run("all_gather_object", lambda: dist.all_gather_object(out, obj, group=self.group))
        return out
