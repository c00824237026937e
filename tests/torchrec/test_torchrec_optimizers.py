"""The optimizer of dynemb's TorchRec modules, chosen the TorchRec ways, and meta-device modules
(docs/design/0027-torchrec-optimizers.md).

Unsharded: ``apply_optimizer_in_backward`` (torch's and TorchRec's classes), TorchRec's default
with a warning, ``optimizer=None`` frozen, conflicts raising, a meta module materialised by
``to_empty``; each trains exactly like a module given the equivalent dynemb optimizer. Under DMP
(gloo, W = 2): sharders' ``fused_params`` of every supported ``EmbOptimType`` train exactly like
the unsharded model with the equivalent dynemb optimizer; ``dmp.fused_optimizer`` is a TorchRec
``KeyedOptimizer`` whose lr an LR scheduler drives; DMP without dynemb's sharders raises.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
import torchrec
from dmp_models import owned_parts
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.tbe.config.optimizer_config import WeightDecayMode
from torch.distributed.optim import _apply_optimizer_in_backward as apply_optimizer_in_backward
from torchrec import EmbeddingBagConfig, EmbeddingConfig, KeyedJaggedTensor
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

import dynemb
import dynemb.torchrec
from dynemb.torchrec import optimizers
from spawning import run_ranks

B, D = 8, 4
TIMEOUT_S = 150.0


def bag_tables() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name="t1", embedding_dim=D, num_embeddings=256, feature_names=["f1"]),
        EmbeddingBagConfig(name="t2", embedding_dim=D, num_embeddings=256, feature_names=["f2"]),
    ]


def batch(step: int, world: int = 1) -> KeyedJaggedTensor:
    """world * B samples of f1, f2, 1..3 ids each; ids 0, -1 and int64 extremes among them."""
    g = torch.Generator().manual_seed(step)
    lengths = torch.randint(1, 4, (2 * world * B,), generator=g)
    values = torch.randint(-40, 40, (int(lengths.sum()),), generator=g)
    values[:3] = torch.tensor([0, -(2**63), 2**63 - 1])
    return KeyedJaggedTensor.from_lengths_sync(keys=["f1", "f2"], values=values, lengths=lengths)


def train(ebc, steps: int = 3) -> list[float]:
    """A few steps of sum(pooled ** 2); the tables' fused optimizer does the update."""
    losses = []
    for step in range(steps):
        loss = (ebc(batch(step)).values() ** 2).sum()
        if loss.requires_grad:  # frozen tables and no dense weight: nothing to differentiate
            loss.backward()
        losses.append(loss.item())
    return losses


def rows(collection) -> dict[tuple[str, int], torch.Tensor]:
    out = {}
    for t in collection.table_names:
        for chunk in collection.export(t):
            for k, e, s in zip(chunk["keys"].tolist(), chunk["embeddings"], chunk["optimizer_state"]):
                out[(t, k)] = torch.cat([e, s])
    return out


def assert_same_tables(a, b) -> None:
    ra, rb = rows(a), rows(b)
    assert ra.keys() == rb.keys()
    for key, row in ra.items():
        torch.testing.assert_close(row, rb[key], rtol=0, atol=0, msg=lambda m, key=key: f"{key}: {m}")


