"""Rows between stock TorchRec and dynemb (docs/design/0028-torchrec-stock-rows.md): convert() of a
trained stock DLRM / EC model gives its outputs on ids < num_embeddings, a stock state_dict
loads into a converted model, and to_stock_weight / to_stock_state_dict go back.

B samples, N rows of a stock table (num_embeddings), D embedding dim.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torchrec
from torchrec import EmbeddingBagConfig, EmbeddingConfig
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_configs import PoolingType
from torchrec_testing import SPECIAL, kjt

import dynemb
import dynemb.torchrec

FEATURES = ["user", "item"]
N = {"user": 40, "item": 24}
bce = torch.nn.functional.binary_cross_entropy_with_logits


def bag_tables(pooling: PoolingType = PoolingType.SUM) -> list[EmbeddingBagConfig]:
    return [EmbeddingBagConfig(name=f"t_{f}", embedding_dim=8, num_embeddings=N[f], feature_names=[f], pooling=pooling) for f in FEATURES]


def stock_dlrm(pooling: PoolingType = PoolingType.SUM, seed: int = 0) -> DLRM:
    torch.manual_seed(seed)
    ebc = torchrec.EmbeddingBagCollection(bag_tables(pooling))
    return DLRM(embedding_bag_collection=ebc, dense_in_features=4, dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[8, 1])


def in_range(seed: int, batch: int = 12) -> tuple:
    """Dense [B, 4], a KJT of ids < num_embeddings of each feature (one vocabulary per feature)
    and labels [B]."""
    g = torch.Generator().manual_seed(seed)
    parts = [kjt([f], batch=batch, vocab=torch.arange(N[f]), seed=seed + i) for i, f in enumerate(FEATURES)]
    features = torchrec.KeyedJaggedTensor.concat(parts)
    return torch.randn(batch, 4, generator=g), features, torch.randint(0, 2, (batch,), generator=g).float()


def train_stock(model: torch.nn.Module, steps: int, lr: float = 0.3, seed: int = 100) -> None:
    """A few plain torch.optim SGD steps over every parameter, the stock tables' weights included."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        dense, features, label = in_range(seed + step)
        opt.zero_grad()
        bce(model(dense, features).squeeze(1), label).backward()
        opt.step()


def ebc_of(model: DLRM):
    return model.sparse_arch.embedding_bag_collection


@pytest.mark.parametrize("pooling", [PoolingType.SUM, PoolingType.MEAN])
def test_convert_of_a_trained_stock_dlrm_gives_its_outputs(pooling):
    model = stock_dlrm(pooling)
    train_stock(model, steps=4)
    stock = copy.deepcopy(model)
    trained = {t: w.detach().clone() for t, w in ((c.name, ebc_of(stock).embedding_bags[c.name].weight) for c in bag_tables())}

    assert dynemb.torchrec.convert(model, optimizer=dynemb.optim.SGD(lr=0.3)) is model
    ebc = ebc_of(model)
    assert type(ebc) is dynemb.torchrec.EmbeddingBagCollection
    for t, weight in trained.items():
        # Row i of the stock weight is key i: copied exactly.
        rows, found = dynemb.torchrec.to_stock_weight(ebc, t, torch.arange(weight.shape[0]))
        assert bool(found.all()) and ebc.stats()[t]["size"] == weight.shape[0]
        assert torch.equal(rows, weight)
    for seed in range(3):
        dense, features, _ = in_range(seed)
        torch.testing.assert_close(model(dense, features), stock(dense, features))

    # Training goes on as the stock model's: dynemb's fused SGD equals torch's SGD on the dense weight.
    dense_opt = torch.optim.SGD(model.parameters(), lr=0.3)
    stock_opt = torch.optim.SGD(stock.parameters(), lr=0.3)
    for step in range(2):
        dense, features, label = in_range(200 + step)
        for m, opt in ((model, dense_opt), (stock, stock_opt)):
            opt.zero_grad()
            bce(m(dense, features).squeeze(1), label).backward()
            opt.step()
    dense, features, _ = in_range(7)
    torch.testing.assert_close(model(dense, features), stock(dense, features))


