"""Caching mode: a table whose rows live in an external store behind a small write-back cache
trains bitwise like the in-memory table; after flush() the store holds every key's row.

N ids per batch, V distinct ids, D embedding dim, M cache rows (much fewer than V).
"""

from __future__ import annotations

import pytest
import torch

import dynemb
from dict_storage import DictStorage
from dynemb import TableConfig
from dynemb.storage import DiskStorage, InMemoryStorage

V, D, M, CAPACITY = 300, 6, 16, 512

OPTIMIZERS = {
    "sgd": lambda: dynemb.optim.SGD(lr=0.1),
    "adagrad": lambda: dynemb.optim.Adagrad(lr=0.1),
    "rowwise_adagrad": lambda: dynemb.optim.RowWiseAdagrad(lr=0.1),
    "adam": lambda: dynemb.optim.Adam(lr=0.05),
}


@pytest.fixture(params=["memory", "disk", "dict"])
def make_store(request, tmp_path):
    made = []

    def make():
        store = {"memory": InMemoryStorage, "dict": DictStorage}.get(request.param, lambda: DiskStorage(tmp_path / f"s{len(made)}"))()
        made.append(store)
        return store

    yield make
    for store in made:
        if isinstance(store, DiskStorage):
            store.close()


def pair(make_store, bag: bool = False, opt: str = "adam", **options):
    """An in-memory table and a caching one (M cache rows) over a fresh store, same settings."""
    cls = dynemb.DynamicEmbeddingBag if bag else dynemb.DynamicEmbedding
    kw = {"mode": "sum"} if bag else {}
    plain = cls(D, options.pop("capacity", CAPACITY), optimizer=OPTIMIZERS[opt](), score_strategy="step", **kw, **options)
    store = make_store()
    cached = cls(
        D, plain.config.capacity, optimizer=OPTIMIZERS[opt](), score_strategy="step", caching=True, external_storage=store, cache_rows=M, **kw, **options
    )
    return plain, cached, store


def rows_by_key(table) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys [K] sorted and their whole rows [K, D+S] (embedding, optimizer state), from export()."""
    chunks = list(table.export(64))
    keys = torch.cat([c["keys"] for c in chunks])
    rows = torch.cat([torch.cat([c["embeddings"], c["optimizer_state"]], 1) for c in chunks])
    order = torch.argsort(keys)
    return keys[order], rows[order]


def store_rows(store) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = list(store.items(50))
    if not pairs:
        return torch.empty(0, dtype=torch.int64), torch.empty(0, 0)
    keys, rows = torch.cat([k for k, _ in pairs]), torch.cat([r for _, r in pairs])
    order = torch.argsort(keys)
    return keys[order], rows[order]


def assert_same(a, b):
    ka, ra = rows_by_key(a)
    kb, rb = rows_by_key(b)
    assert torch.equal(ka, kb)
    assert torch.equal(ra, rb)
    assert a.optimizer_step == b.optimizer_step


def assert_store_holds(table, store):
    """After flush(): the store holds exactly the table's keys, each with its row."""
    table.flush()
    assert table.stats()["cache"]["dirty"] == 0
    keys, rows = rows_by_key(table)
    skeys, srows = store_rows(store)
    assert torch.equal(skeys, keys)
    assert torch.equal(srows, rows)


def train(tables, steps: int, gen: torch.Generator, *, bag: bool = False, n: int = 40, low: int = 0, high: int = V):
    for _ in range(steps):
        ids = torch.randint(low, high, (n,), generator=gen)
        outs = []
        for t in tables:
            out = t(ids, torch.arange(0, n, 4)) if bag else t(ids)
            if out.requires_grad:
                (out * torch.linspace(-1, 1, out.shape[-1])).square().sum().backward()
            outs.append(out.detach())
        for out in outs[1:]:
            assert torch.equal(out, outs[0])


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize("bag", [False, True], ids=["sequence", "pooled"])
def test_trains_bitwise_like_the_in_memory_table(make_store, opt, bag):
    plain, cached, store = pair(make_store, bag, opt)
    train([plain, cached], 12, torch.Generator().manual_seed(1), bag=bag)
    assert_same(plain, cached)
    stats = cached.stats()["cache"]
    # The cache is much smaller than the keys: rows really went to the store and came back.
    assert len(cached) > 10 * M and stats["misses"] > 0 and stats["fetched"] > 0 and stats["written"] > 0
    assert stats["rows"] <= M == stats["capacity"] and 0 < stats["hit_rate"] < 1
    assert_store_holds(cached, store)
    # Keeps training the same after a flush, and in eval mode.
    train([plain, cached], 3, torch.Generator().manual_seed(2), bag=bag)
    assert_same(plain, cached)
    plain.eval(), cached.eval()
    train([plain, cached], 1, torch.Generator().manual_seed(3), bag=bag, high=2 * V)


