"""TieredRowStore and DiskRowStore against a tensor model: random reserve / gather / scatter /
touch sequences read back what was written, wherever rows moved; placement stays a bijection.

n rows in a call, W row width, C capacity in rows.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch

import dynemb
from dynemb import TableConfig, Tier
from dynemb.storage.base import RowStore, TierStats, Touchable
from dynemb.storage.disk import DiskRowStore
from dynemb.storage.tiered import TieredRowStore

W = 6


def check_placement(store: TieredRowStore) -> None:
    """Every reserved row id has one slot, slots map back to it, each tier's slots are a prefix."""
    n = store.reserved
    slots = store.slot_of[:n].long()
    assert torch.equal(store.row_of.index_select(0, slots).long(), torch.arange(n))
    assert slots.unique().numel() == n
    per_tier = torch.bincount(store.tier_of(slots), minlength=len(store.stores)).tolist()
    assert per_tier == store.used
    for t, used in enumerate(store.used):
        local = slots[store.tier_of(slots) == t] - store.starts[t]
        assert sorted(local.tolist()) == list(range(used))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("layout", ["device+disk", "device+host+disk", "device"])
def test_tiered_store_matches_a_tensor_model(tmp_path, seed, layout):
    sizes = {"device+disk": [("device", 8), ("disk", 40)], "device+host+disk": [("device", 4), ("host", 12), ("disk", 30)], "device": [("device", 48)]}[layout]
    tiers = [Tier(k, n, path=str(tmp_path) if k == "disk" else None) for k, n in sizes]
    capacity = sum(n for _, n in sizes) + 3  # index rounding: the last tier takes the excess
    store = TieredRowStore(W, tiers, capacity, dtype=torch.float64, init_rows=2)
    assert isinstance(store, RowStore) and isinstance(store, Touchable) and isinstance(store, TierStats)
    model = torch.zeros(capacity, W, dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    moves = 0
    for _ in range(60):
        op = int(torch.randint(0, 4, (), generator=gen))
        reserved = store.reserved
        if op == 0 or reserved == 0:
            store.reserve(min(capacity, reserved + int(torch.randint(1, 12, (), generator=gen))))
            # New rows are undefined until written: write them whole, so every read is checked.
            new = torch.arange(reserved, store.reserved)
            model[new] = torch.randn(new.numel(), W, generator=gen, dtype=torch.float64)
            store.scatter(new, model[new])
        elif op == 1:
            rows = torch.randperm(reserved, generator=gen)[: int(torch.randint(1, reserved + 1, (), generator=gen))]
            k = W if bool(torch.rand((), generator=gen) < 0.7) else 2
            values = torch.randn(rows.numel(), k, generator=gen, dtype=torch.float64)
            store.scatter(rows, values)
            model[rows, :k] = values
        elif op == 2:
            rows = torch.randint(0, reserved, (int(torch.randint(0, 20, (), generator=gen)),), generator=gen)
            assert torch.equal(store.gather(rows), model[rows])
        else:
            rows = torch.randperm(reserved, generator=gen)[: int(torch.randint(1, 10, (), generator=gen))]
            before = sum(store.counts["promotions"])
            store.touch(rows, torch.randint(0, 50, (rows.numel(),), generator=gen))
            moves += sum(store.counts["promotions"]) - before
        check_placement(store)
        assert torch.equal(store.gather(torch.arange(store.reserved)), model[: store.reserved])
    stats = store.tier_stats()
    assert [s["capacity"] for s in stats] == [n for _, n in sizes[:-1]] + [sizes[-1][1] + 3]
    if len(sizes) > 1:
        assert moves > 0
        assert sum(s["promotions"] for s in stats) == sum(s["demotions"] for s in stats) == moves


def test_touch_promotes_hotter_rows_only(tmp_path):
    store = TieredRowStore(W, [Tier("device", 2), Tier("disk", 4, path=str(tmp_path))])
    store.reserve(6)  # rows 0, 1 on the device tier, 2..5 on disk
    store.scatter(torch.arange(6), torch.arange(6.0)[:, None].expand(6, W).contiguous())
    store.touch(torch.tensor([0, 1]), torch.tensor([10, 20]))
    store.touch(torch.tensor([2, 3, 4]), torch.tensor([5, 15, 30]))
    # 4 (30) and 3 (15) are hotter than the device's coldest 0 (10); 3 is not hotter than 1 (20).
    assert store.tier_of(store.slot_of[:6].long()).tolist() == [1, 0, 1, 1, 0, 1]
    assert store.counts["promotions"] == [1, 0] and store.counts["hits"] == [2, 3] and store.counts["misses"] == [3, 0]
    assert torch.equal(store.gather(torch.arange(6))[:, 0], torch.arange(6.0))
    # Equal scores never swap (no thrashing between tiers).
    store.touch(torch.tensor([0]), torch.tensor([20]))
    assert store.counts["promotions"] == [1, 0]


def test_disk_store_is_scratch_and_removes_dead_processes_files(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    stale = tmp_path / f"dynemb-rows-{int(dead.stdout)}-0.bin"
    stale.write_bytes(b"x" * 100)
    mine = tmp_path / f"dynemb-rows-{os.getpid()}-999.bin"
    mine.write_bytes(b"y")
    other = tmp_path / "notes.bin"
    other.write_bytes(b"z")
    store = DiskRowStore(W, 1000, path=str(tmp_path), dtype=torch.float32)
    # The dead process's file is gone; this process's and foreign files stay; the store's own
    # file is unlinked once mapped (nothing to read back after a crash).
    assert sorted(os.listdir(tmp_path)) == sorted([mine.name, other.name])
    store.reserve(10)
    values = torch.randn(10, W)
    store.scatter(torch.arange(10), values)
    assert torch.equal(store.gather(torch.arange(10)), values)
    clone = copy.deepcopy(store)
    store.scatter(torch.tensor([0]), torch.zeros(1, W))
    assert torch.equal(clone.gather(torch.arange(10)), values)
    half = store.to(torch.device("cpu"), torch.float64)
    assert torch.equal(half.gather(torch.arange(1, 10)), values[1:].double())
    with pytest.raises(IndexError, match="reserved rows"):
        store.scatter(torch.tensor([10]), torch.zeros(1, W))
    assert store.nbytes() == 10 * W * 4


def test_disk_store_errors_name_the_path_and_the_bytes(tmp_path):
    with pytest.raises(ValueError, match="path=.*does not exist"):
        DiskRowStore(W, 10, path=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=r"needs [\d,]+ bytes, [\d,]+ are free"):
        DiskRowStore(W, 2**60 // W, path=str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_tier_config_errors_name_the_argument():
    with pytest.raises(ValueError, match="Tier.kind='ssd'"):
        Tier("ssd", 4)
    with pytest.raises(ValueError, match="Tier.rows=0"):
        Tier("device", 0)
    with pytest.raises(ValueError, match="Tier.path=None: a disk tier needs"):
        Tier("disk", 4)
    with pytest.raises(ValueError, match="Tier.path='/tmp': only a disk tier"):
        Tier("host", 4, path="/tmp")
    with pytest.raises(ValueError, match=r"capacity=10: must equal the tiers' rows summed \(12\)"):
        TableConfig(embedding_dim=4, capacity=10, tiers=[Tier("device", 4), Tier("host", 8)])
    with pytest.raises(ValueError, match="capacity=None: is required unless tiers"):
        TableConfig(embedding_dim=4)
    with pytest.raises(ValueError, match=r"tiers=\['host', 'device'\]: one tier per kind, fastest first"):
        TableConfig(embedding_dim=4, tiers=[Tier("host", 4), Tier("device", 4)])
    with pytest.raises(ValueError, match="tiers=.*non-empty list of dynemb.Tier"):
        TableConfig(embedding_dim=4, tiers=[])
    config = TableConfig(embedding_dim=4, tiers=[Tier("device", 4), Tier("host", 8)])
    assert config.capacity == 12 and isinstance(config.tiers, tuple)


def test_exhaustion_is_a_clear_error_naming_every_tier_budget(tmp_path):
    """A tier larger than its medium fails at construction, naming each tier's budget, never
    with an allocator OOM; nothing is left on disk."""
    huge = 2**60 // 64
    with pytest.raises(ValueError, match=r"do not fit: cpu needs [\d,]+ bytes, has [\d,]+.*budgets: device tier 16 rows.*disk tier") as e:
        dynemb.DynamicEmbedding(8, tiers=[Tier("device", 16), Tier("host", huge), Tier("disk", 64, path=str(tmp_path))])
    assert "host tier" in str(e.value)
    with pytest.raises(ValueError, match=r"disk under '.*' needs [\d,]+ bytes, has [\d,]+ free"):
        dynemb.DynamicEmbedding(8, tiers=[Tier("device", 16), Tier("disk", huge, path=str(tmp_path))])
    with pytest.raises(ValueError, match="Tier.path=.*directory does not exist"):
        dynemb.DynamicEmbedding(8, tiers=[Tier("device", 16), Tier("disk", 64, path=str(tmp_path / "nope"))])
    assert os.listdir(tmp_path) == []


def test_full_tiers_without_eviction_raise_naming_the_tiers(tmp_path):
    table = dynemb.DynamicEmbedding(4, tiers=[Tier("device", 16), Tier("disk", 16, path=str(tmp_path))], score_strategy="no_eviction")
    table(torch.arange(20))
    with pytest.raises(dynemb.InsertionError, match="device tier 16 of 16 rows, disk tier .* of 16 rows"):
        table(torch.arange(100, 200))
