"""Collection tables that start small and grow (issue 16: one index that grows, segments included).

A group's engine builds its index with each table's ``init_capacity`` (docs/design/0025); with
capacity for every key, growth moves no key out, so a growing collection trains exactly as a
full-size one, and its state_dict and checkpoints restore it exactly.
"""

from __future__ import annotations

import pytest
import torch

import dynemb
from dynemb import TableConfig

FEATURES = ("f_a", "f_b")


def tables(init: bool) -> list[TableConfig]:
    # Both tables in one group (same dim and options); each grows on its own from 16 keys.
    return [
        TableConfig(
            name=n, feature_names=[f], embedding_dim=4, capacity=1024, init_capacity=16 if init else None, bucket_capacity=8, score_strategy="step", seed=s
        )
        for n, f, s in (("a", "f_a", 1), ("b", "f_b", 2))
    ]


def batch(step: int) -> dict:
    # Each step brings new keys: table a many (it must grow), table b a few.
    gen = torch.Generator().manual_seed(step)
    a = torch.randint(-(2**40), 2**40, (24,), generator=gen)
    b = torch.randint(0, 40, (6,), generator=gen)
    return {"f_a": (a, torch.full((8,), 3)), "f_b": (b, torch.tensor([1, 0, 2, 1, 1, 1, 0, 0]))}


def step(col, k: int) -> torch.Tensor:
    out = col(batch(k))
    (out.concat * torch.arange(1, 9)[:, None]).sum().backward()
    return out.concat.detach()


def new(init: bool):
    return dynemb.DynamicEmbeddingBagCollection(tables(init), dynemb.optim.Adagrad(lr=0.1))


def figures(col) -> dict:
    """stats() without the scratch buffers (a restored module has not run a step yet)."""
    return {t: {k: v for k, v in s.items() if k != "scratch_bytes"} for t, s in col.stats().items()}


def assert_same_rows(a, b) -> None:
    for name in ("a", "b"):
        ea = {int(k): v for c in a.export(name) for k, v in zip(c["keys"], torch.cat([c["embeddings"], c["optimizer_state"]], 1))}
        eb = {int(k): v for c in b.export(name) for k, v in zip(c["keys"], torch.cat([c["embeddings"], c["optimizer_state"]], 1))}
        assert ea.keys() == eb.keys()
        for k in ea:
            torch.testing.assert_close(ea[k], eb[k], rtol=0, atol=0)


def test_a_growing_group_trains_as_a_full_size_one():
    growing, full = new(True), new(False)
    for k in range(12):
        torch.testing.assert_close(step(growing, k), step(full, k), rtol=0, atol=0)
    g, f = growing.stats(), full.stats()
    assert g["a"]["size"] == f["a"]["size"] > 16 and g["b"]["size"] == f["b"]["size"]
    # Table a grew, table b (few keys) stayed smaller; the full one was allocated at once.
    assert 16 < g["a"]["current_capacity"] < f["a"]["current_capacity"]
    assert g["b"]["current_capacity"] < g["a"]["current_capacity"]
    assert g["a"]["evictions"] == g["a"]["failed_inserts"] == 0
    assert_same_rows(growing, full)


def test_state_dict_of_a_grown_group_restores_it_exactly():
    col = new(True)
    for k in range(8):
        step(col, k)
    restored = new(True)
    restored.load_state_dict(col.state_dict())
    assert figures(restored) == figures(col)
    for k in range(8, 12):
        torch.testing.assert_close(step(restored, k), step(col, k), rtol=0, atol=0)
    assert_same_rows(restored, col)


@pytest.mark.parametrize("into", ["growing", "full"])
def test_checkpoint_of_a_grown_group_loads_into_either_geometry(tmp_path, into):
    col = new(True)
    for k in range(8):
        step(col, k)
    dynemb.checkpoint.save(col, tmp_path / "ckpt")
    restored = new(into == "growing")
    report = dynemb.checkpoint.load(restored, tmp_path / "ckpt")
    assert {n: r["dropped"] for n, r in report.items()} == {"a": 0, "b": 0}
    assert_same_rows(restored, col)
    for k in range(8, 11):
        torch.testing.assert_close(step(restored, k), step(col, k), rtol=0, atol=0)
    if into == "growing":
        # The saved layout is a geometry the fresh index passes through: restored slot by slot.
        assert figures(restored) == figures(col)
