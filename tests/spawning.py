"""Small gloo worlds for tests: ``run_ranks(target, world, *args)`` starts ``world`` spawned
processes joined in a default gloo group on a free localhost port, calls ``target(rank, world,
*args)`` in each (a module-level function of the test module, so the spawned processes can
import it), and fails with every rank's traceback; ranks still running after ``timeout_s`` are
killed. (The sharding tests' many-case worlds are tests/distributed/dist_harness.py.)"""

from __future__ import annotations

import datetime
import os
import socket
import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, target: Callable, world: int, port: int, args: tuple, errors) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
        target(rank, world, *args)
        # A rank that leaves while a peer still reads from it would fail that peer.
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    # Done and checked: leave without the interpreter's teardown, where torch's C++ objects of
    # the destroyed groups are freed in no set order (once seen to abort a finished rank under
    # load: "terminate called without an active exception").
    os._exit(0)


def run_ranks(target: Callable, world: int, *args, timeout_s: float = 150.0) -> None:
    """Run ``target(rank, world, *args)`` on ``world`` gloo processes (see the module doc)."""
    errors = mp.get_context("spawn").SimpleQueue()
    procs = mp.start_processes(_entry, args=(target, world, free_port(), args, errors), nprocs=world, join=False, start_method="spawn")
    what = f"{target.__name__}{args} at world size {world}"
    start = time.monotonic()
    try:
        while not procs.join(timeout=1.0):
            if time.monotonic() - start > timeout_s:
                raise AssertionError(f"{what}: still running after {timeout_s:.0f} s")
    except mp.ProcessRaisedException as e:
        found = []
        while not errors.empty():
            found.append(errors.get())
        report = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(found)) or str(e)
        raise AssertionError(f"{what} failed:\n{report}") from None
    finally:
        for p in procs.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
