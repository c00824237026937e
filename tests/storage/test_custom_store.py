"""A RowStore written here (rows in a dict) plugs into a table and trains as the default store.

N ids, n rows in a store call, D embedding dim, W = D + S row width, C capacity in rows.
"""

from __future__ import annotations

import pytest
import torch

import dynemb
from dynemb.storage.base import RowStore

D = 4


class DictRowStore:
    """Rows in a dict {row id: Tensor [W]}, checking the contract as it is used: ids are read or
    written only once reserved, scatter rows are distinct. Unwritten columns read as NaN (their
    content is undefined). Counts its calls."""

    def __init__(self, width: int, capacity: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        self.width, self.capacity, self.dtype, self.device = width, capacity, dtype, torch.device(device)
        self.rows: dict[int, torch.Tensor] = {}
        self.reserved = 0
        self.calls = {"reserve": 0, "gather": 0, "scatter": 0, "to": 0}

    def reserve(self, n: int) -> None:
        assert n <= self.capacity, f"reserve({n}) past capacity {self.capacity}"
        self.calls["reserve"] += 1
        self.reserved = max(self.reserved, n)

    def _check(self, rows: torch.Tensor) -> list[int]:
        ids = rows.tolist()
        assert rows.dtype == torch.int64 and all(0 <= r < self.reserved for r in ids), f"row ids {ids} outside the {self.reserved} reserved"
        return ids

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        self.calls["gather"] += 1
        nan = torch.full((self.width,), float("nan"), dtype=self.dtype, device=self.device)
        out = [self.rows.get(r, nan).clone() for r in self._check(rows)]
        return torch.stack(out) if out else torch.empty(0, self.width, dtype=self.dtype, device=self.device)

    def scatter(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        self.calls["scatter"] += 1
        ids = self._check(rows)
        assert len(set(ids)) == len(ids), f"scatter to repeated rows {ids}"
        assert values.dtype == self.dtype and values.shape[0] == len(ids) and values.shape[1] <= self.width
        k = values.shape[1]
        for r, v in zip(ids, values.detach()):
            row = self.rows.get(r, torch.full((self.width,), float("nan"), dtype=self.dtype, device=self.device)).clone()
            row[:k] = v
            self.rows[r] = row

    def to(self, device: torch.device, dtype: torch.dtype) -> DictRowStore:
        self.calls["to"] += 1
        moved = DictRowStore(self.width, self.capacity, dtype, device)
        moved.rows = {r: v.to(device=device, dtype=dtype) for r, v in self.rows.items()}
        moved.reserved, moved.calls = self.reserved, self.calls
        return moved

    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.rows.values())


def twins(capacity: int = 64, **kw) -> tuple[dynemb.DynamicEmbedding, dynemb.DynamicEmbedding]:
    """The same table with the default store and with a DictRowStore of its geometry."""
    ref = dynemb.DynamicEmbedding(D, capacity, **kw)
    store = DictRowStore(ref.store.width, ref.store.capacity, ref.store.dtype)
    return ref, dynemb.DynamicEmbedding(D, capacity, store=store, **kw)


def rows_of(table: dynemb.DynamicEmbedding) -> dict[int, torch.Tensor]:
    """key -> [embedding | optimizer state] of every key in the table."""
    out = {}
    for chunk in table.export(chunk_size=16):
        for key, row in zip(chunk["keys"].tolist(), torch.cat([chunk["embeddings"], chunk["optimizer_state"]], 1)):
            out[key] = row
    return out


def assert_same_rows(a: dynemb.DynamicEmbedding, b: dynemb.DynamicEmbedding) -> None:
    ra, rb = rows_of(a), rows_of(b)
    assert sorted(ra) == sorted(rb)
    keys = sorted(ra)
    # The store only keeps values: the same arithmetic on the same values is bitwise equal.
    torch.testing.assert_close(torch.stack([rb[k] for k in keys]), torch.stack([ra[k] for k in keys]), rtol=0, atol=0)


def test_dict_store_satisfies_the_protocol():
    assert isinstance(DictRowStore(4, 8), RowStore)


@pytest.mark.parametrize("optimizer", [dynemb.optim.SGD(lr=0.3), dynemb.optim.Adagrad(lr=0.2), dynemb.optim.Adam(lr=0.05)])
def test_custom_store_trains_as_the_default_store(optimizer):
    ref, ours = twins(capacity=64, optimizer=optimizer, seed=3)
    assert isinstance(ours.store, DictRowStore)
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        # Duplicates inside a batch, keys seen before and new ones.
        ids = torch.randint(-20, 20, (3, 7), generator=g) * 1_000_003
        weight = torch.randn(3, 7, D, generator=g)
        outs = []
        for t in (ref, ours):
            out = t(ids)
            (out * weight).sum().backward()
            outs.append(out.detach())
        torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
        assert_same_rows(ref, ours)
    assert ours.store.calls["gather"] > 0 and ours.store.calls["scatter"] > 0 and ours.store.calls["reserve"] > 0


def test_custom_store_through_eviction_erase_insert_and_eval():
    # A table small enough to evict: leaving rows are read from the store, freed row ids reused.
    ref, ours = twins(capacity=16, bucket_capacity=4, score_strategy="lfu", check_mode="count", optimizer=dynemb.optim.SGD(lr=0.5))
    for t in (ref, ours):
        for step in range(6):
            ids = torch.arange(12) + 7 * step
            t(ids).sum().backward()
        t.erase(torch.arange(0, 40, 3))
        t.insert(torch.tensor([1000, 1001]), torch.full((2, D), 0.25))
    assert_same_rows(ref, ours)
    assert ref.stats()["evictions"] == ours.stats()["evictions"] > 0
    for t in (ref, ours):
        t.eval()
    ids = torch.tensor([1000, 5, 123456, 40])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), ref(ids), rtol=0, atol=0)
    assert_same_rows(ref, ours)


