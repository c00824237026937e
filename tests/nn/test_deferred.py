"""Deferred updates (update="deferred"): gradient accumulation, clipping and GradScaler, checked
against the fused update on one larger batch and against dense PyTorch.

V distinct ids, D embedding dim, P pending keys. Each dynemb key is an arbitrary int64 standing
for a dense id of the reference.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch

import dynemb
from dynemb.hashing import mix64
from dynemb.nn.deferred import GradAccumulator

V, D, K = 40, 6, 4
OPTIMIZERS = {
    "sgd": lambda: dynemb.optim.SGD(lr=0.1),
    "adagrad": lambda: dynemb.optim.Adagrad(lr=0.1, lr_decay=0.01),
    "rowwise_adagrad": lambda: dynemb.optim.RowWiseAdagrad(lr=0.1),
    "adam": lambda: dynemb.optim.Adam(lr=0.05, betas=(0.8, 0.9)),
}


def keys_of(ids: torch.Tensor) -> torch.Tensor:
    """The int64 key standing for each dense id (a bijection reaching the whole int64 range)."""
    return mix64(ids + 777)


ALL_KEYS = keys_of(torch.arange(V))


def rows_of(table) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every (key, embedding, optimizer state) of a table, sorted by key."""
    chunks = list(table.export())
    keys = torch.cat([c["keys"] for c in chunks])
    order = torch.argsort(keys)
    emb = torch.cat([c["embeddings"] for c in chunks])
    state = torch.cat([c["optimizer_state"] for c in chunks])
    return keys[order], emb[order], state[order]


def assert_same_rows(a, b) -> None:
    ka, ea, sa = rows_of(a)
    kb, eb, sb = rows_of(b)
    assert torch.equal(ka, kb)
    torch.testing.assert_close(ea, eb)
    torch.testing.assert_close(sa, sb)
    va, fa = a.find(ALL_KEYS)
    vb, fb = b.find(ALL_KEYS)
    assert torch.equal(fa, fb)
    torch.testing.assert_close(va, vb)


def make(pooled: bool, optimizer, update: str, **options):
    # Capacity well above V: no eviction, so both tables hold the same keys.
    if pooled:
        return dynemb.DynamicEmbeddingBag(D, 8 * V, mode="mean", optimizer=optimizer, update=update, **options)
    return dynemb.DynamicEmbedding(D, 8 * V, optimizer=optimizer, update=update, **options)


def micro_batch(pooled: bool, gen: torch.Generator):
    """ids and offsets (pooled) or ids [3, 5] (sequence), with duplicates."""
    if not pooled:
        ids = torch.randint(0, V, (3, 5), generator=gen)
        ids[0, :2] = ids[2, 4]
        return ids, None
    n = 11
    ids = torch.randint(0, V, (n,), generator=gen)
    ids[3:6] = ids[0]
    cuts = torch.sort(torch.randint(0, n + 1, (3,), generator=gen)).values
    return ids, torch.cat([torch.zeros(1, dtype=torch.int64), cuts])


def concat(batches, pooled: bool):
    if not pooled:
        return torch.cat([ids for ids, _ in batches]), None
    ids = torch.cat([ids for ids, _ in batches])
    starts = torch.cumsum(torch.tensor([0] + [i.numel() for i, _ in batches[:-1]]), 0)
    return ids, torch.cat([off + s for (_, off), s in zip(batches, starts)])


def forward(table, ids, offsets):
    return table(keys_of(ids), offsets) if offsets is not None else table(keys_of(ids))


