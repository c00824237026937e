"""Fused row-wise optimizers: SGD, Adagrad, row-wise Adagrad and lazy Adam.

U rows, D embedding dim. Each ``update`` matches its reference on the rows present in a batch;
see README.md beside this file for the formulas.
"""

from __future__ import annotations

import math

import torch

from dynemb.optim.base import RowOptimizer


def _check_betas(betas) -> tuple[float, float]:
    ok = isinstance(betas, (tuple, list)) and len(betas) == 2 and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas)
    if not ok:
        raise ValueError(f"betas={betas!r}: must be two numbers in [0, 1)")
    return float(betas[0]), float(betas[1])


class SGD(RowOptimizer):
    """w -= lr * (g + weight_decay * w). Matches torch.optim.SGD (no momentum)."""

    def __init__(self, lr: float = 0.01, weight_decay: float = 0.0):
        self.lr = lr
        self.weight_decay = weight_decay

    def state_dim(self, embedding_dim: int) -> int:
        return 0

    def update(self, weight, state, grad, step):
        if self.weight_decay:
            grad = grad.add(weight, alpha=self.weight_decay)
        weight.add_(grad, alpha=-self.lr)


class Adagrad(RowOptimizer):
    """Element-wise Adagrad as torch.optim.Adagrad: state S = D accumulators.

    s += g*g;  w -= lr / (1 + (step - 1) * lr_decay) * g / (sqrt(s) + eps),
    with g = grad + weight_decay * w.
    """

    def __init__(self, lr: float = 0.01, lr_decay: float = 0.0, weight_decay: float = 0.0, initial_accumulator_value: float = 0.0, eps: float = 1e-10):
        self.lr = lr
        self.lr_decay = lr_decay
        self.weight_decay = weight_decay
        self.initial_accumulator_value = initial_accumulator_value
        self.eps = eps

    def state_dim(self, embedding_dim: int) -> int:
        return embedding_dim

    def init_state(self, state):
        state.fill_(self.initial_accumulator_value)

    def update(self, weight, state, grad, step):
        if self.weight_decay:
            grad = grad.add(weight, alpha=self.weight_decay)
        clr = self.lr / (1 + (step - 1) * self.lr_decay)
        state.addcmul_(grad, grad)
        weight.addcdiv_(grad, state.sqrt().add_(self.eps), value=-clr)


class RowWiseAdagrad(RowOptimizer):
    """FBGEMM's row-wise Adagrad: one accumulator per row (S = 1).

    g = grad + weight_decay * w;  s += mean(g*g over D);  w -= lr * g / (sqrt(s) + eps).
    """

    def __init__(self, lr: float = 0.01, eps: float = 1e-8, weight_decay: float = 0.0, initial_accumulator_value: float = 0.0):
        self.lr = lr
        self.eps = eps
        self.weight_decay = weight_decay
        self.initial_accumulator_value = initial_accumulator_value

    def state_dim(self, embedding_dim: int) -> int:
        return 1

    def init_state(self, state):
        state.fill_(self.initial_accumulator_value)

    def update(self, weight, state, grad, step):
        if self.weight_decay:
            grad = grad.add(weight, alpha=self.weight_decay)
        state.add_(grad.square().mean(1, keepdim=True))  # [U, 1]
        weight.addcdiv_(grad, state.sqrt().add_(self.eps), value=-self.lr)


class Adam(RowOptimizer):
    """Lazy Adam as torch.optim.SparseAdam: only rows in the batch move; S = 2D (m, v).

    g = grad + weight_decay * w;  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g*g;
    w -= lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps), t = the table's step.
    """

    def __init__(self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0):
        self.lr = lr
        self.betas = _check_betas(betas)
        self.eps = eps
        self.weight_decay = weight_decay

    def state_dim(self, embedding_dim: int) -> int:
        return 2 * embedding_dim

    def update(self, weight, state, grad, step):
        beta1, beta2 = _check_betas(self.betas)
        if self.weight_decay:
            grad = grad.add(weight, alpha=self.weight_decay)
        D = weight.shape[1]
        exp_avg, exp_avg_sq = state[:, :D], state[:, D:]
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.add_(grad.square().sub_(exp_avg_sq).mul_(1 - beta2))
        step_size = self.lr * math.sqrt(1 - beta2**step) / (1 - beta1**step)
        weight.addcdiv_(exp_avg, exp_avg_sq.sqrt().add_(self.eps), value=-step_size)
