"""Each update rule against its reference on plain tensors, step after step.

V rows, D embedding dim, S state columns, K rows in a step's batch. Rows are stored as the tables
store them, ``[embedding | state]`` in one [V, D+S] tensor, so ``update`` gets strided views.
"""

from __future__ import annotations

import pytest
import torch

from dynemb.optim import SGD, Adagrad, Adam, RowOptimizer, RowWiseAdagrad

V, D, K, STEPS = 12, 5, 7, 6


def batches(every_row: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(rows [K] unique, grad [K, D]) per step; all V rows each step if every_row, else K of the
    first V - 2 (the last two rows never appear)."""
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        rows = torch.arange(V) if every_row else torch.randperm(V - 2, generator=gen)[:K]
        out.append((rows, torch.randn(rows.numel(), D, generator=gen)))
    return out


def run_fused(opt: RowOptimizer, weight: torch.Tensor, steps) -> tuple[torch.Tensor, torch.Tensor]:
    """Final weight [V, D] and state [V, S] after applying opt.update to each batch's rows."""
    S = opt.state_dim(D)
    table = torch.full((V, D + S), float("nan"))
    table[:, :D] = weight
    opt.init_state(table[:, D:])
    for t, (rows, grad) in enumerate(steps, 1):
        data = table[rows]  # [K, D+S]
        opt.update(data[:, :D], data[:, D:], grad, t)
        table[rows] = data
    return table[:, :D], table[:, D:]


def run_torch(make, weight: torch.Tensor, steps, sparse: bool) -> tuple[torch.Tensor, torch.optim.Optimizer]:
    """Final weight and the torch optimizer after the same batches as gradients of a [V, D] param."""
    param = weight.clone().requires_grad_()
    opt = make(param)
    # Checked sparse tensors (torch warns when the checks are left implicit).
    with torch.sparse.check_sparse_tensor_invariants():
        for rows, grad in steps:
            if sparse:
                param.grad = torch.sparse_coo_tensor(rows[None], grad, (V, D))
            else:
                param.grad = torch.zeros(V, D).index_copy_(0, rows, grad)
            opt.step()
    return param.detach(), opt


def initial_weight() -> torch.Tensor:
    return torch.randn(V, D, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_sgd_matches_torch_sgd(weight_decay):
    # torch's sparse SGD refuses weight decay; with it, every row is in every batch (dense).
    steps = batches(every_row=weight_decay > 0)
    w0 = initial_weight()
    got, state = run_fused(SGD(lr=0.1, weight_decay=weight_decay), w0, steps)
    make = lambda p: torch.optim.SGD([p], lr=0.1, weight_decay=weight_decay)
    want, _ = run_torch(make, w0, steps, sparse=weight_decay == 0)
    torch.testing.assert_close(got, want)
    assert state.shape == (V, 0)


@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_adagrad_matches_torch_adagrad(weight_decay):
    steps = batches(every_row=weight_decay > 0)
    w0 = initial_weight()
    kw = {"lr": 0.1, "lr_decay": 0.02, "weight_decay": weight_decay, "initial_accumulator_value": 0.3, "eps": 1e-10}
    got, state = run_fused(Adagrad(**kw), w0, steps)
    want, ref = run_torch(lambda p: torch.optim.Adagrad([p], **kw), w0, steps, sparse=weight_decay == 0)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(state, ref.state[ref.param_groups[0]["params"][0]]["sum"])


def test_adam_matches_torch_sparse_adam():
    """Lazy: rows absent from a batch keep their weight and moments; bias correction uses the
    count of steps, as SparseAdam does."""
    steps = batches(every_row=False)
    w0 = initial_weight()
    kw = {"lr": 0.05, "betas": (0.8, 0.9), "eps": 1e-8}
    got, state = run_fused(Adam(**kw), w0, steps)
    want, ref = run_torch(lambda p: torch.optim.SparseAdam([p], **kw), w0, steps, sparse=True)
    torch.testing.assert_close(got, want)
    ref_state = ref.state[ref.param_groups[0]["params"][0]]
    torch.testing.assert_close(state, torch.cat([ref_state["exp_avg"], ref_state["exp_avg_sq"]], 1))


def test_adam_weight_decay_matches_torch_adam():
    """With every row in every batch, lazy Adam with L2 weight decay is torch.optim.Adam. Adam adds
    eps after the bias correction of sqrt(v), SparseAdam before; with eps=1e-8 and gradients of
    order 1 that differs by ~1e-8 relative, well inside the default float32 tolerance."""
    steps = batches(every_row=True)
    w0 = initial_weight()
    kw = {"lr": 0.05, "betas": (0.8, 0.9), "eps": 1e-8, "weight_decay": 0.05}
    got, state = run_fused(Adam(**kw), w0, steps)
    want, ref = run_torch(lambda p: torch.optim.Adam([p], **kw), w0, steps, sparse=False)
    torch.testing.assert_close(got, want)
    ref_state = ref.state[ref.param_groups[0]["params"][0]]
    torch.testing.assert_close(state, torch.cat([ref_state["exp_avg"], ref_state["exp_avg_sq"]], 1))


@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_rowwise_adagrad_matches_fbgemm_formula(weight_decay):
    """FBGEMM EXACT_ROWWISE_ADAGRAD with L2 weight decay, per row r of the batch:
    g = grad_r + wd * w_r;  s_r += sum(g*g) / D;  w_r -= lr * g / (sqrt(s_r) + eps)."""
    steps = batches(every_row=False)
    w0 = initial_weight()
    lr, eps, s0 = 0.1, 1e-8, 0.2
    opt = RowWiseAdagrad(lr=lr, eps=eps, weight_decay=weight_decay, initial_accumulator_value=s0)
    got, state = run_fused(opt, w0, steps)
    w, s = w0.clone(), torch.full((V,), s0)
    for rows, grad in steps:
        for r, g in zip(rows.tolist(), grad):
            g = g + weight_decay * w[r]
            s[r] += (g * g).sum() / D
            w[r] -= lr * g / (s[r].sqrt() + eps)
    torch.testing.assert_close(got, w)
    torch.testing.assert_close(state, s[:, None])


@pytest.mark.parametrize("cls", [SGD, Adagrad, RowWiseAdagrad, Adam])
def test_rows_outside_the_batch_do_not_move(cls):
    steps = batches(every_row=False)
    w0 = initial_weight()
    opt = cls(lr=0.1)
    got, state = run_fused(opt, w0, steps)
    untouched = torch.ones(V, dtype=torch.bool)
    for rows, _ in steps:
        untouched[rows] = False
    assert torch.equal(got[untouched], w0[untouched])
    fresh = torch.empty(int(untouched.sum()), opt.state_dim(D))
    opt.init_state(fresh)
    assert torch.equal(state[untouched], fresh)