class SequenceModel(torch.nn.Module):
    """A stock EC, its sequences summed per sample, and a dense head."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.ec = torchrec.EmbeddingCollection([EmbeddingConfig(name=f"t_{f}", embedding_dim=4, num_embeddings=N[f], feature_names=[f]) for f in FEATURES])
        self.head = torch.nn.Linear(8, 1)

    def forward(self, dense, features):
        jts = self.ec(features)
        pooled = []
        for f in FEATURES:
            sample = torch.repeat_interleave(torch.arange(jts[f].lengths().numel()), jts[f].lengths())
            pooled.append(torch.zeros(jts[f].lengths().numel(), 4).index_add_(0, sample, jts[f].values()))
        return self.head(torch.cat(pooled, dim=1))


def test_convert_of_a_trained_stock_ec_model_gives_its_outputs():
    model = SequenceModel()
    train_stock(model, steps=4)
    stock = copy.deepcopy(model)
    dynemb.torchrec.convert(model, optimizer=dynemb.optim.SGD(lr=0.3))
    assert type(model.ec) is dynemb.torchrec.EmbeddingCollection
    for seed in range(3):
        dense, features, _ = in_range(seed)
        ours, ref = model.ec(features), stock.ec(features)
        for f in FEATURES:
            torch.testing.assert_close(ours[f].values(), ref[f].values())
            assert torch.equal(ours[f].lengths(), ref[f].lengths())
        torch.testing.assert_close(model(dense, features), stock(dense, features))


def test_a_stock_state_dict_loads_into_a_converted_model():
    trained = stock_dlrm(seed=1)
    train_stock(trained, steps=3)
    model = dynemb.torchrec.convert(stock_dlrm(seed=2), optimizer=dynemb.optim.Adagrad(lr=0.1))
    ebc = ebc_of(model)
    # Keys beyond the stock ids, trained after the conversion, leave on load: the table becomes the checkpoint's.
    special = torch.tensor(SPECIAL)
    model(torch.randn(4, 4), kjt(FEATURES, batch=4, vocab=special, seed=3)).sum().backward()
    left = []
    ebc.collection.register_evict_hook(lambda table, keys, rows: left.append((table, keys.clone())))

    result = model.load_state_dict(trained.state_dict())
    assert result.missing_keys == [] and result.unexpected_keys == []
    for c in bag_tables():
        assert ebc.stats()[c.name]["size"] == c.num_embeddings
        assert not bool(ebc.collection.contains(c.name, special[special >= c.num_embeddings]).any())
    assert {t for t, _ in left} == {"t_user", "t_item"}
    for seed in range(3):
        dense, features, _ = in_range(seed)
        torch.testing.assert_close(model(dense, features), trained(dense, features))

    # The converted model's own state_dict keeps loading as before.
    again = dynemb.torchrec.convert(stock_dlrm(seed=4), optimizer=dynemb.optim.Adagrad(lr=0.1))
    again.load_state_dict(model.state_dict())
    dense, features, _ = in_range(5)
    torch.testing.assert_close(again(dense, features), model(dense, features))
    # Every counter, the erased keys included; scratch_bytes is the size of a work buffer.
    for t, entry in ebc_of(again).stats().items():
        assert {k: v for k, v in entry.items() if k != "scratch_bytes"} == {k: v for k, v in ebc.stats()[t].items() if k != "scratch_bytes"}


def test_a_stock_ec_state_dict_loads_into_an_empty_converted_ec():
    trained = SequenceModel(seed=1)
    train_stock(trained, steps=3)
    model = dynemb.torchrec.convert(SequenceModel(seed=2), copy_rows=False)
    assert all(s["size"] == 0 for s in model.ec.stats().values())
    model.load_state_dict(trained.state_dict())
    dense, features, _ = in_range(0)
    torch.testing.assert_close(model(dense, features), trained(dense, features))


def converted_ebc(**kwargs):
    torch.manual_seed(0)
    return dynemb.torchrec.convert(torchrec.EmbeddingBagCollection(bag_tables()), **kwargs)


def stock_state(seed: int = 5) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return torchrec.EmbeddingBagCollection(bag_tables()).state_dict()


def rows(ebc, table: str) -> torch.Tensor:
    return dynemb.torchrec.to_stock_weight(ebc, table, torch.arange(N[table[2:]]))[0]


def test_stock_state_dict_errors_and_strict_false():
    ebc = converted_ebc()
    before = {t: rows(ebc, t) for t in ("t_user", "t_item")}
    state = stock_state()

    # Both formats at once: nothing changes.
    with pytest.raises(RuntimeError, match=r"both TorchRec's 'embedding_bags.<table>.weight' entries and dynemb's 'collection.\*'"):
        ebc.load_state_dict({**state, **ebc.state_dict()})
    assert torch.equal(rows(ebc, "t_user"), before["t_user"])

    # A wrong shape names the entry; nothing changes.
    bad = {**state, "embedding_bags.t_item.weight": torch.zeros(N["item"] + 1, 8)}
    with pytest.raises(RuntimeError, match=r"size mismatch for embedding_bags.t_item.weight: got \(25, 8\)"):
        ebc.load_state_dict(bad)
    assert torch.equal(rows(ebc, "t_user"), before["t_user"])

    nan = {**state, "embedding_bags.t_item.weight": torch.full((N["item"], 8), float("nan"))}
    with pytest.raises(RuntimeError, match=r"embedding_bags.t_item.weight must hold finite floats"):
        ebc.load_state_dict(nan)
    assert torch.equal(rows(ebc, "t_user"), before["t_user"])

    # An entry naming no table is unexpected (strict), ignored with strict=False.
    extra = {**state, "embedding_bags.t_nope.weight": torch.zeros(3, 8)}
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "embedding_bags.t_nope.weight"'):
        ebc.load_state_dict(extra)
    result = ebc.load_state_dict(extra, strict=False)
    assert result.unexpected_keys == ["embedding_bags.t_nope.weight"] and result.missing_keys == []
    assert torch.equal(rows(ebc, "t_item"), state["embedding_bags.t_item.weight"])

    # A table left out is missing (strict); with strict=False it keeps its rows, the others load.
    fresh = converted_ebc()
    kept = rows(fresh, "t_item")
    partial = {"embedding_bags.t_user.weight": state["embedding_bags.t_user.weight"]}
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "embedding_bags.t_item.weight"'):
        converted_ebc().load_state_dict(partial)
    result = fresh.load_state_dict(partial, strict=False)
    assert result.missing_keys == ["embedding_bags.t_item.weight"]
    assert torch.equal(rows(fresh, "t_user"), state["embedding_bags.t_user.weight"]) and torch.equal(rows(fresh, "t_item"), kept)

    # A table too small for the stock rows: the error names it and both numbers.
    small = dynemb.torchrec.EmbeddingBagCollection(bag_tables(), options={"t_user": {"capacity": 30}})
    with pytest.raises(RuntimeError, match=r"table 't_user': capacity=30 is smaller than its 40 stock rows"):
        small.load_state_dict(state)
    assert small.stats()["t_user"]["size"] == 0 and small.stats()["t_item"]["size"] == 0


def test_to_stock_weight_and_state_dict_round_trip():
    torch.manual_seed(6)
    stock = torchrec.EmbeddingBagCollection(bag_tables())
    weights = {c.name: stock.embedding_bags[c.name].weight.detach().clone() for c in bag_tables()}
    ebc = dynemb.torchrec.convert(copy.deepcopy(stock), options={"t_item": {"eval_default": 0.5}})
    for t, w in weights.items():
        back, found = dynemb.torchrec.to_stock_weight(ebc, t, torch.arange(w.shape[0]))
        assert torch.equal(back, w) and bool(found.all())
    # Any key -> id map; keys the table does not hold get its eval_default and found=False.
    keys = torch.tensor([5, 2**62, 0, -1])
    back, found = dynemb.torchrec.to_stock_weight(ebc, "t_item", keys)
    assert found.tolist() == [True, False, True, False]
    assert torch.equal(back[[0, 2]], weights["t_item"][[5, 0]]) and bool((back[[1, 3]] == 0.5).all())
    # The same on the native collection and on a DynamicTable.
    assert torch.equal(dynemb.torchrec.to_stock_weight(ebc.collection, "t_item", keys)[0], back)
    table = dynemb.DynamicEmbedding(embedding_dim=8, capacity=64)
    table.insert(torch.arange(3), weights["t_user"][:3])
    assert torch.equal(dynemb.torchrec.to_stock_weight(table, None, torch.arange(3))[0], weights["t_user"][:3])

    # The stock state_dict: loads into a fresh stock EBC (strict) and gives the same outputs.
    torch.manual_seed(7)
    other = torchrec.EmbeddingBagCollection(bag_tables())
    other.load_state_dict(dynemb.torchrec.to_stock_state_dict(ebc))
    features = in_range(0)[1]
    torch.testing.assert_close(other(features).values(), stock(features).values())
    # With a key -> id map per table and a prefix (the module's path in a bigger model).
    perm = torch.randperm(N["user"])
    state = dynemb.torchrec.to_stock_state_dict(ebc, {"t_user": perm}, prefix="sparse_arch.embedding_bag_collection.")
    assert torch.equal(state["sparse_arch.embedding_bag_collection.embedding_bags.t_user.weight"], weights["t_user"][perm])
    assert torch.equal(state["sparse_arch.embedding_bag_collection.embedding_bags.t_item.weight"], weights["t_item"])


def test_to_stock_weight_rejects_bad_arguments():
    ebc = converted_ebc()
    with pytest.raises(ValueError, match="keys: must be a 1-D int64 tensor"):
        dynemb.torchrec.to_stock_weight(ebc, "t_user", torch.arange(3, dtype=torch.int32))
    with pytest.raises(KeyError, match="t_nope"):
        dynemb.torchrec.to_stock_weight(ebc, "t_nope", torch.arange(3))
    with pytest.raises(TypeError, match="holds its weight already"):
        dynemb.torchrec.to_stock_weight(torchrec.EmbeddingBagCollection(bag_tables()), "t_user", torch.arange(3))
    with pytest.raises(ValueError, match=r"table\(s\) \['t_nope'\]"):
        dynemb.torchrec.to_stock_state_dict(ebc, {"t_nope": torch.arange(3)})


def test_copy_rows_false_keeps_empty_tables():
    ebc = converted_ebc(copy_rows=False)
    for c in bag_tables():
        assert ebc.stats()[c.name]["size"] == 0 and ebc.stats()[c.name]["requested_capacity"] == c.num_embeddings
    with pytest.raises(TypeError, match="copy_rows='yes'"):
        converted_ebc(copy_rows="yes")


def test_copied_tables_get_headroom_and_a_small_capacity_raises():
    ebc = converted_ebc()
    assert ebc.stats()["t_user"]["requested_capacity"] == 41 and ebc.stats()["t_item"]["requested_capacity"] == 25
    # A power-of-two table: all 4096 rows find a slot (at a capacity of exactly 4096 some need not).
    big = dynemb.torchrec.convert(torchrec.EmbeddingBagCollection([EmbeddingBagConfig(name="t", embedding_dim=2, num_embeddings=4096, feature_names=["f"])]))
    assert big.stats()["t"]["size"] == 4096 and bool(big.collection.contains("t", torch.arange(4096)).all())

    model = stock_dlrm()
    with pytest.raises(ValueError, match=r"options\['t_user'\]\['capacity'\]=39 is smaller than the table's 40 rows"):
        dynemb.torchrec.convert(model, options={"t_user": {"capacity": 39}})
    assert type(ebc_of(model)) is torchrec.EmbeddingBagCollection
    # A capacity of at least num_embeddings is the user's choice, kept as given.
    dynemb.torchrec.convert(model, options={"t_user": {"capacity": 40}})
    assert ebc_of(model).stats()["t_user"]["requested_capacity"] == 40 and ebc_of(model).stats()["t_user"]["size"] == 40


def test_a_stock_module_on_meta_converts_to_empty_tables():
    # A meta stock module becomes a meta dynemb module: no table until it is materialised.
    ebc = dynemb.torchrec.convert(torchrec.EmbeddingBagCollection(bag_tables(), device=torch.device("meta")), optimizer=None)
    assert not ebc.is_built()
    ebc.to_empty(device="cpu")
    for c in bag_tables():
        assert ebc.stats()[c.name]["size"] == 0 and ebc.stats()[c.name]["requested_capacity"] == c.num_embeddings
