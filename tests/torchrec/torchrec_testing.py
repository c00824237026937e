"""Helpers shared by the TorchRec tests: adversarial ids, KJTs, and TorchRec twins that hold
the same rows as a dynemb collection on remapped ids.

B samples, N ids, D embedding dim.
"""

from __future__ import annotations

import torch
from torchrec import KeyedJaggedTensor

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Every int64 is an id: the extremes, 0 and -1 included, far beyond any num_embeddings.
SPECIAL = [0, -1, INT64_MIN, INT64_MAX, 1, 2**40 + 7, -(2**62), 12345678901234]


def ids(n: int, seed: int) -> torch.Tensor:
    """[n] int64 ids over the whole int64 range, the special ids first (n >= len(SPECIAL))."""
    g = torch.Generator().manual_seed(seed)
    rest = torch.randint(INT64_MIN, INT64_MAX, (n - len(SPECIAL),), generator=g, dtype=torch.int64)
    return torch.cat([torch.tensor(SPECIAL), rest])


def kjt(features: list[str], batch: int, vocab: torch.Tensor, seed: int, max_len: int = 3, weighted: bool = False) -> KeyedJaggedTensor:
    """A KJT of ``features`` x ``batch`` bags (0..max_len ids each, empty bags included) drawn from vocab."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_len + 1, (len(features) * batch,), generator=g)
    values = vocab[torch.randint(len(vocab), (int(lengths.sum()),), generator=g)]
    weights = torch.rand(values.shape, generator=g) if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(keys=features, values=values, lengths=lengths, weights=weights)


def single_ids(features: list[str], keys: torch.Tensor) -> KeyedJaggedTensor:
    """Every feature looks up every key once, one key per bag: pooled rows are the rows."""
    n = keys.numel()
    return KeyedJaggedTensor.from_lengths_sync(keys=features, values=keys.repeat(len(features)), lengths=torch.ones(len(features) * n, dtype=torch.int64))


def remap(features: KeyedJaggedTensor, keys: torch.Tensor) -> KeyedJaggedTensor:
    """The same KJT with each id replaced by its position in ``keys`` (TorchRec's 0..N-1 ids)."""
    order = torch.argsort(keys)
    pos = order[torch.searchsorted(keys[order], features.values())]
    assert torch.equal(keys[pos], features.values())
    return KeyedJaggedTensor(keys=features.keys(), values=pos, weights=features.weights_or_none(), lengths=features.lengths(), stride=features.stride())