def test_evictions_and_erase_leave_the_store(make_store):
    plain, cached, store = pair(make_store, capacity=128)
    gen = torch.Generator().manual_seed(4)
    train([plain, cached], 10, gen)
    assert plain.stats()["evictions"] > 0
    assert torch.equal(plain.last_evicted_keys.sort().values, cached.last_evicted_keys.sort().values)
    assert_same(plain, cached)
    assert_store_holds(cached, store)
    keys, _ = rows_by_key(cached)
    gone = keys[::3]
    assert torch.equal(plain.erase(gone), cached.erase(gone))
    # Erased keys leave the store at once, before any flush.
    assert not store.get(gone)[1].any()
    train([plain, cached], 4, gen)
    assert_same(plain, cached)
    assert_store_holds(cached, store)


def test_find_insert_and_whole_row_insert(make_store):
    plain, cached, store = pair(make_store, opt="adagrad")
    gen = torch.Generator().manual_seed(5)
    train([plain, cached], 4, gen)
    keys = torch.arange(-50, 250, 3)
    emb = torch.randn(keys.numel(), D, generator=gen)
    # [N, D]: embeddings of cached and uncached keys, optimizer state kept (read from the store).
    assert torch.equal(plain.insert(keys, emb), cached.insert(keys, emb))
    whole = torch.randn(20, plain.engine.width, generator=gen).abs()
    assert torch.equal(plain.insert(keys[:20] + 1000, whole), cached.insert(keys[:20] + 1000, whole))
    asked = torch.arange(-60, 1100, 7)
    for a, b in zip(plain.find(asked), cached.find(asked)):
        assert torch.equal(a, b)
    assert torch.equal(plain.contains(asked), cached.contains(asked))
    train([plain, cached], 3, gen)
    assert_same(plain, cached)
    assert_store_holds(cached, store)


def test_collection_of_caching_tables(make_store):
    def tables(caching: bool):
        return [
            TableConfig(
                name=name,
                feature_names=[f"f{name}"],
                embedding_dim=D,
                capacity=CAPACITY,
                score_strategy="step",
                **({"caching": True, "external_storage": make_store(), "cache_rows": M} if caching else {}),
            )
            for name in ("a", "b")
        ]

    plain = dynemb.DynamicEmbeddingBagCollection(tables(False), dynemb.optim.RowWiseAdagrad(lr=0.1))
    cached = dynemb.DynamicEmbeddingBagCollection(tables(True), dynemb.optim.RowWiseAdagrad(lr=0.1))
    assert len(cached.engines) == 2
    gen = torch.Generator().manual_seed(6)
    for _ in range(8):
        feats = {f: (torch.randint(0, V, (24,), generator=gen), torch.full((6,), 4)) for f in ("fa", "fb")}
        out_p, out_c = plain(feats), cached(feats)
        assert torch.equal(out_p.concat, out_c.concat)
        out_p.concat.square().sum().backward()
        out_c.concat.square().sum().backward()
    cached.flush()
    for name, config in zip(("a", "b"), cached.table_configs):
        keys, rows = store_rows(config.external_storage)
        chunks = list(plain.export(name))
        want = torch.cat([c["keys"] for c in chunks])
        order = torch.argsort(want)
        assert torch.equal(keys, want[order])
        assert torch.equal(rows, torch.cat([torch.cat([c["embeddings"], c["optimizer_state"]], 1) for c in chunks])[order])
        assert cached.stats()[name]["cache"]["capacity"] == M


def test_state_dict_round_trip(make_store):
    plain, cached, store = pair(make_store)
    gen = torch.Generator().manual_seed(7)
    train([plain, cached], 6, gen)
    state = cached.state_dict()
    assert torch.equal(state["embeddings"], plain.state_dict()["embeddings"])
    # Loading into another caching table over an empty store.
    _, other, other_store = pair(make_store)
    other.load_state_dict(state)
    assert_same(plain, other)
    # Loading back into the table itself after it took new keys: they leave its store.
    train([cached], 3, torch.Generator().manual_seed(8), low=V, high=2 * V)
    cached.load_state_dict(state)
    assert_same(plain, cached)
    assert_store_holds(cached, store)
    train([plain, cached, other], 4, gen)
    assert_same(plain, cached)
    assert_same(plain, other)
    assert_store_holds(other, other_store)


