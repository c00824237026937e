"""dynemb.torchrec.EmbeddingBagCollection / EmbeddingCollection against TorchRec's own modules
(same rows on remapped ids) and against the native dynemb collections.

B samples, N ids, D embedding dim.
"""

from __future__ import annotations

import dataclasses
import io
import warnings

import pytest
import torch
import torchrec
from torchrec import EmbeddingBagConfig, EmbeddingConfig, JaggedTensor, KeyedJaggedTensor, KeyedTensor
from torchrec.modules.embedding_configs import DataType, PoolingType
from torchrec.modules.embedding_modules import get_embedding_names_by_table
from torchrec_testing import SPECIAL, ids, kjt, remap, single_ids

import dynemb
import dynemb.torchrec

FEATURES = ["a", "b", "c"]


def bag_tables() -> list[EmbeddingBagConfig]:
    # Different dims, both poolings, and feature "a" shared by two tables ("a@t1", "a@t3").
    return [
        EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=64, feature_names=["a", "b"]),
        EmbeddingBagConfig(name="t2", embedding_dim=3, num_embeddings=64, feature_names=["c"], pooling=PoolingType.MEAN),
        EmbeddingBagConfig(name="t3", embedding_dim=2, num_embeddings=64, feature_names=["a"]),
    ]


def seq_tables() -> list[EmbeddingConfig]:
    return [
        EmbeddingConfig(name="e1", embedding_dim=4, num_embeddings=64, feature_names=["a", "b"]),
        EmbeddingConfig(name="e2", embedding_dim=4, num_embeddings=64, feature_names=["c"]),
    ]


def torchrec_twin_ebc(ebc: dynemb.torchrec.EmbeddingBagCollection, keys: torch.Tensor) -> torchrec.EmbeddingBagCollection:
    """TorchRec's EBC holding, at row i, the dynemb row of keys[i] (read through one-id bags)."""
    rows = ebc(single_ids(FEATURES, keys))
    tables = [dataclasses.replace(t, num_embeddings=keys.numel()) for t in ebc.embedding_bag_configs()]
    twin = torchrec.EmbeddingBagCollection(tables, is_weighted=ebc.is_weighted())
    for t, names in zip(tables, get_embedding_names_by_table(tables)):
        with torch.no_grad():
            twin.embedding_bags[t.name].weight.copy_(rows[names[0]])
    return twin


def torchrec_twin_ec(ec: dynemb.torchrec.EmbeddingCollection, keys: torch.Tensor) -> torchrec.EmbeddingCollection:
    rows = ec(single_ids(FEATURES, keys))
    tables = [dataclasses.replace(t, num_embeddings=keys.numel()) for t in ec.embedding_configs()]
    twin = torchrec.EmbeddingCollection(tables, need_indices=ec.need_indices())
    for t, names in zip(tables, ec.embedding_names_by_table()):
        with torch.no_grad():
            twin.embeddings[t.name].weight.copy_(rows[names[0]].values())
    return twin


def assert_same_keyed_tensor(ours: KeyedTensor, ref: KeyedTensor) -> None:
    assert isinstance(ours, KeyedTensor)
    assert ours.keys() == ref.keys()
    assert ours.length_per_key() == ref.length_per_key()
    assert ours.offset_per_key() == ref.offset_per_key()
    assert ours.key_dim() == ref.key_dim()
    assert ours.values().shape == ref.values().shape and ours.values().dtype == ref.values().dtype
    torch.testing.assert_close(ours.values(), ref.values())


def test_keyed_tensor_structure_is_torchrecs():
    features = kjt(FEATURES, batch=5, vocab=torch.arange(64), seed=0)
    ours = dynemb.torchrec.EmbeddingBagCollection(bag_tables())(features)
    ref = torchrec.EmbeddingBagCollection(bag_tables())(features)
    assert ours.keys() == ref.keys() == ["a@t1", "b", "c", "a@t3"]
    assert ours.length_per_key() == ref.length_per_key() == [4, 4, 3, 2]
    assert ours.values().shape == ref.values().shape == (5, 13)
    assert list(ours.to_dict()) == list(ref.to_dict())


def test_ebc_equals_torchrec_ebc_holding_the_same_rows():
    keys = ids(40, seed=1)
    ebc = dynemb.torchrec.EmbeddingBagCollection(bag_tables())
    twin = torchrec_twin_ebc(ebc, keys)
    for seed in range(3):
        features = kjt(FEATURES, batch=7, vocab=keys, seed=seed)
        assert_same_keyed_tensor(ebc(features), twin(remap(features, keys)))