def loss_of(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # A sum over samples: the loss of the concatenated batch is the sum of the micro-batches'.
    return ((out - target) ** 2).sum() + 0.5 * out.sum()


def test_update_option_is_validated():
    with pytest.raises(ValueError, match="update='bogus' is not one of 'fused', 'deferred'"):
        dynemb.DynamicEmbedding(D, 64, optimizer=dynemb.optim.SGD(), update="bogus")
    with pytest.raises(ValueError, match="update='deferred' needs an optimizer"):
        dynemb.DynamicEmbeddingBag(D, 64, update="deferred")
    assert dynemb.DynamicEmbedding(D, 64, optimizer=dynemb.optim.SGD()).update_mode == "fused"
    bag = dynemb.DynamicEmbeddingBag(D, 64, optimizer=dynemb.optim.SGD(), update="DEFERRED")
    assert bag.update_mode == "deferred" and "update='deferred'" in repr(bag)


@pytest.mark.parametrize("pooled", [False, True], ids=["sequence", "pooled"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_micro_batches_deferred_equal_one_large_batch_fused(name, pooled):
    fused = make(pooled, OPTIMIZERS[name](), "fused")
    deferred = make(pooled, OPTIMIZERS[name](), "deferred")
    opt = deferred.optimizer
    gen = torch.Generator().manual_seed(5)
    for step in range(3):
        batches = [micro_batch(pooled, gen) for _ in range(K)]
        outs = []
        for ids, offsets in batches:
            out = forward(deferred, ids, offsets)
            loss_of(out, torch.ones_like(out)).backward()
            outs.append(out.detach())
        # Nothing moves before step(): the rows are the fused table's before its update (the
        # deferred table holds the keys new in this step too).
        held = rows_of(fused)[0]
        values, found = deferred.find(held)
        assert bool(found.all())
        torch.testing.assert_close(values, fused.find(held)[0])
        assert deferred.optimizer_step == step
        opt.step()
        assert deferred.stats()["pending_grad_keys"] == 0
        ids, offsets = concat(batches, pooled)
        out = forward(fused, ids, offsets)
        loss_of(out, torch.ones_like(out)).backward()
        torch.testing.assert_close(torch.cat(outs), out.detach())
        assert_same_rows(deferred, fused)
        # Adam's bias correction: one step per optimizer.step(), as one per fused batch.
        assert deferred.optimizer_step == fused.optimizer_step == step + 1


def test_micro_batches_deferred_equal_dense_torch_gradient_accumulation():
    """Against torch itself: nn.Embedding(sparse=False) + torch.optim.Adagrad, K backward calls
    per step (gradient accumulation), Adagrad touching only rows with a gradient because every
    id is in every step."""
    torch.manual_seed(0)
    ref = torch.nn.Embedding(V, D)
    ref_opt = torch.optim.Adagrad(ref.parameters(), lr=0.1)
    table = make(False, dynemb.optim.Adagrad(lr=0.1), "deferred")
    table.insert(ALL_KEYS, ref.weight.detach().clone())
    gen = torch.Generator().manual_seed(6)
    for _ in range(3):
        ids = torch.randperm(V, generator=gen).view(K, -1)
        for part in ids:
            target = torch.randn(part.numel(), D, generator=gen)
            loss_of(table(keys_of(part)), target).backward()
            loss_of(ref(part), target).backward()
        table.optimizer.step()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(table.find(ALL_KEYS)[0], ref.weight.detach())


def test_zero_grad_drops_the_pending_gradient():
    table = make(False, dynemb.optim.Adam(), "deferred")
    out = table(keys_of(torch.arange(10)))
    out.sum().backward()
    before = table.find(ALL_KEYS)[0]
    assert table.stats()["pending_grad_keys"] == 10
    assert torch.equal(table.pending_keys(), torch.sort(keys_of(torch.arange(10))).values)
    table.optimizer.zero_grad()
    assert table.stats()["pending_grad_keys"] == 0
    table.optimizer.step()
    assert torch.equal(table.find(ALL_KEYS)[0], before)
    # Nothing pending: no step counted (Adam's bias correction stays at step 1 for the next one).
    assert table.optimizer_step == 0


def test_keys_erased_before_step_are_skipped():
    table = make(False, dynemb.optim.SGD(lr=1.0), "deferred")
    ids = torch.arange(6)
    table(keys_of(ids)).sum().backward()
    before = table.find(keys_of(ids))[0]
    table.erase(keys_of(torch.tensor([2, 4])))
    table.optimizer.step()
    values, found = table.find(keys_of(ids))
    assert found.tolist() == [True, True, False, True, False, True]
    kept = torch.tensor([0, 1, 3, 5])
    torch.testing.assert_close(values[kept], before[kept] - 1.0)
    assert table.optimizer_step == 1


def test_one_optimizer_steps_every_registered_table():
    opt = dynemb.optim.SGD(lr=1.0)
    a, b = make(False, opt, "deferred"), make(True, opt, "deferred")
    fused = make(False, opt, "fused")
    assert len(opt.param_groups[0]["params"]) == 2
    ids = torch.arange(4)
    a(keys_of(ids)).sum().backward()
    b(keys_of(ids.view(2, 2))).sum().backward()
    before_a, before_b = a.find(keys_of(ids))[0], b.find(keys_of(ids))[0]
    fused(keys_of(ids)).sum().backward()
    opt.step()
    torch.testing.assert_close(a.find(keys_of(ids))[0], before_a - 1.0)
    torch.testing.assert_close(b.find(keys_of(ids))[0], before_b - 0.5)
    # A table that is garbage collected leaves the optimizer.
    del a
    gc.collect()
    params = opt.param_groups[0]["params"]
    assert len(params) == 1 and params[0] is b._pending[0].param


@pytest.mark.parametrize("pooled", [False, True], ids=["sequence", "pooled"])
def test_second_backward_accumulates_like_dense_torch(pooled):
    torch.manual_seed(0)
    ref = torch.nn.EmbeddingBag(V, D, mode="mean") if pooled else torch.nn.Embedding(V, D)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    table = make(pooled, dynemb.optim.SGD(lr=0.1), "deferred")
    table.insert(ALL_KEYS, ref.weight.detach().clone())
    ids, offsets = micro_batch(pooled, torch.Generator().manual_seed(7))
    loss = loss_of(forward(table, ids, offsets), 1.0)
    ref_loss = loss_of(ref(ids, offsets) if pooled else ref(ids), 1.0)
    for _ in range(2):
        loss.backward(retain_graph=True)
        ref_loss.backward(retain_graph=True)
    table.optimizer.step()
    ref_opt.step()
    torch.testing.assert_close(table.find(ALL_KEYS)[0], ref.weight.detach())


def test_second_backward_still_raises_when_fused():
    table = make(False, dynemb.optim.SGD(), "fused")
    loss = table(keys_of(torch.arange(3))).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice through one dynemb lookup"):
        loss.backward()


def dense_twin(lr: float):
    """A deferred table + Linear, and the same model in dense torch, from the same weights."""
    torch.manual_seed(0)
    ref_emb, ref_lin = torch.nn.Embedding(V, D), torch.nn.Linear(D, 1)
    table = make(False, dynemb.optim.SGD(lr=lr), "deferred")
    table.insert(ALL_KEYS, ref_emb.weight.detach().clone())
    lin = copy.deepcopy(ref_lin)
    return table, lin, ref_emb, ref_lin


def check_twin(table, lin, ref_emb, ref_lin) -> None:
    torch.testing.assert_close(table.find(ALL_KEYS)[0], ref_emb.weight.detach())
    for p, q in zip(lin.parameters(), ref_lin.parameters()):
        torch.testing.assert_close(p.detach(), q.detach())


@pytest.mark.parametrize("how", ["model", "optimizers", "torch_placeholders"])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_clip_grad_norm_matches_dense_torch(norm_type, how):
    table, lin, ref_emb, ref_lin = dense_twin(lr=0.5)
    model = torch.nn.ModuleDict({"emb": table, "lin": lin})
    dense_opt = torch.optim.SGD(lin.parameters(), lr=0.5)
    ref_params = [*ref_emb.parameters(), *ref_lin.parameters()]
    ref_opt = torch.optim.SGD(ref_params, lr=0.5)
    gen = torch.Generator().manual_seed(8)
    for _ in range(4):
        ids = torch.randint(0, V, (8, 5), generator=gen)
        target = torch.randn(8, 5, 1, generator=gen)
        dense_opt.zero_grad()
        table.optimizer.zero_grad()
        ref_opt.zero_grad()
        # Two micro-batches: the clipped gradient is the accumulated one.
        for half in (slice(0, 4), slice(4, 8)):
            ((lin(table(keys_of(ids[half]))) - target[half]) ** 2).sum().backward()
            ((ref_lin(ref_emb(ids[half])) - target[half]) ** 2).sum().backward()
        if how == "model":
            norm = dynemb.clip_grad_norm_(model, 0.5, norm_type)
        elif how == "optimizers":
            norm = dynemb.clip_grad_norm_([dense_opt, table.optimizer], 0.5, norm_type)
        else:
            norm = torch.nn.utils.clip_grad_norm_([*lin.parameters(), *table.optimizer.param_groups[0]["params"]], 0.5, norm_type)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref_params, 0.5, norm_type)
        torch.testing.assert_close(norm, ref_norm)
        assert float(norm) > 0.5  # the clip does scale the gradients
        dense_opt.step()
        table.optimizer.step()
        ref_opt.step()
        check_twin(table, lin, ref_emb, ref_lin)


def test_clip_grad_norm_counts_a_gradient_once_and_checks_finiteness():
    table, lin, *_ = dense_twin(lr=0.5)
    lin(table(keys_of(torch.arange(5)))).sum().backward()
    grads = [table.deferred_grad(), *(p.grad for p in lin.parameters())]
    want = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
    got = dynemb.clip_grad_norm_([table, lin, table.optimizer, table, *lin.parameters()], 1e9)
    torch.testing.assert_close(got, want)
    table.deferred_grad()[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="non-finite"):
        dynemb.clip_grad_norm_(table, 1.0, error_if_nonfinite=True)
    with pytest.raises(TypeError, match="cannot take gradients from int"):
        dynemb.clip_grad_norm_([table, 3], 1.0)


def test_grad_scaler_matches_dense_torch():
    """A step with an inf gradient is skipped (rows unchanged, the scale halves), the others
    applied, as for nn.Embedding(sparse=False) + torch.optim.SGD under the same scaler."""
    table, lin, ref_emb, ref_lin = dense_twin(lr=0.1)
    row_opt, dense_opt = table.optimizer, torch.optim.SGD(lin.parameters(), lr=0.1)
    ref_opts = [torch.optim.SGD(ref_emb.parameters(), lr=0.1), torch.optim.SGD(ref_lin.parameters(), lr=0.1)]
    scaler, ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10), torch.amp.GradScaler("cpu", init_scale=2.0**10)
    gen = torch.Generator().manual_seed(9)
    for step, inf in enumerate([True, False, True, False]):
        ids = torch.randint(0, V, (6, 4), generator=gen)
        target = torch.randn(6, 4, 1, generator=gen)
        weight = torch.ones(6, 4, 1)
        if inf:
            weight[1, 2] = float("inf")
        for o in (row_opt, dense_opt, *ref_opts):
            o.zero_grad()
        before = table.find(ALL_KEYS)[0]
        scaler.scale((weight * (lin(table(keys_of(ids))) - target) ** 2).sum()).backward()
        ref_scaler.scale((weight * (ref_lin(ref_emb(ids)) - target) ** 2).sum()).backward()
        if step == 1:
            # unscale_ divides the pending gradient itself: it equals torch's on the looked-up rows.
            scaler.unscale_(row_opt)
            ref_scaler.unscale_(ref_opts[0])
            by_key = dict(zip(ALL_KEYS.tolist(), range(V)))
            rows = torch.tensor([by_key[k] for k in table.pending_keys().tolist()])
            torch.testing.assert_close(table.deferred_grad(), ref_emb.weight.grad.index_select(0, rows))
        scaler.step(dense_opt)
        scaler.step(row_opt)
        scaler.update()
        for o in ref_opts:
            ref_scaler.step(o)
        ref_scaler.update()
        assert scaler.get_scale() == ref_scaler.get_scale()
        if inf:
            assert torch.equal(table.find(ALL_KEYS)[0], before)
        check_twin(table, lin, ref_emb, ref_lin)
    assert scaler.get_scale() == 2.0**8
    # Skipped by the scaler, not by the table's non-finite policy.
    assert table.stats()["nonfinite_grads"] == 0
    assert table.optimizer_step == 2


def test_grad_scaler_step_with_nothing_pending():
    table, lin, *_ = dense_twin(lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(lin(torch.ones(2, D)).sum()).backward()
    scaler.step(table.optimizer)
    scaler.update()
    assert table.optimizer_step == 0


def nan_step(policy: str):
    table = make(False, dynemb.optim.SGD(lr=1.0), "deferred", nonfinite_grads=policy)
    ids = torch.arange(4)
    out = table(keys_of(ids))
    weight = torch.ones(4, D)
    weight[2, 0] = float("nan")
    (out * weight).sum().backward()
    return table, table.find(keys_of(ids))[0]


def test_nonfinite_policy_applies_at_step():
    table, before = nan_step("skip")
    table.optimizer.step()
    after = table.find(keys_of(torch.arange(4)))[0]
    assert torch.equal(after[2], before[2])
    torch.testing.assert_close(after[[0, 1, 3]], before[[0, 1, 3]] - 1.0)
    assert table.stats()["nonfinite_grads"] == 1

    table, before = nan_step("raise")
    with pytest.raises(FloatingPointError, match="non-finite gradient for 1 key"):
        table.optimizer.step()
    assert torch.equal(table.find(keys_of(torch.arange(4)))[0], before)
    assert table.stats()["pending_grad_keys"] == 4
    table.optimizer.zero_grad()
    table.optimizer.step()
    assert table.optimizer_step == 0


def test_pending_gradient_is_not_state():
    fused = make(False, dynemb.optim.Adam(), "fused")
    table = make(False, dynemb.optim.Adam(), "deferred")
    table(keys_of(torch.arange(5))).sum().backward()
    state = table.state_dict()
    fused(keys_of(torch.arange(5)))
    assert state.keys() == fused.state_dict().keys()
    # Loading replaces the rows the pending gradient was computed against: it is dropped.
    table.load_state_dict(state)
    assert table.stats()["pending_grad_keys"] == 0


def test_optimizer_state_dict_and_scheduler_with_deferred_tables():
    opt = dynemb.optim.SGD(lr=1.0)
    table = make(False, opt, "deferred")
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    placeholders = list(opt.param_groups[0]["params"])
    assert len(placeholders) == 1
    saved = opt.state_dict()
    assert saved == {"state": {}, "param_groups": [{"lr": 1.0, "weight_decay": 0.0, "initial_lr": 1.0, "params": []}]}
    opt.load_state_dict(dynemb.optim.SGD(lr=0.25).state_dict())
    assert len(opt.param_groups[0]["params"]) == 1 and opt.param_groups[0]["params"][0] is placeholders[0] and opt.lr == 0.25
    opt.load_state_dict(saved)
    ids = keys_of(torch.arange(3))
    for lr in (1.0, 0.5):
        table(ids).sum().backward()
        before = table.find(ids)[0]
        opt.step()
        sched.step()
        torch.testing.assert_close(table.find(ids)[0], before - lr)
    # A copy of the optimizer serves no table.
    assert copy.deepcopy(opt).param_groups[0]["params"] == []


def test_copies_register_with_their_optimizer():
    table = make(False, dynemb.optim.SGD(lr=1.0), "deferred")
    ids = keys_of(torch.arange(3))
    table(ids).sum().backward()
    clone = copy.deepcopy(table)
    assert clone.optimizer is not table.optimizer
    assert clone.optimizer.param_groups[0]["params"][0].grad is clone.deferred_grad()
    before = table.find(ids)[0]
    clone.optimizer.step()
    torch.testing.assert_close(clone.find(ids)[0], before - 1.0)
    assert torch.equal(table.find(ids)[0], before)
    assert table.stats()["pending_grad_keys"] == 3


def test_to_converts_the_pending_gradient():
    table = make(False, dynemb.optim.SGD(lr=1.0), "deferred")
    ids = keys_of(torch.arange(3))
    table(ids).sum().backward()
    table.double()
    placeholder = table.optimizer.param_groups[0]["params"][0]
    assert table.deferred_grad().dtype == placeholder.grad.dtype == placeholder.dtype == torch.float64
    before = table.find(ids)[0]
    table.optimizer.step()
    torch.testing.assert_close(table.find(ids)[0], before - 1.0)


class TwoGroupOwner:
    """A collection-like owner: two accumulators of different D, one placeholder each."""

    def __init__(self, optimizer):
        self.accs = [GradAccumulator(2, torch.float32, "cpu"), GradAccumulator(3, torch.float32, "cpu")]
        self.applied = []
        for acc in self.accs:
            optimizer.register_deferred(self, acc.param)
            optimizer.register_deferred(self, acc.param)

    def deferred_step(self):
        self.applied.append([acc.drain()[2].clone() for acc in self.accs])

    def deferred_clear(self):
        for acc in self.accs:
            acc.clear()

    def deferred_grad(self):
        return [acc.grad for acc in self.accs]


def test_owner_with_several_placeholders_is_stepped_once_and_clipped_whole():
    opt = dynemb.optim.SGD()
    owner = TwoGroupOwner(opt)
    params = opt.param_groups[0]["params"]
    assert len(params) == 2 and params[0] is owner.accs[0].param and params[1] is owner.accs[1].param
    owner.accs[0].add(torch.tensor([5]), torch.full((1, 2), 3.0))
    owner.accs[1].add(torch.tensor([7, 5]), torch.full((2, 3), 4.0), torch.tensor([1, 0]))
    torch.testing.assert_close(dynemb.clip_grad_norm_(opt, 1.0), torch.tensor(float((2 * 9 + 6 * 16) ** 0.5)))
    torch.testing.assert_close(dynemb.clip_grad_norm_(owner, 1e9), torch.tensor(1.0))
    opt.step()
    assert len(owner.applied) == 1 and [g.shape for g in owner.applied[0]] == [(1, 2), (2, 3)]
    assert [len(acc) for acc in owner.accs] == [0, 0]
    opt.unregister_deferred(owner)
    assert opt.param_groups[0]["params"] == []


@pytest.mark.parametrize("with_segments", [False, True])
def test_accumulator_sums_equal_pairs_like_a_dict(with_segments):
    gen = torch.Generator().manual_seed(10)
    pool = torch.cat([torch.tensor([0, -1, -(2**63), 2**63 - 1]), torch.randint(-(2**62), 2**62, (12,), generator=gen)])
    acc = GradAccumulator(3, torch.float64, "cpu")
    model: dict[tuple[int, int], torch.Tensor] = {}
    for n in (1, 9, 0, 17, 30):
        keys = pool[torch.randint(0, pool.numel(), (n,), generator=gen)]
        segments = torch.randint(0, 3, (n,), generator=gen) if with_segments else None
        grads = torch.randn(n, 3, generator=gen, dtype=torch.float64)
        acc.add(keys, grads, segments)
        for i in range(n):
            pair = (int(segments[i]) if with_segments else 0, int(keys[i]))
            model[pair] = model.get(pair, torch.zeros(3, dtype=torch.float64)) + grads[i]
        pairs = sorted(model)
        got_segments = acc.segments.tolist() if with_segments else [0] * len(acc)
        assert list(zip(got_segments, acc.keys.tolist())) == pairs
        torch.testing.assert_close(acc.grad, torch.stack([model[p] for p in pairs]) if pairs else torch.zeros(0, 3, dtype=torch.float64))
        assert acc.param.grad is acc.grad and acc.param.shape == acc.grad.shape and acc.param.stride() == (0, 0)
    keys, segments, grads = acc.drain()
    assert keys.numel() == len(model) and (segments is not None) == with_segments
    assert len(acc) == 0 and acc.param.grad.shape == (0, 3)


def test_accumulator_checks_its_inputs():
    acc = GradAccumulator(2, torch.float32, "cpu")
    with pytest.raises(ValueError, match="grads: must be"):
        acc.add(torch.tensor([1, 2]), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="grads: must be"):
        acc.add(torch.tensor([1, 2]), torch.zeros(2, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="keys: must be"):
        acc.add(torch.tensor([1.0, 2.0]), torch.zeros(2, 2))
    acc.add(torch.tensor([1, 2]), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="segments: given in some"):
        acc.add(torch.tensor([1]), torch.zeros(1, 2), torch.tensor([0]))
    acc.clear()
    acc.add(torch.tensor([1]), torch.ones(1, 2), torch.tensor([0]))
    assert acc.segments.tolist() == [0]
