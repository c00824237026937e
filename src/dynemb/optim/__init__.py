"""Fused row-wise optimizers applied in backward to the rows of a batch."""

from dynemb.optim.base import RowOptimizer
from dynemb.optim.optimizers import SGD, Adagrad, Adam, RowWiseAdagrad

__all__ = ["SGD", "Adagrad", "Adam", "RowOptimizer", "RowWiseAdagrad"]
