"""TorchRec's DistributedModelParallel shards dynemb's TorchRec modules row-wise
(dynemb.torchrec.plan / sharders): TorchRec's DLRM on the dynemb EBC, a sequence model on the
dynemb EC, and a weighted EBC with a shared feature and deferred updates, on gloo processes
spawned here, train like the unsharded model on the concatenated batches (losses step by step,
then every row and optimizer state gathered by key, each key on rank owner_of(key, W), the
owner function of dynemb's own sharding); the routing itself (sequence ids sent once per
feature); plan() errors.

W ranks, B samples per rank, F features, D embedding dim, N ids.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torchrec
from dmp_models import owned_parts
from torchrec import EmbeddingBagConfig, EmbeddingConfig, KeyedJaggedTensor, PoolingType
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.types import ShardingType
from torchrec.models.dlrm import DLRM
from torchrec_testing import INT64_MAX, INT64_MIN, ids

import dynemb
import dynemb.torchrec
from dynemb.distributed import owner_of
from spawning import run_ranks

B, D = 8, 8
STEPS = 4
SPECIAL = [0, -1, INT64_MIN, INT64_MAX]
BAG_FEATURES = ["user", "item", "history"]
SEQ_FEATURES = ["a", "b", "c"]
SHARED_FEATURES = ["f0", "f1"]
TIMEOUT_S = 150.0
bce = torch.nn.functional.binary_cross_entropy_with_logits


def _dlrm() -> DLRM:
    tables = [
        EmbeddingBagConfig(name="t_user", embedding_dim=D, num_embeddings=1024, feature_names=["user"]),
        EmbeddingBagConfig(name="t_item", embedding_dim=D, num_embeddings=1024, feature_names=["item"]),
        # MEAN: the kernel returns sums, TorchRec divides after the reduce-scatter.
        EmbeddingBagConfig(name="t_history", embedding_dim=D, num_embeddings=1024, feature_names=["history"], pooling=PoolingType.MEAN),
    ]
    ebc = dynemb.torchrec.EmbeddingBagCollection(tables, optimizer=dynemb.optim.Adagrad(lr=0.1))
    return DLRM(embedding_bag_collection=ebc, dense_in_features=4, dense_arch_layer_sizes=[16, D], over_arch_layer_sizes=[16, 1])


class _SequenceModel(torch.nn.Module):
    """EC -> one score per id; tables t_ab (features a, b) and t_c."""

    def __init__(self):
        super().__init__()
        tables = [
            EmbeddingConfig(name="t_ab", embedding_dim=D, num_embeddings=1024, feature_names=["a", "b"]),
            EmbeddingConfig(name="t_c", embedding_dim=D, num_embeddings=1024, feature_names=["c"]),
        ]
        self.ec = dynemb.torchrec.EmbeddingCollection(tables, optimizer=dynemb.optim.Adagrad(lr=0.1))
        self.proj = torch.nn.Linear(D, 1)

    def forward(self, features: KeyedJaggedTensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> the ids' embeddings [N, D] (features in SEQ_FEATURES order) and scores [N, 1]."""
        out = self.ec(features)
        embeddings = torch.cat([out[f].values() for f in SEQ_FEATURES])
        return embeddings, self.proj(embeddings)


class _SharedFeatureModel(torch.nn.Module):
    """Weighted EBC, f1 read by t0 and t1 (embedding names f1@t0, f1@t1), deferred updates."""

    def __init__(self):
        super().__init__()
        tables = [
            EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=1024, feature_names=["f0", "f1"]),
            EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=1024, feature_names=["f1"]),
        ]
        self.sparse_optimizer = dynemb.optim.Adagrad(lr=0.1)
        self.ebc = dynemb.torchrec.EmbeddingBagCollection(tables, optimizer=self.sparse_optimizer, update="deferred", is_weighted=True)
        self.head = torch.nn.Linear(12, 1)

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        return self.head(self.ebc(features).values())  # [B, 1]


