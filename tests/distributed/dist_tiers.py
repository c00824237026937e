"""Rank functions of the tiered sharding tests (test_tiered_sharding.py): tables and a
collection with device + disk tiers, sharded over the world, against the unsharded tiered
model on every rank (dist_cases' steps and final checks).

R ranks; each rank's shard gets every tier's rows // R.
"""

from __future__ import annotations

import torch
from dist_cases import (
    CAPACITY,
    Checks,
    _parity,
    _shard,
    finish_collection,
    finish_table,
    make_collection,
    make_table,
    table_configs,
    train_collection_step,
    train_table_step,
)
from dist_harness import Worker, run_cases

from dynemb import Tier

# 32 device rows in all (16 or 8 per shard): the shards' rows really live on disk and move.
DEVICE_ROWS = 32


def tiers(path: str) -> list[Tier]:
    return [Tier("device", DEVICE_ROWS), Tier("disk", CAPACITY - DEVICE_ROWS, path=path)]


def check_moved(check: Checks, what: str, stats: dict, device_rows: int) -> None:
    """The shard's device tier has ``device_rows`` rows, and rows moved through it."""
    device, disk = stats["tiers"]
    check.true(f"{what}: shard's device tier {device}", device["capacity"] == device_rows and device["promotions"] > 0 and device["demotions"] > 0)
    check.true(f"{what}: shard's disk tier {disk}", disk["hits"] > 0)


def tiered_world(worker: Worker) -> None:
    path = worker.options["disk"]

    def table_case(pooled: bool, opt: str, update: str):
        make = lambda: make_table(pooled, opt, update, capacity=None, tiers=tiers(path))
        return _parity(make, train_table_step, finish_table, "table", 99, pooled, update)

    def collection_case(pooled: bool, opt: str, update: str):
        def finish(check, group, sharded, ref, what):
            finish_collection(check, group, sharded, ref, what)
            stats = sharded.stats()
            # a and b share a group (their shards' tiers add up); c is alone.
            for name, tables in [("a", 2), ("b", 2), ("c", 1)]:
                check_moved(check, f"{what} table {name!r}", stats[name], tables * DEVICE_ROWS // group.size())

        make = lambda: make_collection(pooled, opt, update, table_configs(capacity=None, tiers=tiers(path)))
        return _parity(make, train_collection_step, finish, "collection", 77, pooled, update)

    def moved_case(worker: Worker, group) -> None:
        check = Checks(group.rank())
        table = _shard(make_table(False, "sgd", "fused", capacity=None, tiers=tiers(path)), group)
        gen = torch.Generator().manual_seed(group.rank())
        for _ in range(10):
            table(torch.randint(0, 400, (64,), generator=gen)).sum().backward()
        check_moved(check, "table", table.stats(), DEVICE_ROWS // group.size())
        check.done()

    cases = {
        "table-sequence-adam-fused": table_case(False, "adam", "fused"),
        "table-pooled-rowwise_adagrad-deferred": table_case(True, "rowwise_adagrad", "deferred"),
        "collection-pooled-adam-fused": collection_case(True, "adam", "fused"),
        "collection-sequence-adagrad-fused": collection_case(False, "adagrad", "fused"),
        "moved": moved_case,
    }
    run_cases(worker, cases, group_timeout_s=10.0)
