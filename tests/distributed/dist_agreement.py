"""Rank functions of the collective-agreement tests (test_agreement.py): ranks that raise, or
make different calls, while the others train a sharded table or collection.

R ranks, r this rank, B samples of a global batch, D embedding dim. Each case records, per rank
and per phase, what the rank's call raised (``outcome``: the exception type and message, or
none); the test asserts them on every rank. Around the failing phases the ranks train normal
steps, and the case checks (``Checks``, raising at its end) that the shards still equal an
unsharded reference that took only the steps that happened: ranks that raised in step changed
no table, and their ``step`` clocks (score_strategy="step": a key's score is the step of its
last use) did not move.
"""

from __future__ import annotations

import datetime
import functools
import os
from collections.abc import Callable
from pathlib import Path

import torch
from dist_cases import (
    CAPACITY,
    KEYS,
    OPTIMIZERS,
    TABLE_NAMES,
    Checks,
    D,
    _shard,
    all_gather,
    batch_size,
    check_shards,
    draw_bags,
    draw_features,
    finish_collection,
    finish_table,
    jagged_take,
    local_features,
    make_collection,
    mine,
    offsets_of,
    table_configs,
    train_collection_step,
    train_table_step,
)
from dist_harness import Worker, run_cases

import dynemb
import dynemb.checkpoint
import dynemb.distributed

# The out-of-step case waits this long for the rank that left a call half-way.
BROKEN_TIMEOUT = datetime.timedelta(seconds=5)


def outcome(worker: Worker, case: str, phase: str, call: Callable) -> None:
    """Run ``call()`` and record what it raised (``type`` None when it returned)."""
    try:
        call()
    except Exception as e:
        worker.record(of_case=case, phase=phase, type=type(e).__name__, message=str(e))
    else:
        worker.record(of_case=case, phase=phase, type=None, message="")


def make_bag() -> dynemb.DynamicEmbeddingBag:
    return dynemb.DynamicEmbeddingBag(D, CAPACITY, mode="sum", optimizer=OPTIMIZERS["adam"](), score_strategy="step")


def check_clock(check: Checks, group, what: str, sharded, ref, tables: list[str | None]) -> None:
    """The step clock and every key's score (the step of its last use) match the unsharded model."""
    check.equal(f"{what}: step", sharded.step, ref.step)
    for t in tables:
        chunks = list(sharded.export() if t is None else sharded.export(t))
        keys = torch.cat([c["keys"] for c in chunks]) if chunks else torch.empty(0, dtype=torch.int64)
        scores = torch.cat([c["scores"] for c in chunks]) if chunks else torch.empty(0, dtype=torch.int64)
        everyone = all_gather(group, (keys, scores))
        keys, scores = torch.cat([k for k, _ in everyone]), torch.cat([s for _, s in everyone])
        order = torch.argsort(keys)
        ref_chunks = list(ref.export() if t is None else ref.export(t))
        ref_keys, ref_scores = torch.cat([c["keys"] for c in ref_chunks]), torch.cat([c["scores"] for c in ref_chunks])
        ref_order = torch.argsort(ref_keys)
        check.equal(f"{what}: keys of table {t}", keys[order], ref_keys[ref_order])
        check.equal(f"{what}: scores of table {t}", scores[order], ref_scores[ref_order])


def bag_batch(gen: torch.Generator, group, step: int):
    """A global bag batch and this rank's part: (ids, offsets, local ids, local offsets)."""
    W, r = group.size(), group.rank()
    B = batch_size(step, W)
    ids, lengths, _ = draw_bags(gen, B)
    local_ids, local_lengths = jagged_take(ids, lengths, mine(r, W, B))
    return ids, offsets_of(lengths), local_ids, offsets_of(local_lengths)


