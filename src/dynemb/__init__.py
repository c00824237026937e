"""dynemb: dynamic embedding tables with int64 keys for PyTorch recommender training."""

from dynemb import checkpoint, optim
from dynemb._version import __version__ as __version__
from dynemb.config import Admission, Initializer, TableConfig, Tier
from dynemb.errors import CheckpointError, InsertionError
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
from dynemb.types import Backend, CheckMode, InitKind, NonFiniteGrads, PoolingMode, ScoreStrategy

__all__ = [
    "Admission",
    "Backend",
    "CheckMode",
    "CheckpointError",
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
    "Tier",
    "checkpoint",
    "clip_grad_norm_",
    "optim",
]
