"""The compiled optimizer update against its plain-torch twin (the optimizers' own update on
gathered rows): every optimizer, weight decay, skip / apply of non-finite rows, strided grads;
and the update that sums a bag collection's gradient in its own pass against the two kernels it
fuses (bitwise) and its plain-torch twin."""

from __future__ import annotations

import pytest
import torch

import dynemb
from dynemb.kernels import uses_native
from dynemb.kernels.pool import sum_bags_native
from dynemb.kernels.update import update_rows_from_bags_native, update_rows_from_bags_torch, update_rows_native, update_rows_torch

pytestmark = pytest.mark.skipif(not uses_native("native", "cpu"), reason="compiled kernels could not be built")

D, R, U = 12, 300, 90


def optimizers():
    return {
        "sgd": dynemb.optim.SGD(lr=0.3),
        "sgd_wd": dynemb.optim.SGD(lr=0.3, weight_decay=0.1),
        "adagrad": dynemb.optim.Adagrad(lr=0.2, lr_decay=0.05, eps=1e-6, weight_decay=0.01),
        "rowwise_adagrad": dynemb.optim.RowWiseAdagrad(lr=0.2, eps=1e-6),
        "rowwise_adagrad_wd": dynemb.optim.RowWiseAdagrad(lr=0.2, eps=1e-6, weight_decay=0.05),
        "adam": dynemb.optim.Adam(lr=0.01, betas=(0.8, 0.95), weight_decay=0.02),
    }