def bad_input_table(worker: Worker, group) -> None:
    """Rank 0 passes float ids to a sharded bag (the others good ids); every rank catches its
    error, then all train a normal step: rank 0 raises its TypeError, the others a ValueError
    naming rank 0 and the call; no table changed, and the next steps match the reference."""
    name, r = "bad-input-table", group.rank()
    check = Checks(r)
    table, ref = _shard(make_bag(), group), make_bag()
    gen = torch.Generator().manual_seed(61)
    train_table_step(check, group, table, ref, gen, True, "step 0", batch_size(0, group.size()))
    _, _, local_ids, local_offsets = bag_batch(gen, group, 1)
    ids = local_ids.to(torch.float32) if r == 0 else local_ids
    outcome(worker, name, "bad input", lambda: table(ids, local_offsets).sum().backward())
    outcome(worker, name, "next step", lambda: train_table_step(check, group, table, ref, gen, True, "step 2", batch_size(2, group.size())))
    finish_table(check, group, table, ref, "after the refused forward")
    check_clock(check, group, "after the refused forward", table, ref, [None])
    check.done()


def calls_differ_table(worker: Worker, group) -> None:
    """The last rank calls find() while the others train (forward, backward): every rank raises
    ShardingError naming both calls; then a normal step on every rank matches the reference."""
    name, W, r = "calls-differ-table", group.size(), group.rank()
    check = Checks(r)
    table, ref = _shard(make_bag(), group), make_bag()
    gen = torch.Generator().manual_seed(62)
    train_table_step(check, group, table, ref, gen, True, "step 0", batch_size(0, W))
    _, _, local_ids, local_offsets = bag_batch(gen, group, 1)
    if r == W - 1:
        outcome(worker, name, "differ", lambda: table.find(KEYS[:5]))
    else:
        outcome(worker, name, "differ", lambda: table(local_ids, local_offsets).sum().backward())
    outcome(worker, name, "next step", lambda: train_table_step(check, group, table, ref, gen, True, "step 2", batch_size(2, W)))
    finish_table(check, group, table, ref, "after the differing calls")
    check_clock(check, group, "after the differing calls", table, ref, [None])
    check.done()


def backward_skipped(worker: Worker, group) -> None:
    """Every rank looks up a batch; the last rank then skips backward (as if it raised between
    forward and backward and caught it) and goes on to the next forward, while the others run
    backward: both calls raise ShardingError (in autograd, for the others); the lookups' keys
    are inserted but no rank stepped; a normal step after that matches the reference."""
    name, W, r = "backward-skipped", group.size(), group.rank()
    check = Checks(r)
    table, ref = _shard(make_bag(), group), make_bag()
    gen = torch.Generator().manual_seed(63)
    train_table_step(check, group, table, ref, gen, True, "step 0", batch_size(0, W))
    ids, offsets, local_ids, local_offsets = bag_batch(gen, group, 1)
    out = table(local_ids, local_offsets)
    ref(ids, offsets)
    if r == W - 1:
        _, _, next_ids, next_offsets = bag_batch(gen, group, 2)
        outcome(worker, name, "skipped", lambda: table(next_ids, next_offsets).sum().backward())
    else:
        bag_batch(gen, group, 2)
        outcome(worker, name, "skipped", lambda: out.sum().backward())
    outcome(worker, name, "next step", lambda: train_table_step(check, group, table, ref, gen, True, "step 3", batch_size(3, W)))
    finish_table(check, group, table, ref, "after the skipped backward")
    check_clock(check, group, "after the skipped backward", table, ref, [None])
    check.done()


def collection_agreement(worker: Worker, group) -> None:
    """A sharded bag collection: the last rank's features miss one (ValueError there, and a
    ValueError naming it on the others); then rank 0 calls find() on table 'a' while the others
    insert into table 'b' (ShardingError everywhere). Normal steps around them match the
    reference."""
    name, W, r = "collection-agreement", group.size(), group.rank()
    check = Checks(r)

    def make():
        return make_collection(True, "adam", "fused", table_configs(score_strategy="step"))

    col, ref = _shard(make(), group), make()
    gen = torch.Generator().manual_seed(64)
    train_collection_step(check, group, col, ref, gen, True, "step 0", batch_size(0, W))
    B = batch_size(1, W)
    feats = local_features(draw_features(gen, B), mine(r, W, B))
    if r == W - 1:
        feats.pop("fc")
    outcome(worker, name, "bad input", lambda: col(feats).concat.sum().backward())
    if r == 0:
        outcome(worker, name, "differ", lambda: col.find("a", KEYS[:4]))
    else:
        outcome(worker, name, "differ", lambda: col.insert("b", KEYS[:2] + 7 * r, torch.ones(2, 8)))
    outcome(worker, name, "next step", lambda: train_collection_step(check, group, col, ref, gen, True, "step 2", batch_size(2, W)))
    finish_collection(check, group, col, ref, "after the refused calls")
    check_clock(check, group, "after the refused calls", col, ref, TABLE_NAMES)
    check.done()


