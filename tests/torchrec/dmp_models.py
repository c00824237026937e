"""A model for the DMP checkpoint tests: a dynemb EBC (SUM and MEAN tables) and a dynemb EC (a
table read by two features), dynemb Adagrad, a dense head; batches of a fixed global size G
split over any world size, and every table row gathered by key.

G samples in a global batch, B = G / W per rank, D embedding dim.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torchrec import EmbeddingBagConfig, EmbeddingConfig, KeyedJaggedTensor, PoolingType
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec_testing import INT64_MAX, INT64_MIN, ids

import dynemb
import dynemb.torchrec
from dynemb.distributed import owner_of

G, D = 12, 4
BAGS = ["user", "item", "history"]
SEQ = ["a", "b", "c"]
SPECIAL = [0, -1, INT64_MIN, INT64_MAX]
TABLES = ["t_user", "t_item", "t_history", "t_ab", "t_c"]


class Model(torch.nn.Module):
    """ebc -> head -> one logit per sample; ec -> one score per id."""

    def __init__(self):
        super().__init__()
        bags = [
            EmbeddingBagConfig(name="t_user", embedding_dim=D, num_embeddings=512, feature_names=["user"]),
            EmbeddingBagConfig(name="t_item", embedding_dim=D, num_embeddings=512, feature_names=["item"]),
            EmbeddingBagConfig(name="t_history", embedding_dim=D, num_embeddings=512, feature_names=["history"], pooling=PoolingType.MEAN),
        ]
        seq = [
            EmbeddingConfig(name="t_ab", embedding_dim=D, num_embeddings=512, feature_names=["a", "b"]),
            EmbeddingConfig(name="t_c", embedding_dim=D, num_embeddings=512, feature_names=["c"]),
        ]
        self.ebc = dynemb.torchrec.EmbeddingBagCollection(bags, optimizer=dynemb.optim.Adagrad(lr=0.1))
        self.ec = dynemb.torchrec.EmbeddingCollection(seq, optimizer=dynemb.optim.Adagrad(lr=0.1))
        self.head = torch.nn.Linear(3 * D, 1)
        self.score = torch.nn.Linear(D, 1)

    def forward(self, bags: KeyedJaggedTensor, seq: KeyedJaggedTensor, labels: torch.Tensor) -> torch.Tensor:
        """The loss of this rank's B samples: mean BCE + sum of squared id scores / B."""
        logits = self.head(self.ebc(bags).values()).squeeze(1)
        out = self.ec(seq)
        scores = self.score(torch.cat([out[f].values() for f in SEQ]))
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, labels) + (scores**2).sum() / labels.numel()


def dmp(model: torch.nn.Module) -> DistributedModelParallel:
    plan = dynemb.torchrec.plan(model, dist.get_world_size())
    return DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=dynemb.torchrec.sharders())


def _kjt(features: list[str], g: torch.Generator, vocab: torch.Tensor) -> KeyedJaggedTensor:
    lengths = torch.randint(0, 4, (len(features) * G,), generator=g)
    lengths[:2] = 2
    values = vocab[torch.randint(len(vocab), (int(lengths.sum()),), generator=g)]
    values[:4] = torch.tensor(SPECIAL)
    return KeyedJaggedTensor.from_lengths_sync(keys=features, values=values, lengths=lengths)


def batch(step: int) -> tuple[KeyedJaggedTensor, KeyedJaggedTensor, torch.Tensor]:
    """The global batch of ``step``: G samples (bags, sequences, labels); ids repeat."""
    g = torch.Generator().manual_seed(step)
    vocab = ids(48, seed=step)
    return _kjt(BAGS, g, vocab), _kjt(SEQ, g, vocab), torch.randint(0, 2, (G,), generator=g).float()


def _slice(features: KeyedJaggedTensor, lo: int, hi: int) -> KeyedJaggedTensor:
    values, lengths = [], []
    for f in features.keys():
        jt = features[f]
        a, b = (int(o) for o in jt.offsets()[[lo, hi]])
        values.append(jt.values()[a:b])
        lengths.append(jt.lengths()[lo:hi])
    return KeyedJaggedTensor.from_lengths_sync(keys=features.keys(), values=torch.cat(values), lengths=torch.cat(lengths))


def local_batch(step: int, rank: int, world: int):
    """Samples rank * B .. (rank + 1) * B of the global batch."""
    bags, seq, labels = batch(step)
    lo, hi = rank * G // world, (rank + 1) * G // world
    return _slice(bags, lo, hi), _slice(seq, lo, hi), labels[lo:hi]


def sparse(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's EBC and EC (sharded or not), unwrapping a DMP."""
    inner = model.module if isinstance(model, DistributedModelParallel) else model
    return [inner.ebc, inner.ec]


def local_rows(model: torch.nn.Module) -> dict[tuple[str, int], torch.Tensor]:
    """(table, key) -> embedding and optimizer state, of this rank's keys (all for an unsharded model)."""
    out = {}
    for m, tables in zip(sparse(model), (TABLES[:3], TABLES[3:])):
        for t in tables:
            collection = m.local_collection(t) if isinstance(model, DistributedModelParallel) else m.collection
            for chunk in collection.export(t):
                for k, e, s in zip(chunk["keys"].tolist(), chunk["embeddings"], chunk["optimizer_state"]):
                    out[(t, k)] = torch.cat([e, s])
    return out


def owned_parts(mine: dict[tuple[str, int], torch.Tensor]) -> list[dict]:
    """Every rank's rows by (table, key), rank by rank, after checking that this rank holds only
    keys it owns (owner_of(key, W)) and that no key is on two ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    keys = torch.tensor([k for (_, k) in mine], dtype=torch.int64)
    wrong = keys[owner_of(keys, world) != rank].tolist()
    assert not wrong, f"rank {rank} holds keys of other ranks: {wrong[:5]}"
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    seen: set = set()
    for part in everyone:
        assert not seen & part.keys()
        seen |= part.keys()
    return everyone


def gathered_rows(model: torch.nn.Module) -> dict[tuple[str, int], torch.Tensor]:
    """Every rank's rows by (table, key); each key held by rank owner_of(key, W) only."""
    return {k: v for part in owned_parts(local_rows(model)) for k, v in part.items()}


def assert_rows(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys(), sorted(actual.keys() ^ expected.keys())[:5]
    assert {t for t, _ in expected} == set(TABLES) and {k for _, k in expected} >= set(SPECIAL)
    for key, row in expected.items():
        torch.testing.assert_close(actual[key], row, msg=lambda m, key=key: f"{key}: {m}")


def mean_over_ranks(loss: torch.Tensor) -> torch.Tensor:
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total / dist.get_world_size()
