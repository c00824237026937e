"""The compiled row initialisation against its plain-torch twin: bitwise the same rows."""

from __future__ import annotations

import pytest
import torch

import dynemb
from dynemb.kernels import uses_native
from dynemb.kernels.init import init_rows_native, init_rows_torch
from dynemb.storage.initializers import RowInitializer

pytestmark = pytest.mark.skipif(not uses_native("native", "cpu"), reason="compiled kernels could not be built")

KEYS = [0, -1, 2**63 - 1, -(2**63), 1, 12345, -987654321, 2**40 + 3]


@pytest.mark.parametrize("D", [1, 2, 7, 64, 129])
@pytest.mark.parametrize("optimizer", [None, dynemb.optim.RowWiseAdagrad(initial_accumulator_value=0.5), dynemb.optim.Adam()])
@pytest.mark.parametrize("layout", ["scattered", "shuffled range", "ascending"])
def test_rows_bitwise_like_the_initializer(D, optimizer, layout):
    """Rows scattered over the table (the kernel sorts them), a shuffled contiguous range (put in
    order by one pass), or already ascending (taken as they come)."""
    config = dynemb.Initializer(low=-0.3, high=0.7) if D == 7 else dynemb.Initializer()
    init = RowInitializer(config, D, 11, torch.float32, torch.device("cpu"))
    keys = torch.tensor(KEYS + list(range(100, 400, 7)), dtype=torch.int64)
    width = D + (0 if optimizer is None else optimizer.state_dim(D))
    perm = torch.randperm(500, generator=torch.Generator().manual_seed(D))
    rows = {
        "scattered": perm[: keys.numel()],
        "shuffled range": 37 + perm[perm < keys.numel()],
        "ascending": perm[: keys.numel()].sort().values,
    }[layout]
    ours = torch.full((500, width), float("nan"))
    theirs = ours.clone()
    state = 0.0 if optimizer is None else optimizer.initial_state_value()
    init_rows_native(ours, rows, keys, D, 11, init.low, init.high, state)
    init_rows_torch(theirs, rows, init(keys), optimizer)
    assert torch.equal(ours.nan_to_num(7.0), theirs.nan_to_num(7.0))


@pytest.mark.parametrize("rows", [[0], [499], [7, 3], [499, 0], [5, 4, 3, 2, 1], [3, 1, 2, 0]])
def test_few_rows_in_any_order_bitwise_like_the_initializer(rows):
    """One row at either end of the table, rows descending, a shuffled range of four."""
    init = RowInitializer(dynemb.Initializer(), 6, 2, torch.float32, torch.device("cpu"))
    rows = torch.tensor(rows)
    keys = torch.tensor(KEYS[: rows.numel()])
    ours = torch.full((500, 7), float("nan"))
    theirs = ours.clone()
    init_rows_native(ours, rows, keys, 6, 2, init.low, init.high, 0.5)
    init_rows_torch(theirs, rows, init(keys), dynemb.optim.RowWiseAdagrad(initial_accumulator_value=0.5))
    assert torch.equal(ours.nan_to_num(7.0), theirs.nan_to_num(7.0))


def test_repeated_rows_are_each_written_with_one_of_their_keys():
    """Rows must be distinct; where they repeat anyway (here inside a range as wide as the rows
    given), each is written with the values of one of its keys and nothing else is touched."""
    init = RowInitializer(dynemb.Initializer(), 4, 2, torch.float32, torch.device("cpu"))
    # Views one element into their buffers: an index of -1 (a place left unset) would read row 3
    # and key 99, and write row 3.
    rows, keys = torch.tensor([3, 0, 0, 2])[1:], torch.tensor([99, 11, 22, 33])[1:]
    ours = torch.full((5, 4), float("nan"))
    init_rows_native(ours, rows, keys, 4, 2, init.low, init.high, 0.0)
    values = init(keys)
    assert torch.equal(ours[2], values[2]) and (torch.equal(ours[0], values[0]) or torch.equal(ours[0], values[1]))
    assert ours[[1, 3, 4]].isnan().all()


@pytest.mark.parametrize("D", [128, 129, 130])
@pytest.mark.parametrize("offset", [0, 1])
def test_many_rows_streamed_past_the_caches_bitwise_like_the_initializer(D, offset):
    """Enough rows (over 4 MiB) for the kernel's non-temporal stores: rows of 16-byte multiples
    and rows whose starts fall anywhere, on a table whose first float is not 16-byte aligned."""
    optimizer = dynemb.optim.RowWiseAdagrad(initial_accumulator_value=0.25) if D != 128 else None
    width = D + (0 if optimizer is None else optimizer.state_dim(D))
    init = RowInitializer(dynemb.Initializer(), D, 5, torch.float32, torch.device("cpu"))
    R, n = 20000, 10000
    keys = torch.randint(-(2**62), 2**62, (n,), generator=torch.Generator().manual_seed(D))
    rows = torch.randperm(R, generator=torch.Generator().manual_seed(offset))[:n]
    ours = torch.full((R * width + offset,), float("nan"))[offset:].view(R, width)
    theirs = ours.clone()
    state = 0.0 if optimizer is None else optimizer.initial_state_value()
    init_rows_native(ours, rows, keys, D, 5, init.low, init.high, state)
    init_rows_torch(theirs, rows, init(keys), optimizer)
    assert torch.equal(ours.nan_to_num(7.0), theirs.nan_to_num(7.0))


def test_a_table_writes_the_same_rows_on_both_backends():
    keys = torch.tensor(KEYS * 2 + list(range(1000)))
    tables = [dynemb.DynamicEmbedding(9, 4096, optimizer=dynemb.optim.Adagrad(initial_accumulator_value=0.1), backend=b, seed=3) for b in ("torch", "native")]
    for t in tables:
        t(keys)
    exports = [next(t.export()) for t in tables]
    for name in ("keys", "embeddings"):
        assert torch.equal(*[e[name] for e in exports]), name


def test_a_custom_initial_state_has_no_native_value():
    class Ones(dynemb.optim.RowWiseAdagrad):
        def init_state(self, state):
            state.fill_(1.0)

    assert Ones().initial_state_value() is None
    assert dynemb.optim.Adagrad(initial_accumulator_value=0.2).initial_state_value() == 0.2