def out_of_step(worker: Worker, group, during: str = "forward") -> None:
    """A rank that raises half-way through a call (its owner-side lookup, or with ``during=
    "backward"`` its owner-side update, fails after the keys were exchanged) leaves the others
    waiting in the call: they raise ShardingError naming it and what it did within the timeout;
    from then on every collective raises ShardingError on every rank saying the tables are out
    of step and to restore from a checkpoint. Doing that (a new model, shard(), load()) works:
    it holds the saved rows and trains like the reference."""
    name, W, r = "out-of-step" if during == "forward" else "out-of-step-backward", group.size(), group.rank()
    check = Checks(r)
    path = Path(worker.options["checkpoints"]) / f"{name}-world{W}"
    table, ref = dynemb.distributed.shard(make_bag(), group, timeout=BROKEN_TIMEOUT), make_bag()
    gen = torch.Generator().manual_seed(65)
    train_table_step(check, group, table, ref, gen, True, "step 0", batch_size(0, W))
    dynemb.checkpoint.save(table, path)
    _, _, local_ids, local_offsets = bag_batch(gen, group, 1)
    if r == W - 1:

        def fail(*args, **kwargs):
            raise RuntimeError(f"injected failure in the owner's {'lookup' if during == 'forward' else 'update'}")

        if during == "forward":
            table.engine.local.resolve = fail
        else:
            table.engine.local.apply_gradients = fail
    outcome(worker, name, "half-way", lambda: table(local_ids, local_offsets).sum().backward())
    outcome(worker, name, "after", lambda: table(local_ids, local_offsets).sum().backward())
    outcome(worker, name, "save after", lambda: dynemb.checkpoint.save(table, path.with_name(f"{path.name}-after")))
    # A restore after every rank gave up on the old tables (the last rank gives up at once, the
    # others after the timeout).
    worker.store_barrier(f"restore-{name}-{W}", 60)
    fresh = _shard(make_bag(), group)
    dynemb.checkpoint.load(fresh, path)
    check_shards(check, group, "restored", fresh.export(), ref.export())
    train_table_step(check, group, fresh, ref, gen, True, "step after the restore", batch_size(2, W))
    finish_table(check, group, fresh, ref, "after the restore")
    check_clock(check, group, "after the restore", fresh, ref, [None])
    check.done()


CASES: dict[str, Callable] = {
    "bad-input-table": bad_input_table,
    "calls-differ-table": calls_differ_table,
    "backward-skipped": backward_skipped,
    "collection-agreement": collection_agreement,
    # Last: their Comms time out (the others' Comms are untouched; each case shards anew).
    "out-of-step": out_of_step,
    "out-of-step-backward": functools.partial(out_of_step, during="backward"),
}


def agreement_world(worker: Worker) -> None:
    run_cases(worker, CASES, group_timeout_s=30)


class _NoStore:
    """A store whose every call fails, as one whose host died."""

    def __getattr__(self, name):
        def fail(*args, **kwargs):
            raise RuntimeError("store unreachable (test)")

        return fail


def store_unreachable(worker: Worker) -> None:
    """Three ranks train a sharded bag; then rank 2 exits and the store stops answering ranks 0
    and 1 (their Comm's store is replaced by one that fails): each records the ShardingError of
    its next step, which cannot name a culprit."""
    table = dynemb.distributed.shard(make_bag(), timeout=BROKEN_TIMEOUT)
    gen = torch.Generator().manual_seed(worker.rank)
    table(KEYS[torch.randint(0, KEYS.numel(), (8,), generator=gen)], torch.arange(0, 8, 2)).sum().backward()
    worker.store_barrier("trained", 60)
    if worker.rank == 2:
        worker.record(event="leaving")
        os._exit(0)
    table.engine.comm._store = _NoStore()
    try:
        table(KEYS[:8], torch.arange(0, 8, 2)).sum().backward()
    except Exception as e:
        worker.record(event="raised", type=type(e).__name__, message=str(e))
