"""torchrec.fx.symbolic_trace of models holding dynemb's EBC / EC, TorchRec's DLRM included: the
traced GraphModule shares the module's tables and gives the same outputs and training;
TorchRec's TrainPipelineSparseDist (which rewrites a DMP model by tracing it) trains a DMP'd
DLRM on dynemb tables as plain DMP steps do; and ``tables=[]`` behaves as TorchRec's modules do.

B samples, D embedding dim.
"""

from __future__ import annotations

import pytest
import torch
import torchrec
from tensordict import TensorDict
from torchrec import EmbeddingBagConfig, EmbeddingConfig, KeyedJaggedTensor
from torchrec.datasets.utils import Batch
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.train_pipeline.runtime_forwards import PipelinedForward
from torchrec.fx import symbolic_trace
from torchrec.inference.modules import quantize_inference_model
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec_testing import ids, kjt

import dynemb
import dynemb.torchrec
from dynemb.torchrec import EmbeddingBagCollection, EmbeddingCollection
from spawning import run_ranks

bce = torch.nn.functional.binary_cross_entropy_with_logits


def bag_tables() -> list[EmbeddingBagConfig]:
    # Shared features (f1 read by t1 and t2) and a shared table (t1 reads f1 and f2), SUM and MEAN.
    return [
        EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=64, feature_names=["f1", "f2"]),
        EmbeddingBagConfig(name="t2", embedding_dim=3, num_embeddings=64, feature_names=["f1"], pooling=torchrec.PoolingType.MEAN),
    ]


def seq_tables() -> list[EmbeddingConfig]:
    return [
        EmbeddingConfig(name="t1", embedding_dim=4, num_embeddings=64, feature_names=["f1", "f2"]),
        EmbeddingConfig(name="t2", embedding_dim=4, num_embeddings=64, feature_names=["f1"]),
    ]


def lookup_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and getattr(n.target, "__name__", "") in ("_pooled_lookup", "_sequence_lookup")]


def assert_same_tables(a: torch.nn.Module, b: torch.nn.Module) -> None:
    """Equal keys, rows and optimizer state in every table (scores are wall-clock timestamps)."""
    sa, sb = a.state_dict(), b.state_dict()
    names = [n for n in sa if n.rsplit(".", 1)[-1] in ("keys", "embeddings", "optimizer_state") and ".groups." not in n]
    assert names and names == [n for n in sb if n in names]
    for name in names:
        torch.testing.assert_close(sa[name], sb[name], rtol=0, atol=0, msg=name)


def test_traced_ebc_is_one_lookup_sharing_the_tables_and_trains_as_the_module():
    vocab = ids(40, seed=0)
    eager = EmbeddingBagCollection(bag_tables(), optimizer=dynemb.optim.SGD(lr=0.3))
    module = EmbeddingBagCollection(bag_tables(), optimizer=dynemb.optim.SGD(lr=0.3))
    gm = symbolic_trace(module)
    # One leaf call per forward, the native collection passed by get_attr: not traced into.
    (node,) = lookup_nodes(gm)
    assert node.args[0].op == "get_attr" and node.args[0].target == "collection"
    assert gm.get_submodule("collection") is module.collection
    for step in range(3):
        features = kjt(["f1", "f2"], batch=6, vocab=vocab, seed=step)
        out, ref = gm(features), eager(features)
        assert isinstance(out, torchrec.KeyedTensor)
        assert out.keys() == ref.keys() == ["f1@t1", "f2", "f1@t2"]
        assert out.length_per_key() == ref.length_per_key()
        torch.testing.assert_close(out.values(), ref.values())
        out.values().square().sum().backward()
        ref.values().square().sum().backward()
    assert_same_tables(gm, eager)
    assert_same_tables(module, eager)


def test_traced_weighted_ebc_matches_the_module():
    tables = [EmbeddingBagConfig(name="t1", embedding_dim=3, num_embeddings=16, feature_names=["f1", "f3"])]
    module = EmbeddingBagCollection(tables, is_weighted=True)
    gm = symbolic_trace(module)
    features = kjt(["f1", "f3"], batch=5, vocab=ids(20, seed=1), seed=2, weighted=True)
    ref = module(features).values()
    torch.testing.assert_close(gm(features).values(), ref)
    # The weights are read, so other weights give other sums.
    other = KeyedJaggedTensor(keys=features.keys(), values=features.values(), lengths=features.lengths(), weights=features.weights() * 2)
    torch.testing.assert_close(gm(other).values(), 2 * ref)


