"""DynamicEmbedding(Bag) + fused optimizers against torch.nn.Embedding(Bag)(sparse=True) + torch.optim.

N ids per batch, V distinct ids, D embedding dim. Each dynemb key is an arbitrary int64 standing for
a dense id of the reference; batches contain duplicates.
"""

from __future__ import annotations

import pytest
import torch

import dynemb
from dynemb.hashing import mix64

V, D, STEPS = 50, 8, 30


def devices():
    cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    return ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, cuda])]


class RowWiseAdagradRef:
    """FBGEMM's row-wise Adagrad written out in plain torch on a sparse-grad nn.Embedding."""

    def __init__(self, weight: torch.Tensor, lr: float, eps: float, weight_decay: float = 0.0):
        self.weight, self.lr, self.eps, self.wd = weight, lr, eps, weight_decay
        self.state = torch.zeros(weight.shape[0], 1, dtype=weight.dtype, device=weight.device)

    def zero_grad(self):
        self.weight.grad = None

    @torch.no_grad()
    def step(self):
        g = self.weight.grad.coalesce()
        idx, val = g.indices()[0], g.values()
        w = self.weight.index_select(0, idx)
        val = val + self.wd * w
        s = self.state.index_select(0, idx) + val.square().mean(1, keepdim=True)
        self.state.index_copy_(0, idx, s)
        self.weight.index_copy_(0, idx, w - self.lr * val / (s.sqrt() + self.eps))


OPTIMIZERS = {
    "sgd": (lambda: dynemb.optim.SGD(lr=0.1), lambda p: torch.optim.SGD([p], lr=0.1)),
    "adagrad": (lambda: dynemb.optim.Adagrad(lr=0.1, lr_decay=0.01), lambda p: torch.optim.Adagrad([p], lr=0.1, lr_decay=0.01)),
    "rowwise_adagrad": (lambda: dynemb.optim.RowWiseAdagrad(lr=0.1, eps=1e-8), lambda p: RowWiseAdagradRef(p, lr=0.1, eps=1e-8)),
    "adam": (lambda: dynemb.optim.Adam(lr=0.05, betas=(0.8, 0.9), eps=1e-8), lambda p: torch.optim.SparseAdam([p], lr=0.05, betas=(0.8, 0.9), eps=1e-8)),
}


def reference_state(name: str, opt, weight: torch.Tensor) -> torch.Tensor:
    """Optimizer state per row [V, S] in dynemb's column layout."""
    if name == "sgd":
        return weight.new_zeros(weight.shape[0], 0)
    if name == "rowwise_adagrad":
        return opt.state
    state = opt.state[weight]
    if name == "adagrad":
        return state["sum"]
    return torch.cat([state["exp_avg"], state["exp_avg_sq"]], 1)


def keys_of(ids: torch.Tensor) -> torch.Tensor:
    """The int64 key standing for each dense id (a bijection reaching the whole int64 range)."""
    return mix64(ids + 12345)


def check_table(table, ref_weight, ref_state, device):
    all_ids = torch.arange(V, device=device)
    values, found = table.find(keys_of(all_ids))
    assert bool(found.all())
    torch.testing.assert_close(values, ref_weight.detach())
    chunks = list(table.export())
    keys = torch.cat([c["keys"] for c in chunks])
    state = torch.cat([c["optimizer_state"] for c in chunks])
    order = torch.argsort(keys)
    expected_order = torch.argsort(keys_of(all_ids))
    assert torch.equal(keys[order], keys_of(all_ids)[expected_order])
    torch.testing.assert_close(state[order], ref_state.detach()[expected_order])


def make_pair(name: str, device: str, module: str = "embedding", **bag):
    torch.manual_seed(0)
    make_dyn, make_ref = OPTIMIZERS[name]
    if module == "embedding":
        ref = torch.nn.Embedding(V, D, sparse=True, device=device)
        table = dynemb.DynamicEmbedding(D, 4 * V, optimizer=make_dyn(), device=device, bucket_capacity=8)
    else:
        ref = torch.nn.EmbeddingBag(V, D, sparse=True, device=device, **bag)
        table = dynemb.DynamicEmbeddingBag(D, 4 * V, optimizer=make_dyn(), device=device, bucket_capacity=8, **bag)
    with torch.no_grad():
        ref.weight.uniform_(-1, 1)
    table.insert(keys_of(torch.arange(V, device=device)), ref.weight.detach().clone())
    return table, ref, make_ref(ref.weight)


