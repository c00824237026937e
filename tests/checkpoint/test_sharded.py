"""Checkpoints of sharded models: save at 2 ranks, load at 1, 3 and 4; unsharded -> sharded -> unsharded.

Each case runs in gloo processes spawned here (localhost, bounded waits)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import dynemb
import dynemb.checkpoint
import dynemb.distributed
from spawning import run_ranks

FEATURES = ("f1", "f2", "f3")
B = 4  # samples per rank and step


def _model() -> torch.nn.Module:
    tables = [
        dynemb.TableConfig(name="a", feature_names=["f1", "f2"], embedding_dim=8, capacity=4096),
        dynemb.TableConfig(name="c", feature_names=["f3"], embedding_dim=4, capacity=4096),
    ]
    return dynemb.DynamicEmbeddingBagCollection(tables, dynemb.optim.Adam(lr=0.05))


def _batch(step: int, world: int, rank: int | None) -> dict:
    """The global batch of ``step`` for ``world`` ranks (B samples each), or rank's slice of it."""
    g = torch.Generator().manual_seed(1000 + step)
    lengths = {f: torch.randint(0, 3, (B * world,), generator=g) for f in FEATURES}
    values = {f: torch.randint(-60, 60, (int(n.sum()),), generator=g) for f, n in lengths.items()}
    values["f1"][:2] = torch.tensor([-(2**63), 2**63 - 1])[: values["f1"].numel()]
    if rank is None:
        return {f: (values[f], lengths[f]) for f in FEATURES}
    out = {}
    for f in FEATURES:
        n = lengths[f]
        start, count = int(n[: rank * B].sum()), int(n[rank * B : (rank + 1) * B].sum())
        out[f] = (values[f][start : start + count], n[rank * B : (rank + 1) * B])
    return out


def _train(model, steps, world: int, rank: int | None) -> None:
    for step in steps:
        out = model(_batch(step, world, rank)).concat
        (out * out).sum().backward()


def _contents(model, world: int) -> dict:
    """(table, key) -> embedding and optimizer state, over every rank."""
    mine = {}
    for t in ("a", "c"):
        for chunk in model.export(t):
            for k, e, o in zip(chunk["keys"].tolist(), chunk["embeddings"], chunk["optimizer_state"]):
                mine[(t, k)] = torch.cat([e, o])
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    return {k: v for part in everyone for k, v in part.items()}


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys(), (len(a), len(b), sorted(set(a) ^ set(b))[:5])
    for k in a:
        torch.testing.assert_close(a[k], b[k], msg=lambda m, k=k: f"{k}: {m}")


def _save_at(rank: int, world: int, path: str) -> None:
    model = dynemb.distributed.shard(_model())
    _train(model, range(5), world, rank)
    dynemb.checkpoint.save(model, path)
    contents = _contents(model, world)
    if rank == 0:
        torch.save(contents, path + ".contents.pt")


def _load_at(rank: int, world: int, path: str) -> None:
    saved = torch.load(path + ".contents.pt")
    model = dynemb.distributed.shard(_model())
    dynemb.checkpoint.load(model, path)
    _same(_contents(model, world), saved)
    # Further training: equal to the unsharded model loaded from the same checkpoint and
    # trained on the concatenated batches.
    _train(model, range(5, 8), world, rank)
    after = _contents(model, world)
    reference = _model()
    dynemb.checkpoint.load(reference, path)
    _train(reference, range(5, 8), world, None)
    _same(after, _collect_unsharded(reference))
    # And back: the sharded model saves, an unsharded model loads it.
    dynemb.checkpoint.save(model, path + f".again{world}")
    if rank == 0:
        back = _model()
        dynemb.checkpoint.load(back, path + f".again{world}")
        _same(_collect_unsharded(back), after)


def _collect_unsharded(model) -> dict:
    out = {}
    for t in ("a", "c"):
        for chunk in model.export(t):
            for k, e, o in zip(chunk["keys"].tolist(), chunk["embeddings"], chunk["optimizer_state"]):
                out[(t, k)] = torch.cat([e, o])
    return out


def test_save_at_two_ranks_loads_at_one_three_and_four(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(_save_at, 2, path)
    manifest = dynemb.checkpoint.chain_of(path)[-1][1]
    assert manifest["world_size"] == 2
    names = sorted(os.path.basename(f["path"]) for f in manifest["tables"]["a"]["files"])
    assert any(n.startswith("rows-r00000-") for n in names) and any(n.startswith("rows-r00001-") for n in names), names
    for world in (1, 3, 4):
        run_ranks(_load_at, world, path)


def test_unsharded_checkpoint_loads_sharded(tmp_path):
    path = str(tmp_path / "plain")
    model = _model()
    _train(model, range(5), 2, None)  # the global batches of a 2-rank run
    dynemb.checkpoint.save(model, path)
    torch.save(_collect_unsharded(model), path + ".contents.pt")
    run_ranks(_load_at, 2, path)


def _dcp_save_at(rank: int, world: int, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    from dynemb.checkpoint.dcp import Stateful

    model = dynemb.distributed.shard(_model())
    _train(model, range(5), world, rank)
    dcp.save({"model": Stateful(model)}, checkpoint_id=path)
    contents = _contents(model, world)
    if rank == 0:
        torch.save(contents, path + ".contents.pt")


def _dcp_load_at(rank: int, world: int, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    from dynemb.checkpoint.dcp import Stateful, prepare_load

    saved = torch.load(path + ".contents.pt")
    model = dynemb.distributed.shard(_model())
    state = {"model": Stateful(model)}
    prepare_load(state, path)
    dcp.load(state, checkpoint_id=path)
    _same(_contents(model, world), saved)
    _train(model, range(5, 8), world, rank)
    after = _contents(model, world)
    reference = _model()
    dynemb.checkpoint.load(reference, path + ".plain")
    _train(reference, range(5, 8), world, None)
    _same(after, _collect_unsharded(reference))


def test_dcp_save_at_two_ranks_loads_at_three(tmp_path):
    """torch.distributed.checkpoint: save at 2, load at 3 (tables by key, then 3 steps equal to
    the unsharded model)."""
    path = str(tmp_path / "dcp")
    run_ranks(_dcp_save_at, 2, path)
    # The unsharded reference starts from the same content (a dynemb checkpoint of it).
    plain = _model()
    _train(plain, range(5), 2, None)
    dynemb.checkpoint.save(plain, path + ".plain")
    _same(_collect_unsharded(plain), torch.load(path + ".contents.pt"))
    run_ranks(_dcp_load_at, 3, path)