def test_custom_store_on_an_empty_table_in_eval():
    # Nothing reserved yet: a lookup of missing keys must not read rows the store never reserved
    # (the contract's "valid ids"); the default store hides it by always holding a row.
    ref, ours = twins(optimizer=dynemb.optim.SGD(lr=0.1), eval_default=0.5)
    for t in (ref, ours):
        t.eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(torch.tensor([1, 2])), ref(torch.tensor([1, 2])), rtol=0, atol=0)
    torch.testing.assert_close(ours(torch.tensor([1])), torch.full((1, D), 0.5))


def test_custom_store_follows_a_dtype_move():
    ref, ours = twins(optimizer=dynemb.optim.Adagrad(lr=0.1))
    for t in (ref, ours):
        t(torch.tensor([1, 2, 3])).sum().backward()
        t.to(torch.float64)
    assert ours.store.calls["to"] == 1 and ours.store.dtype == torch.float64
    for t in (ref, ours):
        t(torch.tensor([2, 4])).sum().backward()
    assert_same_rows(ref, ours)
    assert rows_of(ours)[4].dtype == torch.float64


@pytest.mark.parametrize("width_delta,capacity_delta", [(1, 0), (-1, 0), (0, -1)])
def test_store_of_wrong_geometry_is_refused(width_delta, capacity_delta):
    ref = dynemb.DynamicEmbedding(D, 64, optimizer=dynemb.optim.Adagrad())
    store = DictRowStore(ref.store.width + width_delta, ref.store.capacity + capacity_delta)
    with pytest.raises(ValueError, match=f"store=.*width {ref.store.width} and capacity >= {ref.store.capacity}"):
        dynemb.DynamicEmbedding(D, 64, optimizer=dynemb.optim.Adagrad(), store=store)


def test_larger_store_is_accepted():
    ref = dynemb.DynamicEmbedding(D, 64)
    store = DictRowStore(ref.store.width, ref.store.capacity + 100)
    assert dynemb.DynamicEmbedding(D, 64, store=store).store is store


@pytest.mark.parametrize("store", [object(), "rows", torch.zeros(64, D)])
def test_non_store_is_refused(store):
    with pytest.raises(ValueError, match="(?s)store=.*must be a RowStore"):
        dynemb.DynamicEmbedding(D, 64, store=store)
