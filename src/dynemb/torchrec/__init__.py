"""TorchRec integration: the only dynemb package that imports torchrec.

``EmbeddingBagCollection`` / ``EmbeddingCollection`` are TorchRec's modules (subclasses, same
configs, same KeyedJaggedTensor in, same KeyedTensor / dict of JaggedTensor out) whose tables
are dynemb tables keyed by raw int64 ids; ``convert(model)`` swaps them into an existing model.
``sharders()`` (instances of ``DynamicEmbeddingBagCollectionSharder`` /
``DynamicEmbeddingCollectionSharder``) let ``DistributedModelParallel`` shard them row-wise, with
TorchRec's planner or the ``plan(model, world_size)`` shortcut. See docs/design/0012-torchrec.md,
0016-torchrec-dmp.md and 0031-torchrec-planner.md.
"""

from dynemb.torchrec.convert import convert
from dynemb.torchrec.modules import EmbeddingBagCollection, EmbeddingCollection
from dynemb.torchrec.sharding import DynamicEmbeddingBagCollectionSharder, DynamicEmbeddingCollectionSharder, plan, sharders

__all__ = [
    "DynamicEmbeddingBagCollectionSharder",
    "DynamicEmbeddingCollectionSharder",
    "EmbeddingBagCollection",
    "EmbeddingCollection",
    "convert",
    "plan",
    "sharders",
]
