"""Delta checkpoints: a full save and its deltas load to bitwise what a full save at the last
delta holds; a delta holds only what changed; the chain is checked.

K keys of a table, D embedding dim.
"""

from __future__ import annotations

import json

import pytest
import torch
from ckpt_models import (
    Model,
    admission_state,
    assert_equal,
    contents,
    export,
    one_thread,  # noqa: F401 (autouse fixture)
    stats,
    train,
)

import dynemb


def _manifest(path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def _erase_some(model: Model, n: int) -> dict[str, torch.Tensor]:
    """Erase the n smallest keys of each single table; returns them."""
    erased = {}
    for name in ("seq", "bag"):
        table = getattr(model, name)
        keys = export(table, None)["keys"][:n]
        assert bool(table.erase(keys).all())
        erased[name] = keys
    return erased


def _same_tables(got, want) -> None:
    assert_equal(contents(got), contents(want), "contents")
    assert_equal(stats(got), stats(want), "stats")
    assert_equal(admission_state(got), admission_state(want), "admission")


@pytest.mark.parametrize(
    "optimizer, strategy, admission", [("adagrad", "step", True), ("adam", "lfu", False), ("sgd", "no_eviction", True), ("rowwise_adagrad", "timestamp", False)]
)
def test_base_and_three_deltas_equal_a_full_save(optimizer, strategy, admission, tmp_path):
    model = Model(optimizer, strategy, admission)
    train(model, range(6))
    dynemb.checkpoint.save(model, tmp_path / "full")
    base, erased = tmp_path / "full", []
    for k in range(3):
        train(model, range(6 + 3 * k, 9 + 3 * k))
        erased.append(_erase_some(model, 2 + k))
        # A collection table changed outside training too.
        model.ebc.insert("tag", torch.tensor([7 + k, -(2**62)]), torch.full((2, 8), float(k)))
        dynemb.checkpoint.save_delta(model, tmp_path / f"delta-{k}", base=base)
        base = tmp_path / f"delta-{k}"
    dynemb.checkpoint.save(model, tmp_path / "last-full")
    left = {n: s["evictions"] + s["failed_inserts"] for n, s in stats(model).items()}
    assert all(left.values()), left

    from_chain, from_full = Model(optimizer, strategy, admission), Model(optimizer, strategy, admission)
    report = dynemb.checkpoint.load(from_chain, tmp_path / "delta-2")
    dynemb.checkpoint.load(from_full, tmp_path / "last-full")
    _same_tables(from_chain, from_full)
    # And both are the live model's tables.
    _same_tables(from_full, model)
    assert report == {n: {"rows": s["size"], "dropped": 0} for n, s in stats(model).items()}
    # The last delta tombstones the keys erased since the one before (unless they came back).
    last = _manifest(tmp_path / "delta-2")
    assert last["kind"] == "delta" and len(last["chain"]) == 3
    for name, keys in erased[-1].items():
        back = getattr(model, name).contains(keys)
        assert last["tables"][name]["tombstones"] >= int((~back).sum()) > 0
        assert not bool(getattr(from_chain, name).contains(keys[~back]).any())


def test_delta_holds_only_the_changed_keys(tmp_path):
    table = dynemb.DynamicEmbedding(8, 4096, optimizer=dynemb.optim.Adam(lr=0.01), score_strategy="step", seed=1)
    table(torch.arange(3000) * 7919).sum().backward()
    dynemb.checkpoint.save(table, tmp_path / "full")
    full = _manifest(tmp_path / "full")["tables"]["table"]
    assert full["rows"] == 3000 and full["tombstones"] == 0

    # Nothing changed: an empty delta (eval lookups and find() do not change rows or scores).
    table.eval()
    table(torch.arange(100) * 7919)
    table.find(torch.arange(50) * 7919)
    table.train()
    dynemb.checkpoint.save_delta(table, tmp_path / "d0", base=tmp_path / "full")
    d0 = _manifest(tmp_path / "d0")["tables"]["table"]
    assert (d0["rows"], d0["tombstones"]) == (0, 0)
    assert not [f for f in d0["files"] if f["role"] in ("rows", "tombstones")]

    # Five keys trained (two of them new), three erased: five rows and three tombstones.
    table(torch.tensor([0, 7919, 2 * 7919, -1, -2])).sum().backward()
    table.erase(torch.tensor([10, 11, 12]) * 7919)
    dynemb.checkpoint.save_delta(table, tmp_path / "d1", base=tmp_path / "d0")
    d1 = _manifest(tmp_path / "d1")["tables"]["table"]
    assert (d1["rows"], d1["tombstones"]) == (5, 3)
    assert sum(f["rows"] for f in d1["files"] if f["role"] == "rows") == 5
    assert sum(f["bytes"] for f in d1["files"]) < sum(f["bytes"] for f in full["files"]) / 50

    restored = dynemb.DynamicEmbedding(8, 4096, optimizer=dynemb.optim.Adam(lr=0.01), score_strategy="step", seed=1)
    dynemb.checkpoint.load(restored, tmp_path / "d1")
    assert_equal(export(restored, None), export(table, None))


def test_erased_then_reinserted_key_is_a_row_not_a_tombstone(tmp_path):
    table = dynemb.DynamicEmbedding(4, 64, optimizer=dynemb.optim.SGD(lr=0.1), score_strategy="step")
    table(torch.arange(10)).sum().backward()
    dynemb.checkpoint.save(table, tmp_path / "full")
    table.erase(torch.tensor([3, 4]))
    table(torch.tensor([3])).sum().backward()
    dynemb.checkpoint.save_delta(table, tmp_path / "d", base=tmp_path / "full")
    d = _manifest(tmp_path / "d")["tables"]["table"]
    assert (d["rows"], d["tombstones"]) == (1, 1)
    restored = dynemb.DynamicEmbedding(4, 64, optimizer=dynemb.optim.SGD(lr=0.1), score_strategy="step")
    dynemb.checkpoint.load(restored, tmp_path / "d")
    assert_equal(export(restored, None), export(table, None))


def test_save_delta_with_a_wrong_base_raises(tmp_path):
    model = Model("sgd", "step")
    train(model, range(2))
    dynemb.checkpoint.save(model, tmp_path / "a")
    train(model, range(2, 3))
    dynemb.checkpoint.save(model, tmp_path / "b")
    train(model, range(3, 4))
    # "a" is not the model's latest checkpoint: its changes since "a" are not tracked any more.
    with pytest.raises(dynemb.CheckpointError, match="save_delta needs the checkpoint most recently saved or loaded"):
        dynemb.checkpoint.save_delta(model, tmp_path / "d", base=tmp_path / "a")
    with pytest.raises(dynemb.CheckpointError) as missing:
        dynemb.checkpoint.save_delta(model, tmp_path / "d", base=tmp_path / "nowhere")
    assert "nowhere" in str(missing.value)
    # Another model's checkpoint is not this model's base either.
    other = Model("sgd", "step")
    train(other, range(1))
    dynemb.checkpoint.save(other, tmp_path / "other")
    with pytest.raises(dynemb.CheckpointError):
        dynemb.checkpoint.save_delta(model, tmp_path / "d", base=tmp_path / "other")
    # A model that never saved nor loaded has no base.
    with pytest.raises(dynemb.CheckpointError):
        dynemb.checkpoint.save_delta(Model("sgd", "step"), tmp_path / "d", base=tmp_path / "b")
    # Nothing was written, and the right base works.
    assert not (tmp_path / "d").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    dynemb.checkpoint.save_delta(model, tmp_path / "d", base=tmp_path / "b")
    restored = Model("sgd", "step")
    dynemb.checkpoint.load(restored, tmp_path / "d")
    _same_tables(restored, model)


@pytest.mark.parametrize("latest", ["full", "delta"])
def test_restarted_job_continues_the_chain(latest, tmp_path):
    """A job saves a full checkpoint (and a delta); a new job loads the latest one, trains and
    writes the next delta on it; loading that delta gives the new job's tables."""
    first = Model("adam", "step", True)
    train(first, range(6))
    dynemb.checkpoint.save(first, tmp_path / "full")
    latest_path = tmp_path / "full"
    if latest == "delta":
        train(first, range(6, 9))
        first.seq.erase(export(first.seq, None)["keys"][:3])
        dynemb.checkpoint.save_delta(first, tmp_path / "d1", base=tmp_path / "full")
        latest_path = tmp_path / "d1"

    second = Model("adam", "step", True)
    dynemb.checkpoint.load(second, latest_path)
    _same_tables(second, first)
    train(second, range(9, 12))
    second.bag.erase(export(second.bag, None)["keys"][:2])
    dynemb.checkpoint.save_delta(second, tmp_path / "next", base=latest_path)
    if latest == "delta":
        # The load followed the chain: a delta on the full checkpoint alone would miss d1.
        with pytest.raises(dynemb.CheckpointError):
            dynemb.checkpoint.save_delta(second, tmp_path / "wrong", base=tmp_path / "full")

    third = Model("adam", "step", True)
    dynemb.checkpoint.load(third, tmp_path / "next")
    _same_tables(third, second)
    assert _manifest(tmp_path / "next")["chain"] == [_manifest(p)["id"] for p in [tmp_path / "full", tmp_path / "d1"][: 1 + (latest == "delta")]]


@pytest.mark.parametrize("how", ["owns", "optimizer_state", "evict"])
def test_no_delta_on_a_checkpoint_loaded_partially(how, tmp_path):
    """After a load that did not take the checkpoint's content as it is (a shard of the keys,
    fresh optimizer state, keys dropped), a delta on it would not rebuild the tables: refused."""
    model = Model("adagrad", "step")
    train(model, range(4))
    dynemb.checkpoint.save(model, tmp_path / "full")
    restored = Model("adagrad", "step", geometry={"seq": (16, None, 8)} if how == "evict" else None)
    options = {"owns": {"owns": lambda k: k % 2 == 0}, "optimizer_state": {"optimizer_state": False}, "evict": {"on_overflow": "evict"}}[how]
    dynemb.checkpoint.load(restored, tmp_path / "full", **options)
    with pytest.raises(dynemb.CheckpointError):
        dynemb.checkpoint.save_delta(restored, tmp_path / "d", base=tmp_path / "full")
    # A full save starts a new chain.
    dynemb.checkpoint.save(restored, tmp_path / "full2")
    dynemb.checkpoint.save_delta(restored, tmp_path / "d", base=tmp_path / "full2")


def test_delta_chain_with_a_broken_link_raises(tmp_path):
    model = Model("sgd", "step")
    train(model, range(2))
    dynemb.checkpoint.save(model, tmp_path / "full")
    dynemb.checkpoint.save_delta(model, tmp_path / "d1", base=tmp_path / "full")
    # The base replaced by another checkpoint at the same path: the delta's base id no longer matches.
    dynemb.checkpoint.save(model, tmp_path / "full", overwrite=True)
    with pytest.raises(dynemb.CheckpointError, match="expects"):
        dynemb.checkpoint.load(Model("sgd", "step"), tmp_path / "d1")
    # The base removed.
    dynemb.checkpoint.save(model, tmp_path / "full2")
    dynemb.checkpoint.save_delta(model, tmp_path / "d2", base=tmp_path / "full2")
    import shutil

    shutil.rmtree(tmp_path / "full2")
    with pytest.raises(dynemb.CheckpointError, match="full2"):
        dynemb.checkpoint.load(Model("sgd", "step"), tmp_path / "d2")


def test_no_delta_after_a_state_dict_load(tmp_path):
    """load_state_dict replaces a table's rows in place (same geometry): a delta on the
    checkpoint saved before would miss that change, so it is refused."""

    def make(seed):
        return dynemb.DynamicEmbedding(4, 48, optimizer=dynemb.optim.SGD(lr=0.1), score_strategy="step", bucket_capacity=8, seed=seed)

    table, other = make(3), make(4)
    table(torch.arange(30)).sum().backward()
    other(torch.arange(20, 60)).sum().backward()
    dynemb.checkpoint.save(table, tmp_path / "full")
    table.load_state_dict(other.state_dict())
    with pytest.raises(dynemb.CheckpointError, match="do not track changes"):
        dynemb.checkpoint.save_delta(table, tmp_path / "delta", base=tmp_path / "full")
    dynemb.checkpoint.save(table, tmp_path / "full2")
    dynemb.checkpoint.save_delta(table, tmp_path / "delta", base=tmp_path / "full2")
    restored = make(3)
    dynemb.checkpoint.load(restored, tmp_path / "delta")
    assert_equal(export(restored, None), export(table, None))
