"""Tables whose rows live in tiers (device + disk, a small device tier) train bitwise like the
single-tier table of the same capacity while nothing is evicted: outputs, rows, optimizer state.

N ids per batch, V distinct keys, D embedding dim, B bags.
"""

from __future__ import annotations

import copy

import pytest
import torch

import dynemb
from dynemb import TableConfig, Tier
from dynemb.hashing import mix64
from dynemb.storage import InMemoryStorage

V, D, B, STEPS, CAPACITY, DEVICE_ROWS = 120, 8, 6, 12, 256, 16

OPTIMIZERS = {
    "sgd": lambda: dynemb.optim.SGD(lr=0.1),
    "adagrad": lambda: dynemb.optim.Adagrad(lr=0.1, lr_decay=0.01),
    "rowwise_adagrad": lambda: dynemb.optim.RowWiseAdagrad(lr=0.1, eps=1e-8),
    "adam": lambda: dynemb.optim.Adam(lr=0.05, betas=(0.8, 0.9), eps=1e-8),
}


def tiers(path, total: int = CAPACITY, device_rows: int = DEVICE_ROWS, host_rows: int = 0) -> list[Tier]:
    out = [Tier("device", device_rows)] + ([Tier("host", host_rows)] if host_rows else [])
    return out + [Tier("disk", total - device_rows - host_rows, path=str(path))]


def keys_of(ids: torch.Tensor) -> torch.Tensor:
    """Arbitrary int64 keys standing for dense ids [0, V)."""
    return mix64(ids + 12345)


def batches(seed: int, steps: int = STEPS, n: int = 40):
    """Skewed id batches with duplicates (hot ids recur, so rows move up and down)."""
    gen = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, V + 1, dtype=torch.float64)
    for _ in range(steps):
        yield keys_of(torch.multinomial(weights, n, replacement=True, generator=gen))


def rows_of(table) -> dict[int, torch.Tensor]:
    """key -> [embedding | optimizer state | score] of every key of a table."""
    out = {}
    for chunk in table.export(chunk_size=32):
        rows = torch.cat([chunk["embeddings"], chunk["optimizer_state"], chunk["scores"][:, None].to(chunk["embeddings"].dtype)], 1)
        out.update(zip(chunk["keys"].tolist(), rows))
    return out


def assert_same_rows(a, b) -> None:
    ra, rb = rows_of(a), rows_of(b)
    assert ra.keys() == rb.keys()
    for k in ra:
        assert torch.equal(ra[k], rb[k]), k


def moved(stats: list[dict]) -> None:
    """Rows really moved: promotions into the device tier, demotions out of it, disk hits."""
    assert stats[0]["kind"] == "device" and stats[-1]["kind"] == "disk"
    assert stats[0]["promotions"] > 0 and stats[0]["demotions"] > 0
    assert stats[-1]["hits"] > 0 and stats[0]["misses"] > 0
    for s in stats:
        assert 0 <= s["rows"] <= s["capacity"]


def train_pair(make, step) -> None:
    """Train the single-tier and the tiered module on the same batches, outputs compared bitwise."""
    ref, tiered = make(None), make(True)
    for ids in batches(7):
        out_ref, out_tiered = step(ref, ids), step(tiered, ids)
        assert torch.equal(out_ref, out_tiered)
    return ref, tiered


def sequence_step(table, ids):
    out = table(ids)  # [N, D]
    (out * torch.linspace(-1, 1, D)).sum().backward()
    return out.detach()


