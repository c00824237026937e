"""The ExternalStorage contract, checked on the reference store, the disk store and a user's dict
store: get / put / delete / items against a dict model, the empty store, bad arguments.

N keys in a call, W row width.
"""

from __future__ import annotations

import os

import pytest
import torch

from dict_storage import DictStorage
from dynemb.storage import DiskStorage, ExternalStorage, InMemoryStorage

W = 5
ODD_KEYS = [0, -1, 1, -(2**63), 2**63 - 1, 2**40 + 7]


def rows_of(keys: torch.Tensor, version: int = 0, dtype=torch.float32) -> torch.Tensor:
    """Rows derived from keys (and a version), so a read checks itself: [N, W]."""
    base = (keys.remainder(1 << 20).to(torch.float64) + 0.25 * version)[:, None]
    return (base + torch.arange(W, dtype=torch.float64)).to(dtype)


@pytest.fixture(params=["memory", "disk", "dict"])
def store(request, tmp_path):
    if request.param == "memory":
        yield InMemoryStorage()
    elif request.param == "disk":
        s = DiskStorage(tmp_path / "rows")
        yield s
        s.close()
    else:
        yield DictStorage()


def held(store) -> dict[int, torch.Tensor]:
    out = {}
    for keys, rows in store.items(3):
        assert keys.numel() <= 3 and rows.shape[0] == keys.numel()
        for k, r in zip(keys.tolist(), rows):
            assert k not in out, f"items() yielded key {k} twice"
            out[k] = r
    return out


def test_conforms_to_the_protocol(store):
    assert isinstance(store, ExternalStorage)


def test_empty_store(store):
    rows, found = store.get(torch.tensor(ODD_KEYS))
    assert found.dtype == torch.bool and found.tolist() == [False] * len(ODD_KEYS)
    assert rows.shape[0] == 0
    assert list(store.items()) == []
    store.delete(torch.tensor([3, -3]))  # absent keys are ignored
    assert held(store) == {}


def test_get_returns_found_rows_in_order(store):
    keys = torch.tensor(ODD_KEYS)
    store.put(keys, rows_of(keys))
    asked = torch.tensor([5, 2**63 - 1, 0, 99, -(2**63), -1])
    rows, found = store.get(asked)
    assert found.tolist() == [False, True, True, False, True, True]
    torch.testing.assert_close(rows, rows_of(asked[found]), rtol=0, atol=0)


def test_put_replaces_delete_removes_put_again(store):
    keys = torch.arange(-20, 20)
    store.put(keys, rows_of(keys))
    store.put(keys[:10], rows_of(keys[:10], version=1))
    store.delete(keys[30:])
    store.put(torch.tensor([100, 101]), rows_of(torch.tensor([100, 101]), version=2))
    model = {k: rows_of(torch.tensor([k]), version=1 if k < -10 else 0)[0] for k in range(-20, 10)}
    model.update({k: rows_of(torch.tensor([k]), version=2)[0] for k in (100, 101)})
    got = held(store)
    assert sorted(got) == sorted(model)
    for k, row in model.items():
        assert torch.equal(got[k], row), k


def test_random_operations_match_a_dict(store):
    gen = torch.Generator().manual_seed(7)
    model: dict[int, torch.Tensor] = {}
    for step in range(60):
        keys = torch.unique(torch.randint(-50, 50, (int(torch.randint(1, 30, (1,), generator=gen)),), generator=gen))
        keys = keys[torch.randperm(keys.numel(), generator=gen)]
        op = step % 3
        if op == 0:
            store.put(keys, rows_of(keys, version=step))
            model.update({k: r for k, r in zip(keys.tolist(), rows_of(keys, version=step))})
        elif op == 1:
            store.delete(keys)
            for k in keys.tolist():
                model.pop(k, None)
        rows, found = store.get(keys)
        assert found.tolist() == [k in model for k in keys.tolist()]
        want = [model[k] for k in keys.tolist() if k in model]
        if want:
            assert torch.equal(rows, torch.stack(want))
    got = held(store)
    assert sorted(got) == sorted(model) and all(torch.equal(got[k], model[k]) for k in model)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_rows_keep_their_dtype(store, dtype):
    keys = torch.tensor([3, 4])
    store.put(keys, rows_of(keys, dtype=dtype))
    rows, found = store.get(keys)
    assert found.all() and rows.dtype == dtype and torch.equal(rows, rows_of(keys, dtype=dtype))


@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_shipped_stores_refuse_bad_arguments(kind, tmp_path):
    store = InMemoryStorage() if kind == "memory" else DiskStorage(tmp_path)
    with pytest.raises(ValueError, match="keys="):
        store.get(torch.tensor([1.0]))
    with pytest.raises(ValueError, match="rows"):
        store.put(torch.tensor([1, 2]), torch.zeros(3, W))
    store.put(torch.tensor([1]), torch.zeros(1, W))
    with pytest.raises(ValueError, match=r"rows: \[N, 4\]"):
        store.put(torch.tensor([2]), torch.zeros(1, 4))
    with pytest.raises(ValueError, match="chunk_size=0"):
        list(store.items(0))


def test_disk_storage_grows_in_its_file_and_close_removes_it(tmp_path):
    store = DiskStorage(tmp_path / "d")
    keys = torch.arange(3000) * 7919
    for lo in range(0, 3000, 500):
        store.put(keys[lo : lo + 500], rows_of(keys[lo : lo + 500]))
    (file,) = (tmp_path / "d").iterdir()
    assert file.stat().st_size >= 3000 * W * 4
    rows, found = store.get(keys.flip(0))
    assert found.all() and torch.equal(rows, rows_of(keys.flip(0)))
    other = DiskStorage(tmp_path / "d")  # a second store in the same directory has its own file
    assert len(os.listdir(tmp_path / "d")) == 2 and not other.get(keys[:3])[1].any()
    store.close()
    other.close()
    assert os.listdir(tmp_path / "d") == []


def test_disk_storage_refuses_a_file_as_path(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="path="):
        DiskStorage(tmp_path / "f")


@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_shipped_stores_convert_their_rows_to_a_new_dtype(kind, tmp_path):
    store = InMemoryStorage() if kind == "memory" else DiskStorage(tmp_path)
    keys = torch.arange(40)
    store.put(keys, rows_of(keys))
    store.put(torch.tensor([100]), rows_of(torch.tensor([100]), dtype=torch.float64))
    rows, found = store.get(torch.tensor([3, 100]))
    assert found.all() and rows.dtype == torch.float64
    assert torch.equal(rows, torch.cat([rows_of(torch.tensor([3])).double(), rows_of(torch.tensor([100]), dtype=torch.float64)]))
    if kind == "disk":
        assert len(os.listdir(tmp_path)) == 1  # the float32 file was replaced
        store.close()
