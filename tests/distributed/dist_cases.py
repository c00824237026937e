"""Rank functions of the sharding tests: what each rank of a gloo world runs.

R ranks, r this rank, B samples of a global batch, L ids per sample, N ids, D embedding dim,
V keys of the key universe.

Parity (``CASES``, run by ``sharding_world`` in one world per size): every rank builds the same
model from the same seed (per-key initialisation makes a new key's row a function of the key),
shards it, and draws the same global batch from the same generator at every step; it trains the
sharded model on its samples (r::R) and a local unsharded copy on the whole batch, with loss =
sum over samples. The sharded outputs must equal the matching rows of the unsharded ones, the
all-reduced loss the unsharded loss, and the union of the shards (each rank exports its own; all
gathered by key) the unsharded table: same keys, embeddings and optimizer state. Checks do not
raise at once (``Checks`` collects them) so that a mismatch keeps the ranks in lockstep; a case
raises at its end.

``peer_failure`` is the rank function of the dead / raising peer tests.
"""

from __future__ import annotations

import datetime
import os
import re
import time
import traceback
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
from dist_harness import Worker, run_cases

import dynemb
from dynemb import TableConfig
from dynemb.hashing import mix64

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
STEPS = 20
D, L = 6, 3
# Room for every key on every shard (no eviction, no failure): parity needs the same key sets.
CAPACITY = 1 << 12
# A healthy collective takes milliseconds; a failing case costs this much (its peers wait it out).
SHARD_TIMEOUT = datetime.timedelta(seconds=10)

OPTIMIZERS = {
    "sgd": lambda: dynemb.optim.SGD(lr=0.1),
    "adagrad": lambda: dynemb.optim.Adagrad(lr=0.1, lr_decay=0.01),
    "rowwise_adagrad": lambda: dynemb.optim.RowWiseAdagrad(lr=0.1),
    "adam": lambda: dynemb.optim.Adam(lr=0.05, betas=(0.8, 0.9)),
}

# V = 64 keys: the int64 extremes, 0 and -1 first (most frequent under the Zipf draw, so they
# repeat within and across ranks), then keys spread over the whole int64 range.
SPECIAL = [0, -1, INT64_MIN, INT64_MAX, 1, INT64_MIN + 1, INT64_MAX - 1]
KEYS = torch.cat([torch.tensor(SPECIAL), mix64(torch.arange(1000, 1057))])
ZIPF = 1.0 / torch.arange(1, KEYS.numel() + 1, dtype=torch.float64)
# Keys never trained: find / eval must report them missing.
UNSEEN = mix64(torch.arange(5000, 5016))
assert torch.unique(torch.cat([KEYS, UNSEEN])).numel() == KEYS.numel() + UNSEEN.numel()

# Table b is read by two features; a and b share a dim (one group), c has its own.
FEATURES = ["fa", "fb", "fb2", "fc"]


def table_configs(capacity: int = CAPACITY, **options) -> list[TableConfig]:
    return [
        TableConfig(name="a", feature_names=["fa"], embedding_dim=8, capacity=capacity, pooling="sum", **options),
        TableConfig(name="b", feature_names=["fb", "fb2"], embedding_dim=8, capacity=capacity, pooling="mean", **options),
        TableConfig(name="c", feature_names=["fc"], embedding_dim=4, capacity=capacity, pooling="sum", **options),
    ]


TABLE_NAMES = ["a", "b", "c"]
# Adam's state is per element and its bias correction counts steps; row-wise Adagrad's state is
# one value per row (SGD and Adagrad are covered by the single tables).
COLLECTION_OPTIMIZERS = ["adam", "rowwise_adagrad"]
FEATURE_DIMS = {"fa": 8, "fb": 8, "fb2": 8, "fc": 4}


def zipf_keys(gen: torch.Generator, n: int) -> torch.Tensor:
    """[n] keys of KEYS drawn with Zipf weights (repeats within a batch and across ranks)."""
    if n == 0:
        return torch.empty(0, dtype=torch.int64)
    return KEYS[torch.multinomial(ZIPF, n, replacement=True, generator=gen)]


def mine(rank: int, world: int, batch: int) -> torch.Tensor:
    """The samples of a global batch of ``batch`` samples that ``rank`` trains on: [B_r]."""
    return torch.arange(batch)[rank::world]


