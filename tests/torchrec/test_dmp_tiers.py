"""TorchRec's DistributedModelParallel over a dynemb EBC whose tables have device + disk tiers
(options={"t": {"tiers": [...]}}): each rank's local table gets every tier's rows // W, and 2
gloo ranks train like the unsharded tiered EBC on the concatenated batches.

W ranks, G samples per global batch, D embedding dim.
"""

from __future__ import annotations

import tempfile

import torch
import torch.distributed as dist
from dmp_models import BAGS, TABLES, D, G, batch, dmp, local_batch
from torchrec import EmbeddingBagConfig, PoolingType
from torchrec.distributed.model_parallel import DistributedModelParallel

import dynemb
import dynemb.torchrec
from dynemb import Tier
from spawning import run_ranks

STEPS, DEVICE_ROWS, ROWS = 4, 16, 512


class Model(torch.nn.Module):
    """The EBC of dmp_models' tables, tiered, and a fixed sum loss of its pooled outputs."""

    def __init__(self, disk: str):
        super().__init__()
        tables = [
            EmbeddingBagConfig(name="t_user", embedding_dim=D, num_embeddings=ROWS, feature_names=["user"]),
            EmbeddingBagConfig(name="t_item", embedding_dim=D, num_embeddings=ROWS, feature_names=["item"]),
            EmbeddingBagConfig(name="t_history", embedding_dim=D, num_embeddings=ROWS, feature_names=["history"], pooling=PoolingType.MEAN),
        ]
        tiers = [Tier("device", DEVICE_ROWS), Tier("disk", ROWS - DEVICE_ROWS, path=disk)]
        options = {t.name: {"tiers": tiers, "score_strategy": "step"} for t in tables}
        self.ebc = dynemb.torchrec.EmbeddingBagCollection(tables, options=options, optimizer=dynemb.optim.Adam(lr=0.05))

    def forward(self, bags, coef: torch.Tensor) -> torch.Tensor:
        return (self.ebc(bags).values() * coef).sum()


def rows(model) -> dict:
    out = {}
    for t in TABLES[:3]:
        for chunk in model.ebc.collection.export(t):
            for k, e, s in zip(chunk["keys"].tolist(), chunk["embeddings"], chunk["optimizer_state"]):
                out[(t, k)] = torch.cat([e, s])
    return out


def _worker(rank: int, world: int) -> None:
    with tempfile.TemporaryDirectory() as disk:
        sharded, ref = dmp(Model(disk)), Model(disk)
        for step in range(STEPS):
            coef = torch.randn(G, len(BAGS) * D, generator=torch.Generator().manual_seed(step))
            lo, hi = rank * G // world, (rank + 1) * G // world
            loss = sharded(local_batch(step, rank, world)[0], coef[lo:hi])
            loss.backward()
            # DMP averages the ranks' gradients: the reference's loss is the mean of the ranks'.
            ref_loss = ref(batch(step)[0], coef) / world
            ref_loss.backward()
            total = loss.detach().clone()
            dist.all_reduce(total)
            torch.testing.assert_close(total / world, ref_loss.detach())
        got, want = gathered(sharded), rows(ref)
        assert got.keys() == want.keys()
        for key, row in want.items():
            torch.testing.assert_close(got[key], row, msg=lambda m, key=key: f"{key}: {m}")
        for t in TABLES[:3]:
            collection = sharded.module.ebc.local_collection(t)
            config = dict(zip(collection.table_names, collection.table_configs))[t]
            assert [x.rows for x in config.tiers] == [DEVICE_ROWS // world, (ROWS - DEVICE_ROWS) // world]
            device = collection.stats()[t]["tiers"][0]
            assert device["promotions"] > 0 and device["demotions"] > 0, device


def gathered(model: DistributedModelParallel) -> dict:
    """(table, key) -> embedding and optimizer state of every rank's keys."""
    inner = model.module
    world = dist.get_world_size()
    mine = {}
    for t in TABLES[:3]:
        for chunk in inner.ebc.local_collection(t).export(t):
            for k, e, s in zip(chunk["keys"].tolist(), chunk["embeddings"], chunk["optimizer_state"]):
                mine[(t, k)] = torch.cat([e, s])
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    out = {}
    for part in everyone:
        out.update(part)
    return out


def test_dmp_tiered_ebc_equals_unsharded_tiered_ebc():
    run_ranks(_worker, 2, timeout_s=150.0)