def test_weighted_ebc_equals_torchrec():
    keys = ids(30, seed=2)
    tables = [
        EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=64, feature_names=["a", "b"]),
        EmbeddingBagConfig(name="t2", embedding_dim=3, num_embeddings=64, feature_names=["c"]),
    ]
    ebc = dynemb.torchrec.EmbeddingBagCollection(tables, is_weighted=True)
    assert ebc.is_weighted()
    twin = torchrec_twin_ebc(dynemb.torchrec.EmbeddingBagCollection(tables), keys)
    twin._is_weighted = True
    features = kjt(FEATURES, batch=6, vocab=keys, seed=3, weighted=True)
    assert_same_keyed_tensor(ebc(features), twin(remap(features, keys)))


def test_unweighted_ebc_ignores_kjt_weights_as_torchrec_does():
    keys = ids(30, seed=4)
    ebc = dynemb.torchrec.EmbeddingBagCollection(bag_tables())
    twin = torchrec_twin_ebc(ebc, keys)
    features = kjt(FEATURES, batch=6, vocab=keys, seed=5, weighted=True)
    assert_same_keyed_tensor(ebc(features), twin(remap(features, keys)))


def test_weighted_ebc_needs_weights_and_sum_pooling():
    tables = [EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=8, feature_names=FEATURES)]
    ebc = dynemb.torchrec.EmbeddingBagCollection(tables, is_weighted=True)
    with pytest.raises(ValueError, match="no weights"):
        ebc(kjt(FEATURES, batch=2, vocab=torch.arange(5), seed=0))
    # TorchRec's would fail in forward (nn.EmbeddingBag rejects weights with mode='mean').
    with pytest.raises(ValueError, match="t2.*mean"):
        dynemb.torchrec.EmbeddingBagCollection(bag_tables(), is_weighted=True)


@pytest.mark.parametrize("need_indices", [False, True])
def test_ec_equals_torchrec_ec_holding_the_same_rows(need_indices):
    keys = ids(40, seed=6)
    ec = dynemb.torchrec.EmbeddingCollection(seq_tables(), need_indices=need_indices)
    twin = torchrec_twin_ec(ec, keys)
    features = kjt(FEATURES, batch=7, vocab=keys, seed=7)
    ours, ref = ec(features), twin(remap(features, keys))
    assert list(ours) == list(ref) == FEATURES
    for name in FEATURES:
        assert isinstance(ours[name], JaggedTensor)
        torch.testing.assert_close(ours[name].values(), ref[name].values())
        assert torch.equal(ours[name].lengths(), ref[name].lengths())
        if need_indices:
            # The raw ids, where TorchRec's twin gives its remapped ones.
            assert torch.equal(ours[name].weights(), features[name].values())
        else:
            assert ours[name].weights_or_none() is None and ref[name].weights_or_none() is None


def test_ec_shared_feature_names_are_torchrecs():
    tables = [
        EmbeddingConfig(name="e1", embedding_dim=4, num_embeddings=8, feature_names=["a", "b"]),
        EmbeddingConfig(name="e2", embedding_dim=4, num_embeddings=8, feature_names=["a", "c"]),
    ]
    features = kjt(FEATURES, batch=3, vocab=torch.arange(8), seed=8)
    ours = dynemb.torchrec.EmbeddingCollection(tables)(features)
    ref = torchrec.EmbeddingCollection(tables)(features)
    assert list(ours) == list(ref) == ["a@e1", "b", "a@e2", "c"]
    for name in ref:
        assert ours[name].values().shape == ref[name].values().shape
        assert torch.equal(ours[name].lengths(), ref[name].lengths())


def _native_configs(tables, pooled: bool) -> list[dynemb.TableConfig]:
    return [
        dynemb.TableConfig(
            name=t.name,
            feature_names=list(t.feature_names),
            embedding_dim=t.embedding_dim,
            capacity=t.num_embeddings,
            **({"pooling": "mean" if t.pooling == PoolingType.MEAN else "sum"} if pooled else {}),
        )
        for t in tables
    ]


def test_ebc_trains_as_the_native_collection():
    keys = ids(50, seed=9)
    tables = [
        EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=64, feature_names=["a", "b"]),
        EmbeddingBagConfig(name="t2", embedding_dim=3, num_embeddings=64, feature_names=["c"], pooling=PoolingType.MEAN),
    ]
    ebc = dynemb.torchrec.EmbeddingBagCollection(tables, optimizer=dynemb.optim.Adagrad(lr=0.3))
    native = dynemb.nn.DynamicEmbeddingBagCollection(_native_configs(tables, pooled=True), dynemb.optim.Adagrad(lr=0.3))
    target = torch.randn(6, 11, generator=torch.Generator().manual_seed(0))
    for step in range(4):
        features = kjt(FEATURES, batch=6, vocab=keys, seed=10 + step)
        ours, ref = ebc(features).values(), native(features).concat
        torch.testing.assert_close(ours, ref)
        (ours * target).sum().backward()
        (ref * target).sum().backward()
    assert ebc.stats()["t1"]["size"] == native.stats()["t1"]["size"] > 0


