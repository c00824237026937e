"""dynemb: dynamic embedding tables with int64 keys for PyTorch recommender training."""

from dynemb import optim
from dynemb.config import Admission, Initializer, TableConfig
from dynemb.errors import InsertionError
from dynemb.nn import (
    DynamicEmbedding,
    DynamicEmbeddingBag,
    DynamicEmbeddingBagCollection,
    DynamicEmbeddingCollection,
    DynamicTable,
    PooledEmbeddings,
)
from dynemb.nn.deferred import clip_grad_norm_
from dynemb.table.index import KeyIndex
from dynemb.types import CheckMode, InitKind, NonFiniteGrads, PoolingMode, ScoreStrategy

__version__ = "0.1.0"

__all__ = [
    "Admission",
    "CheckMode",
    "DynamicEmbedding",
    "DynamicEmbeddingBag",
    "DynamicEmbeddingBagCollection",
    "DynamicEmbeddingCollection",
    "DynamicTable",
    "InitKind",
    "Initializer",
    "InsertionError",
    "KeyIndex",
    "NonFiniteGrads",
    "PooledEmbeddings",
    "PoolingMode",
    "ScoreStrategy",
    "TableConfig",
    "clip_grad_norm_",
    "optim",
]
