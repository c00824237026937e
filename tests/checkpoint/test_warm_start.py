"""Warm start: loading into tables of another geometry, score strategy or optimizer, a shard of
the keys, or a model with other tables.

K keys of a table, C capacity, D embedding dim, S optimizer state columns.
"""

from __future__ import annotations

import pytest
import torch
from ckpt_models import (
    GEOMETRY,
    Model,
    admission_state,
    assert_equal,
    contents,
    export,
    one_thread,  # noqa: F401 (autouse fixture)
    stats,
    train,
)

import dynemb


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A trained model (its tables full, keys evicted) and its checkpoint."""
    model = Model("adam", "lfu", True)
    train(model, range(12))
    path = tmp_path_factory.mktemp("warm") / "ckpt"
    dynemb.checkpoint.save(model, path)
    return model, path


def _snapshot(model) -> dict:
    return {
        "contents": contents(model),
        "stats": stats(model),
        "admission": admission_state(model),
        "step": [m.step for m in (model.seq, model.bag, model.ebc)],
    }


def _scaled(factor: float, bucket_capacity: int | None = None, init: bool = False) -> dict:
    out = {}
    for name, (capacity, _, W) in GEOMETRY.items():
        c = int(capacity * factor)
        out[name] = (c, max(1, c // 4) if init else None, bucket_capacity or W)
    return out


GEOMETRIES = {
    "capacity x4": _scaled(4),
    "bucket_capacity 16": _scaled(1, 16),
    "bucket_capacity 4, capacity x2": _scaled(2, 4),
    "init_capacity C/4, capacity x2": _scaled(2, init=True),
}


@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_other_geometry_reinserts_every_key(saved, geometry):
    model, path = saved
    target = Model("adam", "lfu", True, geometry=GEOMETRIES[geometry])
    report = dynemb.checkpoint.load(target, path)
    assert report == {n: {"rows": s["size"], "dropped": 0} for n, s in stats(model).items()}
    # Same keys, rows, optimizer state and scores; only the placement differs.
    assert_equal(contents(target), contents(model))
    assert_equal(admission_state(target), admission_state(model))
    for name, s in stats(target).items():
        want = stats(model)[name]
        assert {k: s[k] for k in ("size", "step", "optimizer_step", "erased", "admission_rejections")} == {
            k: want[k] for k in ("size", "step", "optimizer_step", "erased", "admission_rejections")
        }
    # Training goes on.
    train(target, range(12, 14))


@pytest.mark.parametrize("strategy", ["step", "timestamp", "no_eviction"])
def test_other_score_strategy_keeps_the_saved_scores(saved, strategy):
    model, path = saved
    target = Model("adam", strategy, True)
    dynemb.checkpoint.load(target, path)
    assert_equal(contents(target), contents(model))
    train(target, range(12, 14))


def test_full_table_into_the_same_capacity_with_another_bucket_width(saved):
    """Every table is full (K == C): re-inserting them all needs cuckoo moves the batch insert
    does not always find."""
    model, path = saved
    assert all(s["size"] == s["capacity"] for s in stats(model).values())
    target = Model("adam", "step", True, geometry=_scaled(1, 16))
    dynemb.checkpoint.load(target, path)
    assert_equal(contents(target), contents(model))


def test_keys_that_do_not_fit_raise_before_any_table_changes(saved):
    _, path = saved
    # Only one table is too small: the others, which fit, must not change either.
    target = Model("sgd", "step", geometry={"tag": (8, None, 8)})
    train(target, range(3))
    before = _snapshot(target)
    with pytest.raises(dynemb.CheckpointError, match="tag") as error:
        dynemb.checkpoint.load(target, path, optimizer_state=False)
    assert "on_overflow='evict'" in str(error.value)
    assert_equal(_snapshot(target), before)
    # The model still trains as before.
    train(target, range(3, 4))


def test_evict_keeps_the_highest_scored_keys_and_reports_the_dropped(saved):
    """One bucket per table (bucket_capacity >= capacity): any C keys fit, so exactly the C keys
    of highest priority (score, then smaller key) must stay."""
    model, path = saved
    small = {"seq": (16, None, 16), "bag": (8, None, 8), "user": (8, None, 8), "item": (16, None, 16), "tag": (8, None, 8)}
    target = Model("adam", "lfu", True, geometry=small)
    report = dynemb.checkpoint.load(target, path, on_overflow="evict")
    source, got = contents(model), contents(target)
    for name, table in source.items():
        capacity = small[name.split(".")[-1]][0]
        K = table["keys"].numel()
        assert report[name] == {"rows": capacity, "dropped": K - capacity}, name
        # Priority order: higher score first, then smaller key (keys are sorted ascending).
        top = torch.sort(table["scores"], descending=True, stable=True).indices[:capacity]
        want = {k: table[k][torch.sort(top).values] for k in table}
        assert_equal(got[name], want, name)


def test_evict_fills_tables_of_another_bucket_width(saved):
    model, path = saved
    target = Model("adam", "lfu", True, geometry=_scaled(0.5, 4))
    report = dynemb.checkpoint.load(target, path, on_overflow="evict")
    source, got = contents(model), contents(target)
    for name, s in stats(target).items():
        K = source[name]["keys"].numel()
        assert report[name] == {"rows": s["size"], "dropped": K - s["size"]}
        assert s["size"] >= s["capacity"] - 2, (name, s)
        # Kept keys hold their saved rows.
        kept = torch.isin(source[name]["keys"], got[name]["keys"])
        assert_equal(got[name], {k: v[kept] for k, v in source[name].items()}, name)


def test_optimizer_state_false_loads_embeddings_into_another_optimizer(saved):
    model, path = saved
    target = Model("adagrad", "lfu", True)
    with pytest.raises(dynemb.CheckpointError, match="optimizer_state=False") as error:
        dynemb.checkpoint.load(target, path)
    assert "Adam" in str(error.value) and "Adagrad" in str(error.value)
    dynemb.checkpoint.load(target, path, optimizer_state=False)
    source, got = contents(model), contents(target)
    for name in source:
        for k in ("keys", "embeddings", "scores"):
            assert_equal(got[name][k], source[name][k], f"{name}.{k}")
        # Adagrad's own initial state (one accumulator per column), step counts from 0.
        assert got[name]["optimizer_state"].shape == source[name]["embeddings"].shape
        assert bool((got[name]["optimizer_state"] == 0).all())
        assert stats(target)[name]["optimizer_step"] == 0
    train(target, range(12, 14))
    assert all(s["optimizer_step"] > 0 for s in stats(target).values())


def test_optimizer_state_false_into_a_frozen_model(saved):
    model, path = saved
    target = Model(None, "lfu", True)
    dynemb.checkpoint.load(target, path, optimizer_state=False)
    for name, table in contents(model).items():
        assert_equal(contents(target)[name]["embeddings"], table["embeddings"])


def test_owns_loads_only_the_keys_it_accepts(saved):
    model, path = saved
    target = Model("adam", "lfu", True)
    report = dynemb.checkpoint.load(target, path, owns=lambda k: k % 2 == 0)
    for name, table in contents(model).items():
        even = table["keys"] % 2 == 0
        assert 0 < int(even.sum()) < table["keys"].numel()
        assert_equal(contents(target)[name], {k: v[even] for k, v in table.items()}, name)
        assert report[name] == {"rows": int(even.sum()), "dropped": 0}


def test_owns_must_return_a_bool_mask(saved):
    _, path = saved
    target = Model("adam", "lfu", True)
    before = _snapshot(target)
    with pytest.raises(ValueError, match="owns"):
        dynemb.checkpoint.load(target, path, owns=lambda k: k % 2)
    assert_equal(_snapshot(target), before)


class WithExtra(torch.nn.Module):
    def __init__(self, with_bag: bool = True):
        super().__init__()
        base = Model("adam", "lfu", True)
        self.seq, self.ebc = base.seq, base.ebc
        if with_bag:
            self.bag = base.bag
        self.extra = dynemb.DynamicEmbedding(4, 32, optimizer=dynemb.optim.Adam(lr=0.05), score_strategy="step")


def test_strict_names_the_missing_and_extra_tables(saved):
    _, path = saved
    target = WithExtra(with_bag=False)
    target.extra(torch.arange(5)).sum().backward()
    before = contents(target)
    with pytest.raises(dynemb.CheckpointError) as error:
        dynemb.checkpoint.load(target, path)
    assert "'extra'" in str(error.value) and "'bag'" in str(error.value)
    assert_equal(contents(target), before)


def test_not_strict_loads_the_common_tables_and_leaves_the_others(saved):
    model, path = saved
    target = WithExtra(with_bag=False)
    target.extra(torch.arange(5)).sum().backward()
    extra_before, extra_stats = export(target.extra, None), target.extra.stats()
    report = dynemb.checkpoint.load(target, path, strict=False)
    assert set(report) == {"seq", "ebc.user", "ebc.item", "ebc.tag"}
    assert_equal({n: t for n, t in contents(target).items() if n != "extra"}, {n: t for n, t in contents(model).items() if n != "bag"})
    assert_equal(export(target.extra, None), extra_before)
    assert target.extra.stats() == extra_stats
    # The model is not the checkpoint's content (extra is not in it): no delta on it.
    with pytest.raises(dynemb.CheckpointError):
        dynemb.checkpoint.save_delta(target, path.parent / "delta-on-partial", base=path)


@pytest.mark.parametrize("admission", [False, True])
def test_admission_setting_may_differ(saved, admission, tmp_path):
    """A checkpoint with admission counts loads into tables without admission (the counts are
    dropped), and one without into tables with it (they start counting afresh)."""
    model, path = saved
    if not admission:
        target = Model("adam", "lfu", False)
        dynemb.checkpoint.load(target, path)
        assert_equal(contents(target), contents(model))
        return
    plain = Model("adam", "lfu", False)
    train(plain, range(4))
    dynemb.checkpoint.save(plain, tmp_path / "plain")
    target = Model("adam", "lfu", True)
    train(target, range(20, 22))
    dynemb.checkpoint.load(target, tmp_path / "plain")
    assert_equal(contents(target), contents(plain))
    assert all(a is not None and a["keys"].numel() == 0 for a in admission_state(target).values())
    train(target, range(4, 6))


def test_not_strict_keeps_a_collection_table_the_checkpoint_lacks(tmp_path):
    """A table sharing a group (one index, one store) with loaded tables keeps its rows, step
    count, counters and generator."""

    def collection(names):
        configs = [dynemb.TableConfig(name=n, embedding_dim=4, capacity=64, score_strategy="step", seed=i) for i, n in enumerate(names)]
        return dynemb.DynamicEmbeddingBagCollection(configs, dynemb.optim.Adagrad(lr=0.1))

    def step(ebc, names, k):
        ids = torch.arange(6) * (k + 1) + 100 * k
        out = ebc({n: (ids, torch.tensor([3, 3])) for n in names})
        out.concat.sum().backward()

    saved = collection(["a", "b"])
    for k in range(3):
        step(saved, ["a", "b"], k)
    dynemb.checkpoint.save(saved, tmp_path / "ckpt")

    target = collection(["a", "b", "c"])
    for k in range(5):
        step(target, ["a", "b", "c"], k + 10)
    c_rows, c_stats = export(target, "c"), target.stats()["c"]
    with pytest.raises(dynemb.CheckpointError, match="'c'"):
        dynemb.checkpoint.load(target, tmp_path / "ckpt")
    dynemb.checkpoint.load(target, tmp_path / "ckpt", strict=False)
    for name in ("a", "b"):
        assert_equal(export(target, name), export(saved, name), name)
        assert target.stats()[name]["optimizer_step"] == saved.stats()[name]["optimizer_step"]
    assert_equal(export(target, "c"), c_rows)
    got = dict(target.stats()["c"])
    # The collection's clock is the checkpoint's now.
    got.pop("step"), c_stats.pop("step")
    assert got == c_stats
    # New keys of c still get c's own initial rows after the load.
    fresh = collection(["a", "b", "c"])
    for k in range(5):
        step(fresh, ["a", "b", "c"], k + 10)
    step(target, ["a", "b", "c"], 20)
    step(fresh, ["a", "b", "c"], 20)
    # (Scores differ: the collections' step clocks do.)
    for k in ("keys", "embeddings", "optimizer_state"):
        assert_equal(export(target, "c")[k], export(fresh, "c")[k], k)


def test_embedding_dim_mismatch_raises(saved):
    _, path = saved

    class Wrong(torch.nn.Module):
        def __init__(self):
            super().__init__()
            base = Model("adam", "lfu", True)
            self.bag, self.ebc = base.bag, base.ebc
            self.seq = dynemb.DynamicEmbedding(6, 48, optimizer=dynemb.optim.Adam(lr=0.05))

    target = Wrong()
    with pytest.raises(dynemb.CheckpointError, match="'seq'.*embedding_dim"):
        dynemb.checkpoint.load(target, path)


def _full_table(seed: int) -> dynemb.DynamicEmbedding:
    """A table filled to capacity by inserts that evicted: every one of its 64 buckets full."""
    table = dynemb.DynamicEmbedding(4, 512, bucket_capacity=8, score_strategy="step", check_mode="count", optimizer=dynemb.optim.RowWiseAdagrad(lr=0.1))
    g = torch.Generator().manual_seed(seed)
    for _ in range(6):
        keys = torch.unique(torch.randint(-(10**12), 10**12, (256,), generator=g))
        table.insert(keys, torch.randn(keys.numel(), 5, generator=g))
    assert table.size() == table.capacity()
    return table


@pytest.mark.parametrize("how, seed", [("owns", 0), ("owns", 1), ("delta", 1), ("delta", 4)])
def test_a_full_table_reloads_by_reinsertion(how, seed, tmp_path):
    """Re-inserting every key of a full table (a delta chain, a shard filter, another geometry)
    must find a placement whenever one exists, even where a batch insert alone does not (owns-0,
    delta-1 and delta-4 needed cuckoo paths when this test was written)."""
    table = _full_table(seed)
    dynemb.checkpoint.save(table, tmp_path / "full")
    path, options = tmp_path / "full", {"owns": lambda k: torch.ones_like(k, dtype=torch.bool)}
    if how == "delta":
        table.erase(export(table, None)["keys"][::7])
        # Full again: the delta holds new keys and tombstones, evictions included.
        more = torch.arange(200) * 1_000_003 + 5
        table.insert(more, torch.ones(200, 5))
        assert table.size() == table.capacity()
        dynemb.checkpoint.save_delta(table, tmp_path / "delta", base=tmp_path / "full")
        path, options = tmp_path / "delta", {}
    target = dynemb.DynamicEmbedding(4, 512, bucket_capacity=8, score_strategy="step", optimizer=dynemb.optim.RowWiseAdagrad(lr=0.1))
    report = dynemb.checkpoint.load(target, path, **options)
    assert report["table"] == {"rows": table.size(), "dropped": 0}
    assert_equal(export(target, None), export(table, None))
    assert target.stats()["inserts"] == table.stats()["inserts"]


def _keys_by_buckets(index, want: list[tuple[int, int]]) -> list[int]:
    """Small keys whose candidate buckets are the given (unordered) pairs, one key per pair."""
    keys = torch.arange(10_000)
    b1, b2 = index._buckets(keys)
    pairs = [tuple(sorted(p)) for p in zip(b1.tolist(), b2.tolist())]
    out, used = [], set()
    for p in want:
        k = next(k for k, q in enumerate(pairs) if q == tuple(sorted(p)) and k not in used)
        used.add(k)
        out.append(k)
    return out


def test_cuckoo_paths_move_keys_and_evict_the_lowest_reachable():
    """The placement behind warm starts, on a two-bucket index of width 2 (buckets 0 and 1):
    a key left out reaches a free slot by moving a key to its other bucket, and with evict a key
    with no free slot in reach replaces a lower-priority key it can reach."""
    from dynemb.table.exact import place_exact as _place_exact
    from dynemb.table.index import KeyIndex

    index = KeyIndex(capacity=4, bucket_capacity=2, score_strategy="step")
    assert (index.num_buckets, index.bucket_capacity) == (2, 2)
    # Keys: a, b only in bucket 0; c movable (0 or 1); d only in bucket 1; h only in bucket 0.
    a, b, c, d, h = _keys_by_buckets(index, [(0, 0), (0, 0), (0, 1), (1, 1), (0, 0)])
    keys = torch.tensor([a, c, d, h])
    scores = torch.tensor([9, 5, 5, 7])
    no = torch.zeros(4, dtype=torch.bool)
    # Bucket 0 full (a, c), bucket 1 has one free slot: h gets in by moving c to bucket 1.
    slots = _place_exact(index, keys, None, scores, torch.tensor([0, 1, 2, -1]), evict=False, optional=no)
    assert sorted((slots // 2).tolist()) == [0, 0, 1, 1] and (slots[1] // 2, slots[3] // 2) == (1, 0)
    assert torch.unique(slots).numel() == 4

    keys = torch.tensor([a, b, d, h])
    scores = torch.tensor([9, 3, 5, 7])
    slots = torch.tensor([0, 1, 2, -1])
    # Bucket 0 holds a and b, neither can move: without evict h fails, with evict it replaces
    # b (score 3 < 7), never a (9).
    assert _place_exact(index, keys, None, scores, slots, evict=False, optional=no).tolist() == [0, 1, 2, -1]
    got = _place_exact(index, keys, None, scores, slots, evict=True, optional=no)
    assert got[1] == -1 and got[3] // 2 == 0 and got[0] // 2 == 0 and got[2] == 2
    # A key below both residents is dropped instead.
    scores = torch.tensor([9, 8, 5, 7])
    assert _place_exact(index, keys, None, scores, slots, evict=True, optional=no).tolist() == [0, 1, 2, -1]
    # An optional key (beyond capacity) only takes a free slot, never replaces.
    scores = torch.tensor([9, 3, 5, 7])
    assert _place_exact(index, keys, None, scores, slots, evict=True, optional=torch.tensor([False, False, False, True])).tolist() == [0, 1, 2, -1]