def offsets_of(lengths: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(lengths, 0) - lengths


def jagged_take(values: torch.Tensor, lengths: torch.Tensor, samples: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Values [N, *] of the given samples (in that order) of a jagged batch, and their lengths."""
    starts = offsets_of(lengths)
    parts = [values[s : s + n] for s, n in zip(starts[samples].tolist(), lengths[samples].tolist())]
    return (torch.cat(parts) if parts else values[:0]), lengths[samples]


def loss_of(out: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """A sum over samples; its gradient depends on the outputs too."""
    return (out * coef).sum() + 0.5 * out.pow(2).sum()


def draw_sequence(gen: torch.Generator, batch: int, key: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, L] (all equal to ``key`` if given) and loss coefficients [B, L, D]."""
    ids = zipf_keys(gen, batch * L).view(batch, L)
    if key is not None:
        ids = torch.full_like(ids, key)
    return ids, torch.randn(batch, L, D, generator=gen)


def draw_bags(gen: torch.Generator, batch: int, key: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [N], lengths [B] (0 to 4, empty bags included) and coefficients [B, D]."""
    lengths = torch.randint(0, 5, (batch,), generator=gen)
    if key is not None:
        lengths = lengths.clamp(min=1)
    ids = zipf_keys(gen, int(lengths.sum()))
    if key is not None:
        ids = torch.full_like(ids, key)
    return ids, lengths, torch.randn(batch, D, generator=gen)


def draw_features(gen: torch.Generator, batch: int, empty: tuple[str, ...] = (), key: int | None = None) -> dict:
    """feature -> (values [N_f], lengths [B]); features in ``empty`` have no ids at all."""
    out = {}
    for f in FEATURES:
        lengths = torch.randint(0, 4, (batch,), generator=gen)
        if f in empty:
            lengths.zero_()
        values = zipf_keys(gen, int(lengths.sum()))
        if key is not None:
            values = torch.full_like(values, key)
        out[f] = (values, lengths)
    return out


def local_features(features: dict, samples: torch.Tensor) -> dict:
    return {f: jagged_take(v, n, samples) for f, (v, n) in features.items()}


def batch_size(step: int, world: int) -> int:
    """Global batch sizes that are not always a multiple of the world size."""
    return 3 * world - 1 + step % 3


class Checks:
    """Collects failed checks instead of raising, so the ranks stay in lockstep."""

    def __init__(self, rank: int):
        self.rank = rank
        self.failures: list[str] = []

    def close(self, what: str, got, want) -> None:
        try:
            torch.testing.assert_close(got, want)
        except (AssertionError, TypeError, ValueError, RuntimeError) as e:
            self.failures.append(f"{what}: {e}")

    def equal(self, what: str, got, want) -> None:
        same = torch.equal(got, want) if isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor) else got == want
        if not same:
            self.failures.append(f"{what}: got {_short(got)}, want {_short(want)}")

    def true(self, what: str, ok: bool) -> None:
        if not ok:
            self.failures.append(what)

    def done(self) -> None:
        if self.failures:
            shown = "\n\n".join(self.failures[:6])
            more = f"\n\n... and {len(self.failures) - 6} more" if len(self.failures) > 6 else ""
            raise AssertionError(f"{len(self.failures)} check(s) failed on rank {self.rank}:\n\n{shown}{more}")


def _short(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor(shape={tuple(x.shape)}, dtype={x.dtype}, {x.reshape(-1)[:12].tolist()}{'...' if x.numel() > 12 else ''})"
    s = repr(x)
    return s if len(s) < 400 else s[:400] + "..."


def rows_of(chunks) -> dict[str, torch.Tensor]:
    """keys [K], embeddings [K, D], optimizer_state [K, S] of exported chunks, sorted by key."""
    chunks = list(chunks)
    if not chunks:
        return {"keys": torch.empty(0, dtype=torch.int64)}
    keys = torch.cat([c["keys"] for c in chunks])
    order = torch.argsort(keys)
    return {
        "keys": keys[order],
        "embeddings": torch.cat([c["embeddings"] for c in chunks])[order],
        "optimizer_state": torch.cat([c["optimizer_state"] for c in chunks])[order],
    }


def all_gather(group, obj) -> list:
    everyone = [None] * group.size()
    dist.all_gather_object(everyone, obj, group=group)
    return everyone


def check_shards(check: Checks, group, what: str, shard_chunks, ref_chunks) -> list[torch.Tensor]:
    """The shards (one export per rank, gathered) partition the unsharded table's keys and hold
    its rows. Returns each rank's keys."""
    shards = all_gather(group, rows_of(shard_chunks))
    ref = rows_of(ref_chunks)
    per_rank = [s["keys"] for s in shards]
    everyone = torch.cat(per_rank)
    check.equal(f"{what}: a key is held by two ranks (shard sizes {[k.numel() for k in per_rank]})", torch.unique(everyone).numel(), everyone.numel())
    with_rows = [s for s in shards if s["keys"].numel()]
    if not with_rows:
        check.equal(f"{what}: gathered keys", everyone, ref["keys"])
        return per_rank
    keys = torch.cat([s["keys"] for s in with_rows])
    order = torch.argsort(keys)
    check.equal(f"{what}: gathered keys vs unsharded keys", keys[order], ref["keys"])
    if keys.numel() == ref["keys"].numel() and torch.equal(keys[order], ref["keys"]):
        check.close(f"{what}: embeddings", torch.cat([s["embeddings"] for s in with_rows])[order], ref["embeddings"])
        check.close(f"{what}: optimizer state", torch.cat([s["optimizer_state"] for s in with_rows])[order], ref["optimizer_state"])
    return per_rank


def probes(rank: int, world: int) -> list[torch.Tensor]:
    """Keys each rank looks up with find(): trained and never-seen keys, duplicates, a 2-D
    shape, and (on the last rank) an empty first call."""
    first = torch.cat([KEYS[rank::world], UNSEEN[rank::world], KEYS[:3]])
    if rank == world - 1:
        first = first[:0]
    second = torch.cat([KEYS[(rank + 1) % world :: world][:8], UNSEEN[:4], torch.tensor([INT64_MIN, INT64_MAX])])
    return [first, second[: second.numel() // 2 * 2].view(-1, 2)]


def check_find(check: Checks, what: str, rank: int, world: int, find: Callable, ref_find: Callable) -> None:
    """find() is collective: every rank calls it with its own keys, in the same order."""
    for i, probe in enumerate(probes(rank, world)):
        values, found = find(probe)
        want_values, want_found = ref_find(probe)
        check.equal(f"{what}: find #{i} found flags", found, want_found)
        check.close(f"{what}: find #{i} values", values, want_values)


def check_local_stats(check: Checks, what: str, stats: dict, keys: torch.Tensor, world: int, configured: int) -> None:
    """stats() describe this rank's shard: its keys, its capacity (configured // R, rounded up
    to whole buckets)."""
    check.equal(f"{what}: stats()['size'] vs exported keys", stats["size"], keys.numel())
    check.true(
        f"{what}: stats()['capacity']={stats['capacity']} outside [{configured // world}, {2 * (configured // world)}]",
        configured // world <= stats["capacity"] <= 2 * (configured // world),
    )


def _shard(module, group, **kw):
    import dynemb.distributed

    got = dynemb.distributed.shard(module, group, timeout=SHARD_TIMEOUT, **kw)
    assert got is module, "shard() must return the module it was given"
    return module


def make_table(pooled: bool, opt: str, update: str, capacity: int = CAPACITY, **options) -> dynemb.DynamicTable:
    kw = dict(optimizer=OPTIMIZERS[opt](), update=update, **options)
    if pooled:
        return dynemb.DynamicEmbeddingBag(D, capacity, mode="mean", **kw)
    return dynemb.DynamicEmbedding(D, capacity, **kw)


def train_table_step(check, group, sharded, ref, gen, pooled: bool, what: str, batch: int, key: int | None = None) -> None:
    """One global batch: sharded forward / backward on this rank's samples, unsharded on all."""
    W, r = group.size(), group.rank()
    sel = mine(r, W, batch)
    if pooled:
        ids, lengths, coef = draw_bags(gen, batch, key)
        local_ids, local_lengths = jagged_take(ids, lengths, sel)
        out = sharded(local_ids, offsets_of(local_lengths))
        want = ref(ids, offsets_of(lengths))
    else:
        ids, coef = draw_sequence(gen, batch, key)
        out = sharded(ids[sel])
        want = ref(ids)
    check.close(f"{what}: outputs of samples {sel.tolist()} of {batch}", out.detach(), want.detach()[sel])
    loss = loss_of(out, coef[sel])
    ref_loss = loss_of(want, coef)
    loss.backward()
    ref_loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    check.close(f"{what}: all-reduced loss vs unsharded loss", total, ref_loss.detach())
    check.equal(f"{what}: last_failed_keys (capacity for every key)", sharded.last_failed_keys.numel(), 0)


def micro_batches(step: int, update: str) -> int:
    """Deferred: every third optimizer step accumulates two micro-batches."""
    return 2 if update == "deferred" and step % 3 == 1 else 1


def deferred_step(step: int, *models) -> None:
    """optimizer.step() then zero_grad(); every 7th step only zero_grad() (the gradient is dropped)."""
    for m in models:
        if step % 7 != 6:
            m.optimizer.step()
        m.optimizer.zero_grad()


def finish_table(check, group, sharded, ref, what: str) -> None:
    W, r = group.size(), group.rank()
    keys = check_shards(check, group, what, sharded.export(), ref.export())
    check_local_stats(check, what, sharded.stats(), keys[r], W, CAPACITY)
    check_find(check, what, r, W, sharded.find, ref.find)


def _parity(make: Callable, train_step: Callable, finish: Callable, what: str, seed: int, pooled: bool, update: str) -> Callable:
    """STEPS steps of the sharded model against the unsharded one, then the final checks."""

    def case(worker: Worker, group) -> None:
        check = Checks(group.rank())
        sharded = _shard(make(), group)
        ref = make()
        gen = torch.Generator().manual_seed(seed)
        for step in range(STEPS):
            for micro in range(micro_batches(step, update)):
                train_step(check, group, sharded, ref, gen, pooled, f"step {step}.{micro}", batch_size(step, group.size()))
            if update == "deferred":
                deferred_step(step, sharded, ref)
        finish(check, group, sharded, ref, what)
        check.done()

    return case


def table_parity(pooled: bool, opt: str, update: str) -> Callable:
    return _parity(lambda: make_table(pooled, opt, update), train_table_step, finish_table, "table", 1234, pooled, update)


def table_edges(pooled: bool, update: str) -> Callable:
    """Adam (its bias correction counts steps): global batches of one key (only its owner gets a
    gradient), fewer samples than ranks (some ranks look up nothing), then an eval forward."""

    def case(worker: Worker, group) -> None:
        W, r = group.size(), group.rank()
        check = Checks(r)
        sharded = _shard(make_table(pooled, "adam", update), group)
        ref = make_table(pooled, "adam", update)
        gen = torch.Generator().manual_seed(99)
        schedule = [
            ("normal", None),
            ("one key", INT64_MIN),
            ("fewer samples than ranks", None),
            ("normal", None),
            ("one key", INT64_MAX),
            ("one sample", None),
            ("normal", None),
            ("normal", None),
        ]
        for step, (kind, key) in enumerate(schedule):
            batch = {"fewer samples than ranks": W - 1, "one sample": 1}.get(kind, 2 * W + 1)
            train_table_step(check, group, sharded, ref, gen, pooled, f"step {step} ({kind})", batch, key)
            if update == "deferred":
                sharded.optimizer.step(), ref.optimizer.step()
                sharded.optimizer.zero_grad(), ref.optimizer.zero_grad()
        finish_table(check, group, sharded, ref, "after training")
        # Eval: every rank looks up trained and unseen keys; nothing is inserted.
        sharded.eval(), ref.eval()
        before = sum(all_gather(group, sharded.stats()["size"]))
        ids = torch.cat([KEYS[r::W][:5], UNSEEN[r::W][:3], torch.tensor([0, -1])])
        with torch.no_grad():
            if pooled:
                got, want = sharded(ids, torch.tensor([0, 2, 2, 7])), ref(ids, torch.tensor([0, 2, 2, 7]))
            else:
                got, want = sharded(ids.view(2, -1)), ref(ids.view(2, -1))
        check.close("eval outputs", got, want)
        after = sum(all_gather(group, sharded.stats()["size"]))
        check.equal("eval inserted keys: total size before / after", after, before)
        check.equal("total size vs unsharded size", after, len(ref))
        check.done()

    return case


def weighted_bags(worker: Worker, group) -> None:
    """Sum bags with per_sample_weights and include_last_offset, 1-D ids + offsets and 2-D ids."""
    W, r = group.size(), group.rank()
    check = Checks(r)

    def make():
        return dynemb.DynamicEmbeddingBag(D, CAPACITY, mode="sum", include_last_offset=True, optimizer=dynemb.optim.Adagrad(lr=0.1))

    sharded, ref = _shard(make(), group), make()
    gen = torch.Generator().manual_seed(5)
    for step in range(10):
        B = batch_size(step, W)
        sel = mine(r, W, B)
        if step % 2 == 0:
            ids, lengths, coef = draw_bags(gen, B)
            weights = torch.randn(ids.numel(), generator=gen)
            local_ids, local_lengths = jagged_take(ids, lengths, sel)
            local_weights, _ = jagged_take(weights, lengths, sel)
            offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(local_lengths, 0)])
            out = sharded(local_ids, offsets, per_sample_weights=local_weights)
            want = ref(ids, torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)]), per_sample_weights=weights)
        else:
            ids = zipf_keys(gen, B * L).view(B, L)
            weights = torch.randn(B, L, generator=gen)
            coef = torch.randn(B, D, generator=gen)
            out = sharded(ids[sel], per_sample_weights=weights[sel])
            want = ref(ids, per_sample_weights=weights)
        check.close(f"step {step}: outputs", out.detach(), want.detach()[sel])
        loss, ref_loss = loss_of(out, coef[sel]), loss_of(want, coef)
        loss.backward()
        ref_loss.backward()
    finish_table(check, group, sharded, ref, "weighted bags")
    check.done()


