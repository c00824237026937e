"""DeviceRowStore against a plain-tensor model, and the RowStore contract through a table.

n rows in a call, W = D + S row width, C capacity in rows, D embedding dim.
"""

from __future__ import annotations

import pytest
import torch

from dynemb.storage.base import RowStore
from dynemb.storage.device_store import DeviceRowStore

W, C = 6, 40


def written(store: DeviceRowStore, model: torch.Tensor, mask: torch.Tensor) -> None:
    """Every row the model says was written reads back bitwise from the store."""
    rows = mask.nonzero().squeeze(1)
    torch.testing.assert_close(store.gather(rows), model.index_select(0, rows), rtol=0, atol=0)


def test_satisfies_the_protocol():
    store = DeviceRowStore(W, C)
    assert isinstance(store, RowStore)
    assert (store.width, store.capacity, store.dtype, store.device) == (W, C, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("init_rows", [1, 3, C])
def test_random_operations_match_a_tensor_model(seed, init_rows):
    # Random reserve / full-width scatter / first-k scatter / gather against a [C, W] tensor
    # holding what was written; growth by doubling must keep every written row.
    g = torch.Generator().manual_seed(seed)
    store = DeviceRowStore(W, C, init_rows=init_rows)
    model = torch.zeros(C, W)
    mask = torch.zeros(C, dtype=torch.bool)  # rows written in full, so defined
    reserved = 0
    for _ in range(60):
        op = int(torch.randint(4, (1,), generator=g))
        if op == 0:
            reserved = max(reserved, int(torch.randint(1, C + 1, (1,), generator=g)))
            store.reserve(reserved)
        elif reserved and op in (1, 2):
            n = int(torch.randint(1, reserved + 1, (1,), generator=g))
            rows = torch.randperm(reserved, generator=g)[:n]
            k = W if op == 1 else int(torch.randint(0, W + 1, (1,), generator=g))
            values = torch.randn(n, k, generator=g)
            store.scatter(rows, values)
            model[rows, :k] = values
            if k == W:
                mask[rows] = True
            # A first-k write into a row never written in full leaves its other columns undefined.
            written(store, model, mask)
        elif reserved:
            rows = mask.nonzero().squeeze(1)
            rows = rows[torch.randperm(rows.numel(), generator=g)]
            torch.testing.assert_close(store.gather(rows), model.index_select(0, rows), rtol=0, atol=0)
    written(store, model, mask)


def test_scatter_first_k_columns_keeps_the_others():
    store = DeviceRowStore(W, C)
    store.reserve(4)
    full = torch.arange(4 * W, dtype=torch.float32).view(4, W)
    store.scatter(torch.arange(4), full)
    store.scatter(torch.tensor([2, 0]), torch.tensor([[-1.0, -2.0], [-3.0, -4.0]]))
    expected = full.clone()
    expected[2, :2] = torch.tensor([-1.0, -2.0])
    expected[0, :2] = torch.tensor([-3.0, -4.0])
    torch.testing.assert_close(store.gather(torch.arange(4)), expected, rtol=0, atol=0)


def test_gather_returns_a_fresh_tensor():
    store = DeviceRowStore(W, C)
    store.reserve(3)
    values = torch.randn(3, W)
    store.scatter(torch.arange(3), values)
    out = store.gather(torch.tensor([1, 1, 2]))
    out.fill_(7.0)
    torch.testing.assert_close(store.gather(torch.arange(3)), values, rtol=0, atol=0)
    # Nor does the store keep the caller's values tensor.
    values.fill_(-7.0)
    assert not bool((store.gather(torch.arange(3)) == -7.0).any())


def test_gather_of_no_rows():
    store = DeviceRowStore(W, C)
    out = store.gather(torch.empty(0, dtype=torch.int64))
    assert out.shape == (0, W) and out.dtype == torch.float32


def test_growth_keeps_rows_and_stays_within_capacity():
    store = DeviceRowStore(W, C, init_rows=1)
    store.reserve(1)
    first = torch.randn(1, W)
    store.scatter(torch.tensor([0]), first)
    sizes = [store.nbytes()]
    for n in (2, 3, 9, C):
        store.reserve(n)
        sizes.append(store.nbytes())
        torch.testing.assert_close(store.gather(torch.tensor([0])), first, rtol=0, atol=0)
        # Growth by doubling: enough for n rows, never more than twice n (nor than C).
        assert n * W * 4 <= store.nbytes() <= min(2 * n, C) * W * 4
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1] == C * W * 4
    store.scatter(torch.tensor([C - 1]), first)
    torch.testing.assert_close(store.gather(torch.tensor([C - 1, 0])), first.expand(2, W), rtol=0, atol=0)


def test_reserve_within_allocated_rows_allocates_nothing():
    store = DeviceRowStore(W, C)
    before = store.nbytes()
    assert before == C * W * 4
    for n in (0, 1, C):
        store.reserve(n)
        assert store.nbytes() == before


def test_reserve_past_capacity_is_refused_and_keeps_rows():
    store = DeviceRowStore(W, C, init_rows=4)
    store.reserve(4)
    values = torch.randn(4, W)
    store.scatter(torch.arange(4), values)
    before = store.nbytes()
    with pytest.raises(ValueError, match=f"n={C + 1}: more rows than the store's capacity {C}"):
        store.reserve(C + 1)
    assert store.nbytes() == before
    torch.testing.assert_close(store.gather(torch.arange(4)), values, rtol=0, atol=0)


