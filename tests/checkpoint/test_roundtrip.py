"""save -> load into a fresh model gives bitwise the saved tables, and training continues bitwise.

K keys of a table. Every optimizer is crossed with every score strategy of a model holding a
DynamicEmbedding, a DynamicEmbeddingBag and a two-group DynamicEmbeddingBagCollection (one table
read by two features); admission alternates over that grid so that each optimizer and each
strategy runs with and without it (a full 4 x 4 x 2 product would double the time for pairs that
do not interact: admission is table policy, the optimizer only sees rows). ``customized`` scores
(collections refuse them) run on single tables, every optimizer, with and without admission.

Timestamp tables score keys with wall time, so two runs never hold equal scores: there the
tables' keys, embeddings, optimizer state, placement and counters must be equal, and scores equal
in order (the same key is evicted), not in value.
"""

from __future__ import annotations

import pytest
import torch
from ckpt_models import (
    OPTIMIZERS,
    STRATEGIES,
    CustomModel,
    Model,
    admission_state,
    assert_equal,
    contents,
    contents_modulo_clock,
    one_thread,  # noqa: F401 (autouse fixture)
    placement,
    stats,
    train,
)

import dynemb

BEFORE, AFTER = 6, 10
GRID = [(opt, strategy, (i + j) % 2 == 1) for i, opt in enumerate(OPTIMIZERS) for j, strategy in enumerate(STRATEGIES)]


def _placement_modulo_clock(p: dict) -> dict:
    return {name: {**t, "scores": torch.unique(t["scores"], return_inverse=True)[1]} for name, t in p.items()}


def _assert_same_tables(got: torch.nn.Module, want: torch.nn.Module, *, wall_clock: bool = False) -> None:
    c_got, c_want, p_got, p_want = contents(got), contents(want), placement(got), placement(want)
    if wall_clock:
        c_got, c_want = contents_modulo_clock(c_got), contents_modulo_clock(c_want)
        p_got, p_want = _placement_modulo_clock(p_got), _placement_modulo_clock(p_want)
    assert_equal(c_got, c_want, "contents")
    assert_equal(p_got, p_want, "placement")
    assert_equal(stats(got), stats(want), "stats")
    assert_equal(admission_state(got), admission_state(want), "admission")


def _roundtrip(make, tmp_path, *, wall_clock: bool) -> None:
    saved = make()
    train(saved, range(BEFORE))
    # Keys already left the tables (evicted, or failed under no_eviction) before the save...
    left_before = {n: s["evictions"] + s["failed_inserts"] for n, s in stats(saved).items()}
    assert sum(left_before.values()) > 0, left_before
    dynemb.checkpoint.save(saved, tmp_path / "ckpt")

    restored = make()
    report = dynemb.checkpoint.load(restored, tmp_path / "ckpt")
    assert report == {n: {"rows": s["size"], "dropped": 0} for n, s in stats(saved).items()}
    # Right after the load: bitwise, scores included (they are the saved values, wall time or not).
    _assert_same_tables(restored, saved)

    # The saved model goes on uninterrupted; the restored one must follow it exactly.
    want = train(saved, range(BEFORE, BEFORE + AFTER))
    got = train(restored, range(BEFORE, BEFORE + AFTER))
    assert_equal(got, want, "outputs and losses")
    _assert_same_tables(restored, saved, wall_clock=wall_clock)
    # ... and keep leaving every table after it.
    left_after = {n: s["evictions"] + s["failed_inserts"] for n, s in stats(saved).items()}
    assert all(left_after[n] > left_before[n] for n in left_after), (left_before, left_after)


@pytest.mark.parametrize("optimizer, strategy, admission", GRID)
def test_roundtrip_and_ten_more_steps(optimizer, strategy, admission, tmp_path):
    _roundtrip(lambda: Model(optimizer, strategy, admission), tmp_path, wall_clock=strategy == "timestamp")


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_roundtrip_customized_scores(optimizer, tmp_path):
    admission = list(OPTIMIZERS).index(optimizer) % 2 == 0
    _roundtrip(lambda: CustomModel(optimizer, admission), tmp_path, wall_clock=False)


def test_timestamp_clock_restored_and_keeps_rising(tmp_path):
    """A restored timestamp table never scores a key below the saved scores (its clock is the
    saved last timestamp, even if the wall clock went back)."""
    saved = Model("sgd", "timestamp")
    train(saved, range(3))
    dynemb.checkpoint.save(saved, tmp_path / "ckpt")
    restored = Model("sgd", "timestamp")
    dynemb.checkpoint.load(restored, tmp_path / "ckpt")
    assert restored.seq.clock() == saved.seq.clock() and saved.seq.clock()["last_timestamp"] > 0
    assert restored.ebc.clock() == saved.ebc.clock() and saved.ebc.clock()["last_timestamp"] > 0
    # Pretend the saved clock is far in the future (a century of seconds): the next scores
    # must still be above it.
    future = saved.seq.clock()["last_timestamp"] + 100 * 365 * 86400
    restored.seq.set_clock(restored.seq.step, future)
    train(restored, range(3, 4))
    assert int(contents(restored)["seq"]["scores"].max()) == future + 1


def test_roundtrip_of_a_frozen_model(tmp_path):
    """Tables without an optimizer (S = 0) save and load too."""
    saved = Model(None, "lfu")
    train(saved, range(4))
    dynemb.checkpoint.save(saved, tmp_path / "ckpt")
    restored = Model(None, "lfu")
    dynemb.checkpoint.load(restored, tmp_path / "ckpt")
    _assert_same_tables(restored, saved)
    assert all(t["optimizer_state"].shape[1] == 0 for t in contents(restored).values())


def test_save_returns_the_manifest_id_and_overwrite_is_explicit(tmp_path):
    model = Model("sgd", "step")
    train(model, range(2))
    first = dynemb.checkpoint.save(model, tmp_path / "ckpt")
    assert isinstance(first, str) and first
    with pytest.raises(FileExistsError):
        dynemb.checkpoint.save(model, tmp_path / "ckpt")
    train(model, range(2, 3))
    second = dynemb.checkpoint.save(model, tmp_path / "ckpt", overwrite=True)
    assert second != first
    restored = Model("sgd", "step")
    dynemb.checkpoint.load(restored, tmp_path / "ckpt")
    _assert_same_tables(restored, model)


def test_chunked_rows_files_load_the_same(tmp_path):
    """chunk_rows splits a table's rows over several files; the result does not depend on it."""
    model = Model("rowwise_adagrad", "step", True)
    train(model, range(4))
    dynemb.checkpoint.save(model, tmp_path / "small", chunk_rows=5)
    restored = Model("rowwise_adagrad", "step", True)
    dynemb.checkpoint.load(restored, tmp_path / "small")
    _assert_same_tables(restored, model)
    assert_equal(train(restored, range(4, 7)), train(model, range(4, 7)))
