"""Modules: DynamicEmbedding, DynamicEmbeddingBag, the DynamicTable they share, the collections,
and the functional layer (TableEngine, GroupEngine) under them."""

from dynemb.nn.collection import DynamicEmbeddingBagCollection, DynamicEmbeddingCollection, PooledEmbeddings
from dynemb.nn.embedding import DynamicEmbedding, DynamicEmbeddingBag
from dynemb.nn.functional import Resolved, TableEngine
from dynemb.nn.module import DynamicTable

__all__ = [
    "DynamicEmbedding",
    "DynamicEmbeddingBag",
    "DynamicEmbeddingBagCollection",
    "DynamicEmbeddingCollection",
    "DynamicTable",
    "PooledEmbeddings",
    "Resolved",
    "TableEngine",
]
