"""torch.distributed.checkpoint save / load of models with dynemb tables, one process, no process
group: dynemb.checkpoint.dcp.Stateful + prepare_load."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ckpt_models import Model, admission_state, assert_equal, contents, placement, stats, train
from torch.distributed.checkpoint.api import CheckpointException

import dynemb
from dynemb.checkpoint.dcp import Stateful, prepare_load

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class WithDense(torch.nn.Module):
    """The checkpoint tests' model (DynamicEmbedding, DynamicEmbeddingBag, a collection of three
    tables) plus a dense layer."""

    def __init__(self, **kw):
        super().__init__()
        self.sparse = Model("adam", "step", admission=True, **kw)
        self.head = torch.nn.Linear(4, 1)

    def forward(self, step: int) -> torch.Tensor:
        return self.sparse(step)


def _train(model: WithDense, steps) -> list[torch.Tensor]:
    dense_opt = torch.optim.SGD(model.head.parameters(), lr=0.1)
    outs = []
    for step in steps:
        out = model.sparse(step)  # [B, 28]
        loss = (model.head(out[:, :4]).squeeze(1) - out[:, 4:].sum(1)).square().sum()
        dense_opt.zero_grad()
        loss.backward()
        dense_opt.step()
        outs.append(out.detach().clone())
    return outs


def _assert_same_tables(a: torch.nn.Module, b: torch.nn.Module, exact_placement: bool = True) -> None:
    assert_equal(contents(a), contents(b), "contents")
    assert_equal(admission_state(a), admission_state(b), "admission")
    if exact_placement:
        assert_equal(stats(a), stats(b), "stats")
        assert_equal(placement(a), placement(b), "placement")


def test_save_load_round_trip_and_training_continues(tmp_path):
    assert not dist.is_initialized()
    model = WithDense()
    _train(model, range(6))
    dcp.save({"model": Stateful(model)}, checkpoint_id=tmp_path / "dcp")

    fresh = WithDense()
    state = {"model": Stateful(fresh)}
    prepare_load(state, tmp_path / "dcp")
    dcp.load(state, checkpoint_id=tmp_path / "dcp")
    assert not dist.is_initialized()

    _assert_same_tables(model, fresh)
    assert_equal(dict(model.head.state_dict()), dict(fresh.head.state_dict()), "head")
    # Same geometry: the index is restored slot by slot, so training goes on bitwise the same.
    assert_equal(_train(model, range(6, 10)), _train(fresh, range(6, 10)), "outputs")
    _assert_same_tables(model, fresh)


def test_plain_module_saved_wrapper_loads(tmp_path):
    """A module saved as it is ({"model": model}) loads through the wrapper (same entries)."""
    model = Model("sgd", "lfu")
    train(model, range(5))
    dcp.save({"model": model}, checkpoint_id=tmp_path)
    fresh = Model("sgd", "lfu")
    state = {"model": Stateful(fresh)}
    prepare_load(state, storage_reader=dcp.FileSystemReader(tmp_path))
    dcp.load(state, checkpoint_id=tmp_path)
    _assert_same_tables(model, fresh)


def test_several_wrapped_modules_and_a_bare_table(tmp_path):
    """Two top-level entries with the same entry names are told apart by their key; a
    DynamicTable may itself be the wrapped module."""
    table = dynemb.DynamicEmbedding(4, 100, optimizer=dynemb.optim.Adagrad(lr=0.1), seed=1)
    table(torch.arange(30)).sum().backward()
    other = dynemb.DynamicEmbedding(4, 100, optimizer=dynemb.optim.Adagrad(lr=0.1), seed=2)
    other(torch.arange(50, 57)).sum().backward()
    dcp.save({"a": Stateful(table), "b": Stateful(other), "step": torch.tensor(7)}, checkpoint_id=tmp_path)

    fa = dynemb.DynamicEmbedding(4, 100, optimizer=dynemb.optim.Adagrad(lr=0.1))
    fb = dynemb.DynamicEmbedding(4, 100, optimizer=dynemb.optim.Adagrad(lr=0.1))
    state = {"a": Stateful(fa), "b": Stateful(fb), "step": torch.tensor(0)}
    prepare_load(state, tmp_path)
    dcp.load(state, checkpoint_id=tmp_path)
    assert_equal(table.state_dict(), fa.state_dict(), "a")
    assert_equal(other.state_dict(), fb.state_dict(), "b")
    assert int(state["step"]) == 7


def test_load_into_another_geometry(tmp_path):
    """Into tables of another capacity the keys are re-inserted (contents equal, placement not)."""
    model = Model("adam", "step")
    train(model, range(6))
    dcp.save({"model": Stateful(model)}, checkpoint_id=tmp_path)
    bigger = Model("adam", "step", geometry={name: (256, None, 16) for name in ("seq", "bag", "user", "item", "tag")})
    state = {"model": Stateful(bigger)}
    prepare_load(state, tmp_path)
    dcp.load(state, checkpoint_id=tmp_path)
    _assert_same_tables(model, bigger, exact_placement=False)


def test_without_prepare_load_dcp_refuses(tmp_path):
    """Why the wrapper exists: a fresh table's template has other sizes than the saved one."""
    model = Model("sgd", "step")
    train(model, range(3))
    dcp.save({"model": model}, checkpoint_id=tmp_path)
    with pytest.raises(CheckpointException, match="Size mismatch"):
        dcp.load({"model": Model("sgd", "step")}, checkpoint_id=tmp_path)
    with pytest.raises(TypeError, match="wrap it as dynemb.checkpoint.dcp.Stateful"):
        prepare_load({"model": Model("sgd", "step")}, tmp_path)


def test_stateful_protocol():
    from torch.distributed.checkpoint.stateful import Stateful as DCPStateful

    assert isinstance(Stateful(Model()), DCPStateful)
