"""dynemb.torchrec.convert(): TorchRec collections inside a model become dynemb ones, in place."""

from __future__ import annotations

import pytest
import torch
import torchrec
from torchrec import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_configs import PoolingType
from torchrec_testing import SPECIAL, ids, kjt

import dynemb
import dynemb.torchrec

POOLED = ["user", "item"]
SEQUENCE = ["clicks"]


class Model(torch.nn.Module):
    """An EBC and an EC, each fed its own KJT, and a dense head."""

    def __init__(self, weighted: bool = False):
        super().__init__()
        self.ebc = torchrec.EmbeddingBagCollection(
            [
                EmbeddingBagConfig(name="t_user", embedding_dim=8, num_embeddings=100, feature_names=["user"]),
                EmbeddingBagConfig(name="t_item", embedding_dim=4, num_embeddings=100, feature_names=["item"], pooling=PoolingType.SUM),
            ],
            is_weighted=weighted,
        )
        self.ec = torchrec.EmbeddingCollection(
            [EmbeddingConfig(name="t_clicks", embedding_dim=4, num_embeddings=100, feature_names=["clicks"])], need_indices=True
        )
        self.head = torch.nn.Linear(16, 1)

    def forward(self, pooled, sequence):
        kt = self.ebc(pooled)
        jt = self.ec(sequence)["clicks"]
        return self.head(torch.cat([kt.values(), _segment_sum(jt)], dim=1))


def _segment_sum(jt) -> torch.Tensor:
    """[n, D] values summed per sample -> [B, D]."""
    sample = torch.repeat_interleave(torch.arange(jt.lengths().numel()), jt.lengths())
    return torch.zeros(jt.lengths().numel(), jt.values().shape[1]).index_add_(0, sample, jt.values())


def inputs(vocab: torch.Tensor, seed: int, weighted: bool = False):
    return kjt(POOLED, batch=6, vocab=vocab, seed=seed, weighted=weighted), kjt(SEQUENCE, batch=6, vocab=vocab, seed=seed + 100)


def test_convert_swaps_ebc_and_ec_keeping_names_and_order():
    model = Model()
    configs_ebc, configs_ec = model.ebc.embedding_bag_configs(), model.ec.embedding_configs()
    names = list(model.ebc._embedding_names)
    in_range = inputs(torch.arange(100), seed=0)
    before_kt, before_jt = model.ebc(in_range[0]), model.ec(in_range[1])

    assert dynemb.torchrec.convert(model, options={"t_item": {"capacity": 1 << 10}}, optimizer=dynemb.optim.SGD(lr=0.5)) is model
    assert type(model.ebc) is dynemb.torchrec.EmbeddingBagCollection and type(model.ec) is dynemb.torchrec.EmbeddingCollection
    assert isinstance(model.ebc, torchrec.EmbeddingBagCollection) and isinstance(model.ec, torchrec.EmbeddingCollection)
    assert model.ebc.embedding_bag_configs() is configs_ebc and model.ec.embedding_configs() is configs_ec
    assert model.ebc._embedding_names == names and model.ec.need_indices()
    # t_user took its 100 stock rows: num_embeddings plus 1/64 (docs/design/0028-torchrec-stock-rows.md).
    assert model.ebc.stats()["t_item"]["requested_capacity"] == 1 << 10 and model.ebc.stats()["t_user"]["requested_capacity"] == 102
    handles = list(model.ebc.optimizer_handles.parameters()) + list(model.ec.optimizer_handles.parameters())
    assert sorted(map(id, model.parameters())) == sorted(map(id, list(model.head.parameters()) + handles))

    # Same structure as TorchRec's output.
    kt, jts = model.ebc(in_range[0]), model.ec(in_range[1])
    assert kt.keys() == before_kt.keys() and kt.length_per_key() == before_kt.length_per_key()
    assert kt.values().shape == before_kt.values().shape
    assert list(jts) == list(before_jt) and jts["clicks"].values().shape == before_jt["clicks"].values().shape

    # Raw int64 ids, and the optimizer trains the converted tables.
    vocab = ids(30, seed=1)
    batch = inputs(vocab, seed=2)
    first = model(*batch)
    first.sum().backward()
    assert not torch.equal(model(*batch), first)
    for table, feature in (("t_user", batch[0]["user"]), ("t_clicks", batch[1]["clicks"])):
        collection = model.ec.collection if table == "t_clicks" else model.ebc.collection
        assert bool(collection.find(table, feature.values())[1].all())


def test_convert_keeps_is_weighted_and_leaves_converted_modules_alone():
    model = Model(weighted=True)
    dynemb.torchrec.convert(model)
    assert model.ebc.is_weighted()
    ebc, ec = model.ebc, model.ec
    dynemb.torchrec.convert(model)
    assert model.ebc is ebc and model.ec is ec
    model(*inputs(ids(20, seed=3), seed=4, weighted=True))


def test_convert_root_and_shared_modules():
    ebc = torchrec.EmbeddingBagCollection([EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"])])
    new = dynemb.torchrec.convert(ebc)
    assert type(new) is dynemb.torchrec.EmbeddingBagCollection and new.embedding_bag_configs() is ebc.embedding_bag_configs()

    holder = torch.nn.Module()
    holder.a = holder.b = torchrec.EmbeddingBagCollection([EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"])])
    dynemb.torchrec.convert(holder)
    assert type(holder.a) is dynemb.torchrec.EmbeddingBagCollection and holder.a is holder.b


def test_convert_checks_options_before_changing_anything():
    model = Model()
    with pytest.raises(ValueError, match="t_nope"):
        dynemb.torchrec.convert(model, options={"t_nope": {"capacity": 10}})
    assert type(model.ebc) is torchrec.EmbeddingBagCollection and type(model.ec) is torchrec.EmbeddingCollection


def test_convert_dlrm_then_train_on_any_int64():
    from torchrec.models.dlrm import DLRM

    tables = [EmbeddingBagConfig(name=f"t_{f}", embedding_dim=8, num_embeddings=100, feature_names=[f]) for f in POOLED]
    model = DLRM(
        embedding_bag_collection=torchrec.EmbeddingBagCollection(tables), dense_in_features=3, dense_arch_layer_sizes=[8], over_arch_layer_sizes=[4, 1]
    )
    dynemb.torchrec.convert(model, optimizer=dynemb.optim.Adagrad(lr=0.1))
    ebc = model.sparse_arch.embedding_bag_collection
    assert type(ebc) is dynemb.torchrec.EmbeddingBagCollection
    special = torch.tensor(SPECIAL)
    features = kjt(POOLED, batch=8, vocab=special, seed=5, max_len=2)
    model(torch.randn(8, 3), features).sum().backward()
    assert bool(ebc.collection.find("t_user", features["user"].values())[1].all())
