"""Worlds of gloo processes for the sharding tests.

R ranks. ``run_world(R, "module:function")`` starts R fresh interpreters (this file as a script,
with torchrun's environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) joined by a TCPStore
that the parent hosts, so no port is guessed and a rank that dies cannot take the store with it.
Each rank initialises the default gloo group, imports ``module`` (a file beside this one) and
calls ``function(worker)``. Ranks report through ``worker.record(**fields)``: one JSON line each,
appended to ``rank<r>.jsonl`` and flushed at once, so what a rank said before it died or hung is
kept. The parent waits until ``deadline_s``, kills the ranks still running, and returns a
:class:`World` whose ``assert_case`` / ``assert_ok`` fail with every rank's traceback and the
tail of its stderr.

``run_cases(worker, cases)`` runs many cases in one world: each gets a fresh gloo group, a case
that raises is recorded and the next one starts after a store barrier, so one bad case does not
hide the others (its peers, blocked in a collective, wait out the case's timeout).
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
_ADDR = "127.0.0.1"


class Worker:
    """What a rank's function gets: its rank, the world size, the store, and ``record``."""

    def __init__(self, rank: int, size: int, store, out: Path, options: dict):
        self.rank, self.size, self.store, self.options = rank, size, store, options
        self._log = open(out / f"rank{rank}.jsonl", "a")

    def record(self, **fields) -> None:
        """Append one JSON record (a dict of JSON-able fields) to this rank's log."""
        fields.setdefault("t", time.time())
        self._log.write(json.dumps(fields) + "\n")
        self._log.flush()

    def store_barrier(self, name: str, timeout_s: float) -> bool:
        """Wait until every rank arrived at ``name`` (through the parent's store, so it works when
        the gloo groups are broken); False after ``timeout_s``."""
        key = f"harness/barrier/{name}"
        self.store.add(key, 1)
        deadline = time.monotonic() + timeout_s
        while self.store.add(key, 0) < self.size:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True


def run_cases(worker: Worker, cases: dict[str, Callable], group_timeout_s: float = 60.0, barrier_timeout_s: float = 120.0) -> None:
    """Run ``case(worker, group)`` for each case in order, each with a new gloo group of all ranks;
    record ``{"case", "ok", "seconds", "error"}`` per case."""
    import torch.distributed as dist

    for name, case in cases.items():
        worker.store_barrier(f"case/{name}", barrier_timeout_s)
        started = time.monotonic()
        try:
            group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=group_timeout_s))
            case(worker, group)
        except Exception:
            worker.record(case=name, ok=False, seconds=time.monotonic() - started, error=traceback.format_exc())
        else:
            worker.record(case=name, ok=True, seconds=time.monotonic() - started)


def _child() -> None:
    import torch
    import torch.distributed as dist

    from dynemb import workspace

    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = Path(os.environ["DYNEMB_TEST_OUT"])
    options = json.loads(os.environ["DYNEMB_TEST_OPTIONS"])
    torch.set_num_threads(1)
    # As tests/conftest.py does in the test process: fresh buffers are poisoned.
    workspace.set_poison(True)
    timeout = datetime.timedelta(seconds=options["init_timeout_s"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), size, is_master=False, timeout=timeout, wait_for_workers=False)
    dist.init_process_group("gloo", store=dist.PrefixStore("default_pg", store), rank=rank, world_size=size, timeout=timeout)
    worker = Worker(rank, size, store, out, options)
    module, _, function = os.environ["DYNEMB_TEST_TARGET"].partition(":")
    try:
        getattr(importlib.import_module(module), function)(worker)
    except BaseException:
        worker.record(event="error", error=traceback.format_exc())
        traceback.print_exc()
        _leave(1)
    worker.record(event="returned")
    if options["final_barrier"]:
        # A rank that leaves while a peer still reads from it would fail that peer.
        worker.store_barrier("end", options["init_timeout_s"])
    _leave(0)


