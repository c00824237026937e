"""Whatever save completes, load reads: rows made non-finite on purpose (nonfinite_grads='apply')
are saved with a warning and load with a warning, in full checkpoints and deltas alike."""

from __future__ import annotations

import pytest
import torch

import dynemb

D = 4
BIG = 3e38


def build(policy: str = "apply"):
    return dynemb.DynamicEmbedding(D, 64, optimizer=dynemb.optim.Adam(lr=1.0), nonfinite_grads=policy, score_strategy="step")


def step(table, keys: list[int], big: int | None = None):
    """One lookup of ``keys``; ``big`` gets a gradient that overflows Adam's second moment."""
    ids = torch.tensor(keys)
    scale = torch.ones(len(keys), 1)
    if big is not None:
        scale[keys.index(big)] = BIG
    (table(ids) * scale).sum().backward()


def contents(table) -> dict[str, torch.Tensor]:
    chunks = list(table.export())
    out = {k: torch.cat([c[k] for c in chunks]) for k in ("keys", "embeddings", "optimizer_state", "scores")}
    order = torch.argsort(out["keys"])
    return {k: v[order] for k, v in out.items()}


def assert_same(a: dict, b: dict) -> None:
    for k in a:
        # Bitwise, NaN and inf included.
        assert torch.equal(a[k].view(torch.uint8) if a[k].is_floating_point() else a[k], b[k].view(torch.uint8) if b[k].is_floating_point() else b[k]), k


def test_full_and_delta_with_nonfinite_rows_save_and_load(tmp_path):
    table = build()
    step(table, [1, 2, 3])
    table.insert(torch.tensor([9]), torch.full((1, D), BIG))
    step(table, [1, 9], big=9)
    assert not torch.isfinite(contents(table)["optimizer_state"]).all()
    with pytest.warns(RuntimeWarning, match=r"saving table 'table': the rows of 1 key\(s\) \[9\] hold NaN or inf"):
        dynemb.checkpoint.save(table, tmp_path / "base")
    full = contents(table)

    # The delta holds only rows touched since (key 9 is not): it writes no non-finite row.
    step(table, [2, 4])
    dynemb.checkpoint.save_delta(table, tmp_path / "d1", base=tmp_path / "base")
    delta = contents(table)

    for path, want in ((tmp_path / "base", full), (tmp_path / "d1", delta)):
        fresh = build()
        with pytest.warns(RuntimeWarning, match=r"the rows of 1 key\(s\) \[9\] hold NaN or inf"):
            dynemb.checkpoint.load(fresh, path)
        assert_same(contents(fresh), want)


def test_a_nonfinite_row_replaced_by_a_delta_loads_without_warning(tmp_path, recwarn):
    table = build()
    table.insert(torch.tensor([9]), torch.full((1, D), BIG))
    step(table, [9], big=9)
    dynemb.checkpoint.save(table, tmp_path / "base")
    table.insert(torch.tensor([9]), torch.zeros(1, D + table.state_dim))
    dynemb.checkpoint.save_delta(table, tmp_path / "d1", base=tmp_path / "base")
    recwarn.clear()
    fresh = build()
    dynemb.checkpoint.load(fresh, tmp_path / "d1")
    assert not [w for w in recwarn if "NaN or inf" in str(w.message)]
    assert_same(contents(fresh), contents(table))


def test_default_policy_keeps_checkpoints_finite(tmp_path, recwarn):
    table = build("skip")
    table.insert(torch.tensor([9]), torch.full((1, D), BIG))
    step(table, [1, 9], big=9)
    assert table.stats()["nonfinite_grads"] == 1
    dynemb.checkpoint.save(table, tmp_path / "ck")
    fresh = build("skip")
    dynemb.checkpoint.load(fresh, tmp_path / "ck")
    assert not [w for w in recwarn if "NaN or inf" in str(w.message)]
    assert_same(contents(fresh), contents(table))
    assert fresh.stats()["nonfinite_grads"] == 1