def make_collection(pooled: bool, opt: str, update: str, tables: list[TableConfig] | None = None):
    cls = dynemb.DynamicEmbeddingBagCollection if pooled else dynemb.DynamicEmbeddingCollection
    return cls(tables or table_configs(), OPTIMIZERS[opt](), update=update)


def train_collection_step(check, group, sharded, ref, gen, pooled: bool, what: str, batch: int, **draw) -> None:
    W, r = group.size(), group.rank()
    sel = mine(r, W, batch)
    feats = draw_features(gen, batch, **draw)
    local = local_features(feats, sel)
    out, want = sharded(local), ref(feats)
    if pooled:
        coef = torch.randn(batch, sum(FEATURE_DIMS.values()), generator=gen)
        check.equal(f"{what}: features of the output", list(out), FEATURES)
        check.close(f"{what}: pooled outputs (concat) of samples {sel.tolist()} of {batch}", out.concat.detach(), want.concat.detach()[sel])
        loss, ref_loss = loss_of(out.concat, coef[sel]), loss_of(want.concat, coef)
    else:
        loss = ref_loss = 0
        for f in FEATURES:
            lengths = feats[f][1]
            coef = torch.randn(int(lengths.sum()), FEATURE_DIMS[f], generator=gen)
            check.close(f"{what}: {f} embeddings of samples {sel.tolist()} of {batch}", out[f][0].detach(), jagged_take(want[f][0].detach(), lengths, sel)[0])
            check.equal(f"{what}: {f} lengths", out[f][1], lengths[sel])
            loss = loss + loss_of(out[f][0], jagged_take(coef, lengths, sel)[0])
            ref_loss = ref_loss + loss_of(want[f][0], coef)
    loss.backward()
    ref_loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    check.close(f"{what}: all-reduced loss vs unsharded loss", total, ref_loss.detach())
    for name in TABLE_NAMES:
        check.equal(f"{what}: last_failed_keys[{name!r}] (capacity for every key)", sharded.last_failed_keys[name].numel(), 0)