@pytest.mark.parametrize("need_indices", [False, True])
def test_traced_ec_matches_the_module(need_indices):
    vocab = ids(30, seed=3)
    eager = EmbeddingCollection(seq_tables(), optimizer=dynemb.optim.Adagrad(lr=0.1), need_indices=need_indices)
    module = EmbeddingCollection(seq_tables(), optimizer=dynemb.optim.Adagrad(lr=0.1), need_indices=need_indices)
    gm = symbolic_trace(module)
    assert len(lookup_nodes(gm)) == 1
    for step in range(2):
        features = kjt(["f1", "f2"], batch=4, vocab=vocab, seed=10 + step)
        out, ref = gm(features), eager(features)
        assert list(out) == list(ref) == ["f1@t1", "f2", "f1@t2"]
        for name in ref:
            torch.testing.assert_close(out[name].values(), ref[name].values())
            torch.testing.assert_close(out[name].lengths(), ref[name].lengths(), rtol=0, atol=0)
            if need_indices:
                torch.testing.assert_close(out[name].weights(), ref[name].weights(), rtol=0, atol=0)
            else:
                assert out[name].weights_or_none() is None
        sum(jt.values().sum() for jt in out.values()).backward()
        sum(jt.values().sum() for jt in ref.values()).backward()
    assert_same_tables(module, eager)


def test_traced_modules_take_a_tensordict_as_torchrec_modules_do():
    values = {"f1": torch.tensor([5, -1, 2**62]), "f2": torch.tensor([1, 0])}
    lengths = {"f1": torch.tensor([2, 1]), "f2": torch.tensor([1, 1])}
    td = TensorDict(source={f: torch.nested.nested_tensor_from_jagged(values=values[f], lengths=lengths[f]) for f in values})
    features = KeyedJaggedTensor.from_lengths_sync(keys=["f1", "f2"], values=torch.cat(list(values.values())), lengths=torch.cat(list(lengths.values())))
    ebc = EmbeddingBagCollection(bag_tables())
    torch.testing.assert_close(symbolic_trace(ebc)(td).values(), ebc(features).values())
    ec = EmbeddingCollection(seq_tables())
    out, ref = symbolic_trace(ec)(td), ec(features)
    for name in ref:
        torch.testing.assert_close(out[name].values(), ref[name].values())


def test_traced_module_keeps_the_checks():
    gm = symbolic_trace(EmbeddingBagCollection(bag_tables()))
    vbe = KeyedJaggedTensor(
        keys=["f1", "f2"],
        values=torch.tensor([1, 2, 3]),
        lengths=torch.tensor([1, 1, 1]),
        stride_per_key_per_rank=torch.tensor([[2], [1]]),
    )
    with pytest.raises(ValueError, match="variable-batch"):
        gm(vbe)
    typo = KeyedJaggedTensor.from_lengths_sync(keys=["f1", "f2", "f9"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 1, 1]))
    with pytest.raises(ValueError, match=r"unknown feature\(s\) \['f9'\]"):
        gm(typo)


def dlrm(ebc) -> DLRM:
    return DLRM(embedding_bag_collection=ebc, dense_in_features=4, dense_arch_layer_sizes=[8, 4], over_arch_layer_sizes=[8, 1])


