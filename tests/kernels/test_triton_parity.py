"""The Triton kernels (dynemb.kernels.gpu) against their plain-torch twins: bitwise for the
index's slots and rows and for the initial rows, assert_close for the optimizer steps.

On a GPU they run compiled on CUDA tensors; elsewhere under Triton's interpreter
(TRITON_INTERPRET=1, set by tests/conftest.py before Triton is first imported) on CPU
tensors: the same kernel source, so CI checks their logic on every run and the GPU session
checks the compiled code.
"""

from __future__ import annotations

import pytest
import torch

CUDA = torch.cuda.is_available()

from test_update_parity import optimizers  # noqa: E402

import dynemb  # noqa: E402
from dynemb.kernels.gpu import failure  # noqa: E402
from dynemb.kernels.init import init_rows_torch  # noqa: E402
from dynemb.kernels.locate import locate_torch  # noqa: E402
from dynemb.kernels.update import update_rows_torch  # noqa: E402
from dynemb.storage.initializers import RowInitializer  # noqa: E402
from dynemb.workspace import Workspace  # noqa: E402

if failure() is not None:  # the test command installs Triton: fail loudly, never skip
    raise RuntimeError(f"Triton does not import: {failure()}")

from dynemb.kernels.gpu.init import init_rows_triton  # noqa: E402
from dynemb.kernels.gpu.locate import candidates_triton, locate_triton  # noqa: E402
from dynemb.kernels.gpu.update import update_rows_triton  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
EXTREMES = [0, -1, 1, 2**63 - 1, -(2**63), -(2**63) + 1, 2**62, 12345]


def filled_index(keys: torch.Tensor, **kw) -> dynemb.KeyIndex:
    index = dynemb.KeyIndex(backend="torch", device=DEVICE, **kw)
    index.find_or_insert(keys.to(DEVICE), now=1)
    return index


def check_locate(index: dynemb.KeyIndex, queries: torch.Tensor, seg: torch.Tensor | None = None) -> None:
    queries = queries.to(DEVICE)
    b1, b2 = index._segments.candidates(queries, seg)
    t1, t2 = candidates_triton(index._segments, queries, seg)
    assert torch.equal(t1, b1) and torch.equal(t2, b2)
    pos, found = locate_torch(index._keys, index._tags, b1, b2, queries, Workspace(DEVICE))
    tpos, tfound, trows = locate_triton(index._keys, index._tags, index._segments, queries, seg, index._rows)
    assert torch.equal(tpos, pos) and torch.equal(tfound, found)
    rows = torch.where(found, index._rows.view(-1).index_select(0, pos.clamp(min=0)).long(), -1)
    assert torch.equal(trows, rows)


@pytest.mark.parametrize("bucket_capacity", [16, 5, 1])
def test_locate_adversarial_keys(bucket_capacity):
    g = torch.Generator().manual_seed(bucket_capacity)
    present = torch.cat([torch.tensor(EXTREMES), torch.randint(-(2**62), 2**62, (700,), generator=g)])
    index = filled_index(present, capacity=2048, bucket_capacity=bucket_capacity)
    absent = torch.randint(-(2**62), 2**62, (300,), generator=g)
    queries = torch.cat([present, absent, present[:50], torch.tensor([0, 0, -1])])  # duplicates too
    check_locate(index, queries[torch.randperm(queries.numel(), generator=g)])


def test_locate_keys_of_one_bucket_and_erased_slots():
    # Keys whose two candidates are the same bucket of a 64-bucket index, then half of them erased.
    index = dynemb.KeyIndex(capacity=1024, bucket_capacity=16, backend="torch", device=DEVICE)
    cand = torch.arange(200_000)
    b1, b2 = index._segments.candidates(cand.to(DEVICE), None)
    one = cand[((b1 == 7) & (b2 == 7)).cpu()][:16]
    assert one.numel() >= 4
    index.find_or_insert(one.to(DEVICE), now=1)
    index.erase(one[::2].to(DEVICE))
    check_locate(index, torch.cat([one, one.flip(0)]))


def test_locate_segments():
    index = dynemb.KeyIndex(capacities=[256, 1024, 64], bucket_capacity=8, backend="torch", device=DEVICE)
    g = torch.Generator().manual_seed(1)
    keys = torch.randint(-1000, 1000, (600,), generator=g)
    seg = torch.randint(0, 3, (600,), generator=g)
    pairs = torch.unique(torch.stack([seg, keys], 1), dim=0)
    index.upsert_unique(pairs[:, 1].to(DEVICE), torch.ones(len(pairs), dtype=torch.int64, device=DEVICE), now=1, segments=pairs[:, 0].to(DEVICE))
    queries = torch.cat([keys, torch.tensor(EXTREMES)])
    qseg = torch.cat([seg, torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])]).to(DEVICE)
    check_locate(index, queries, qseg)


