"""dynemb.checkpoint of DMP models: a checkpoint of a model sharded by TorchRec's
DistributedModelParallel at 2 ranks loads into the unsharded model, into DMP at 3 ranks and into
dynemb's own sharding at 2, and a natively sharded checkpoint loads under DMP: each time the
tables (rows and optimizer state by key) equal the saved ones, and one further training step
gives the loss and the rows of the model that went on without the checkpoint. A delta saved
under DMP after that step loads unsharded with its rows.

G samples per global batch, W ranks.
"""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
import torch.distributed as dist
from dmp_models import Model, assert_rows, dmp, gathered_rows, local_batch, local_rows, mean_over_ranks
from torchrec import EmbeddingBagConfig

import dynemb
import dynemb.distributed
import dynemb.torchrec
from spawning import run_ranks

STEPS = 3
TIMEOUT_S = 150.0


def _build(kind: str) -> torch.nn.Module:
    model = Model()
    if kind == "dmp":
        return dmp(model)
    if kind == "native":
        return dynemb.distributed.shard(model)
    return model


def _step(model: torch.nn.Module, kind: str, step: int, rank: int, world: int, optimizer=None) -> torch.Tensor:
    """One training step on this rank's part of global batch ``step``; the global loss."""
    loss = model(*local_batch(step, rank, world))
    mean = mean_over_ranks(loss) if world > 1 else loss.detach()
    if optimizer is not None:
        optimizer.zero_grad()
    # DMP divides the gradients it sends back by W (the mean over ranks); dynemb's own sharding
    # sums the ranks' gradients of a row.
    (loss / world if kind == "native" else loss).backward()
    if optimizer is not None:
        optimizer.step()
    return mean


def _rows(model: torch.nn.Module, world: int) -> dict:
    return gathered_rows(model) if world > 1 else local_rows(model)


def _train_and_save(rank: int, world: int, kind: str, root: str) -> None:
    """Train STEPS steps, save, go on one step: rank 0 writes what a load must reproduce."""
    torch.manual_seed(0)
    model = _build(kind)
    # The dense part trains under DMP (DDP averages its gradients); natively sharded ranks
    # would each train their own copy, so there it stays as initialised.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05) if kind == "dmp" else None
    for step in range(STEPS):
        _step(model, kind, step, rank, world, optimizer)
    dynemb.checkpoint.save(model, f"{root}/{kind}", dense=True)
    saved = _rows(model, world)
    loss = _step(model, kind, STEPS, rank, world, optimizer)
    # Only the rows that step touched, every rank its own keys'.
    dynemb.checkpoint.save_delta(model, f"{root}/{kind}-delta", base=f"{root}/{kind}")
    after = _rows(model, world)
    if rank == 0:
        torch.save({"rows": saved, "loss": loss, "after": after}, f"{root}/{kind}.expected.pt")


def _load_and_step(rank: int, world: int, kind: str, root: str, source: str) -> None:
    expected = torch.load(f"{root}/{source}.expected.pt", weights_only=False)
    # Other dense weights than the saved ones: the load brings them.
    torch.manual_seed(1)
    model = _build(kind)
    dynemb.checkpoint.load(model, f"{root}/{source}", dense=True)
    assert_rows(_rows(model, world), expected["rows"])
    loss = _step(model, kind, STEPS, rank, world)
    torch.testing.assert_close(loss, expected["loss"])
    assert_rows(_rows(model, world), expected["after"])


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    """A DMP checkpoint at 2 ranks and a natively sharded one at 2 ranks (with expectations)."""
    root = str(tmp_path_factory.mktemp("dmp_ckpt"))
    run_ranks(_train_and_save, 2, "dmp", root, timeout_s=TIMEOUT_S)
    run_ranks(_train_and_save, 2, "native", root, timeout_s=TIMEOUT_S)
    return root


def test_dmp_checkpoint_loads_unsharded(saved):
    assert not dist.is_initialized()
    _load_and_step(0, 1, "unsharded", saved, "dmp")


def test_dmp_checkpoint_loads_under_dmp_at_three_ranks(saved):
    run_ranks(_load_and_step, 3, "dmp", saved, "dmp", timeout_s=TIMEOUT_S)


def test_dmp_checkpoint_loads_natively_sharded(saved):
    run_ranks(_load_and_step, 2, "native", saved, "dmp", timeout_s=TIMEOUT_S)


def test_dmp_delta_loads_unsharded(saved):
    expected = torch.load(f"{saved}/dmp.expected.pt", weights_only=False)
    model = Model()
    dynemb.checkpoint.load(model, f"{saved}/dmp-delta")
    assert_rows(local_rows(model), expected["after"])
    # The delta holds the rows of the keys the step touched, not the whole table.
    manifest = json.loads((pathlib.Path(saved) / "dmp-delta" / "manifest.json").read_text())
    assert manifest["kind"] == "delta" and 0 < sum(t["rows"] for t in manifest["tables"].values()) < len(expected["after"])


def test_native_checkpoint_loads_under_dmp(saved):
    run_ranks(_load_and_step, 2, "dmp", saved, "native", timeout_s=TIMEOUT_S)


def _admission_worker(rank: int, world: int, root: str) -> None:
    tables = [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=64, feature_names=["f"])]
    options = {"t": {"admission": dynemb.Admission(threshold=2)}}
    model = dmp(dynemb.torchrec.EmbeddingBagCollection(tables, options=options, optimizer=dynemb.optim.SGD(lr=0.1)))
    with pytest.raises(ValueError, match=r"tables \['collection.t'\]: saving tables with admission sharded by DMP"):
        dynemb.checkpoint.save(model, f"{root}/admission")


def test_dmp_tables_with_admission_refuse_to_save(tmp_path):
    run_ranks(_admission_worker, 2, str(tmp_path), timeout_s=TIMEOUT_S)
