"""Checkpoints and the timestamp clock (docs/design/0036): a save / load round trip keeps the
clock and the int32 scores; a checkpoint written with the nanosecond clock of before 0036 loads
in seconds, a delta written after such a load reads back in one unit, and training goes on."""

from __future__ import annotations

import time

import torch
from ckpt_models import TABLES, Model, assert_equal, contents, one_thread, train  # noqa: F401  (one_thread: autouse fixture)

import dynemb
from dynemb.nn import clock
from dynemb.nn.clock import EPOCH_S, LEGACY_MIN

NS = 10**9
MODULES = ("seq", "bag", "ebc")


def _clocks(model: Model) -> dict[str, dict[str, int]]:
    return {name: getattr(model, name).clock() for name in MODULES}


def _index_dtypes(model: Model) -> set[torch.dtype]:
    """dtypes of the scores the model's indexes store (int32, or int64 once widened)."""
    indexes = [model.seq.index, model.bag.index, *(e.index for e in model.ebc.engines)]
    return {index._scores.dtype for index in indexes}


def _legacy_model(monkeypatch, steps) -> Model:
    """A timestamp model trained by the clock of before 0036, ``max(time.time_ns(), last + 1)``."""
    with monkeypatch.context() as m:
        m.setattr(clock, "tick", lambda last: max(time.time_ns(), last + 1))
        model = Model("adam", "timestamp")
        train(model, steps)
    return model


def test_round_trip_keeps_the_clock_and_int32_scores(tmp_path):
    saved = Model("adam", "timestamp")
    train(saved, range(4))
    assert _index_dtypes(saved) == {torch.int32}
    dynemb.checkpoint.save(saved, tmp_path / "ckpt")
    restored = Model("adam", "timestamp")
    dynemb.checkpoint.load(restored, tmp_path / "ckpt")
    assert _clocks(restored) == _clocks(saved) and all(0 < c["last_timestamp"] < 2**31 for c in _clocks(saved).values())
    assert_equal(contents(restored), contents(saved))
    assert _index_dtypes(restored) == {torch.int32}
    figures = [restored.seq.stats(), restored.bag.stats(), *restored.ebc.stats().values()]
    assert all(f["index_bytes_per_key"] <= 20 for f in figures)


def test_nanosecond_checkpoint_loads_in_seconds_and_a_delta_after_it_reads_back(tmp_path, monkeypatch):
    old = _legacy_model(monkeypatch, range(4))
    old_contents, old_clocks = contents(old), _clocks(old)
    assert all(c["last_timestamp"] >= LEGACY_MIN for c in old_clocks.values())
    dynemb.checkpoint.save(old, tmp_path / "base")

    model = Model("adam", "timestamp")
    dynemb.checkpoint.load(model, tmp_path / "base")
    assert _clocks(model) == {n: {"step": c["step"], "last_timestamp": c["last_timestamp"] // NS - EPOCH_S} for n, c in old_clocks.items()}
    # Every score floored to whole seconds since the epoch, rows bitwise; int32 scores again.
    want = {n: {**t, "scores": t["scores"] // NS - EPOCH_S} for n, t in old_contents.items()}
    assert_equal(contents(model), want)
    assert _index_dtypes(model) == {torch.int32}

    # Training goes on above every loaded score; a delta on the nanosecond base then reads back
    # in seconds (the base's untouched rows converted on load, the delta's as they are).
    train(model, range(4, 6))
    for name in TABLES:
        scores = contents(model)[name]["scores"]
        assert int(scores.max()) == _clocks(model)[name.split(".")[0]]["last_timestamp"] < LEGACY_MIN
    dynemb.checkpoint.save_delta(model, tmp_path / "delta", base=tmp_path / "base")
    chained = Model("adam", "timestamp")
    dynemb.checkpoint.load(chained, tmp_path / "delta")
    assert_equal(contents(chained), contents(model))
    assert _clocks(chained) == _clocks(model) and _index_dtypes(chained) == {torch.int32}


def test_nanosecond_state_dict_of_the_whole_model_loads_in_seconds(monkeypatch):
    old = _legacy_model(monkeypatch, range(3))
    model = Model("adam", "timestamp")
    model.load_state_dict(old.state_dict())
    want = {n: {**t, "scores": t["scores"] // NS - EPOCH_S} for n, t in contents(old).items()}
    assert_equal(contents(model), want)
    assert _index_dtypes(model) == {torch.int32}
