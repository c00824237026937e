"""Rank functions of the sharded caching tests (test_caching_sharded.py): a caching table, and a
collection of caching tables, sharded over the world, against the unsharded in-memory model.

R ranks, r this rank, D embedding dim, M cache rows per rank.
"""

from __future__ import annotations

import dataclasses

import torch
from dist_cases import (
    SHARD_TIMEOUT,
    STEPS,
    Checks,
    batch_size,
    finish_collection,
    finish_table,
    make_collection,
    make_table,
    table_configs,
    train_collection_step,
    train_table_step,
)
from dist_harness import Worker, run_cases

import dynemb.distributed
from dynemb.storage import InMemoryStorage

M = 8


def stored(store) -> dict[int, torch.Tensor]:
    return {k: row for keys, rows in store.items() for k, row in zip(keys.tolist(), rows)}


def check_store(check: Checks, what: str, chunks, store) -> None:
    """After flush(): this rank's store holds exactly this rank's keys, each with its row."""
    held = stored(store)
    want = {k: torch.cat([e, o]) for c in chunks for k, e, o in zip(c["keys"].tolist(), c["embeddings"], c["optimizer_state"])}
    check.equal(f"{what}: keys in this rank's store vs its shard", sorted(held), sorted(want))
    check.true(f"{what}: rows in this rank's store differ from its shard's", all(torch.equal(held[k], want[k]) for k in want if k in held))


def caching_table(pooled: bool):
    def case(worker: Worker, group) -> None:
        check = Checks(group.rank())
        store = InMemoryStorage()
        sharded = make_table(pooled, "adam", "fused", caching=True, external_storage=store, cache_rows=M)
        dynemb.distributed.shard(sharded, group, timeout=SHARD_TIMEOUT)
        ref = make_table(pooled, "adam", "fused")
        gen = torch.Generator().manual_seed(31)
        for step in range(STEPS):
            train_table_step(check, group, sharded, ref, gen, pooled, f"step {step}", batch_size(step, group.size()))
        finish_table(check, group, sharded, ref, "caching table")
        check.true("the cache holds fewer rows than the shard", sharded.stats()["cache"]["capacity"] < sharded.stats()["size"])
        sharded.flush()
        check_store(check, "caching table", sharded.export(), store)
        check.done()

    return case


def caching_collection(worker: Worker, group) -> None:
    check = Checks(group.rank())
    tables = table_configs()
    stores = {c.name: InMemoryStorage() for c in tables}
    caching = [dataclasses.replace(c, caching=True, external_storage=stores[c.name], cache_rows=M) for c in tables]
    sharded = make_collection(True, "adam", "fused", caching)
    dynemb.distributed.shard(sharded, group, timeout=SHARD_TIMEOUT)
    ref = make_collection(True, "adam", "fused", tables)
    gen = torch.Generator().manual_seed(32)
    for step in range(STEPS):
        train_collection_step(check, group, sharded, ref, gen, True, f"step {step}", batch_size(step, group.size()))
    finish_collection(check, group, sharded, ref, "caching collection")
    sharded.flush()
    for name, store in stores.items():
        check_store(check, f"caching collection table {name}", sharded.export(name), store)
    check.done()


CASES = {"caching-table-sequence": caching_table(False), "caching-table-pooled": caching_table(True), "caching-collection": caching_collection}


def caching_world(worker: Worker) -> None:
    run_cases(worker, CASES, group_timeout_s=SHARD_TIMEOUT.total_seconds())