def test_ec_trains_as_the_native_collection():
    keys = ids(50, seed=11)
    ec = dynemb.torchrec.EmbeddingCollection(seq_tables(), optimizer=dynemb.optim.SGD(lr=0.5))
    native = dynemb.nn.DynamicEmbeddingCollection(_native_configs(seq_tables(), pooled=False), dynemb.optim.SGD(lr=0.5))
    for step in range(4):
        features = kjt(FEATURES, batch=6, vocab=keys, seed=20 + step)
        ours, ref = ec(features), native(features)
        for name in FEATURES:
            values, lengths = ref[name]
            torch.testing.assert_close(ours[name].values(), values)
            assert torch.equal(ours[name].lengths(), lengths)
        sum((ours[n].values() ** 2).sum() for n in FEATURES).backward()
        sum((ref[n][0] ** 2).sum() for n in FEATURES).backward()


def test_any_int64_id_no_bound_no_remapping():
    ebc = dynemb.torchrec.EmbeddingBagCollection([EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=16, feature_names=["f"])])
    special = torch.tensor(SPECIAL)
    out = ebc(single_ids(["f"], special))["f"]  # [8, 4]
    assert out.shape == (len(SPECIAL), 4) and torch.isfinite(out).all()
    # Distinct ids get distinct rows (no id folding), and a repeated id its same row.
    assert torch.unique(out, dim=0).shape[0] == len(SPECIAL)
    torch.testing.assert_close(ebc(single_ids(["f"], special.flip(0)))["f"], out.flip(0))
    assert ebc.stats()["t"]["size"] == len(SPECIAL)


def test_no_dense_weights_anywhere():
    ebc = dynemb.torchrec.EmbeddingBagCollection(bag_tables(), optimizer=dynemb.optim.SGD(lr=0.1))
    ec = dynemb.torchrec.EmbeddingCollection(seq_tables(), optimizer=dynemb.optim.SGD(lr=0.1))
    for module in (ebc, ec):
        # Only the per-table handles (meta, [0, D]: no memory) that apply_optimizer_in_backward tags.
        assert [p.shape[0] for p in module.parameters()] == [0] * len(module.dynemb_configs)
        assert all(p.is_meta for p in module.parameters())
        assert not any(name.endswith(".weight") for name in module.state_dict())
        module.to("cpu")  # a registered meta dummy would refuse to move
        module.float()
    # TorchRec's bookkeeping stays readable.
    # The placeholder weight takes no memory: one zero, stride 0, on the tables' device.
    weight = ebc.embedding_bags["t1"].weight
    assert weight.shape == (64, 4) and weight.stride() == (0, 0) and weight.device == torch.device("cpu")
    assert ebc.embedding_bag_configs()[0].name == "t1" and ebc.device == torch.device("cpu")
    assert ec.embedding_dim() == 4 and ec.embedding_names_by_table() == [["a", "b"], ["c"]]


