"""Modules: DynamicEmbedding, DynamicEmbeddingBag and the collections, front-ends of one module
base (DynamicTables, the policy) over one engine class (Engine, the functional layer)."""

from dynemb.nn.base import EngineContract
from dynemb.nn.collection import DynamicEmbeddingBagCollection, DynamicEmbeddingCollection, PooledEmbeddings
from dynemb.nn.embedding import DynamicEmbedding, DynamicEmbeddingBag
from dynemb.nn.engine import Engine, GroupEngine, Resolved, TableEngine
from dynemb.nn.module import DynamicTable
from dynemb.nn.tables import DynamicTables

__all__ = [
    "DynamicEmbedding",
    "DynamicEmbeddingBag",
    "DynamicEmbeddingBagCollection",
    "DynamicEmbeddingCollection",
    "DynamicTable",
    "DynamicTables",
    "Engine",
    "EngineContract",
    "GroupEngine",
    "PooledEmbeddings",
    "Resolved",
    "TableEngine",
]
