"""Contract of a fused row-wise optimizer.

U rows updated in a call (one per unique key, gradients already summed per key), D embedding
dim, S state columns per row. A row stores ``[embedding (D) | state (S)]``; the optimizer defines
S and the meaning of its state columns.
"""

from __future__ import annotations

import abc
import math

import torch


class RowOptimizer(abc.ABC):
    """Hyper-parameters of a fused optimizer and its update rule.

    ``lr`` (and the other hyper-parameters) may be changed between steps; the next backward uses
    the new value. One optimizer object may serve several tables: they share its hyper-parameters,
    while each table keeps its own step count.
    """

    lr: float

    def __setattr__(self, name, value):
        if name in ("lr", "eps", "weight_decay", "lr_decay", "initial_accumulator_value"):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{type(self).__name__}.{name}={value!r}: must be a finite number >= 0")
            value = float(value)
        object.__setattr__(self, name, value)

    @abc.abstractmethod
    def state_dim(self, embedding_dim: int) -> int:
        """S, optimizer state columns per row for embeddings of D columns."""

    def init_state(self, state: torch.Tensor) -> None:
        """Fill the state of new rows in place (Tensor: [n, S]); zeros unless overridden."""
        state.zero_()

    @abc.abstractmethod
    def update(self, weight: torch.Tensor, state: torch.Tensor, grad: torch.Tensor, step: int) -> None:
        """Apply one step in place.

        Args:
            weight (Tensor): [U, D] embeddings of the rows (may be a strided view).
            state (Tensor): [U, S] their optimizer state (may be a strided view).
            grad (Tensor): [U, D] summed gradient per row.
            step: 1-based count of updates this table has applied, this one included.
        """

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"
