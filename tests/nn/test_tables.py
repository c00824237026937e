"""The module base (nn/tables.py): policy that tables and collections share, per table of a group.

Each test pins a behaviour the merge of the table and collection bases could lose (issue 16).
"""

from __future__ import annotations

import torch

import dynemb
from dynemb import Admission, TableConfig
from dynemb.storage.device_store import DeviceRowStore


def two_tables(admission_a: Admission | None = None) -> list[TableConfig]:
    # One group: equal dim and options; only the admission setting differs.
    return [
        TableConfig(name="a", feature_names=["fa"], embedding_dim=4, capacity=64, admission=admission_a, score_strategy="step"),
        TableConfig(name="b", feature_names=["fb"], embedding_dim=4, capacity=64, score_strategy="step"),
    ]


def feats(a: list[int], b: list[int]) -> dict:
    return {
        "fa": (torch.tensor(a, dtype=torch.int64), torch.ones(len(a), dtype=torch.int64)),
        "fb": (torch.tensor(b, dtype=torch.int64), torch.ones(len(b), dtype=torch.int64)),
    }


def test_admission_of_one_table_leaves_the_others_of_its_group_alone():
    ebc = dynemb.DynamicEmbeddingBagCollection(two_tables(Admission(threshold=3)), dynemb.optim.SGD(lr=0.1))
    assert len(ebc.engines) == 1
    for seen in (1, 2, 3):
        ebc(feats([7], [2])).concat.sum().backward()
        assert bool(ebc.find("b", torch.tensor([2]))[1]), "a table without admission inserts at once"
        assert bool(ebc.find("a", torch.tensor([7]))[1]) == (seen == 3)
    assert ebc.stats()["a"]["admission_rejections"] == 2 and ebc.stats()["b"]["admission_rejections"] == 0


def test_erase_reports_the_erased_table_only():
    ebc = dynemb.DynamicEmbeddingBagCollection(two_tables(), dynemb.optim.SGD(lr=0.1))
    left = []
    ebc.register_evict_hook(lambda name, keys, rows: left.append((name, keys.tolist(), rows["embeddings"].shape[0])))
    ebc(feats([1], [1])).concat.sum().backward()
    found = ebc.erase("a", torch.tensor([1, 5]))
    assert found.tolist() == [True, False]
    assert left == [("a", [1], 1)]
    assert ebc.last_evicted_keys["a"].tolist() == [1] and ebc.last_evicted_keys["b"].tolist() == []
    assert not bool(ebc.contains("a", torch.tensor([1]))) and bool(ebc.contains("b", torch.tensor([1])))
    assert ebc.stats()["a"]["erased"] == 1 and ebc.stats()["b"]["erased"] == 0


def test_insert_clears_the_admission_count_of_its_keys():
    table = dynemb.DynamicEmbedding(4, 64, optimizer=dynemb.optim.SGD(lr=0.1), admission=Admission(threshold=2), score_strategy="step")
    table(torch.tensor([5]))  # seen once: not admitted
    table.insert(torch.tensor([5]), torch.ones(1, 4))
    table.erase(torch.tensor([5]))
    table(torch.tensor([5]))  # counting starts afresh after the insert: seen once again
    assert not bool(table.contains(torch.tensor([5])))
    assert table.stats()["admission_rejections"] == 2


class CountingStore(DeviceRowStore):
    """The default store that counts its writes (a user's own store, for the test)."""

    writes = 0

    def scatter(self, rows, values):
        type(self).writes += 1
        super().scatter(rows, values)


def test_load_state_dict_keeps_a_tables_own_store():
    def make():
        store = CountingStore(4 + 4, 64, init_rows=64)
        return dynemb.DynamicEmbedding(4, 64, optimizer=dynemb.optim.Adagrad(lr=0.1), store=store, bucket_capacity=8)

    table = make()
    table(torch.arange(10)).sum().backward()
    restored = make()
    store = restored.store
    restored.load_state_dict(table.state_dict())
    assert restored.store is store
    torch.testing.assert_close(restored.find(torch.arange(10))[0], table.find(torch.arange(10))[0], rtol=0, atol=0)
    before = CountingStore.writes
    restored(torch.arange(12)).sum().backward()
    assert CountingStore.writes > before


def test_checkpoint_load_gives_a_table_its_own_store_back(tmp_path):
    def make():
        return dynemb.DynamicEmbedding(4, 64, optimizer=dynemb.optim.Adagrad(lr=0.1), store=CountingStore(4 + 4, 64, init_rows=2), bucket_capacity=8)

    table = make()
    table(torch.arange(20)).sum().backward()
    dynemb.checkpoint.save(table, tmp_path / "ckpt")
    restored = make()
    store = restored.store
    dynemb.checkpoint.load(restored, tmp_path / "ckpt")
    assert restored.store is store
    torch.testing.assert_close(restored.find(torch.arange(20))[0], table.find(torch.arange(20))[0], rtol=0, atol=0)
    for t in (table, restored):
        t(torch.arange(5, 25)).sum().backward()
    torch.testing.assert_close(restored.find(torch.arange(25))[0], table.find(torch.arange(25))[0], rtol=0, atol=0)
