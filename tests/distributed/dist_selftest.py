"""Rank functions that check the harness itself (test_harness.py): no dynemb sharding."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from dist_harness import Worker, run_cases


def all_reduce(worker: Worker) -> None:
    x = torch.tensor([float(worker.rank + 1)])
    dist.all_reduce(x)

    def case(worker: Worker, group) -> None:
        y = torch.tensor([1.0])
        dist.all_reduce(y, group=group)
        assert y.item() == worker.size

    def bad_case(worker: Worker, group) -> None:
        raise ValueError(f"bad case on rank {worker.rank}")

    run_cases(worker, {"sum": case, "bad": bad_case, "after-bad": case})
    worker.record(event="sum", value=x.item())


def misbehave(worker: Worker) -> None:
    """Rank 1 raises, the last rank hangs, the others return."""
    x = torch.ones(1)
    dist.all_reduce(x)
    if worker.rank == 1:
        raise ValueError("boom on rank 1")
    if worker.rank == worker.size - 1:
        worker.record(event="hanging")
        time.sleep(3600)