def loss_of(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # Depends on the output's value, so gradients differ per row and per step; a mean over
    # samples keeps training stable so rounding differences do not compound.
    return ((out - target) ** 2).sum(-1).mean() + out.mean()


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_embedding_matches_torch(name, device):
    table, ref, opt = make_pair(name, device)
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        ids = torch.randint(0, V, (6, 7), generator=gen).to(device)
        ids[0, :3] = ids[1, 0]  # duplicates, also across rows
        target = torch.randn(6, 7, D, generator=gen).to(device)
        out = table(keys_of(ids))
        out_ref = ref(ids)
        torch.testing.assert_close(out, out_ref)
        loss_of(out, target).backward()
        opt.zero_grad()
        loss_of(out_ref, target).backward()
        opt.step()
        check_table(table, ref.weight, reference_state(name, opt, ref.weight), device)
    assert table.stats()["size"] == V


BAG_CASES = {
    "sum_offsets": dict(mode="sum"),
    "mean_offsets": dict(mode="mean"),
    "weighted_sum": dict(mode="sum"),
    "mean_2d": dict(mode="mean"),
    "sum_last_offset": dict(mode="sum", include_last_offset=True),
}


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("case", list(BAG_CASES))
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_embedding_bag_matches_torch(name, case, device):
    kwargs = BAG_CASES[case]
    table, ref, opt = make_pair(name, device, module="bag", **kwargs)
    gen = torch.Generator().manual_seed(2)
    for _ in range(STEPS):
        if case == "mean_2d":
            ids = torch.randint(0, V, (5, 4), generator=gen)
            ids[:, 0] = ids[0, 1]
            offsets = None
        else:
            n = 23
            ids = torch.randint(0, V, (n,), generator=gen)
            ids[5:9] = ids[0]
            # Bags of random lengths, one of them empty.
            cuts = torch.sort(torch.randint(0, n + 1, (5,), generator=gen)).values
            offsets = torch.cat([torch.zeros(1, dtype=torch.int64), cuts])
            if kwargs.get("include_last_offset"):
                offsets = torch.cat([offsets, torch.tensor([n])])
            offsets = offsets.to(device)
        ids = ids.to(device)
        psw = torch.rand(ids.shape, generator=gen).to(device) if case == "weighted_sum" else None
        out = table(keys_of(ids), offsets, per_sample_weights=psw)
        out_ref = ref(ids, offsets, per_sample_weights=psw)
        torch.testing.assert_close(out, out_ref)
        target = torch.randn(out.shape, generator=gen).to(device)
        loss_of(out, target).backward()
        opt.zero_grad()
        loss_of(out_ref, target).backward()
        opt.step()
        check_table(table, ref.weight, reference_state(name, opt, ref.weight), device)


def test_learning_rate_changes_between_steps():
    table, ref, opt = make_pair("adagrad", "cpu")
    gen = torch.Generator().manual_seed(3)
    for step in range(6):
        lr = 0.1 / (step + 1)
        table.optimizer.lr = lr
        opt.param_groups[0]["lr"] = lr
        ids = torch.randint(0, V, (40,), generator=gen)
        table(keys_of(ids)).sum().backward()
        opt.zero_grad()
        ref(ids).sum().backward()
        opt.step()
    check_table(table, ref.weight, reference_state("adagrad", opt, ref.weight), "cpu")


def test_two_lookups_before_backward_sgd():
    """Two lookups of one table in a step: SGD's update is linear, so sequential fused updates
    equal torch's single step on the summed gradient."""
    table, ref, opt = make_pair("sgd", "cpu")
    gen = torch.Generator().manual_seed(4)
    for _ in range(5):
        a = torch.randint(0, V, (30,), generator=gen)
        b = torch.randint(0, V, (30,), generator=gen)
        (table(keys_of(a)).sum() + 2 * table(keys_of(b)).square().sum()).backward()
        opt.zero_grad()
        (ref(a).sum() + 2 * ref(b).square().sum()).backward()
        opt.step()
    check_table(table, ref.weight, reference_state("sgd", opt, ref.weight), "cpu")


@pytest.mark.parametrize("name", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
def test_weight_decay(name):
    """weight_decay adds wd * w to the gradient of the rows in a batch (torch's dense L2 rule)."""
    wd = 0.05
    make = {
        "sgd": lambda: dynemb.optim.SGD(lr=0.1, weight_decay=wd),
        "adagrad": lambda: dynemb.optim.Adagrad(lr=0.1, weight_decay=wd),
        "rowwise_adagrad": lambda: dynemb.optim.RowWiseAdagrad(lr=0.1, weight_decay=wd),
        "adam": lambda: dynemb.optim.Adam(lr=0.05, weight_decay=wd),
    }[name]
    torch.manual_seed(0)
    ref = torch.nn.Embedding(V, D)
    table = dynemb.DynamicEmbedding(D, 4 * V, optimizer=make(), bucket_capacity=8)
    table.insert(keys_of(torch.arange(V)), ref.weight.detach().clone())
    ids = torch.arange(V)  # every row in every batch, so dense torch optimizers are the reference
    if name == "rowwise_adagrad":
        opt = RowWiseAdagradRef(ref.weight, lr=0.1, eps=1e-8, weight_decay=wd)
        ref = torch.nn.Embedding.from_pretrained(ref.weight.detach(), freeze=False, sparse=True)
        opt.weight = ref.weight
    else:
        opt = {
            "sgd": lambda p: torch.optim.SGD([p], lr=0.1, weight_decay=wd),
            "adagrad": lambda p: torch.optim.Adagrad([p], lr=0.1, weight_decay=wd),
            "adam": lambda p: torch.optim.Adam([p], lr=0.05, weight_decay=wd),
        }[name](ref.weight)
    for _ in range(10):
        table(keys_of(ids)).square().sum().backward()
        opt.zero_grad()
        ref(ids).square().sum().backward()
        opt.step()
    values, _ = table.find(keys_of(ids))
    torch.testing.assert_close(values, ref.weight.detach())
