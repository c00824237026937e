"""TorchRec integration: the only dynemb package that imports torchrec.

``EmbeddingBagCollection`` / ``EmbeddingCollection`` are TorchRec's modules (subclasses, same
configs, same KeyedJaggedTensor in, same KeyedTensor / dict of JaggedTensor out) whose tables
are dynemb tables keyed by raw int64 ids; ``convert(model)`` swaps them into an existing model.
``sharders()`` (instances of ``DynamicEmbeddingBagCollectionSharder`` /
``DynamicEmbeddingCollectionSharder``) let ``DistributedModelParallel`` shard them row-wise, with
TorchRec's planner or the ``plan(model, world_size)`` shortcut. ``convert()`` copies a stock
table's rows (row i -> key i), the drop-ins load a stock module's state_dict, and
``to_stock_weight()`` / ``to_stock_state_dict()`` go back. See docs/design/0012-torchrec.md,
0016-torchrec-dmp.md, 0027-torchrec-optimizers.md, 0028-torchrec-stock-rows.md and 0031-torchrec-planner.md.
"""

from dynemb.torchrec.convert import convert
from dynemb.torchrec.modules import EmbeddingBagCollection, EmbeddingCollection
from dynemb.torchrec.optimizers import from_fused_params
from dynemb.torchrec.sharding import DynamicEmbeddingBagCollectionSharder, DynamicEmbeddingCollectionSharder, plan, sharders
from dynemb.torchrec.stock import to_stock_state_dict, to_stock_weight

__all__ = [
    "DynamicEmbeddingBagCollectionSharder",
    "DynamicEmbeddingCollectionSharder",
    "EmbeddingBagCollection",
    "EmbeddingCollection",
    "convert",
    "from_fused_params",
    "plan",
    "sharders",
    "to_stock_state_dict",
    "to_stock_weight",
]