@pytest.mark.parametrize("name,value", [("width", 0), ("width", -3), ("width", 2.0), ("width", True), ("capacity", 0), ("capacity", None), ("capacity", "8")])
def test_constructor_names_bad_argument(name, value):
    kwargs = {"width": W, "capacity": C, name: value}
    with pytest.raises(ValueError, match=f"{name}={value!r}: must be an int >= 1"):
        DeviceRowStore(kwargs["width"], kwargs["capacity"])


def test_rows_out_of_range_raise():
    # The contract asks callers for valid ids; a bad one must still raise (torch's bounds check)
    # rather than read or write memory past the rows.
    store = DeviceRowStore(W, C)
    store.scatter(torch.arange(C), torch.ones(C, W))
    with pytest.raises(IndexError):
        store.gather(torch.tensor([0, C]))
    with pytest.raises((IndexError, RuntimeError)):
        store.scatter(torch.tensor([C]), torch.full((1, W), 5.0))
    with pytest.raises((IndexError, RuntimeError)):
        store.scatter(torch.tensor([-C - 1]), torch.full((1, 2), 5.0))
    with pytest.raises(ValueError, match="values"):
        store.scatter(torch.tensor([1]), torch.full((1, W + 1), 5.0))
    torch.testing.assert_close(store.gather(torch.arange(C)), torch.ones(C, W), rtol=0, atol=0)


@pytest.mark.parametrize("k", [W, 2])
def test_scatter_with_one_bad_row_writes_nothing(k):
    store = DeviceRowStore(W, C)
    store.scatter(torch.arange(C), torch.ones(C, W))
    with pytest.raises((IndexError, RuntimeError)):
        store.scatter(torch.tensor([1, C]), torch.full((2, k), 5.0))
    torch.testing.assert_close(store.gather(torch.arange(C)), torch.ones(C, W), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64, torch.float32])
def test_to_dtype_matches_torch(dtype):
    store = DeviceRowStore(W, C, init_rows=8)
    store.reserve(5)
    # Values beyond float16's range and below bfloat16's precision, so a wrong rounding shows.
    values = torch.cat([torch.randn(4, W, generator=torch.Generator().manual_seed(0)) * 1000, torch.full((1, W), 1e5 + 1 / 3)])
    store.scatter(torch.arange(5), values)
    moved = store.to(torch.device("cpu"), dtype)
    assert isinstance(moved, RowStore)
    assert (moved.dtype, moved.device, moved.width, moved.capacity) == (dtype, torch.device("cpu"), W, C)
    out = moved.gather(torch.arange(5))
    assert out.dtype == dtype
    torch.testing.assert_close(out, values.to(dtype), rtol=0, atol=0, equal_nan=True)
    assert moved.nbytes() == 8 * W * torch.empty(0, dtype=dtype).element_size()
    # The moved store keeps working: writes in the new dtype, growth, reads.
    moved.reserve(20)
    moved.scatter(torch.tensor([19]), torch.ones(1, W, dtype=dtype))
    torch.testing.assert_close(moved.gather(torch.tensor([19, 0])), torch.cat([torch.ones(1, W), values[:1]]).to(dtype), rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_to_cuda_and_back():
    store = DeviceRowStore(W, C)
    values = torch.randn(C, W)
    store.scatter(torch.arange(C), values)
    cuda = store.to(torch.device("cuda"), torch.bfloat16)
    assert cuda.device.type == "cuda" and cuda.gather(torch.arange(C, device="cuda")).device.type == "cuda"
    back = cuda.to(torch.device("cpu"), torch.float32)
    torch.testing.assert_close(back.gather(torch.arange(C)), values.to(torch.bfloat16).float(), rtol=0, atol=0)


def test_writes_under_inference_mode_stay_trainable():
    # A lookup under torch.inference_mode() may insert rows; the store must not turn into an
    # inference tensor, or a later training write would fail.
    store = DeviceRowStore(W, C, init_rows=1)
    with torch.inference_mode():
        store.reserve(4)
        store.scatter(torch.arange(4), torch.ones(4, W))
        store.to(torch.device("cpu"), torch.float64)
    store.scatter(torch.tensor([2]), torch.full((1, W), 3.0, dtype=torch.float64))
    torch.testing.assert_close(store.gather(torch.tensor([1, 2])), torch.tensor([[1.0] * W, [3.0] * W], dtype=torch.float64), rtol=0, atol=0)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda s: s.reserve(-1), "n=-1"),
        (lambda s: s.reserve(2.5), "n=2.5"),
        (lambda s: s.scatter(torch.tensor([0]), torch.ones(1, W + 1)), "values"),
        (lambda s: s.scatter(torch.tensor([0]), torch.ones(1, W, dtype=torch.float64)), "values"),
        (lambda s: DeviceRowStore(W, C, dtype=torch.int64), "dtype=torch.int64"),
        (lambda s: DeviceRowStore(W, C, device="gpu0"), "device='gpu0'"),
    ],
)
def test_bad_arguments_are_named(call, match):
    with pytest.raises(ValueError, match=match):
        call(DeviceRowStore(W, C))