def table_and_batch(optimizer, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    S = optimizer.state_dim(D)
    table = torch.randn(R, D + S, generator=g)
    # State columns must be valid for the optimizer (accumulators >= 0).
    table[:, D:] = table[:, D:].abs()
    rows = torch.randperm(R, generator=g)[:U]
    grads = torch.randn(U, D, generator=g)
    return table, rows, grads


@pytest.mark.parametrize("name", list(optimizers()))
@pytest.mark.parametrize("step", [1, 7])
def test_update_matches_the_optimizer(name, step):
    opt = optimizers()[name]
    table, rows, grads = table_and_batch(opt)
    ours, theirs = table.clone(), table.clone()
    assert update_rows_native(ours, rows, grads, opt.native_update(step), check=True) is None
    update_rows_torch(opt, theirs, rows, grads, step, check=True)
    torch.testing.assert_close(ours, theirs)
    # Rows outside the batch are untouched.
    others = torch.ones(R, dtype=torch.bool).index_fill_(0, rows, False)
    assert torch.equal(ours[others], table[others])


@pytest.mark.parametrize("name", ["sgd", "rowwise_adagrad", "adam"])
def test_nonfinite_rows_are_skipped_or_applied_like_the_twin(name):
    opt = optimizers()[name]
    table, rows, grads = table_and_batch(opt, 1)
    grads[3, 2] = float("nan")
    grads[10, 0] = float("inf")
    # A finite gradient whose square overflows float32: the update is not finite.
    grads[20, 5] = 3e38
    for check in (True, False):
        ours, theirs = table.clone(), table.clone()
        bad = update_rows_native(ours, rows, grads, opt.native_update(1), check=check)
        want = update_rows_torch(opt, theirs, rows, grads, 1, check=check)
        if check:
            assert torch.equal(bad, want) and bad[[3, 10]].all()
            assert torch.equal(ours.index_select(0, rows[bad]), table.index_select(0, rows[bad]))
        else:
            assert bad is None and want is None
        torch.testing.assert_close(ours, theirs, equal_nan=True)


def test_strided_gradient_rows():
    opt = optimizers()["rowwise_adagrad"]
    table, rows, grads = table_and_batch(opt, 2)
    wide = torch.randn(U, 2 * D)
    wide[:, :D] = grads
    ours, theirs = table.clone(), table.clone()
    update_rows_native(ours, rows, wide[:, :D], opt.native_update(3), check=False)
    update_rows_torch(opt, theirs, rows, grads, 3, check=False)
    torch.testing.assert_close(ours, theirs)


def test_an_optimizer_overriding_update_has_no_native_step():
    class Halved(dynemb.optim.SGD):
        def update(self, weight, state, grad, step):
            weight.add_(grad, alpha=-self.lr / 2)

    assert Halved(lr=0.1).native_update(1) is None
    assert dynemb.optim.SGD(lr=0.1).native_update(1) is not None


def bag_gradient(k: int, seed: int, hot: int = 40):
    """A concat gradient in unit rows and U rows' ids (row 0 hot, ``hot`` ids; some rows of one
    id), as a bag collection's backward hands them over: (grad_rows, first_row, order, starts)."""
    g = torch.Generator().manual_seed(seed)
    B, K, u = 50, 6, D // k
    grad_rows = torch.randn(B * K, u, generator=g)
    n = 3 * U
    first_row = torch.randint(0, B, (n,), generator=g) * K + torch.randint(0, K - k + 1, (n,), generator=g)
    inverse = torch.cat([torch.zeros(hot, dtype=torch.int64), torch.arange(U), torch.randint(1, U, (n - hot - U,), generator=g)])
    inverse = inverse[torch.randperm(n, generator=g)]
    order = torch.argsort(inverse, stable=True)
    counts = torch.bincount(inverse, minlength=U)
    return grad_rows, first_row, order, counts.cumsum(0) - counts


@pytest.mark.parametrize("name", list(optimizers()))
@pytest.mark.parametrize("k", [1, 3])
def test_update_from_bags_is_the_sum_then_the_update(name, k):
    opt = optimizers()[name]
    table, rows, _ = table_and_batch(opt, 3)
    bags = bag_gradient(k, 4)
    fused, apart, twin = table.clone(), table.clone(), table.clone()
    assert update_rows_from_bags_native(fused, rows, *bags, k, opt.native_update(5), check=True) is None
    update_rows_native(apart, rows, sum_bags_native(*bags, U, k), opt.native_update(5), check=True)
    # The same floats summed in the same order, then the same step: bitwise.
    assert torch.equal(fused, apart)
    update_rows_from_bags_torch(opt, twin, rows, *bags, k, 5, check=True)
    torch.testing.assert_close(fused, twin)
    others = torch.ones(R, dtype=torch.bool).index_fill_(0, rows, False)
    assert torch.equal(fused[others], table[others])


@pytest.mark.parametrize("name", ["sgd", "rowwise_adagrad", "adam"])
def test_update_from_bags_skips_nonfinite_rows_like_the_two_kernels(name):
    opt = optimizers()[name]
    table, rows, _ = table_and_batch(opt, 5)
    grad_rows, first_row, order, starts = bag_gradient(1, 6)
    # One id of row 7 and one of row 30 bring a NaN and an inf; row 50's sum overflows.
    grad_rows[first_row[order[starts[7]]], 1] = float("nan")
    grad_rows[first_row[order[starts[30]]], 0] = float("inf")
    grad_rows[first_row[order[starts[50]]], 2] = 3e38
    bags = (grad_rows, first_row, order, starts)
    for check in (True, False):
        fused, apart = table.clone(), table.clone()
        bad = update_rows_from_bags_native(fused, rows, *bags, 1, opt.native_update(1), check=check)
        want = update_rows_native(apart, rows, sum_bags_native(*bags, U, 1), opt.native_update(1), check=check)
        if check:
            assert torch.equal(fused, apart)
            assert torch.equal(bad, want) and bad[[7, 30]].all()
        else:
            # Applied: NaN rows compare equal only as NaN.
            torch.testing.assert_close(fused, apart, equal_nan=True, rtol=0, atol=0)
            assert bad is None and want is None


def test_update_from_bags_refuses_mismatched_inputs():
    opt = optimizers()["sgd"]
    table, rows, _ = table_and_batch(opt, 7)
    grad_rows, first_row, order, starts = bag_gradient(1, 8)
    before = table.clone()
    with pytest.raises(ValueError, match="starts"):
        update_rows_from_bags_native(table, rows, grad_rows, first_row, order, starts[:-1], 1, opt.native_update(1), check=True)
    assert torch.equal(table, before)
