"""dynemb.torchrec modules whose tables are caching tables (``options`` per table: caching,
external_storage, cache_rows) train bitwise like the in-memory ones; after flush() each store
holds its table's rows.

B samples, M cache rows.
"""

from __future__ import annotations

import torch
from torchrec import EmbeddingBagConfig, EmbeddingConfig
from torchrec_testing import ids, kjt

import dynemb
import dynemb.torchrec
from dynemb.storage import InMemoryStorage

FEATURES = ["a", "b", "c"]
M = 4


def caching_options(names: list[str]) -> tuple[dict, dict]:
    stores = {name: InMemoryStorage() for name in names}
    return {name: {"caching": True, "external_storage": store, "cache_rows": M} for name, store in stores.items()}, stores


def check_stores(module, stores: dict) -> None:
    module.flush()
    for name, store in stores.items():
        chunks = list(module.collection.export(name))
        want = {k: torch.cat([e, o]) for c in chunks for k, e, o in zip(c["keys"].tolist(), c["embeddings"], c["optimizer_state"])}
        held = {k: row for keys, rows in store.items() for k, row in zip(keys.tolist(), rows)}
        assert sorted(held) == sorted(want) and len(want) > M
        assert all(torch.equal(held[k], want[k]) for k in want)


def test_ebc_with_caching_tables():
    tables = [
        EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=64, feature_names=["a", "b"]),
        EmbeddingBagConfig(name="t2", embedding_dim=3, num_embeddings=64, feature_names=["c"]),
    ]
    options, stores = caching_options(["t1", "t2"])
    plain = dynemb.torchrec.EmbeddingBagCollection(tables, optimizer=dynemb.optim.Adam(lr=0.05))
    cached = dynemb.torchrec.EmbeddingBagCollection(tables, options=options, optimizer=dynemb.optim.Adam(lr=0.05))
    vocab = ids(40, seed=1)
    for step in range(6):
        features = kjt(FEATURES, 8, vocab, seed=step)
        outs = [m(features).values() for m in (plain, cached)]
        assert torch.equal(outs[0], outs[1])
        for out in outs:
            out.square().sum().backward()
    assert cached.stats()["t1"]["cache"]["misses"] > 0
    check_stores(cached, stores)


def test_ec_with_caching_tables():
    tables = [EmbeddingConfig(name="e1", embedding_dim=4, num_embeddings=64, feature_names=FEATURES)]
    options, stores = caching_options(["e1"])
    plain = dynemb.torchrec.EmbeddingCollection(tables, optimizer=dynemb.optim.RowWiseAdagrad(lr=0.1))
    cached = dynemb.torchrec.EmbeddingCollection(tables, options=options, optimizer=dynemb.optim.RowWiseAdagrad(lr=0.1))
    vocab = ids(40, seed=2)
    for step in range(6):
        features = kjt(FEATURES, 8, vocab, seed=10 + step)
        outs = [m(features) for m in (plain, cached)]
        for f in FEATURES:
            assert torch.equal(outs[0][f].values(), outs[1][f].values())
        for out in outs:
            sum(out[f].values().square().sum() for f in FEATURES).backward()
    check_stores(cached, stores)