def _global_batch(features: list[str], step: int, world: int, weighted: bool = False) -> KeyedJaggedTensor:
    """world * B samples of every feature (0..3 ids a bag); 0, -1, int64 min and max open rank
    0's first feature and close the last rank's last feature."""
    g = torch.Generator().manual_seed(100 + step)
    vocab = ids(64, seed=step)
    lengths = torch.randint(0, 4, (len(features) * world * B,), generator=g)
    lengths[:2] = 2
    lengths[-2:] = 2
    values = vocab[torch.randint(len(vocab), (int(lengths.sum()),), generator=g)]
    values[:4] = torch.tensor(SPECIAL)
    values[-4:] = torch.tensor(SPECIAL)
    weights = torch.rand(values.shape, generator=g) if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(keys=features, values=values, lengths=lengths, weights=weights)


def _local(features: KeyedJaggedTensor, rank: int) -> KeyedJaggedTensor:
    """Samples rank * B .. (rank + 1) * B of every feature."""
    values, lengths, weights = [], [], []
    for f in features.keys():
        jt = features[f]
        lo, hi = (int(o) for o in jt.offsets()[[rank * B, (rank + 1) * B]])
        values.append(jt.values()[lo:hi])
        lengths.append(jt.lengths()[rank * B : (rank + 1) * B])
        if jt.weights_or_none() is not None:
            weights.append(jt.weights()[lo:hi])
    return KeyedJaggedTensor.from_lengths_sync(
        keys=features.keys(), values=torch.cat(values), lengths=torch.cat(lengths), weights=torch.cat(weights) if weights else None
    )


def _positions(features: KeyedJaggedTensor, rank: int) -> torch.Tensor:
    """[N_rank] positions of the rank's ids among the global batch's ids (features in order)."""
    out, start = [], 0
    for f in features.keys():
        offsets = features[f].offsets()
        out.append(torch.arange(int(offsets[rank * B]), int(offsets[(rank + 1) * B])) + start)
        start += int(offsets[-1])
    return torch.cat(out)


def _rows(collection, tables: list[str]) -> dict[tuple[str, int], torch.Tensor]:
    """(table, key) -> embedding and optimizer state."""
    out = {}
    for t in tables:
        for chunk in collection.export(t):
            for k, e, s in zip(chunk["keys"].tolist(), chunk["embeddings"], chunk["optimizer_state"]):
                out[(t, k)] = torch.cat([e, s])
    return out


def _check_rows(sharded, reference, tables: list[str]) -> None:
    """Every rank's local rows, gathered: each key on rank owner_of(key, W) only (the owner of
    dynemb's own sharding), and equal by key to the unsharded model's rows."""
    mine = {}
    for t in tables:
        mine.update(_rows(sharded.local_collection(t), [t]))
    everyone = owned_parts(mine)
    gathered = {k: v for part in everyone for k, v in part.items()}
    assert all(everyone), "a rank holds no key"
    expected = _rows(reference, tables)
    assert gathered.keys() == expected.keys(), sorted(gathered.keys() ^ expected.keys())[:5]
    assert {k for (_, k) in gathered} >= set(SPECIAL)
    for key, row in expected.items():
        torch.testing.assert_close(gathered[key], row, msg=lambda m, key=key: f"{key}: {m}")


def _mean_over_ranks(loss: torch.Tensor) -> torch.Tensor:
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total / dist.get_world_size()


def _dmp(model: torch.nn.Module) -> DistributedModelParallel:
    plan = dynemb.torchrec.plan(model, dist.get_world_size())
    return DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=dynemb.torchrec.sharders())


