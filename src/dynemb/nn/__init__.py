"""Modules: DynamicEmbedding, DynamicEmbeddingBag, the DynamicTable they share, and the
functional layer (TableEngine) under them."""

from dynemb.nn.embedding import DynamicEmbedding, DynamicEmbeddingBag
from dynemb.nn.functional import Resolved, TableEngine
from dynemb.nn.module import DynamicTable

__all__ = ["DynamicEmbedding", "DynamicEmbeddingBag", "DynamicTable", "Resolved", "TableEngine"]