def test_traced_dlrm_on_dynemb_tables_trains_as_the_model():
    features = ["user", "item"]
    tables = [EmbeddingBagConfig(name=f"t_{f}", embedding_dim=4, num_embeddings=64, feature_names=[f]) for f in features]
    torch.manual_seed(0)
    model = dlrm(EmbeddingBagCollection(tables, optimizer=dynemb.optim.SGD(lr=0.2)))
    torch.manual_seed(0)
    eager = dlrm(EmbeddingBagCollection(tables, optimizer=dynemb.optim.SGD(lr=0.2)))
    gm = symbolic_trace(model)
    (node,) = lookup_nodes(gm)
    assert node.args[0].target == "sparse_arch.embedding_bag_collection.collection"
    assert gm.get_submodule(node.args[0].target) is model.sparse_arch.embedding_bag_collection.collection
    opt_gm = torch.optim.SGD(gm.parameters(), lr=0.1)
    opt_eager = torch.optim.SGD(eager.parameters(), lr=0.1)
    vocab = ids(50, seed=4)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        dense, labels = torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g).float()
        sparse = kjt(features, batch=8, vocab=vocab, seed=100 + step)
        logits, ref = gm(dense, sparse), eager(dense, sparse)
        torch.testing.assert_close(logits, ref)
        for opt, out in ((opt_gm, logits), (opt_eager, ref)):
            opt.zero_grad()
            bce(out.squeeze(-1), labels).backward()
            opt.step()
    assert_same_tables(model, eager)


def test_inference_quantization_leaves_dynemb_tables_alone():
    """TorchRec's quantize_inference_model swaps modules by exact type: a dynemb EBC stays as it
    is (its dense placeholders are not tables to quantize) and the model's outputs are kept."""
    features = ["user", "item"]
    tables = [EmbeddingBagConfig(name=f"t_{f}", embedding_dim=4, num_embeddings=64, feature_names=[f]) for f in features]
    model = dlrm(EmbeddingBagCollection(tables))
    dense, sparse = torch.randn(6, 4, generator=torch.Generator().manual_seed(0)), kjt(features, batch=6, vocab=ids(20, seed=5), seed=6)
    ref = model(dense, sparse).detach()
    model.eval()
    quantized = quantize_inference_model(model)
    assert isinstance(quantized.sparse_arch.embedding_bag_collection, EmbeddingBagCollection)
    torch.testing.assert_close(quantized(dense, sparse), ref)


def _export(collection, table: str) -> dict[str, torch.Tensor]:
    chunks = list(collection.export(table))
    return {name: torch.cat([c[name] for c in chunks]) for name in ("keys", "embeddings", "optimizer_state")}


def _pipeline_worker(rank: int, world: int) -> None:
    features = ["user", "item"]

    def model() -> DistributedModelParallel:
        tables = [EmbeddingBagConfig(name=f"t_{f}", embedding_dim=4, num_embeddings=256, feature_names=[f]) for f in features]
        torch.manual_seed(0)
        train = DLRMTrain(dlrm(EmbeddingBagCollection(tables, optimizer=dynemb.optim.Adagrad(lr=0.1))))
        return DistributedModelParallel(train, device=torch.device("cpu"), plan=dynemb.torchrec.plan(train, world), sharders=dynemb.torchrec.sharders())

    piped, eager = model(), model()
    opt_piped, opt_eager = (torch.optim.SGD(m.parameters(), lr=0.05) for m in (piped, eager))
    batches = []
    for step in range(4):
        g = torch.Generator().manual_seed(10 * rank + step)
        sparse = kjt(features, batch=8, vocab=ids(40, seed=step), seed=10 * rank + step)
        batches.append(Batch(dense_features=torch.randn(8, 4, generator=g), sparse_features=sparse, labels=torch.randint(0, 2, (8,), generator=g).float()))
    pipeline = TrainPipelineSparseDist(piped, opt_piped, torch.device("cpu"))
    batch_iter = iter(batches)
    for step, batch in enumerate(batches):
        loss, _, _ = pipeline.progress(batch_iter)
        opt_eager.zero_grad()
        loss_eager, _ = eager(batch)
        loss_eager.backward()
        opt_eager.step()
        torch.testing.assert_close(loss, loss_eager.detach(), msg=lambda m, step=step: f"rank {rank} step {step}: {m}")
    with pytest.raises(StopIteration):
        pipeline.progress(batch_iter)
    # The pipeline traced the model and rewrote dynemb's sharded EBC (its input dist runs a batch ahead).
    sharded = piped.module.model.sparse_arch.embedding_bag_collection
    assert type(sharded).__name__ == "ShardedDynamicEmbeddingBagCollection"
    assert isinstance(sharded.forward, PipelinedForward)
    for t in ("t_user", "t_item"):
        ours, ref = (_export(m.module.model.sparse_arch.embedding_bag_collection.local_collection(t), t) for m in (piped, eager))
        assert ours["keys"].numel() > 0
        torch.testing.assert_close(ours["keys"], ref["keys"], rtol=0, atol=0)
        torch.testing.assert_close(ours["embeddings"], ref["embeddings"])
        torch.testing.assert_close(ours["optimizer_state"], ref["optimizer_state"])