def _twins(make) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(unsharded reference, DMP model), the same dense weights."""
    torch.manual_seed(0)
    reference = make()
    torch.manual_seed(0)
    return reference, _dmp(make())


def _step(losses_and_optimizers) -> None:
    for loss, opt in losses_and_optimizers:
        opt.zero_grad()
        loss.backward()
        opt.step()


def _dlrm_worker(rank: int, world: int) -> None:
    reference, model = _twins(_dlrm)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, reference)]
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        dense, label = torch.randn(world * B, 4, generator=g), torch.randint(0, 2, (world * B,), generator=g).float()
        features = _global_batch(BAG_FEATURES, step, world)
        mine = slice(rank * B, (rank + 1) * B)
        loss = bce(model(dense[mine], _local(features, rank)).squeeze(1), label[mine])
        loss_ref = bce(reference(dense, features).squeeze(1), label)
        torch.testing.assert_close(_mean_over_ranks(loss), loss_ref.detach(), msg=lambda m, step=step: f"step {step}: {m}")
        _step(zip((loss, loss_ref), opts))
    sharded = model.module.sparse_arch.embedding_bag_collection
    assert type(sharded).__name__ == "ShardedDynamicEmbeddingBagCollection"
    _check_rows(sharded, reference.sparse_arch.embedding_bag_collection.collection, ["t_user", "t_item", "t_history"])
    # Each rank's tables hold a W-th of the capacity.
    assert all(s["requested_capacity"] == 1024 // world for s in sharded.stats().values())
    # The model's state_dict holds the tables' rows under the unsharded module's names, each
    # rank's block of a row-sharded tensor (tests/torchrec/test_dmp_dcp.py loads them).
    state = model.state_dict()
    prefix = "sparse_arch.embedding_bag_collection.collection."
    rows = {k[len(prefix) :] for k in state if k.startswith(prefix)}
    per_table = ("keys", "embeddings", "optimizer_state", "scores", "optimizer_step", "counters")
    assert rows == {f"{t}.{e}" for t in ("t_user", "t_item", "t_history") for e in per_table} | {"step", "last_timestamp"}, sorted(rows)
    mine = torch.cat([c["keys"] for c in sharded.local_collection("t_user").export("t_user")])
    held = torch.tensor([mine.numel()])
    dist.all_reduce(held)
    keys = state[prefix + "t_user.keys"]
    assert keys.size(0) == int(held) and torch.equal(torch.sort(keys.local_shards()[0].tensor).values, torch.sort(mine).values)


def _sequence_worker(rank: int, world: int) -> None:
    reference, model = _twins(_SequenceModel)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, reference)]
    for step in range(STEPS):
        features = _global_batch(SEQ_FEATURES, 10 + step, world)
        embeddings, scores = model(_local(features, rank))
        embeddings_ref, scores_ref = reference(features)
        # Every id's row comes back to its rank, in the order of the rank's ids.
        torch.testing.assert_close(embeddings, embeddings_ref[_positions(features, rank)])
        # Per rank: sum over its ids / B; the mean over ranks is the global loss.
        loss = (scores**2).sum() / B
        loss_ref = (scores_ref**2).sum() / (world * B)
        torch.testing.assert_close(_mean_over_ranks(loss), loss_ref.detach(), msg=lambda m, step=step: f"step {step}: {m}")
        _step(zip((loss, loss_ref), opts))
    sharded = model.module.ec
    assert type(sharded).__name__ == "ShardedDynamicEmbeddingCollection"
    _check_rows(sharded, reference.ec.collection, ["t_ab", "t_c"])


def _shared_feature_worker(rank: int, world: int) -> None:
    reference, model = _twins(_SharedFeatureModel)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, reference)]
    for step in range(STEPS):
        features = _global_batch(SHARED_FEATURES, 20 + step, world, weighted=True)
        loss = (model(_local(features, rank)) ** 2).sum() / B
        loss_ref = (reference(features) ** 2).sum() / (world * B)
        torch.testing.assert_close(_mean_over_ranks(loss), loss_ref.detach(), msg=lambda m, step=step: f"step {step}: {m}")
        _step(zip((loss, loss_ref), opts))
        # Deferred: the rows change at the dynemb optimizer's step(), on every rank's shard.
        for m in (model.module, reference):
            m.sparse_optimizer.step()
            m.sparse_optimizer.zero_grad()
    _check_rows(model.module.ebc, reference.ebc.collection, ["t0", "t1"])


def test_dmp_shards_dlrm_and_trains_like_the_unsharded_model():
    run_ranks(_dlrm_worker, 2, timeout_s=TIMEOUT_S)


def test_dmp_shards_the_sequence_collection_and_trains_like_the_unsharded_model():
    run_ranks(_sequence_worker, 2, timeout_s=TIMEOUT_S)


def test_dmp_weighted_shared_feature_deferred_at_three_ranks():
    run_ranks(_shared_feature_worker, 3, timeout_s=TIMEOUT_S)


def test_plan_puts_every_table_row_wise_on_the_dynemb_kernel():
    result = dynemb.torchrec.plan(_dlrm(), 4)
    assert list(result.plan) == ["sparse_arch.embedding_bag_collection"]
    tables = result.plan["sparse_arch.embedding_bag_collection"]
    assert sorted(tables) == ["t_history", "t_item", "t_user"]
    for p in tables.values():
        assert p.sharding_type == ShardingType.ROW_WISE.value and p.compute_kernel == "customized_kernel"
        assert [s.placement.rank() for s in p.sharding_spec.shards] == [0, 1, 2, 3]
    # A model that is itself the dynemb collection is planned under "".
    assert list(dynemb.torchrec.plan(_SequenceModel().ec, 2).plan) == [""]
    kinds = {s.module_type for s in dynemb.torchrec.sharders()}
    assert kinds == {dynemb.torchrec.EmbeddingBagCollection, dynemb.torchrec.EmbeddingCollection}
    assert all(s.sharding_types("cpu") == [ShardingType.ROW_WISE.value] for s in dynemb.torchrec.sharders())


def test_plan_without_a_dynemb_module_raises():
    with pytest.raises(ValueError, match="holds no dynemb.torchrec.EmbeddingBagCollection or EmbeddingCollection"):
        dynemb.torchrec.plan(torch.nn.Linear(4, 1), 2)
    # TorchRec's own collection is not dynemb's: convert() it first.
    stock = torchrec.EmbeddingBagCollection(
        [EmbeddingBagConfig(name="t", embedding_dim=D, num_embeddings=16, feature_names=["f"])], device=torch.device("meta")
    )
    with pytest.raises(ValueError, match=r"convert\(model\)"):
        dynemb.torchrec.plan(stock, 2)
    with pytest.raises(ValueError, match="world_size=0"):
        dynemb.torchrec.plan(_dlrm(), 0)


def test_sharder_refuses_foreign_plans_and_trained_modules():
    ec = _SequenceModel().ec
    sharder = next(s for s in dynemb.torchrec.sharders() if s.module_type is dynemb.torchrec.EmbeddingCollection)
    params = dynemb.torchrec.plan(ec, 2).plan[""]
    foreign = {**params, "t_c": dataclasses.replace(params["t_c"], compute_kernel="fused_uvm")}
    with pytest.raises(ValueError, match="'t_c'.*customized_kernel"):
        sharder.shard(ec, foreign, env=None)
    # Rows already trained would not reach the (empty) local tables: refused.
    ec(_global_batch(SEQ_FEATURES, 0, world=1))
    with pytest.raises(ValueError, match="hold keys"):
        sharder.shard(ec, params, env=None)


def test_routing_sends_each_id_to_its_owner_and_sequence_ids_once_per_feature():
    from dynemb.torchrec.routing import route_pooled, route_sequence

    W = 3
    features = _global_batch(SEQ_FEATURES, 0, world=1, weighted=True)
    F, B = len(SEQ_FEATURES), features.stride()
    bags = features.lengths().view(F, B)
    # Pooled: every bag keeps its ids (with their weights), split by owner, in their order.
    pooled = route_pooled(features, W)
    lengths = pooled.lengths().view(W, F, B)
    assert torch.equal(lengths.sum(0), bags)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.flatten().cumsum(0)])
    for f, name in enumerate(SEQ_FEATURES):
        jt = features[name]
        for b in range(B):
            lo, hi = (int(o) for o in jt.offsets()[b : b + 2])
            ids_, weights = jt.values()[lo:hi], jt.weights()[lo:hi]
            for r in range(W):
                mine = owner_of(ids_, W) == r
                i = (r * F + f) * B + b
                got = slice(int(offsets[i]), int(offsets[i + 1]))
                assert torch.equal(pooled.values()[got], ids_[mine])
                assert torch.equal(pooled.weights()[got], weights[mine])
    # Sequence: each (owner, feature) sends its distinct ids once; the inverse gives every id back.
    routed, inverse = route_sequence(features, W)
    counts = routed.lengths().view(W, F, B).sum(2)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.flatten().cumsum(0)])
    assert torch.equal(routed.values()[inverse], features.values())
    assert routed.values().numel() < features.values().numel()
    for f, name in enumerate(SEQ_FEATURES):
        for r in range(W):
            sent = routed.values()[int(offsets[r * F + f]) : int(offsets[r * F + f + 1])]
            ids_ = features[name].values()
            assert torch.equal(sent, torch.unique(ids_[owner_of(ids_, W) == r]))