@pytest.mark.parametrize("layout", [True, False])
def test_checkpoint_sees_the_flushed_state(make_store, tmp_path, layout):
    plain, cached, store = pair(make_store)
    gen = torch.Generator().manual_seed(9)
    train([plain, cached], 6, gen)
    assert cached.stats()["cache"]["dirty"] > 0
    dynemb.checkpoint.save(cached, tmp_path / "ckpt", layout=layout)
    # The save flushed: the store holds every row the checkpoint holds.
    assert cached.stats()["cache"]["dirty"] == 0
    keys, rows = rows_by_key(cached)
    skeys, srows = store_rows(store)
    assert torch.equal(skeys, keys) and torch.equal(srows, rows)
    _, loaded, loaded_store = pair(make_store)
    dynemb.checkpoint.load(loaded, tmp_path / "ckpt")
    assert_same(plain, loaded)
    train([plain, loaded], 4, gen)
    assert_same(plain, loaded)
    assert_store_holds(loaded, loaded_store)


def test_bad_arguments_name_themselves(tmp_path):
    store = InMemoryStorage()
    with pytest.raises(ValueError, match="external_storage=None"):
        TableConfig(embedding_dim=D, capacity=8, caching=True)
    with pytest.raises(ValueError, match="external_storage=InMemoryStorage"):
        TableConfig(embedding_dim=D, capacity=8, external_storage=store)
    with pytest.raises(ValueError, match="caching='yes'"):
        TableConfig(embedding_dim=D, capacity=8, caching="yes", external_storage=store)
    with pytest.raises(ValueError, match="external_storage=.*get, put, delete and items"):
        TableConfig(embedding_dim=D, capacity=8, caching=True, external_storage={})
    with pytest.raises(ValueError, match="store="):
        dynemb.DynamicEmbedding(D, 8, caching=True, external_storage=store, store=object())
    shared = [TableConfig(name=n, embedding_dim=D, capacity=8, caching=True, external_storage=store) for n in ("a", "b")]
    with pytest.raises(ValueError, match=r"external_storage: tables \['a', 'b'\] share one store"):
        dynemb.DynamicEmbeddingCollection(shared)
    with pytest.raises(ValueError, match="cache_rows=4"):
        TableConfig(embedding_dim=D, capacity=8, cache_rows=4)
    with pytest.raises(ValueError, match="cache_rows=0"):
        TableConfig(embedding_dim=D, capacity=8, caching=True, external_storage=store, cache_rows=0)
    assert "cache" not in dynemb.DynamicEmbedding(D, 8).stats()


def test_a_store_that_loses_rows_is_reported(make_store):
    _, cached, store = pair(make_store)
    train([cached], 3, torch.Generator().manual_seed(10))
    cached.flush()
    keys, _ = store_rows(store)
    store.delete(keys)
    with pytest.raises(RuntimeError, match="external_storage lost the rows"):
        train([cached], 1, torch.Generator().manual_seed(10))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_dtype_conversion_rewrites_the_store(make_store, dtype):
    plain, cached, store = pair(make_store, opt="adagrad")
    gen = torch.Generator().manual_seed(11)
    train([plain, cached], 5, gen)
    plain.to(dtype), cached.to(dtype)
    assert_same(plain, cached)
    assert store_rows(store)[1].dtype == dtype
    assert_store_holds(cached, store)
    train([plain, cached], 3, gen)
    assert_same(plain, cached)
    assert_store_holds(cached, store)


def test_delta_checkpoint_of_a_caching_table(make_store, tmp_path):
    plain, cached, store = pair(make_store)
    gen = torch.Generator().manual_seed(12)
    train([plain, cached], 4, gen)
    dynemb.checkpoint.save(cached, tmp_path / "full")
    train([plain, cached], 4, gen)
    cached.erase(torch.arange(0, V, 5))
    plain.erase(torch.arange(0, V, 5))
    dynemb.checkpoint.save_delta(cached, tmp_path / "delta", base=tmp_path / "full")
    # The save flushed: nothing was dirty left for assert_store_holds' own flush to write.
    assert cached.stats()["cache"]["dirty"] == 0
    assert_store_holds(cached, store)
    _, loaded, loaded_store = pair(make_store)
    dynemb.checkpoint.load(loaded, tmp_path / "delta")
    assert_same(plain, loaded)
    assert_store_holds(loaded, loaded_store)
    # (A delta holds no index layout; nothing is evicted here, so placement does not matter.)
    train([plain, loaded], 3, gen)
    assert_same(plain, loaded)
    assert plain.stats()["evictions"] == 0