def test_train_pipeline_sparse_dist_trains_dmp_dlrm_on_dynemb_tables():
    run_ranks(_pipeline_worker, 2)


# tables=[]: TorchRec 1.8 builds both; its EBC fails in forward (torch.cat of nothing), its EC
# returns {}; device() is the device argument, else CPU (a meta context included).
@pytest.mark.parametrize("kind", ["ebc", "ec"])
def test_no_tables_builds_as_torchrec(kind):
    ours_cls, stock_cls = (EmbeddingBagCollection, torchrec.EmbeddingBagCollection) if kind == "ebc" else (EmbeddingCollection, torchrec.EmbeddingCollection)
    ours, stock = ours_cls(tables=[]), stock_cls(tables=[])
    assert ours.device == stock.device == torch.device("cpu")
    assert ours_cls(tables=[], device="cpu").device == torch.device("cpu")
    with torch.device("meta"):
        assert ours_cls(tables=[]).device == stock_cls(tables=[]).device == torch.device("cpu")
    assert list(ours.state_dict()) == list(stock.state_dict()) == []
    assert list(ours.parameters()) == []
    assert ours.stats() == {}
    assert ours.to("cpu").device == torch.device("cpu")
    configs = ours.embedding_bag_configs() if kind == "ebc" else ours.embedding_configs()
    assert configs == []
    assert type(dynemb.torchrec.convert(stock)) is ours_cls


def test_no_tables_forward_as_torchrec():
    empty = KeyedJaggedTensor.from_lengths_sync(keys=[], values=torch.tensor([], dtype=torch.int64), lengths=torch.tensor([], dtype=torch.int64))
    for module in (EmbeddingBagCollection(tables=[]), torchrec.EmbeddingBagCollection(tables=[])):
        with pytest.raises(ValueError):
            module(empty)
        with pytest.raises(ValueError):
            symbolic_trace(module)(empty)
    ec = EmbeddingCollection(tables=[])
    assert ec(empty) == torchrec.EmbeddingCollection(tables=[])(empty) == {}
    assert symbolic_trace(ec)(empty) == {}
    # A feature an empty collection cannot read is an unknown feature, as for any dynemb module.
    with pytest.raises(ValueError, match="unknown feature"):
        ec(KeyedJaggedTensor.from_lengths_sync(keys=["f1"], values=torch.tensor([5]), lengths=torch.tensor([1])))


def test_meta_inputs_give_torchrec_shapes_without_touching_the_tables():
    features = KeyedJaggedTensor.from_lengths_sync(
        keys=["f1", "f2"], values=torch.arange(7, device="meta"), lengths=torch.tensor([2, 0, 1, 3, 1, 0], device="meta")
    )
    ebc, stock_ebc = EmbeddingBagCollection(bag_tables()), torchrec.EmbeddingBagCollection(bag_tables(), device=torch.device("meta"))
    out, ref = ebc(features), stock_ebc(features)
    assert out.values().is_meta and out.values().shape == ref.values().shape == (3, 11)
    assert out.keys() == ref.keys() and out.length_per_key() == ref.length_per_key()
    ec, stock_ec = (
        EmbeddingCollection(seq_tables(), need_indices=True),
        torchrec.EmbeddingCollection(seq_tables(), device=torch.device("meta"), need_indices=True),
    )
    out, ref = ec(features), stock_ec(features)
    assert list(out) == list(ref)
    for name in ref:
        assert out[name].values().is_meta and out[name].values().shape == ref[name].values().shape
        assert out[name].lengths().shape == ref[name].lengths().shape and out[name].weights().shape == ref[name].weights().shape
    assert all(s["size"] == 0 for s in ebc.stats().values()) and all(s["size"] == 0 for s in ec.stats().values())
