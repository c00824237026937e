"""state_dict / load_state_dict: plain tensors, bitwise restore, training continues bitwise.

K keys held, D embedding dim.
"""

from __future__ import annotations

import io
import subprocess
import sys

import pytest
import torch
from restart_job import CASES, make, run, train

import dynemb

HERE = __import__("pathlib").Path(__file__).parent


def assert_states_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def roundtrip(state: dict) -> dict:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_state_dict_is_not_empty_and_restores_the_table():
    """Finding 1: state_dict() was empty and load_state_dict 'succeeded' into an empty table."""
    table, _ = run("adam", False, 6)
    state = table.state_dict()
    assert state["keys"].numel() == table.size() > 0
    fresh = make("adam", False)
    fresh.load_state_dict(roundtrip(state))
    assert fresh.size() == table.size()
    assert_states_equal(fresh.state_dict(), state)


def test_save_restart_process_load_continues_bitwise(tmp_path):
    """Save, restart the process, load, train 10 more steps == uninterrupted, every optimizer,
    sequence and pooled."""
    job = [sys.executable, str(HERE / "restart_job.py")]
    subprocess.run([*job, "save", str(tmp_path), "7"], check=True, timeout=300, cwd=HERE)
    subprocess.run([*job, "resume", str(tmp_path), "10"], check=True, timeout=300, cwd=HERE)
    for optimizer, pooled in CASES:
        table, outs = run(optimizer, pooled, 17)
        resumed = torch.load(tmp_path / f"{optimizer}-{int(pooled)}-resumed.pt", weights_only=True)
        for got, want in zip(resumed["outs"], outs[7:]):
            assert torch.equal(got, want), (optimizer, pooled)
        assert table.stats()["evictions"] > 0
        assert_states_equal(resumed["state"], table.state_dict())


@pytest.mark.parametrize("pooled", [False, True])
def test_restore_into_other_geometry_reinserts_and_trains_on(pooled):
    table, _ = run("rowwise_adagrad", pooled, 5)
    state = table.state_dict()
    other = (
        dynemb.DynamicEmbeddingBag(4, 400, mode="sum", optimizer=dynemb.optim.RowWiseAdagrad(lr=0.1), bucket_capacity=8)
        if pooled
        else dynemb.DynamicEmbedding(4, 400, optimizer=dynemb.optim.RowWiseAdagrad(lr=0.1), bucket_capacity=8)
    )
    other.load_state_dict(state)
    a = {k: v for k, v in zip(state["keys"].tolist(), state["embeddings"])}
    values, found = other.find(state["keys"])
    assert bool(found.all())
    torch.testing.assert_close(values, torch.stack([a[k] for k in state["keys"].tolist()]), rtol=0, atol=0)
    assert other.step == table.step and other.optimizer_step == table.optimizer_step
    train(other, pooled, range(5, 8))


def test_load_into_too_small_table_raises_and_changes_nothing():
    table, _ = run("sgd", False, 8)
    small = dynemb.DynamicEmbedding(4, 16, optimizer=dynemb.optim.SGD(lr=0.1))
    small(torch.tensor([1, 2, 3]))
    before = small.state_dict()
    with pytest.raises(RuntimeError, match="do not fit"):
        small.load_state_dict(table.state_dict())
    assert_states_equal(small.state_dict(), before)


def test_strict_semantics_like_nn_module():
    table, _ = run("sgd", False, 3)
    state = dict(table.state_dict())
    fresh = make("sgd", False)
    with pytest.raises(RuntimeError, match="Unexpected key"):
        fresh.load_state_dict({**state, "bogus": torch.zeros(1)})
    result = make("sgd", False).load_state_dict({**state, "bogus": torch.zeros(1)}, strict=False)
    assert result.unexpected_keys == ["bogus"] and result.missing_keys == []
    partial = {k: v for k, v in state.items() if k != "scores"}
    with pytest.raises(RuntimeError, match="Missing key"):
        make("sgd", False).load_state_dict(partial)
    # Non-strict with a missing entry cannot restore the table: it reports and leaves it alone.
    untouched = make("sgd", False)
    with pytest.raises(RuntimeError, match="not changed"):
        untouched.load_state_dict(partial, strict=False)
    assert untouched.size() == 0


def test_nested_in_a_model_state_dict():
    model = torch.nn.ModuleDict({"emb": make("adagrad", False), "head": torch.nn.Linear(4, 1)})
    train(model["emb"], False, range(4))
    state = roundtrip(model.state_dict())
    assert "emb.keys" in state and "head.weight" in state
    other = torch.nn.ModuleDict({"emb": make("adagrad", False), "head": torch.nn.Linear(4, 1)})
    other.load_state_dict(state)
    assert_states_equal(other["emb"].state_dict(), model["emb"].state_dict())


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda s: s.update(embeddings=s["embeddings"][:, :2]), "embedding_dim"),
        (lambda s: s.update(optimizer_state=torch.zeros(s["keys"].numel(), 3)), "optimizer"),
        (lambda s: s.update(keys=s["keys"].to(torch.float32)), "dtype"),
        (lambda s: s.update(keys=torch.cat([s["keys"][:1], s["keys"][:-1]])), "duplicate"),
        (lambda s: s.update(scores=s["scores"][:-1]), "shape"),
        (lambda s: s.update(step=torch.tensor(-1)), "step"),
    ],
)
def test_bad_state_raises_and_changes_nothing(edit, match):
    table, _ = run("adagrad", False, 4)
    state = {k: v.clone() for k, v in table.state_dict().items()}
    edit(state)
    target, _ = run("adagrad", False, 2)
    before = target.state_dict()
    with pytest.raises(RuntimeError, match=match):
        target.load_state_dict(state)
    assert_states_equal(target.state_dict(), before)


@pytest.mark.parametrize("strategy", ["timestamp", "step", "lfu"])
def test_export_then_insert_restores_a_full_table(strategy):
    """Finding 2: export() + insert() into a fresh table of the same config lost keys."""
    kw = dict(optimizer=dynemb.optim.Adam(lr=0.01), score_strategy=strategy, check_mode="count")
    table = dynemb.DynamicEmbedding(8, 1024, **kw)
    g = torch.Generator().manual_seed(0)
    for _ in range(12):
        table(torch.randint(-(2**62), 2**62, (512,), generator=g)).sum().backward()
    assert table.size() == table.capacity()
    chunks = list(table.export())
    keys = torch.cat([c["keys"] for c in chunks])
    rows = torch.cat([torch.cat([c["embeddings"], c["optimizer_state"]], 1) for c in chunks])
    scores = torch.cat([c["scores"] for c in chunks])
    fresh = dynemb.DynamicEmbedding(8, 1024, **kw)
    ok = fresh.insert(keys, rows, scores=scores)
    assert bool(ok.all()) and fresh.size() == keys.numel()
    assert fresh.last_evicted_keys.numel() == 0
    values, found = fresh.find(keys)
    assert bool(found.all())
    torch.testing.assert_close(values, rows[:, :8], rtol=0, atol=0)
    assert torch.equal(fresh.index.scores(keys)[0], scores)
