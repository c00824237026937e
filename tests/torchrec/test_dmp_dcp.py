"""torch.distributed.checkpoint (DCP) of a DMP model's ``state_dict()``: saved at 2 ranks, loaded
at 3 (the tables' row-sharded entries re-templated from the checkpoint's metadata by
``dynemb.checkpoint.dcp.prepare_load``, each row sent to its key's owner by
``load_state_dict``): equal tables (rows and optimizer state by key), equal dense weights, and
one further step equal to the model that went on without the checkpoint. The same through
dynemb's ``Stateful`` wrapper.

G samples per global batch, W ranks.
"""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from dmp_models import Model, assert_rows, dmp, gathered_rows, local_batch, mean_over_ranks

from dynemb.checkpoint.dcp import Stateful, prepare_load
from spawning import run_ranks

STEPS = 3
TIMEOUT_S = 150.0


def _dense(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.module.named_parameters()}


def _step(model, step: int, rank: int, world: int, optimizer=None) -> torch.Tensor:
    loss = model(*local_batch(step, rank, world))
    if optimizer is not None:
        optimizer.zero_grad()
    loss.backward()
    if optimizer is not None:
        optimizer.step()
    return mean_over_ranks(loss)


def _save(rank: int, world: int, root: str, how: str) -> None:
    torch.manual_seed(0)
    model = dmp(Model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(STEPS):
        _step(model, step, rank, world, optimizer)
    dcp.save(model.state_dict() if how == "state_dict" else {"model": Stateful(model)}, checkpoint_id=f"{root}/dcp")
    saved, dense = gathered_rows(model), _dense(model)
    loss = _step(model, STEPS, rank, world)
    after = gathered_rows(model)
    if rank == 0:
        torch.save({"rows": saved, "dense": dense, "loss": loss, "after": after}, f"{root}/expected.pt")


def _load(rank: int, world: int, root: str, how: str) -> None:
    expected = torch.load(f"{root}/expected.pt", weights_only=False)
    torch.manual_seed(1)
    model = dmp(Model())
    state = model.state_dict() if how == "state_dict" else {"model": Stateful(model)}
    prepare_load(state, f"{root}/dcp")
    dcp.load(state, checkpoint_id=f"{root}/dcp")
    if how == "state_dict":
        model.load_state_dict(state)
    assert_rows(gathered_rows(model), expected["rows"])
    dense = _dense(model)
    assert dense.keys() == expected["dense"].keys()
    for name, value in expected["dense"].items():
        torch.testing.assert_close(dense[name], value, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")
    torch.testing.assert_close(_step(model, STEPS, rank, world), expected["loss"])
    assert_rows(gathered_rows(model), expected["after"])


def test_dcp_of_dmp_state_dict_saved_at_two_ranks_loads_at_three(tmp_path):
    run_ranks(_save, 2, str(tmp_path), "state_dict", timeout_s=TIMEOUT_S)
    run_ranks(_load, 3, str(tmp_path), "state_dict", timeout_s=TIMEOUT_S)


def test_dcp_of_the_dynemb_stateful_wrapper_of_a_dmp_model_at_two_ranks_loads_at_three(tmp_path):
    # dynemb's own DCP wrapper (its dynemb_tables.* layout, as for natively sharded models).
    run_ranks(_save, 2, str(tmp_path), "stateful", timeout_s=TIMEOUT_S)
    run_ranks(_load, 3, str(tmp_path), "stateful", timeout_s=TIMEOUT_S)
