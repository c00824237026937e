"""TorchRec integration: the only dynemb package that imports torchrec.

``EmbeddingBagCollection`` / ``EmbeddingCollection`` are TorchRec's modules (subclasses, same
configs, same KeyedJaggedTensor in, same KeyedTensor / dict of JaggedTensor out) whose tables
are dynemb tables keyed by raw int64 ids; ``convert(model)`` swaps them into an existing model.
``sharders()`` and ``plan(model, world_size)`` let ``DistributedModelParallel`` shard them
row-wise. See docs/design/0012-torchrec.md and 0016-torchrec-dmp.md.
"""

from dynemb.torchrec.convert import convert
from dynemb.torchrec.modules import EmbeddingBagCollection, EmbeddingCollection
from dynemb.torchrec.optimizers import from_fused_params
from dynemb.torchrec.sharding import DynamicEmbeddingBagCollectionSharder, DynamicEmbeddingCollectionSharder, plan, sharders

__all__ = [
    "DynamicEmbeddingBagCollectionSharder",
    "DynamicEmbeddingCollectionSharder",
    "EmbeddingBagCollection",
    "EmbeddingCollection",
    "convert",
    "from_fused_params",
    "plan",
    "sharders",
]