@pytest.mark.parametrize("pooled", [True, False])
def test_state_dict_round_trip(pooled, tmp_path):
    keys = ids(60, seed=12)

    def make():
        if pooled:
            return dynemb.torchrec.EmbeddingBagCollection(bag_tables(), optimizer=dynemb.optim.Adagrad(lr=0.2))
        return dynemb.torchrec.EmbeddingCollection(seq_tables(), optimizer=dynemb.optim.Adagrad(lr=0.2))

    def loss(out):
        return (out.values() ** 2).sum() if pooled else sum((jt.values() ** 2).sum() for jt in out.values())

    module = make()
    for step in range(3):
        loss(module(kjt(FEATURES, batch=8, vocab=keys, seed=30 + step))).backward()
    buffer = io.BytesIO()
    torch.save(module.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert state and all(type(v) is torch.Tensor and not v.is_meta for v in state.values())
    assert all(k.startswith("collection.") for k in state)
    restored = make()
    restored.load_state_dict(state)
    features = kjt(FEATURES, batch=8, vocab=keys, seed=40)
    for m in (module, restored):
        m.eval()
    a, b = module(features), restored(features)
    if pooled:
        torch.testing.assert_close(a.values(), b.values())
    else:
        for name in a:
            torch.testing.assert_close(a[name].values(), b[name].values())
    # Optimizer state came along: one more training step stays equal.
    for m in (module, restored):
        m.train()
        loss(m(features)).backward()
        m.eval()
    a, b = module(features), restored(features)
    if pooled:
        torch.testing.assert_close(a.values(), b.values())


def test_unknown_feature_raises_naming_it():
    for module in (dynemb.torchrec.EmbeddingBagCollection(bag_tables()), dynemb.torchrec.EmbeddingCollection(seq_tables())):
        with pytest.raises(ValueError, match="bogus"):
            module(kjt([*FEATURES, "bogus"], batch=2, vocab=torch.arange(5), seed=0))


def test_missing_feature_raises_naming_it():
    for module in (dynemb.torchrec.EmbeddingBagCollection(bag_tables()), dynemb.torchrec.EmbeddingCollection(seq_tables())):
        with pytest.raises(ValueError, match="'c'|\\bc\\b"):
            module(kjt(["a", "b"], batch=2, vocab=torch.arange(5), seed=0))


def test_variable_batch_kjt_raises():
    vbe = KeyedJaggedTensor(
        keys=FEATURES,
        values=torch.arange(6),
        lengths=torch.ones(6, dtype=torch.int64),
        stride_per_key_per_rank=[[1], [2], [3]],
        inverse_indices=(FEATURES, torch.tensor([[0, 0, 0], [0, 1, 1], [0, 1, 2]])),
    )
    for module in (dynemb.torchrec.EmbeddingBagCollection(bag_tables()), dynemb.torchrec.EmbeddingCollection(seq_tables())):
        with pytest.raises(ValueError, match="variable-batch"):
            module(vbe)


def test_options_reach_the_tables():
    ebc = dynemb.torchrec.EmbeddingBagCollection(bag_tables(), options={"t1": {"capacity": 1 << 12, "score_strategy": "lfu"}, "t2": {"seed": 3}})
    stats = ebc.stats()
    assert stats["t1"]["requested_capacity"] == 1 << 12 and stats["t2"]["requested_capacity"] == 64


def test_options_are_checked():
    with pytest.raises(ValueError, match="nope"):
        dynemb.torchrec.EmbeddingBagCollection(bag_tables(), options={"nope": {}})
    with pytest.raises(ValueError, match="embedding_dim"):
        dynemb.torchrec.EmbeddingBagCollection(bag_tables(), options={"t1": {"embedding_dim": 8}})
    with pytest.raises(ValueError, match="colour"):
        dynemb.torchrec.EmbeddingBagCollection(bag_tables(), options={"t1": {"colour": 1}})
    with pytest.raises(ValueError, match="t1.*capacity"):
        dynemb.torchrec.EmbeddingBagCollection(bag_tables(), options={"t1": {"capacity": 0}})
    with pytest.raises(TypeError, match="optimizer="):
        dynemb.torchrec.EmbeddingBagCollection(bag_tables(), optimizer=torch.optim.SGD)


def test_data_type_and_init_bounds():
    quantized = [EmbeddingBagConfig(name="h", embedding_dim=4, num_embeddings=8, feature_names=["f"], data_type=DataType.INT8)]
    with pytest.raises(ValueError, match="'h'.*data_type"):
        dynemb.torchrec.EmbeddingBagCollection(quantized)
    dynemb.torchrec.EmbeddingBagCollection(quantized, options={"h": {"dtype": torch.float32}})
    half = [EmbeddingBagConfig(name="h", embedding_dim=4, num_embeddings=8, feature_names=["f"], data_type=DataType.FP16)]
    assert dynemb.torchrec.EmbeddingBagCollection(half).collection.table_configs[0].dtype == torch.float16

    bounded = [EmbeddingBagConfig(name="u", embedding_dim=8, num_embeddings=64, feature_names=["f"], weight_init_min=0.5, weight_init_max=0.75)]
    rows = dynemb.torchrec.EmbeddingBagCollection(bounded)(single_ids(["f"], ids(20, seed=13)))["f"]
    assert rows.min() >= 0.5 and rows.max() <= 0.75

    custom = [EmbeddingBagConfig(name="c", embedding_dim=4, num_embeddings=8, feature_names=["f"], init_fn=torch.nn.init.zeros_)]
    with pytest.warns(UserWarning, match="init_fn"):
        dynemb.torchrec.EmbeddingBagCollection(custom)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dynemb.torchrec.EmbeddingBagCollection(custom, options={"c": {"initializer": dynemb.Initializer(kind="constant")}})
        dynemb.torchrec.EmbeddingBagCollection(bag_tables())


def test_none_pooling_raises():
    with pytest.raises(ValueError, match="[Pp]ooling"):
        dynemb.torchrec.EmbeddingBagCollection([EmbeddingBagConfig(name="n", embedding_dim=4, num_embeddings=8, feature_names=["f"], pooling=PoolingType.NONE)])


def test_kjt_given_by_offsets():
    keys = ids(20, seed=14)
    ebc = dynemb.torchrec.EmbeddingBagCollection(bag_tables())
    by_lengths = kjt(FEATURES, batch=4, vocab=keys, seed=15)
    by_offsets = KeyedJaggedTensor.from_offsets_sync(keys=FEATURES, values=by_lengths.values(), offsets=by_lengths.offsets())
    torch.testing.assert_close(ebc(by_offsets).values(), ebc(by_lengths).values())
