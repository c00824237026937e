"""save(dense=True) / load(dense=True): the model's other state_dict entries ride along."""

from __future__ import annotations

import pytest
import torch

import dynemb
import dynemb.checkpoint as ck


def model() -> torch.nn.Module:
    m = torch.nn.Module()
    m.table = dynemb.DynamicEmbedding(4, 64, optimizer=dynemb.optim.SGD(lr=0.1))
    m.linear = torch.nn.Linear(4, 2)
    m.norm = torch.nn.BatchNorm1d(2)
    return m


def test_dense_round_trip(tmp_path):
    torch.manual_seed(0)
    a = model()
    a.norm(a.linear(a.table(torch.tensor([1, 2, 3])))).sum().backward()
    ck.save(a, tmp_path / "c", dense=True)
    b = model()
    ck.load(b, tmp_path / "c", dense=True)
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k


def test_dense_mismatch_raises_before_any_change(tmp_path):
    a = model()
    a.table(torch.tensor([1, 2])).sum().backward()
    ck.save(a, tmp_path / "c", dense=True)
    b = model()
    b.linear = torch.nn.Linear(4, 3)
    before = {k: v.clone() for k, v in b.state_dict().items()}
    with pytest.raises(dynemb.CheckpointError, match="dense"):
        ck.load(b, tmp_path / "c", dense=True)
    assert all(torch.equal(v, b.state_dict()[k]) for k, v in before.items())
    with pytest.raises(dynemb.CheckpointError, match="no dense"):
        ck.save(a, tmp_path / "d")
        ck.load(b, tmp_path / "d", dense=True)