def pooled_step(table, ids):
    offsets = torch.arange(0, ids.numel(), ids.numel() // B, device=ids.device)[:B]
    out = table(ids, offsets)  # [B, D]
    (out.square() * torch.linspace(-1, 1, D, device=ids.device)).sum().backward()
    return out.detach()


@pytest.mark.parametrize("pooled", [False, True], ids=["sequence", "pooled"])
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_tiered_table_trains_bitwise_like_one_tier(tmp_path, opt, pooled):
    cls = dynemb.DynamicEmbeddingBag if pooled else dynemb.DynamicEmbedding

    def make(tiered):
        kw = {"tiers": tiers(tmp_path)} if tiered else {"capacity": CAPACITY}
        return cls(D, optimizer=OPTIMIZERS[opt](), score_strategy="lfu", seed=3, **kw)

    ref, tiered = train_pair(make, pooled_step if pooled else sequence_step)
    assert ref.stats()["evictions"] == tiered.stats()["evictions"] == 0
    assert_same_rows(ref, tiered)
    moved(tiered.stats()["tiers"])
    assert "tiers" not in ref.stats()


def test_three_tiers_and_deferred_update_train_bitwise(tmp_path):
    """device + host + disk (host is CPU memory on a CPU table), deferred optimizer steps."""

    def make(tiered):
        kw = {"tiers": tiers(tmp_path, device_rows=8, host_rows=24)} if tiered else {"capacity": CAPACITY}
        return dynemb.DynamicEmbedding(D, optimizer=dynemb.optim.Adam(lr=0.05), update="deferred", score_strategy="step", **kw)

    def step(table, ids):
        out = sequence_step(table, ids)
        table.optimizer.step()
        table.optimizer.zero_grad()
        return out

    ref, tiered = train_pair(make, step)
    assert_same_rows(ref, tiered)
    stats = tiered.stats()["tiers"]
    assert [s["kind"] for s in stats] == ["device", "host", "disk"]
    moved(stats)
    assert stats[1]["promotions"] > 0


TABLES = [
    TableConfig(name="a", feature_names=["fa"], embedding_dim=8, capacity=CAPACITY, pooling="sum", score_strategy="step"),
    TableConfig(name="b", feature_names=["fb"], embedding_dim=8, capacity=CAPACITY, pooling="mean", score_strategy="step"),
    TableConfig(name="c", feature_names=["fc"], embedding_dim=4, capacity=CAPACITY, pooling="sum", score_strategy="step"),
]


def collection_input(ids: torch.Tensor) -> dict:
    """Features fa, fb, fc of B bags each from one batch of keys."""
    n = ids.numel() // 3
    lengths = torch.full((B,), n // B)
    lengths[-1] += n - int(lengths.sum())
    return {f: (ids[i * n : (i + 1) * n] ^ i, lengths) for i, f in enumerate(["fa", "fb", "fc"])}


@pytest.mark.parametrize("pooled", [False, True], ids=["sequence", "pooled"])
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_tiered_collection_trains_bitwise_like_one_tier(tmp_path, opt, pooled):
    cls = dynemb.DynamicEmbeddingBagCollection if pooled else dynemb.DynamicEmbeddingCollection

    def make(tiered):
        configs = [
            TableConfig(**{**c.__dict__, "capacity": None, "tiers": tiers(tmp_path, device_rows=8 + 4 * i)}) if tiered else c for i, c in enumerate(TABLES)
        ]
        return cls(configs, OPTIMIZERS[opt]())

    def step(col, ids):
        out = col(collection_input(ids))
        if pooled:
            parts = [out[f] for f in ["fa", "fb", "fc"]]
        else:
            parts = [out[f][0] for f in ["fa", "fb", "fc"]]
        sum((p * (j + 1)).square().sum() for j, p in enumerate(parts)).backward()
        return torch.cat([p.detach().flatten() for p in parts])

    ref, tiered = train_pair(make, step)
    stats = tiered.stats()
    # a and b share a group (one tiered store: device 8 + 12 rows, disk the rest); c is alone.
    assert stats["a"]["tiers"] == stats["b"]["tiers"]
    assert stats["a"]["tiers"][0]["capacity"] == 20 and stats["c"]["tiers"][0]["capacity"] == 16
    moved(stats["a"]["tiers"])
    for name in ["a", "b", "c"]:
        assert stats[name]["evictions"] == 0
        ref_chunks, tiered_chunks = list(ref.export(name)), list(tiered.export(name))
        for x, y in zip(ref_chunks, tiered_chunks, strict=True):
            for k in x:
                assert torch.equal(x[k], y[k]), (name, k)


def test_groups_only_with_the_same_tier_layout(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    configs = [
        TableConfig(name="a", embedding_dim=4, tiers=tiers(tmp_path)),
        TableConfig(name="b", embedding_dim=4, tiers=tiers(tmp_path, device_rows=32)),
        TableConfig(name="c", embedding_dim=4, tiers=tiers(other)),
        TableConfig(name="d", embedding_dim=4, capacity=CAPACITY),
    ]
    col = dynemb.DynamicEmbeddingCollection(configs, dynemb.optim.SGD(lr=0.1))
    assert len(col.groups) == 3
    stats = col.stats()
    assert stats["a"]["tiers"][0]["capacity"] == DEVICE_ROWS + 32
    assert "tiers" not in stats["d"]


def test_find_insert_erase_export_state_dict_see_one_table(tmp_path):
    def make(tiered):
        kw = {"tiers": tiers(tmp_path)} if tiered else {"capacity": CAPACITY}
        return dynemb.DynamicEmbedding(D, optimizer=dynemb.optim.Adagrad(lr=0.1), score_strategy="step", **kw)

    ref, tiered = train_pair(make, sequence_step)
    probe = torch.cat([keys_of(torch.arange(V)), torch.tensor([-1, 2**62])])
    for a, b in zip(ref.find(probe), tiered.find(probe)):
        assert torch.equal(a, b)
    new_keys = torch.arange(1000, 1040)
    values = torch.randn(new_keys.numel(), D)
    for t in (ref, tiered):
        t.insert(new_keys, values)
        t.erase(keys_of(torch.arange(0, V, 3)))
    assert_same_rows(ref, tiered)
    assert torch.equal(ref.find(new_keys)[0], values)
    assert torch.equal(tiered.find(new_keys)[0], values)
    # state_dict of the tiered table loads into a single-tier table and back into a fresh tiered one.
    state = tiered.state_dict()
    for k, v in ref.state_dict().items():
        assert torch.equal(v, state[k]), k
    fresh = make(True)
    fresh.load_state_dict(state)
    assert_same_rows(ref, fresh)
    for ids in batches(11, steps=4):
        assert torch.equal(sequence_step(ref, ids), sequence_step(fresh, ids))
    assert_same_rows(ref, fresh)


def test_tier_stats_count_hits_misses_and_moves(tmp_path):
    table = dynemb.DynamicEmbedding(D, optimizer=dynemb.optim.SGD(lr=0.1), tiers=tiers(tmp_path), score_strategy="step")
    resolved = 0
    for ids in batches(3):
        sequence_step(table, ids)
        resolved += ids.unique().numel()
    stats = table.stats()["tiers"]
    device, disk = stats
    # Every resolved row is a hit of exactly one tier; a device miss is a disk hit.
    assert device["hits"] + disk["hits"] == resolved
    assert device["misses"] == disk["hits"] and disk["misses"] == 0
    assert device["promotions"] == device["demotions"] > 0
    assert device["rows"] == DEVICE_ROWS and disk["rows"] == len(table) - DEVICE_ROWS
    assert disk["bytes"] == disk["rows"] * table.store.width * 4
    assert device["placement_bytes"] == 16 * DEVICE_ROWS
    # Eval lookups count too (and never insert).
    table.eval()
    table(keys_of(torch.arange(V)))
    after = table.stats()["tiers"]
    assert after[0]["hits"] + after[1]["hits"] == resolved + len(table)


def test_dtype_move_and_deepcopy_keep_one_table(tmp_path):
    def make(tiered):
        kw = {"tiers": tiers(tmp_path)} if tiered else {"capacity": CAPACITY}
        return dynemb.DynamicEmbedding(D, optimizer=dynemb.optim.RowWiseAdagrad(lr=0.1), score_strategy="step", **kw)

    ref, tiered = train_pair(make, sequence_step)
    ref_copy, tiered_copy = copy.deepcopy(ref), copy.deepcopy(tiered)
    for a, b in [(ref, tiered), (ref_copy, tiered_copy)]:
        a.to(torch.float64)
        b.to(torch.float64)
        for ids in batches(5, steps=4):
            assert torch.equal(sequence_step(a, ids.clone()), sequence_step(b, ids.clone()))
        assert_same_rows(a, b)
        assert b.stats()["tiers"][1]["bytes"] == b.stats()["tiers"][1]["rows"] * b.store.width * 8
    # The copy has its own rows (its own disk file): training the original does not change it.
    before = rows_of(tiered_copy)
    for ids in batches(9, steps=2):
        sequence_step(tiered, ids)
    after = rows_of(tiered_copy)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not all(torch.equal(before[k], v) for k, v in rows_of(tiered).items() if k in before)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_cuda_device_and_host_tiers_train_bitwise_like_one_tier(opt):
    def make(tiered):
        kw = {"tiers": [Tier("device", DEVICE_ROWS), Tier("host", CAPACITY - DEVICE_ROWS)]} if tiered else {"capacity": CAPACITY}
        return dynemb.DynamicEmbeddingBag(D, optimizer=OPTIMIZERS[opt](), score_strategy="lfu", device="cuda", **kw)

    def step(table, ids):
        return pooled_step(table, ids.cuda()).cpu()

    ref, tiered = train_pair(make, step)
    assert_same_rows(ref, tiered)
    moved([*tiered.stats()["tiers"][:1], {**tiered.stats()["tiers"][1], "kind": "disk"}])
    assert tiered.store.stores[1].data.is_pinned()


def test_caching_over_tiers_is_refused_naming_tiers():
    with pytest.raises(ValueError, match="tiers.*not supported yet"):
        TableConfig(embedding_dim=4, caching=True, external_storage=InMemoryStorage(), tiers=[Tier("device", rows=8), Tier("host", rows=8)])