def finish_collection(check, group, sharded, ref, what: str) -> None:
    W, r = group.size(), group.rank()
    stats = sharded.stats()
    for name in TABLE_NAMES:
        keys = check_shards(check, group, f"{what} table {name!r}", sharded.export(name), ref.export(name))
        check_local_stats(check, f"{what} table {name!r}", stats[name], keys[r], W, CAPACITY)
        check_find(check, f"{what} table {name!r}", r, W, lambda k, n=name: sharded.find(n, k), lambda k, n=name: ref.find(n, k))


def collection_parity(pooled: bool, opt: str, update: str) -> Callable:
    return _parity(lambda: make_collection(pooled, opt, update), train_collection_step, finish_collection, "collection", 4321, pooled, update)


def collection_edges(pooled: bool, update: str) -> Callable:
    """Adam: a feature with no ids in the whole batch, fewer samples than ranks, every id one key."""

    def case(worker: Worker, group) -> None:
        W = group.size()
        check = Checks(group.rank())
        sharded = _shard(make_collection(pooled, "adam", update), group)
        ref = make_collection(pooled, "adam", update)
        gen = torch.Generator().manual_seed(77)
        schedule = [
            ("normal", 2 * W + 1, {}),
            ("feature fc empty", 2 * W + 1, {"empty": ("fc",)}),
            ("fewer samples than ranks", W - 1, {}),
            ("every id is -1", 2 * W, {"key": -1}),
            ("features fa, fb, fb2 empty", 2 * W, {"empty": ("fa", "fb", "fb2")}),
            ("normal", 2 * W + 1, {}),
            ("normal", 2 * W + 1, {}),
        ]
        for step, (kind, batch, draw) in enumerate(schedule):
            train_collection_step(check, group, sharded, ref, gen, pooled, f"step {step} ({kind})", batch, **draw)
            if update == "deferred":
                sharded.optimizer.step(), ref.optimizer.step()
                sharded.optimizer.zero_grad(), ref.optimizer.zero_grad()
        finish_collection(check, group, sharded, ref, "collection")
        check.done()

    return case


