"""Modules: DynamicEmbedding, DynamicEmbeddingBag and the table engine they share."""

from dynemb.nn.embedding import DynamicEmbedding, DynamicEmbeddingBag
from dynemb.nn.table import DynamicTable

__all__ = ["DynamicEmbedding", "DynamicEmbeddingBag", "DynamicTable"]