def test_empty_batches():
    index = filled_index(torch.arange(10), capacity=64)
    check_locate(index, torch.empty(0, dtype=torch.int64))


@pytest.mark.parametrize("name", list(optimizers()))
@pytest.mark.parametrize("D", [12, 1])
def test_update_matches_the_optimizer(name, D):
    opt = optimizers()[name]
    g = torch.Generator().manual_seed(D)
    R, U = 200, 60
    table = torch.randn(R, D + opt.state_dim(D), generator=g)
    table[:, D:] = table[:, D:].abs()
    rows = torch.randperm(R, generator=g)[:U]
    grads = torch.randn(U, 2 * D, generator=g)[:, :D]  # strided rows
    grads[3, 0], grads[7, D - 1] = float("nan"), float("inf")
    table, rows, grads = table.to(DEVICE), rows.to(DEVICE), grads.to(DEVICE)
    for check in (True, False):
        ours, theirs = table.clone(), table.clone()
        bad = update_rows_triton(ours, rows, grads, opt.native_update(3), check=check)
        want = update_rows_torch(opt, theirs, rows, grads, 3, check=check)
        if check:
            assert torch.equal(bad, want)
            torch.testing.assert_close(ours, theirs)
        else:
            assert bad is None and want is None
            torch.testing.assert_close(ours, theirs, equal_nan=True)


@pytest.mark.parametrize("D", [1, 7, 64])
@pytest.mark.parametrize("optimizer", [None, dynemb.optim.RowWiseAdagrad(initial_accumulator_value=0.5), dynemb.optim.Adam()])
def test_init_rows_bitwise_like_the_initializer(D, optimizer):
    config = dynemb.Initializer(low=-0.3, high=0.7) if D == 7 else dynemb.Initializer()
    init = RowInitializer(config, D, 11, torch.float32, DEVICE)
    keys = torch.tensor(EXTREMES + list(range(100, 400, 7)), dtype=torch.int64, device=DEVICE)
    width = D + (0 if optimizer is None else optimizer.state_dim(D))
    rows = torch.randperm(500, generator=torch.Generator().manual_seed(D))[: keys.numel()].to(DEVICE)
    ours = torch.full((500, width), float("nan"), device=DEVICE)
    theirs = ours.clone()
    state = 0.0 if optimizer is None else optimizer.initial_state_value()
    init_rows_triton(ours, rows, keys, D, 11, init.low, init.high, state)
    init_rows_torch(theirs, rows, init(keys), optimizer)
    assert torch.equal(ours.nan_to_num(7.0), theirs.nan_to_num(7.0))


needs_cuda = [pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason="needs CUDA")]


@pytest.mark.parametrize("optimizer", [dynemb.optim.SGD(lr=0.1), dynemb.optim.RowWiseAdagrad(lr=0.1), dynemb.optim.Adam(lr=0.01)])
@pytest.mark.parametrize("mark", [pytest.param(0, marks=needs_cuda)])
def test_a_cuda_table_trains_the_same_on_both_backends(optimizer, mark):
    g = torch.Generator().manual_seed(0)
    tables = [dynemb.DynamicEmbedding(16, 1 << 15, optimizer=optimizer, backend=b, seed=5, device="cuda") for b in ("torch", "native")]
    assert [t.engine.index.triton for t in tables] == [False, True]
    v = torch.randn(16, generator=g).cuda()
    for _ in range(6):
        keys = torch.cat([torch.tensor(EXTREMES), torch.randint(-(2**40), 2**40, (3000,), generator=g)]).cuda()
        for t in tables:
            (t(keys) * v).sum().backward()
    exports = [next(t.export()) for t in tables]
    assert torch.equal(exports[0]["keys"], exports[1]["keys"])
    torch.testing.assert_close(exports[0]["embeddings"], exports[1]["embeddings"])


@pytest.mark.parametrize("mark", [pytest.param(0, marks=needs_cuda)])
def test_a_cuda_index_upserts_the_same_on_both_backends(mark):
    g = torch.Generator().manual_seed(2)
    indexes = [dynemb.KeyIndex(capacity=4096, backend=b, device="cuda") for b in ("torch", "native")]
    for step in range(12):  # past capacity: evictions too
        keys = torch.randint(-(2**62), 2**62, (900,), generator=g).cuda()
        keys[:100] = keys[100:200]  # duplicates
        results = [index.find_or_insert(keys, now=step) for index in indexes]
        for name in ("positions", "rows", "found", "inserted", "evicted_keys", "evicted_rows", "failed_keys"):
            assert torch.equal(getattr(results[0], name), getattr(results[1], name)), name