def _leave(code: int) -> None:
    """Exit with ``code`` now. Interpreter teardown with a live gloo group can abort the process
    ("terminate called without an active exception", exit -6) when a peer still holds a
    connection; the exit code must say how the rank's function ended, not how torch tore down."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@dataclasses.dataclass
class Rank:
    rank: int
    returncode: int | None  # None: still running at the deadline (then killed)
    killed: bool
    records: list[dict]
    stderr: str
    ended_at: float  # time.time() when the parent saw it end (or killed it)

    def error(self) -> str | None:
        return next((r["error"] for r in self.records if r.get("event") == "error"), None)

    def describe(self, tail: int = 3000) -> str:
        state = "killed (still running at the deadline)" if self.killed else f"exit code {self.returncode}"
        err = self.stderr[-tail:] if self.stderr.strip() else "(empty)"
        return f"--- rank {self.rank}: {state}; stderr tail:\n{err}"


@dataclasses.dataclass
class World:
    size: int
    ranks: list[Rank]
    started_at: float
    seconds: float

    def describe(self) -> str:
        return f"world of {self.size} ranks ran {self.seconds:.1f} s\n" + "\n".join(r.describe() for r in self.ranks)

    def assert_ok(self) -> None:
        """Every rank returned from its function and exited 0."""
        bad = [r for r in self.ranks if r.killed or r.returncode != 0 or r.error()]
        if bad:
            raise AssertionError("ranks failed:\n" + "\n".join((r.error() or "") + r.describe() for r in bad))

    def case(self, name: str) -> list[dict | None]:
        """The record of case ``name`` on each rank (None where the rank never finished it)."""
        return [next((rec for rec in r.records if rec.get("case") == name), None) for r in self.ranks]

    def assert_case(self, name: str) -> None:
        """Case ``name`` passed on every rank; else fail with each rank's traceback (and, for a
        rank that never finished the case, how the rank ended)."""
        problems = []
        for r, rec in zip(self.ranks, self.case(name)):
            if rec is None:
                problems.append(f"=== rank {r.rank}: no result for case {name!r}\n{r.error() or ''}{r.describe()}")
            elif not rec["ok"]:
                problems.append(f"=== rank {r.rank} ({rec['seconds']:.1f} s):\n{rec['error']}")
        if problems:
            raise AssertionError(f"case {name!r} failed in a {self.size}-rank world:\n" + "\n".join(problems))


def run_world(
    size: int,
    target: str,
    out: Path,
    *,
    deadline_s: float = 120.0,
    linger_s: float | None = None,
    final_barrier: bool = True,
    init_timeout_s: float = 60.0,
    **options,
) -> World:
    """Run ``target`` ("module:function", a module beside this file) on ``size`` gloo ranks.

    Ranks still running ``deadline_s`` after the start, or ``linger_s`` after the first rank
    ended (when given), are killed. ``out`` (a fresh directory) receives the ranks' logs;
    ``options`` (JSON-able) reach the ranks as ``worker.options``.
    """
    import torch.distributed as dist

    out.mkdir(parents=True, exist_ok=True)
    store = dist.TCPStore(_ADDR, 0, is_master=True, wait_for_workers=False)
    options = {**options, "final_barrier": final_barrier, "init_timeout_s": init_timeout_s}
    started_at, start = time.time(), time.monotonic()
    procs = []
    for rank in range(size):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(size),
            "MASTER_ADDR": _ADDR,
            "MASTER_PORT": str(store.port),
            "OMP_NUM_THREADS": "1",
            "DYNEMB_TEST_TARGET": target,
            "DYNEMB_TEST_OUT": str(out),
            "DYNEMB_TEST_OPTIONS": json.dumps(options),
        }
        err = open(out / f"rank{rank}.stderr", "w")
        procs.append(subprocess.Popen([sys.executable, str(HERE / "dist_harness.py")], env=env, cwd=HERE, stdout=err, stderr=subprocess.STDOUT))
        err.close()
    ended_at: list[float | None] = [None] * size
    killed = [False] * size
    while any(t is None for t in ended_at):
        now = time.monotonic()
        for rank, p in enumerate(procs):
            if ended_at[rank] is None and p.poll() is not None:
                ended_at[rank] = time.time()
        first_end = min((t for t in ended_at if t is not None), default=None)
        lingered = linger_s is not None and first_end is not None and time.time() - first_end > linger_s
        if now - start > deadline_s or lingered:
            for rank, p in enumerate(procs):
                if ended_at[rank] is None:
                    p.kill()
                    p.wait(timeout=30)
                    killed[rank], ended_at[rank] = True, time.time()
            break
        time.sleep(0.05)
    seconds = time.monotonic() - start
    ranks = []
    for rank, p in enumerate(procs):
        log = out / f"rank{rank}.jsonl"
        records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.exists() else []
        stderr = (out / f"rank{rank}.stderr").read_text(errors="replace")
        ranks.append(Rank(rank, None if killed[rank] else p.returncode, killed[rank], records, stderr, ended_at[rank]))
    del store
    return World(size, ranks, started_at, seconds)


if __name__ == "__main__":
    _child()