def local_stats(worker: Worker, group) -> None:
    """After shard(), stats() are the local shard's: its size, and its requested capacity the
    configured one divided by the world size (single tables and every table of a collection)."""
    W, r = group.size(), group.rank()
    check = Checks(r)
    table = _shard(make_table(True, "sgd", "fused", capacity=1000), group)
    col = _shard(make_collection(True, "sgd", "fused", table_configs(capacity=1000)), group)
    gen = torch.Generator().manual_seed(8)
    for _ in range(3):
        sel = mine(r, W, 2 * W)
        ids, lengths, _ = draw_bags(gen, 2 * W)
        local_ids, local_lengths = jagged_take(ids, lengths, sel)
        table(local_ids, offsets_of(local_lengths)).sum().backward()
        col(local_features(draw_features(gen, 2 * W), sel)).concat.sum().backward()
    s = table.stats()
    held = rows_of(table.export())["keys"].numel()
    check.equal("table: stats()['size'] vs its exported keys", s["size"], held)
    check.equal("table: len(table) vs its exported keys", len(table), held)
    check.equal("table: stats()['requested_capacity'] (1000 on each of the ranks, divided)", s["requested_capacity"], 1000 // W)
    check.true(f"table: capacity() {table.capacity()} not in [{1000 // W}, {2 * (1000 // W)}]", 1000 // W <= table.capacity() <= 2 * (1000 // W))
    for name, entry in col.stats().items():
        held = rows_of(col.export(name)).get("keys").numel()
        check.equal(f"collection table {name!r}: stats()['size'] vs its exported keys", entry["size"], held)
        check.equal(f"collection table {name!r}: stats()['requested_capacity']", entry["requested_capacity"], 1000 // W)
        check.true(
            f"collection table {name!r}: stats()['capacity'] {entry['capacity']} not in [{1000 // W}, {2 * (1000 // W)}]",
            1000 // W <= entry["capacity"] <= 2 * (1000 // W),
        )
    sizes = all_gather(group, len(table))
    check.true(f"table: shard sizes {sizes}: a rank holds no key", all(n > 0 for n in sizes))
    check.done()


def failed_keys_table(worker: Worker, group) -> None:
    """A shard too small for the keys sent to it (check_mode="count"): each rank's
    last_failed_keys are exactly the keys it asked for that no shard holds."""
    W, r = group.size(), group.rank()
    check = Checks(r)
    capacity = 16 * W  # 16 rows (two buckets of 8) per shard
    table = _shard(
        dynemb.DynamicEmbeddingBag(D, capacity, mode="sum", optimizer=dynemb.optim.SGD(lr=0.1), check_mode="count", score_strategy="step", bucket_capacity=8),
        group,
    )
    for step in range(4):
        if step == 2:
            # Keys all held now: nothing fails, and last_failed_keys says so (it is per call).
            held = torch.cat(all_gather(group, rows_of(table.export())["keys"]))
            ids = held[r::W]
        else:
            # ~40 distinct keys per shard and step, some asked by several ranks.
            fresh = mix64(torch.arange(10_000 * step, 10_000 * step + 40 * W))
            ids = torch.cat([fresh[r::W], fresh[:6], torch.tensor([INT64_MIN, -1, 0])])
        table(ids, torch.tensor([0])).sum().backward()
        failed = table.last_failed_keys
        check.equal(f"step {step}: last_failed_keys dtype", failed.dtype, torch.int64)
        asked = set(ids.tolist())
        mine_failed = set(failed.tolist())
        check.true(f"step {step}: last_failed_keys has keys this rank did not ask for: {sorted(mine_failed - asked)[:8]}", mine_failed <= asked)
        check.equal(f"step {step}: last_failed_keys has duplicates", len(mine_failed), failed.numel())
        everyone_asked = set().union(*all_gather(group, asked))
        held = set(torch.cat(all_gather(group, rows_of(table.export())["keys"])).tolist())
        missing = everyone_asked - held
        union_failed = set().union(*all_gather(group, mine_failed))
        check.equal(f"step {step}: union of last_failed_keys vs asked keys no shard holds", sorted(union_failed), sorted(missing))
        check.equal(f"step {step}: this rank's last_failed_keys vs its asked keys no shard holds", sorted(mine_failed), sorted(asked & missing))
        if step != 2:
            check.true(f"step {step}: no key failed (the test needs some to)", bool(missing))
        _, found = table.find(ids)
        check.equal(f"step {step}: find(asked).found vs held", found.tolist(), [k in held for k in ids.tolist()])
        s = table.stats()
        check.true(f"step {step}: size {s['size']} > capacity {s['capacity']}", s["size"] <= s["capacity"])
        check.equal(f"step {step}: requested_capacity", s["requested_capacity"], capacity // W)
    # check_mode="warn": the warning says the capacity is this rank's shard's.
    warned_table = _shard(
        dynemb.DynamicEmbeddingBag(D, capacity, mode="sum", optimizer=dynemb.optim.SGD(lr=0.1), check_mode="warn", bucket_capacity=8),
        group,
    )
    fresh = mix64(torch.arange(90_000, 90_000 + 80 * W))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warned_table(fresh[r::W], torch.tensor([0])).sum().backward()
    messages = [str(w.message) for w in caught if "could not be inserted" in str(w.message)]
    check.true(f"insertion warnings without 'this rank's shard': {messages}", all("this rank's shard" in m for m in messages))
    check.true("no rank warned about failed keys (the test needs some to)", any(all_gather(group, bool(messages))))
    check.done()


def failed_keys_collection(worker: Worker, group) -> None:
    """The same through a bag collection whose table b is too small; a and c have room."""
    W, r = group.size(), group.rank()
    check = Checks(r)
    tables = table_configs(check_mode="count", score_strategy="step", bucket_capacity=8)
    tables[1] = TableConfig(**{**tables[1].__dict__, "capacity": 16 * W})
    col = _shard(dynemb.DynamicEmbeddingBagCollection(tables, dynemb.optim.SGD(lr=0.1)), group)
    for step in range(3):
        fresh = mix64(torch.arange(20_000 * (step + 1), 20_000 * (step + 1) + 30 * W))
        mine_fb, mine_fb2 = fresh[r::W], torch.cat([fresh[:5], torch.tensor([INT64_MAX])])
        feats = {
            "fa": (fresh[r::W], torch.tensor([mine_fb.numel()])),
            "fb": (mine_fb, torch.tensor([mine_fb.numel()])),
            "fb2": (mine_fb2, torch.tensor([mine_fb2.numel()])),
            "fc": (torch.tensor([0, -1]), torch.tensor([2])),
        }
        col(feats).concat.sum().backward()
        for name, features in (("a", ["fa"]), ("b", ["fb", "fb2"]), ("c", ["fc"])):
            failed = col.last_failed_keys[name]
            asked = set(torch.cat([feats[f][0] for f in features]).tolist())
            held = set(torch.cat(all_gather(group, rows_of(col.export(name))["keys"])).tolist())
            everyone_asked = set().union(*all_gather(group, asked))
            missing = everyone_asked - held
            mine_failed = set(failed.tolist())
            union_failed = set().union(*all_gather(group, mine_failed))
            what = f"step {step} table {name!r}"
            check.equal(f"{what}: this rank's last_failed_keys vs its asked keys no shard holds", sorted(mine_failed), sorted(asked & missing))
            check.equal(f"{what}: union of last_failed_keys vs asked keys no shard holds", sorted(union_failed), sorted(missing))
            check.true(f"{what}: {'no' if name == 'b' else 'some'} key failed", bool(missing) == (name == "b"))
    check.done()


def fill(worker: Worker, group) -> None:
    """A table configured with capacity C on R ranks holds about C keys in all: a stream of new
    keys (evicting the oldest) fills every shard, i.e. the routing does not starve buckets."""
    W, r = group.size(), group.rank()
    check = Checks(r)
    capacity = 64 * W
    table = _shard(dynemb.DynamicEmbedding(4, capacity, optimizer=dynemb.optim.SGD(lr=0.1), score_strategy="step", check_mode="count"), group)
    ref = dynemb.DynamicEmbedding(4, capacity, optimizer=dynemb.optim.SGD(lr=0.1), score_strategy="step", check_mode="count")
    for step in range(20):
        fresh = mix64(torch.arange(100_000 * (step + 1), 100_000 * (step + 1) + 48 * W))
        table(fresh[r::W]).sum().backward()
        ref(fresh).sum().backward()
    s = table.stats()
    sizes = all_gather(group, (s["size"], s["capacity"], s["requested_capacity"]))
    total = sum(x[0] for x in sizes)
    check.true(f"shards (size, capacity, requested) {sizes}: not every shard full", all(size == cap for size, cap, _ in sizes))
    check.true(f"shards {sizes} hold {total} keys in all: more than 2x the configured capacity {capacity}", total <= 2 * capacity)
    check.true(f"shards {sizes} hold {total} keys, the unsharded table of the same capacity {len(ref)}", total >= 0.9 * len(ref))
    check.done()


def _insert_erase(
    check: Checks, group, insert: Callable, ref_insert: Callable, erase: Callable | None, ref_erase: Callable | None, dim: int, width: int
) -> None:
    """Each rank inserts its share of the keys (embeddings, then whole rows with scores over
    keys partly present), then erases its share of a mix of present and never-seen keys; the
    last rank passes no keys to the first insert and to erase. Returns flags are checked
    against the unsharded table's for the same keys."""
    W, r = group.size(), group.rank()
    gen = torch.Generator().manual_seed(31)

    def all_but_last(n: int) -> torch.Tensor:
        # This rank's share of n keys when the last rank has none: rank 0 takes its share too.
        if r == W - 1:
            return torch.arange(0)
        mine = torch.arange(r, n, W)
        return torch.sort(torch.cat([mine, torch.arange(W - 1, n, W)])).values if r == 0 else mine

    first = KEYS[:40]
    values = torch.randn(first.numel(), dim, generator=gen)
    mine_first = all_but_last(first.numel())
    ok = insert(first[mine_first], values[mine_first], None)
    want = ref_insert(first, values, None)
    check.equal("insert (embeddings): returned flags", ok, want[mine_first])
    second = KEYS[20:]
    rows = torch.rand(second.numel(), width, generator=gen)  # whole rows: Adam's v must be >= 0
    scores = torch.arange(100, 100 + second.numel())
    sel = torch.arange(r, second.numel(), W)
    ok = insert(second[sel], rows[sel], scores[sel])
    want = ref_insert(second, rows, scores)
    check.equal("insert (whole rows, scores): returned flags", ok, want[sel])
    if erase is not None:
        doomed = torch.cat([KEYS[::3], UNSEEN[:6]])
        sel = all_but_last(doomed.numel())
        found = erase(doomed[sel])
        want = ref_erase(doomed)
        check.equal("erase: found flags", found, want[sel])


def insert_erase_table(worker: Worker, group) -> None:
    """insert() / erase() on a sharded table: collective, each rank's keys to their owners; the
    shards then hold exactly the unsharded table's rows, find() agrees, and one more training
    step (Adam, so the inserted optimizer state matters) matches."""
    W, r = group.size(), group.rank()
    check = Checks(r)

    def make():
        return dynemb.DynamicEmbedding(D, CAPACITY, optimizer=OPTIMIZERS["adam"](), score_strategy="step")

    table, ref = _shard(make(), group), make()
    _insert_erase(check, group, table.insert, ref.insert, table.erase, ref.erase, dim=D, width=3 * D)
    check_shards(check, group, "table after insert / erase", table.export(), ref.export())
    check_find(check, "table after insert / erase", r, W, table.find, ref.find)
    ids = KEYS[1::2]
    coef = torch.randn(ids.numel(), D, generator=torch.Generator().manual_seed(32))
    sel = torch.arange(r, ids.numel(), W)
    loss_of(table(ids[sel]), coef[sel]).backward()
    loss_of(ref(ids), coef).backward()
    check_shards(check, group, "table after a training step", table.export(), ref.export())
    check.done()


def insert_erase_collection(worker: Worker, group) -> None:
    """insert() on a sharded collection's table (table 'b', in a group with 'a'): as for a table;
    the other tables are untouched."""
    W, r = group.size(), group.rank()
    check = Checks(r)
    col, ref = _shard(make_collection(True, "adam", "fused"), group), make_collection(True, "adam", "fused")
    engine = col.engines[col.table_group[TABLE_NAMES.index("b")][0]]

    def insert(c):
        return lambda keys, values, scores: c.insert("b", keys, values, scores)

    _insert_erase(check, group, insert(col), insert(ref), None, None, dim=engine.embedding_dim, width=engine.width)
    for name in TABLE_NAMES:
        check_shards(check, group, f"collection table {name!r} after insert", col.export(name), ref.export(name))
    check_find(check, "collection table 'b' after insert", r, W, lambda k: col.find("b", k), lambda k: ref.find("b", k))
    check.done()


def insert_agreement(worker: Worker, group) -> None:
    """The ranks agree on insert / erase inputs before any collective: a rank with no keys and no
    scores joins ranks that give scores and whole rows; widths or scores that differ between
    ranks with keys, or bad input on one rank, raise on every rank (naming the problem) and
    leave the ranks in step (the next calls work and match the unsharded table)."""
    W, r = group.size(), group.rank()
    check = Checks(r)

    def make():
        return dynemb.DynamicEmbedding(D, CAPACITY, optimizer=OPTIMIZERS["adam"](), score_strategy="lfu")

    table, ref = _shard(make(), group), make()
    gen = torch.Generator().manual_seed(33)
    keys = KEYS[:12]
    rows = torch.rand(keys.numel(), 3 * D, generator=gen)
    scores = torch.arange(1, keys.numel() + 1)
    # Rank 0 inserts everything (whole rows, scores); the others pass nothing, as plain empties.
    if r == 0:
        table.insert(keys, rows, scores)
    else:
        table.insert(torch.empty(0, dtype=torch.int64), torch.empty(0, D))
    ref.insert(keys, rows, scores)

    def raises(what: str, call: Callable, match: str) -> None:
        try:
            call()
        except (TypeError, ValueError) as e:
            check.true(f"{what}: error {e} does not say {match!r}", re.search(match, str(e)) is not None)
        else:
            check.true(f"{what}: no error", False)

    other = KEYS[12:14] + r
    raises("widths differ", lambda: table.insert(other, torch.ones(2, D if r == 0 else 3 * D)), "width differs between ranks")
    raises("scores on some ranks", lambda: table.insert(other, torch.ones(2, D), torch.ones(2, dtype=torch.int64) if r == 0 else None), "scores differs")
    bad = torch.tensor([5, 5]) if r == W - 1 else other
    raises("duplicates on the last rank", lambda: table.insert(bad, torch.ones(2, D)), "duplicate" if r == W - 1 else "bad input on another rank")
    raises("erase with bad keys on the last rank", lambda: table.erase(torch.tensor([1.5]) if r == W - 1 else KEYS[:1]), "int64|bad input on another rank")
    # Still in step: an erase and a find that match the unsharded table.
    found = table.erase(KEYS[r : r + 1])
    want = ref.erase(KEYS[:W])
    check.equal("erase after the errors: found", found, want[r : r + 1])
    check_shards(check, group, "table after the refused calls", table.export(), ref.export())
    check_find(check, "table after the refused calls", r, W, table.find, ref.find)
    check.done()


def nonfinite_rows(worker: Worker, group) -> None:
    """Non-finite rows on a sharded table: a NaN insert on one rank raises on every rank and
    changes nothing; an update that would overflow a row (finite gradient 3e38, SGD lr 10) is
    skipped and counted by its owner ('skip'), or raises on every rank before any rank writes
    ('raise'); the shards match the unsharded table throughout."""
    W, r = group.size(), group.rank()
    check = Checks(r)
    big_key = KEYS[:1]
    for policy in ("skip", "raise"):

        def make(policy=policy):
            return dynemb.DynamicEmbedding(D, CAPACITY, optimizer=dynemb.optim.SGD(lr=10.0), nonfinite_grads=policy, score_strategy="step")

        table, ref = _shard(make(), group), make()
        values = torch.ones(2, D)
        if r == W - 1:
            values[1, 0] = float("nan")
        try:
            table.insert(KEYS[1:3] + 10 * r, values)
            check.true(f"{policy}: NaN insert on rank {W - 1} did not raise", False)
        except ValueError as e:
            check.true(f"{policy}: NaN insert error {e}", ("NaN or inf" if r == W - 1 else "bad input on another rank") in str(e))
        check.equal(f"{policy}: keys after the refused insert", len(table), 0)
        rows = torch.full((1, D), 3e38)
        table.insert(big_key if r == 0 else big_key[:0], rows if r == 0 else rows[:0])
        ref.insert(big_key, rows)
        ids = KEYS[:4]
        # Every rank looks up the same keys; rank 0 alone gives big_key the huge gradient.
        scale = torch.ones(4, 1)
        if r == 0:
            scale[0] = 3e38
        ref_scale = torch.ones(4, 1) * W
        ref_scale[0] = 3e38 + (W - 1)
        raised = []
        for name, module, s in (("sharded", table, scale), ("unsharded", ref, ref_scale)):
            try:
                (module(ids) * s).sum().backward()
            except FloatingPointError as e:
                raised.append((name, str(e)))
        if policy == "raise":
            check.equal("raise: both raised", [n for n, _ in raised], ["sharded", "unsharded"])
            owner = int(dynemb.distributed.owner_of(big_key, W))
            want = "non-finite" if r == owner else "owned by another rank"
            check.true(f"raise: rank {r} error {raised[:1]} does not say {want!r}", bool(raised) and want in raised[0][1])
        else:
            check.equal("skip: nothing raised", raised, [])
            counted = sum(all_gather(group, table.stats()["nonfinite_grads"]))
            check.equal("skip: keys skipped over all ranks", counted, ref.stats()["nonfinite_grads"])
        check_shards(check, group, f"{policy}: table", table.export(), ref.export())
    # A state_dict is one rank's shard: loading one into a sharded table is refused, unchanged.
    try:
        table.load_state_dict(ref.state_dict())
        check.true("load_state_dict on a sharded table did not raise", False)
    except RuntimeError as e:
        check.true(f"load_state_dict error {e}", "dynemb.checkpoint" in str(e))
    check_shards(check, group, "table after the refused load_state_dict", table.export(), ref.export())
    check.done()


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = dynemb.DynamicEmbeddingBag(D, CAPACITY, mode="sum", optimizer=dynemb.optim.Adam(lr=0.05))
        self.seq = torch.nn.ModuleDict({"col": dynemb.DynamicEmbeddingCollection(table_configs(), dynemb.optim.RowWiseAdagrad(lr=0.1))})

    def forward(self, ids, offsets, feats):
        return self.bag(ids, offsets), self.seq["col"](feats)


def nested_module(worker: Worker, group) -> None:
    """shard(model) with the default process group shards every table inside a plain module."""
    W, r = group.size(), group.rank()
    check = Checks(r)
    model = _shard(Model(), None)
    ref = Model()
    gen = torch.Generator().manual_seed(3)
    for step in range(6):
        B = batch_size(step, W)
        sel = mine(r, W, B)
        ids, lengths, coef = draw_bags(gen, B)
        feats = draw_features(gen, B)
        local_ids, local_lengths = jagged_take(ids, lengths, sel)
        pooled, seq = model(local_ids, offsets_of(local_lengths), local_features(feats, sel))
        want_pooled, want_seq = ref(ids, offsets_of(lengths), feats)
        check.close(f"step {step}: bag outputs", pooled.detach(), want_pooled.detach()[sel])
        loss, ref_loss = loss_of(pooled, coef[sel]), loss_of(want_pooled, coef)
        for f in FEATURES:
            got = seq[f][0]
            want = jagged_take(want_seq[f][0], feats[f][1], sel)[0]
            check.close(f"step {step}: {f} outputs", got.detach(), want.detach())
            loss, ref_loss = loss + got.pow(2).sum(), ref_loss + want_seq[f][0].pow(2).sum()
        loss.backward()
        ref_loss.backward()
    world_group = dist.group.WORLD
    check_shards(check, world_group, "model.bag", model.bag.export(), ref.bag.export())
    for name in TABLE_NAMES:
        check_shards(check, world_group, f"model.seq.col table {name!r}", model.seq["col"].export(name), ref.seq["col"].export(name))
    check.done()


def _cases() -> dict[str, Callable]:
    cases: dict[str, Callable] = {}
    for update in ("fused", "deferred"):
        for pooled in (False, True):
            kind = "bag" if pooled else "seq"
            for opt in OPTIMIZERS:
                cases[f"table-{kind}-{opt}-{update}"] = table_parity(pooled, opt, update)
            cases[f"table-edges-{kind}-{update}"] = table_edges(pooled, update)
    cases["table-weighted-bags"] = weighted_bags
    for update in ("fused", "deferred"):
        for pooled in (False, True):
            kind = "ebc" if pooled else "ec"
            for opt in COLLECTION_OPTIMIZERS:
                cases[f"collection-{kind}-{opt}-{update}"] = collection_parity(pooled, opt, update)
            cases[f"collection-edges-{kind}-{update}"] = collection_edges(pooled, update)
    cases["local-stats"] = local_stats
    cases["failed-keys-table"] = failed_keys_table
    cases["failed-keys-collection"] = failed_keys_collection
    cases["fill"] = fill
    cases["insert-erase-table"] = insert_erase_table
    cases["insert-erase-collection"] = insert_erase_collection
    cases["insert-agreement"] = insert_agreement
    cases["nonfinite-rows"] = nonfinite_rows
    # Last: it uses the default group, which a failed case might leave busy.
    cases["nested-module-default-group"] = nested_module
    return cases


CASES = _cases()


def sharding_world(worker: Worker) -> None:
    only = worker.options.get("only")
    cases = {name: case for name, case in CASES.items() if only is None or re.search(only, name)}
    run_cases(worker, cases, group_timeout_s=SHARD_TIMEOUT.total_seconds())


def peer_failure(worker: Worker) -> None:
    """Train a sharded bag in a loop; at step 3 rank 1 dies (os._exit), raises, or hangs (sleeps
    outside any collective). The others record what they raise (and when); they must not finish
    the loop."""
    import dynemb.distributed

    mode, timeout_s = worker.options["mode"], worker.options["timeout_s"]
    table = dynemb.DynamicEmbeddingBag(D, 1 << 10, mode="sum", optimizer=dynemb.optim.Adam(lr=0.01))
    dynemb.distributed.shard(table, timeout=datetime.timedelta(seconds=timeout_s))
    gen = torch.Generator().manual_seed(worker.rank)
    step = 0
    try:
        for step in range(10_000):
            if worker.rank == 1 and step == 3 and mode == "exit":
                worker.record(event="dying", step=step)
                os._exit(1)
            out = table(zipf_keys(gen, 12), torch.arange(0, 12, 3))
            if worker.rank == 1 and step == 3 and mode == "raise":
                worker.record(event="dying", step=step)
                raise RuntimeError("injected failure on rank 1 between forward and backward")
            if worker.rank == 1 and step == 3 and mode == "hang":
                worker.record(event="dying", step=step)
                time.sleep(3600)
            out.pow(2).sum().backward()
    except Exception as e:
        if worker.rank == 1:
            raise
        worker.record(
            event="peer failed", step=step, type=type(e).__name__, runtime_error=isinstance(e, RuntimeError), message=str(e), traceback=traceback.format_exc()
        )
        return
    worker.record(event="finished", step=step)
