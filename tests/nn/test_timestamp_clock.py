"""The timestamp clock (docs/design/0036): seconds since 2025-01-01 UTC, one value per call,
strictly rising; default tables keep int32 scores (20 bytes a key, docs/design/0035); the clock
survives a state_dict round trip; nanosecond states of before 0036 load in seconds.

K keys held, D embedding dim.
"""

from __future__ import annotations

import time
import types

import pytest
import torch

import dynemb
from dynemb import TableConfig
from dynemb.nn import clock
from dynemb.nn.clock import EPOCH_S, LEGACY_MIN, clock_from_legacy, loaded_scores
from dynemb.types import ScoreStrategy

NS = 10**9


def _table(capacity: int = 256, **kw) -> dynemb.DynamicEmbedding:
    # Every option at its default but the size: the score strategy is timestamp.
    return dynemb.DynamicEmbedding(4, capacity=capacity, optimizer=dynemb.optim.SGD(lr=0.1), **kw)


def _collection(strategies: tuple = (None, None)) -> dynemb.DynamicEmbeddingCollection:
    """Tables a (D 4) and b (D 8): two engines; a strategy None is the config's default."""
    tables = [
        TableConfig(name=name, embedding_dim=dim, capacity=256, **({} if s is None else {"score_strategy": s}))
        for name, dim, s in zip("ab", (4, 8), strategies)
    ]
    return dynemb.DynamicEmbeddingCollection(tables, dynemb.optim.SGD(lr=0.1))


def _train_table(table: dynemb.DynamicEmbedding, batches) -> None:
    for keys in batches:
        table(torch.as_tensor(keys)).sum().backward()


def _train_collection(col, batches) -> None:
    for keys in batches:
        keys = torch.as_tensor(keys)
        lengths = torch.tensor([keys.numel()])
        out = col({"a": (keys, lengths), "b": (keys + 1000, lengths)})
        (out["a"][0].sum() + out["b"][0].sum()).backward()


def _scores(module, table: str | None = None) -> dict[int, int]:
    chunks = list(module.export() if table is None else module.export(table))
    return {k: s for c in chunks for k, s in zip(c["keys"].tolist(), c["scores"].tolist())}


def _indexes(module) -> list:
    return [module.index] if isinstance(module, dynemb.DynamicTable) else [e.index for e in module.engines]


def _legacy_tick(monkeypatch) -> None:
    """The clock before 0036, ``max(time.time_ns(), last + 1)``, as every older dynemb ran it."""
    monkeypatch.setattr(clock, "tick", lambda last: max(time.time_ns(), last + 1))


def _wall(monkeypatch, seconds_since_epoch: int) -> None:
    """Stop the clock's wall clock at a fixed time."""
    monkeypatch.setattr(clock, "time", types.SimpleNamespace(time_ns=lambda: (EPOCH_S + seconds_since_epoch) * NS))


def test_default_table_and_collection_keep_int32_scores_and_20_bytes_a_key():
    assert TableConfig(embedding_dim=4, capacity=8).score_strategy is ScoreStrategy.TIMESTAMP
    table, col = _table(), _collection()
    batches = [range(i * 10, i * 10 + 30) for i in range(5)]
    _train_table(table, batches)
    _train_collection(col, batches)
    figures = [table.stats(), col.stats()["a"], col.stats()["b"]]
    assert all(f["size"] > 0 and f["index_bytes"] == 17 * f["current_capacity"] for f in figures)
    assert all(f["index_bytes_per_key"] == pytest.approx(20.0) and f["index_bytes_per_key"] <= 20 + 1e-9 for f in figures)
    assert all(index._scores.dtype is torch.int32 for m in (table, col) for index in _indexes(m))


def test_scores_are_seconds_since_2025_one_value_per_call_rising():
    before = time.time_ns() // NS - EPOCH_S
    col = _collection()
    _train_collection(col, [[1, 2], [2, 3], [3, 4]])
    after = time.time_ns() // NS - EPOCH_S
    a, b = _scores(col, "a"), _scores(col, "b")
    # Both engines of a call share its value; each call is later than the one before.
    assert a[1] < a[2] < a[3] == a[4] and [b[k + 1000] for k in (1, 2, 3, 4)] == [a[1], a[2], a[3], a[4]]
    assert before <= a[1] and a[4] <= after + 2
    assert col.clock()["last_timestamp"] == a[4]


def test_lru_order_holds_when_the_wall_clock_stalls_or_goes_back(monkeypatch):
    # One bucket of 16: every key competes with every other.
    table = _table(capacity=16, bucket_capacity=16, check_mode="count")
    _wall(monkeypatch, 1000)
    _train_table(table, [range(16)])
    _wall(monkeypatch, 1000)
    _train_table(table, [range(8)])
    # The wall clock went back a day: the clock still moves on.
    _wall(monkeypatch, 1000 - 86400)
    _train_table(table, [[100]])
    scores = _scores(table)
    assert [scores[0], scores[100]] == [1001, 1002] and table.clock()["last_timestamp"] == 1002
    # The key used least recently (one of 8..15, scored 1000) made room.
    (evicted,) = table.last_evicted_keys.tolist()
    assert 8 <= evicted < 16 and evicted not in scores and all(scores[k] == 1000 for k in range(8, 16) if k != evicted)