# -- the FBGEMM names ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fused", "expected"),
    [
        ({"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.3}, dynemb.optim.SGD(lr=0.3)),
        ({"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": 0.3, "eps": 1e-6}, dynemb.optim.Adagrad(lr=0.3, eps=1e-6)),
        ({"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.3}, dynemb.optim.RowWiseAdagrad(lr=0.3, eps=1e-8)),
        (
            {"optimizer": EmbOptimType.ADAM, "learning_rate": 0.3, "beta1": 0.8, "beta2": 0.9, "weight_decay": 0.1, "weight_decay_mode": WeightDecayMode.L2},
            dynemb.optim.Adam(lr=0.3, betas=(0.8, 0.9), eps=1e-8, weight_decay=0.1),
        ),
        ({}, dynemb.optim.SGD(lr=0.01)),  # FBGEMM's defaults
    ],
)
def test_fused_params_name_the_equivalent_dynemb_optimizer(fused, expected):
    got = dynemb.torchrec.from_fused_params(fused)
    assert type(got) is type(expected) and optimizers.hyper_parameters(got) == optimizers.hyper_parameters(expected)


def test_unsupported_fused_params_raise_naming_the_key():
    with pytest.raises(ValueError, match="cache_load_factor=0.2 is not supported"):
        dynemb.torchrec.from_fused_params({"optimizer": EmbOptimType.EXACT_SGD, "cache_load_factor": 0.2})
    with pytest.raises(ValueError, match="optimizer=.*LAMB.*not supported"):
        dynemb.torchrec.from_fused_params({"optimizer": EmbOptimType.LAMB})
    with pytest.raises(ValueError, match="weight_decay_mode=.*DECOUPLE"):
        dynemb.torchrec.from_fused_params({"weight_decay": 0.1, "weight_decay_mode": WeightDecayMode.DECOUPLE})
    with pytest.raises(ValueError, match="weight_decay=0.1 with weight_decay_mode NONE has no effect"):
        dynemb.torchrec.from_fused_params({"weight_decay": 0.1})
    with pytest.raises(ValueError, match="learning_rate=-1"):
        dynemb.torchrec.from_fused_params({"learning_rate": -1})
    # sharders() checks its fused_params at once, not at DMP time.
    with pytest.raises(ValueError, match="stochastic_rounding"):
        dynemb.torchrec.sharders(fused_params={"stochastic_rounding": True})


# -- apply_optimizer_in_backward, the default, frozen, conflicts -----------------------------------


@pytest.mark.parametrize(
    ("cls", "kwargs", "expected"),
    [
        (torchrec.optim.RowWiseAdagrad, {"lr": 0.2}, dynemb.optim.RowWiseAdagrad(lr=0.2, eps=1e-8)),
        (torch.optim.SGD, {"lr": 0.2}, dynemb.optim.SGD(lr=0.2)),
        (torch.optim.Adagrad, {"lr": 0.2, "eps": 1e-6}, dynemb.optim.Adagrad(lr=0.2, eps=1e-6)),
        (torch.optim.Adam, {"lr": 0.2, "betas": (0.8, 0.95), "weight_decay": 0.01}, dynemb.optim.Adam(lr=0.2, betas=(0.8, 0.95), eps=1e-8, weight_decay=0.01)),
    ],
)
def test_apply_optimizer_in_backward_trains_like_the_equivalent_dynemb_optimizer(cls, kwargs, expected):
    torch.manual_seed(0)
    ebc = dynemb.torchrec.EmbeddingBagCollection(bag_tables())
    apply_optimizer_in_backward(cls, ebc.parameters(), kwargs)
    reference = dynemb.torchrec.EmbeddingBagCollection(bag_tables(), optimizer=expected)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no default-optimizer warning: one was chosen
        assert train(ebc) == train(reference)
    assert type(ebc.collection.optimizer) is type(expected)
    assert_same_tables(ebc.collection, reference.collection)


def test_no_optimizer_trains_with_torchrecs_default_and_says_so(monkeypatch):
    monkeypatch.setattr(optimizers, "_warned", set())
    ebc = dynemb.torchrec.EmbeddingBagCollection(bag_tables())
    with pytest.warns(UserWarning, match=r"TorchRec's fused default, dynemb.optim.SGD\(lr=0.01"):
        losses = train(ebc)
    reference = dynemb.torchrec.EmbeddingBagCollection(bag_tables(), optimizer=dynemb.optim.SGD(lr=0.01))
    assert losses == train(reference)
    assert_same_tables(ebc.collection, reference.collection)
    frozen = dynemb.torchrec.EmbeddingBagCollection(bag_tables(), optimizer=None)
    train(frozen)
    trained, untouched = rows(ebc.collection), rows(frozen.collection)
    assert any(not torch.equal(trained[k], untouched[k]) for k in trained)  # trained, not frozen
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        train(dynemb.torchrec.EmbeddingBagCollection(bag_tables()), steps=1)


def test_optimizer_none_on_purpose_stays_frozen():
    ebc = dynemb.torchrec.EmbeddingBagCollection(bag_tables(), optimizer=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train(ebc, steps=1)
    before = rows(ebc.collection)
    train(ebc, steps=1)  # the same batch again: no key changes
    after = rows(ebc.collection)
    assert all(torch.equal(after[k], before[k]) for k in before)


def test_conflicting_choices_raise_naming_both():
    ebc = dynemb.torchrec.EmbeddingBagCollection(bag_tables(), optimizer=dynemb.optim.SGD(lr=0.1))
    apply_optimizer_in_backward(torch.optim.Adagrad, ebc.parameters(), {"lr": 0.1})
    with pytest.raises(ValueError, match=r"optimizer= chose dynemb.optim.SGD.*apply_optimizer_in_backward chose dynemb.optim.Adagrad"):
        train(ebc, steps=1)
    frozen = dynemb.torchrec.EmbeddingBagCollection(bag_tables(), optimizer=None)
    apply_optimizer_in_backward(torch.optim.SGD, frozen.parameters(), {"lr": 0.1})
    with pytest.raises(ValueError, match="None"):
        train(frozen, steps=1)
    # Different optimizers on the tables of one module: dynemb's tables share one.
    split = dynemb.torchrec.EmbeddingBagCollection(bag_tables())
    first, second = split.parameters()
    apply_optimizer_in_backward(torch.optim.SGD, [first], {"lr": 0.1})
    apply_optimizer_in_backward(torch.optim.SGD, [second], {"lr": 0.2})
    with pytest.raises(ValueError, match="different optimizers"):
        train(split, steps=1)
    # An optimizer dynemb does not have, or an argument it does not take.
    with pytest.raises(ValueError, match="not supported"):
        other = dynemb.torchrec.EmbeddingBagCollection(bag_tables())
        apply_optimizer_in_backward(torch.optim.RMSprop, other.parameters(), {"lr": 0.1})
        train(other, steps=1)
    with pytest.raises(ValueError, match="momentum=0.9"):
        other = dynemb.torchrec.EmbeddingBagCollection(bag_tables())
        apply_optimizer_in_backward(torch.optim.SGD, other.parameters(), {"lr": 0.1, "momentum": 0.9})
        train(other, steps=1)


def test_apply_optimizer_in_backward_after_training_started_raises(monkeypatch):
    monkeypatch.setattr(optimizers, "_warned", set())
    ebc = dynemb.torchrec.EmbeddingBagCollection(bag_tables())
    with pytest.warns(UserWarning, match="default"):
        train(ebc, steps=1)
    apply_optimizer_in_backward(torch.optim.Adagrad, ebc.parameters(), {"lr": 0.1})
    with pytest.raises(ValueError, match=r"after the tables started training with dynemb.optim.SGD\(lr=0.01"):
        train(ebc, steps=1)
    # The same optimizer tagged late is no conflict.
    same = dynemb.torchrec.EmbeddingBagCollection(bag_tables())
    train(same, steps=1)
    apply_optimizer_in_backward(torch.optim.SGD, same.parameters(), {"lr": 0.01})
    train(same, steps=1)


# -- meta ----------------------------------------------------------------------------------------


def test_meta_module_allocates_nothing_until_to_empty():
    ebc = dynemb.torchrec.EmbeddingBagCollection(bag_tables(), device="meta", optimizer=dynemb.optim.Adagrad(lr=0.1))
    with torch.device("meta"):
        ec = dynemb.torchrec.EmbeddingCollection([EmbeddingConfig(name="t", embedding_dim=D, num_embeddings=64, feature_names=["a"])])
    for module in (ebc, ec):
        assert not module.is_built() and module.device == torch.device("meta")
        assert all(p.is_meta for p in module.parameters())
        with pytest.raises(RuntimeError, match="device='meta'.*to_empty"):
            module.stats()
    with pytest.raises(RuntimeError, match="device='meta'"):
        ebc(batch(0))
    # Meta inputs give TorchRec's meta outputs without tables.
    meta_batch = KeyedJaggedTensor.from_lengths_sync(
        keys=["f1", "f2"], values=torch.zeros(3, dtype=torch.long, device="meta"), lengths=torch.ones(3, dtype=torch.long, device="meta")
    )
    assert ebc(meta_batch).values().is_meta
    ebc.to_empty(device="cpu")
    assert ebc.is_built() and ebc.device == torch.device("cpu")
    reference = dynemb.torchrec.EmbeddingBagCollection(bag_tables(), optimizer=dynemb.optim.Adagrad(lr=0.1))
    assert train(ebc) == train(reference)
    assert_same_tables(ebc.collection, reference.collection)
    ec.to("cpu")  # .to(device) materialises a meta module too
    assert ec.is_built()


def test_meta_module_with_apply_optimizer_in_backward_then_to_empty():
    ebc = dynemb.torchrec.EmbeddingBagCollection(bag_tables(), device=torch.device("meta"))
    apply_optimizer_in_backward(torchrec.optim.RowWiseAdagrad, ebc.parameters(), {"lr": 0.05})
    ebc.to_empty(device="cpu")
    train(ebc, steps=1)
    assert isinstance(ebc.collection.optimizer, dynemb.optim.RowWiseAdagrad) and ebc.collection.optimizer.lr == 0.05


# -- under DMP -----------------------------------------------------------------------------------


class _Model(torch.nn.Module):
    def __init__(self, ebc):
        super().__init__()
        self.ebc = ebc
        self.head = torch.nn.Linear(2 * D, 1)

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        return self.head(self.ebc(features).values())  # [B, 1]


def _local(features: KeyedJaggedTensor, rank: int) -> KeyedJaggedTensor:
    """Samples rank * B .. (rank + 1) * B of every feature."""
    values, lengths = [], []
    for f in features.keys():
        jt = features[f]
        lo, hi = (int(o) for o in jt.offsets()[[rank * B, (rank + 1) * B]])
        values.append(jt.values()[lo:hi])
        lengths.append(jt.lengths()[rank * B : (rank + 1) * B])
    return KeyedJaggedTensor.from_lengths_sync(keys=features.keys(), values=torch.cat(values), lengths=torch.cat(lengths))


def _gathered_rows(sharded, tables: list[str]) -> dict[tuple[str, int], torch.Tensor]:
    mine = {}
    for t in tables:
        collection = sharded.local_collection(t)
        mine.update({key: row for key, row in rows(collection).items() if key[0] == t})
    return {k: v for part in owned_parts(mine) for k, v in part.items()}


def _dmp_vs_unsharded(rank: int, world: int, make_dmp, reference_optimizer, steps: int = 3) -> DistributedModelParallel:
    """DMP (built by make_dmp from a meta-free model) against the unsharded model with
    ``reference_optimizer``: equal losses (mean over ranks) and equal tables."""
    torch.manual_seed(0)
    reference = _Model(dynemb.torchrec.EmbeddingBagCollection(bag_tables(), optimizer=reference_optimizer))
    torch.manual_seed(0)
    dmp = make_dmp(_Model(dynemb.torchrec.EmbeddingBagCollection(bag_tables())))
    dense = [torch.optim.SGD(m.head.parameters(), lr=0.05) for m in (dmp.module, reference)]
    for step in range(steps):
        features = batch(step, world)
        loss = (dmp(_local(features, rank)) ** 2).sum() / B
        loss_ref = (reference(features) ** 2).sum() / (world * B)
        total = loss.detach().clone()
        dist.all_reduce(total)
        torch.testing.assert_close(total / world, loss_ref.detach(), msg=lambda m, step=step: f"step {step}: {m}")
        for opt, value in zip(dense, (loss, loss_ref)):
            opt.zero_grad()
            value.backward()
            opt.step()
    gathered = _gathered_rows(dmp.module.ebc, ["t1", "t2"])
    expected = rows(reference.ebc.collection)
    assert gathered.keys() == expected.keys()
    for key, row in expected.items():
        torch.testing.assert_close(gathered[key], row, msg=lambda m, key=key: f"{key}: {m}")
    return dmp


FUSED = [
    ({"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.2}, dynemb.optim.SGD(lr=0.2)),
    ({"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": 0.2}, dynemb.optim.Adagrad(lr=0.2, eps=1e-8)),
    ({"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.2, "eps": 1e-6}, dynemb.optim.RowWiseAdagrad(lr=0.2, eps=1e-6)),
    ({"optimizer": EmbOptimType.ADAM, "learning_rate": 0.05, "beta1": 0.8}, dynemb.optim.Adam(lr=0.05, betas=(0.8, 0.999), eps=1e-8)),
]


def _fused_params_worker(rank: int, world: int) -> None:
    for fused, expected in FUSED:
        plan_free = lambda model, fused=fused: DistributedModelParallel(
            model, device=torch.device("cpu"), sharders=dynemb.torchrec.sharders(fused_params=fused)
        )
        dmp = _dmp_vs_unsharded(rank, world, plan_free, expected)
        local = dmp.module.ebc.local_collection("t1").optimizer
        assert type(local) is type(expected) and optimizers.hyper_parameters(local) == optimizers.hyper_parameters(expected)


def test_fused_params_of_every_optimizer_train_like_the_equivalent_dynemb_optimizer():
    run_ranks(_fused_params_worker, 2, timeout_s=TIMEOUT_S)


def _fused_optimizer_worker(rank: int, world: int) -> None:
    def in_backward(model):
        apply_optimizer_in_backward(torchrec.optim.RowWiseAdagrad, model.ebc.parameters(), {"lr": 0.2})
        return DistributedModelParallel(model, device=torch.device("cpu"), sharders=dynemb.torchrec.sharders())

    dmp = _dmp_vs_unsharded(rank, world, in_backward, dynemb.optim.RowWiseAdagrad(lr=0.2, eps=1e-8))
    fused = dmp.fused_optimizer
    assert isinstance(fused, KeyedOptimizer) and {g["lr"] for g in fused.param_groups} == {0.2}
    assert {"ebc.embedding_bags.t1.weight", "ebc.embedding_bags.t2.weight"} <= set(fused.params)
    # Combined with the dense optimizer as TorchRec's examples do; a scheduler drives the tables' lr.
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())), lambda p: torch.optim.SGD(p, lr=0.1))
    combined = CombinedOptimizer([fused, dense])
    scheduler = torch.optim.lr_scheduler.StepLR(combined, step_size=1, gamma=0.5)
    scheduler.step()
    combined.step()  # TorchRec's fused optimizers take the group's lr at step()
    assert dmp.module.ebc.local_collection("t1").optimizer.lr == 0.1
    # state_dict / load_state_dict carry the lr (param groups saved on request, as TorchRec's).
    combined.save_param_groups(True)
    saved = combined.state_dict()
    scheduler.step()
    combined.step()
    assert dmp.module.ebc.local_collection("t1").optimizer.lr == 0.05
    combined.load_state_dict(saved)
    assert {g["lr"] for g in fused.param_groups} == {0.1}
    combined.step()
    assert dmp.module.ebc.local_collection("t1").optimizer.lr == 0.1


def test_dmp_fused_optimizer_is_a_keyed_optimizer_driving_the_tables_lr():
    run_ranks(_fused_optimizer_worker, 2, timeout_s=TIMEOUT_S)


def _no_sharders_worker(rank: int, world: int) -> None:
    for device in ("cpu", "meta"):
        model = _Model(dynemb.torchrec.EmbeddingBagCollection(bag_tables(), device=device, optimizer=dynemb.optim.SGD(lr=0.1)))
        with pytest.raises(RuntimeError, match=r"without dynemb's sharders.*sharders=dynemb.torchrec.sharders\(\)"):
            DistributedModelParallel(model, device=torch.device("cpu"))


def test_dmp_without_dynemb_sharders_raises():
    run_ranks(_no_sharders_worker, 2, timeout_s=TIMEOUT_S)


def test_a_copy_of_a_module_keeps_its_optimizer_unchosen():
    twin = copy.deepcopy(dynemb.torchrec.EmbeddingBagCollection(bag_tables()))
    apply_optimizer_in_backward(torch.optim.SGD, twin.parameters(), {"lr": 0.3})
    train(twin, steps=1)
    assert isinstance(twin.collection.optimizer, dynemb.optim.SGD) and twin.collection.optimizer.lr == 0.3
