"""Runs examples/torchrec_golden_training.py (TorchRec's golden training script with two lines
changed) under torchrun at small sizes, then checks what the script itself cannot print:

- the tables are sharded: every key on exactly one rank;
- they trained with the RowWiseAdagrad and lr that apply_optimizer_in_backward named (each
  rank's dynemb optimizer, and rows with optimizer state);
- ``dmp.fused_optimizer`` reports that lr;
- ``dynemb.checkpoint.save`` of the DMP model loads into the unsharded model with equal rows.

    torchrun --nproc-per-node 2 tests/torchrec/golden_example_harness.py OUT_DIR

Each rank prints ``golden example: rank R ok`` at the end. Used by test_torchrec_golden_example.py.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import torch
import torch.distributed as dist

import dynemb
import dynemb.checkpoint
import dynemb.torchrec

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "torchrec_golden_training.py"
NUM_EMBEDDINGS, DIM, ITERATIONS, LR = 4096, 16, 12, 0.1


def _load_example():
    spec = importlib.util.spec_from_file_location("torchrec_golden_training", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(collection, table: str) -> dict[int, torch.Tensor]:
    out = {}
    for chunk in collection.export(table):
        for k, e, s in zip(chunk["keys"].tolist(), chunk["embeddings"], chunk["optimizer_state"]):
            out[k] = torch.cat([e, s])
    return out


def main(out_dir: str) -> None:
    example = _load_example()
    captured = {}

    class CapturingDMP(example.DistributedModelParallel):
        """The script's DMP, kept for the checks (the script does not return it)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            captured["dmp"] = self

    example.DistributedModelParallel = CapturingDMP
    example.train(num_embeddings=NUM_EMBEDDINGS, embedding_dim=DIM, learning_rate=LR, num_iterations=ITERATIONS)
    dmp = captured["dmp"]
    rank, world = dist.get_rank(), dist.get_world_size()
    sharded = dmp.module.model.sparse_arch.embedding_bag_collection
    assert type(sharded).__name__ == "ShardedDynamicEmbeddingBagCollection", type(sharded)
    tables = sorted(sharded.stats())

    # Trained by RowWiseAdagrad at the lr apply_optimizer_in_backward named; fused_optimizer says so.
    local = {t: _rows(sharded.local_collection(t), t) for t in tables}
    for t in tables:
        optimizer = sharded.local_collection(t).optimizer
        assert isinstance(optimizer, dynemb.optim.RowWiseAdagrad) and optimizer.lr == LR, (t, optimizer)
    assert all(group["lr"] == LR for group in dmp.fused_optimizer.param_groups), dmp.fused_optimizer.param_groups
    trained = [row[-1] for rows in local.values() for row in rows.values()]
    assert trained and all(s > 0 for s in trained), "rows without RowWiseAdagrad state"

    # Sharded: every key on exactly one rank.
    everyone: list = [None] * world
    dist.all_gather_object(everyone, local)
    for t in tables:
        seen = [set(part[t]) for part in everyone]
        assert all(seen), f"table {t}: a rank holds no key"
        assert not set.intersection(*seen), f"table {t}: keys on several ranks"

    # dynemb.checkpoint.save of the DMP model loads into the unsharded model with equal rows.
    path = pathlib.Path(out_dir) / "checkpoint"
    dynemb.checkpoint.save(dmp, path)
    dist.barrier()
    if rank == 0:
        configs = [
            example.EmbeddingBagConfig(name=f"t_{f}", embedding_dim=DIM, num_embeddings=NUM_EMBEDDINGS, feature_names=[f]) for f in example.DEFAULT_CAT_NAMES
        ]
        ebc = dynemb.torchrec.EmbeddingBagCollection(configs, optimizer=dynemb.optim.RowWiseAdagrad(lr=LR, eps=1e-8))
        unsharded = example.DLRMTrain(
            example.DLRM(embedding_bag_collection=ebc, dense_in_features=13, dense_arch_layer_sizes=[64, DIM], over_arch_layer_sizes=[64, 1])
        )
        dynemb.checkpoint.load(unsharded, path)
        for t in tables:
            expected = {k: v for part in everyone for k, v in part[t].items()}
            restored = _rows(ebc.collection, t)
            assert restored.keys() == expected.keys(), t
            for k, row in expected.items():
                torch.testing.assert_close(restored[k], row, rtol=0, atol=0)
    dist.barrier()
    print(f"golden example: rank {rank} ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