def test_each_engine_gets_its_own_strategys_clock():
    # Before 0036 the first table's strategy chose the clock of every engine.
    for strategies in (("step", "timestamp"), ("timestamp", "step")):
        col = _collection(strategies)
        before = time.time_ns() // NS - EPOCH_S
        _train_collection(col, [[1], [2]])
        by_table = dict(zip("ab", strategies))
        for name in "ab":
            scores = sorted(_scores(col, name).values())
            if by_table[name] == "step":
                assert scores == [1, 2]
            else:
                assert scores[0] >= before and scores[1] > scores[0]


@pytest.mark.parametrize("make, train", [(_table, _train_table), (_collection, _train_collection)])
def test_state_dict_round_trip_keeps_the_clock(make, train, monkeypatch):
    saved = make()
    train(saved, [[1, 2], [3]])
    loaded = make()
    loaded.load_state_dict(saved.state_dict())
    assert loaded.clock() == saved.clock()
    # Even with the wall clock before the saved one, the next call scores above every key.
    _wall(monkeypatch, 0)
    train(loaded, [[4]])
    names = [None] if make is _table else ["a", "b"]
    for name in names:
        scores = _scores(loaded, name)
        assert max(scores.values()) == saved.clock()["last_timestamp"] + 1 == loaded.clock()["last_timestamp"]


@pytest.mark.parametrize("make, train", [(_table, _train_table), (_collection, _train_collection)])
def test_nanosecond_state_of_before_0036_loads_in_seconds(make, train, monkeypatch):
    with monkeypatch.context() as m:
        _legacy_tick(m)
        old = make()
        train(old, [[1, 2], [3, 4], [1]])
        state = old.state_dict()
    names = [None] if make is _table else ["a", "b"]
    old_scores = {name: _scores(old, name) for name in names}
    last_ns = old.clock()["last_timestamp"]
    assert last_ns >= LEGACY_MIN and all(s >= LEGACY_MIN for sc in old_scores.values() for s in sc.values())
    # The old process widened its scores: 21 bytes a slot.
    assert all(index._scores.dtype is torch.int64 for index in _indexes(old))

    new = make()
    new.load_state_dict(state)
    assert new.clock() == {"step": old.clock()["step"], "last_timestamp": last_ns // NS - EPOCH_S}
    for name in names:
        # Every score floored to whole seconds since the epoch: order kept (to the second).
        assert _scores(new, name) == {k: s // NS - EPOCH_S for k, s in old_scores[name].items()}
    assert all(index._scores.dtype is torch.int32 for index in _indexes(new))
    stats = [new.stats()] if make is _table else list(new.stats().values())
    assert all(s["index_bytes_per_key"] == pytest.approx(20.0) for s in stats)
    # Training goes on: the next call scores above every loaded key, still int32.
    train(new, [[5]])
    for name in names:
        scores = _scores(new, name)
        fresh = scores[5 if name != "b" else 1005]
        assert fresh == new.clock()["last_timestamp"] > max(v for k, v in scores.items() if k not in (5, 1005))
    assert all(index._scores.dtype is torch.int32 for index in _indexes(new))


def test_set_clock_converts_a_nanosecond_value_and_keeps_others():
    table = _table()
    table.set_clock(3, 1_750_000_000 * NS + 999_999_999)
    assert table.clock() == {"step": 3, "last_timestamp": 1_750_000_000 - EPOCH_S}
    table.set_clock(4, 12345)
    assert table.clock() == {"step": 4, "last_timestamp": 12345}
    # A nanosecond clock of before the epoch: 0, below every value the clock hands out.
    assert clock_from_legacy(1_700_000_000 * NS) == 0 and clock_from_legacy(LEGACY_MIN - 1) == LEGACY_MIN - 1


def test_loaded_scores_convert_only_nanosecond_timestamps():
    scores = torch.tensor([0, 7, LEGACY_MIN - 1, LEGACY_MIN, (EPOCH_S + 5) * NS + NS - 1, 2**63 - 1], dtype=torch.int64)
    got = loaded_scores(scores, ScoreStrategy.TIMESTAMP)
    legacy = [LEGACY_MIN // NS - EPOCH_S, 5, (2**63 - 1) // NS - EPOCH_S]
    assert got.dtype is torch.int64 and got.tolist() == [0, 7, LEGACY_MIN - 1, *legacy]
    for strategy in ("step", "lfu", "customized", "no_eviction"):
        assert loaded_scores(scores, ScoreStrategy(strategy)) is scores
