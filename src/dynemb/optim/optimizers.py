"""Fused row-wise optimizers: SGD, Adagrad, row-wise Adagrad and lazy Adam.

U rows, D embedding dim. Each ``update`` matches its reference on the rows present in a batch;
see README.md beside this file for the formulas.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dynemb.optim.base import HyperParameter, RowOptimizer, non_negative


def _betas(betas: Any) -> tuple[float, float]:
    # Fast path: Adam reads its betas through this check at every update.
    fast = type(betas) is tuple and len(betas) == 2 and type(betas[0]) is type(betas[1]) is float
    if fast and 0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0:
        return betas
    ok = isinstance(betas, (tuple, list)) and len(betas) == 2
    ok = ok and all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in betas)
    if not ok:
        raise ValueError("must be two numbers in [0, 1)")
    return float(betas[0]), float(betas[1])


def _native(cls: type, optimizer: RowOptimizer, spec: dict) -> dict | None:
    """``spec`` while ``optimizer``'s update is the one the kernel implements (the class's own,
    as defined here): a subclass's override or a patched update runs in plain torch."""
    return spec if type(optimizer).update is _KERNEL_MATHS[cls][0] else None


def _constant_state(cls: type, optimizer: RowOptimizer, value: float) -> float | None:
    """``value`` while ``optimizer``'s init_state is ``cls``'s own (as defined here)."""
    return value if type(optimizer).init_state is _KERNEL_MATHS[cls][1] else None


class SGD(RowOptimizer):
    """w -= lr * (g + weight_decay * w). Matches torch.optim.SGD (no momentum)."""

    weight_decay = HyperParameter(non_negative)

    def __init__(self, lr: float = 0.01, weight_decay: float = 0.0):
        super().__init__(lr=lr, weight_decay=weight_decay)

    def state_dim(self, embedding_dim: int) -> int:
        return 0

    def update(self, weight, state, grad, step):
        weight_decay = self.weight_decay
        if weight_decay:
            grad = grad.add(weight, alpha=weight_decay)
        weight.add_(grad, alpha=-self.lr)

    def native_update(self, step):
        return _native(SGD, self, {"kind": "sgd", "lr": self.lr, "weight_decay": self.weight_decay})


class Adagrad(RowOptimizer):
    """Element-wise Adagrad as torch.optim.Adagrad: state S = D accumulators.

    s += g*g;  w -= lr / (1 + (step - 1) * lr_decay) * g / (sqrt(s) + eps),
    with g = grad + weight_decay * w.
    """

    lr_decay = HyperParameter(non_negative)
    weight_decay = HyperParameter(non_negative)
    initial_accumulator_value = HyperParameter(non_negative)
    eps = HyperParameter(non_negative)

    def __init__(self, lr: float = 0.01, lr_decay: float = 0.0, weight_decay: float = 0.0, initial_accumulator_value: float = 0.0, eps: float = 1e-10):
        super().__init__(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay, initial_accumulator_value=initial_accumulator_value, eps=eps)

    def state_dim(self, embedding_dim: int) -> int:
        return embedding_dim

    def init_state(self, state):
        state.fill_(self.initial_accumulator_value)

    def initial_state_value(self):
        return _constant_state(Adagrad, self, self.initial_accumulator_value)

    def update(self, weight, state, grad, step):
        weight_decay = self.weight_decay
        if weight_decay:
            grad = grad.add(weight, alpha=weight_decay)
        clr = self.lr / (1 + (step - 1) * self.lr_decay)
        state.addcmul_(grad, grad)
        weight.addcdiv_(grad, state.sqrt().add_(self.eps), value=-clr)

    def native_update(self, step):
        clr = self.lr / (1 + (step - 1) * self.lr_decay)
        return _native(Adagrad, self, {"kind": "adagrad", "lr": self.lr, "weight_decay": self.weight_decay, "eps": self.eps, "a": clr})


class RowWiseAdagrad(RowOptimizer):
    """FBGEMM's row-wise Adagrad: one accumulator per row (S = 1).

    g = grad + weight_decay * w;  s += mean(g*g over D);  w -= lr * g / (sqrt(s) + eps).
    """

    eps = HyperParameter(non_negative)
    weight_decay = HyperParameter(non_negative)
    initial_accumulator_value = HyperParameter(non_negative)

    def __init__(self, lr: float = 0.01, eps: float = 1e-8, weight_decay: float = 0.0, initial_accumulator_value: float = 0.0):
        super().__init__(lr=lr, eps=eps, weight_decay=weight_decay, initial_accumulator_value=initial_accumulator_value)

    def state_dim(self, embedding_dim: int) -> int:
        return 1

    def init_state(self, state):
        state.fill_(self.initial_accumulator_value)

    def initial_state_value(self):
        return _constant_state(RowWiseAdagrad, self, self.initial_accumulator_value)

    def update(self, weight, state, grad, step):
        weight_decay = self.weight_decay
        if weight_decay:
            grad = grad.add(weight, alpha=weight_decay)
        state.add_(grad.square().mean(1, keepdim=True))  # [U, 1]
        weight.addcdiv_(grad, state.sqrt().add_(self.eps), value=-self.lr)

    def native_update(self, step):
        return _native(RowWiseAdagrad, self, {"kind": "rowwise_adagrad", "lr": self.lr, "weight_decay": self.weight_decay, "eps": self.eps})


class Adam(RowOptimizer):
    """Lazy Adam as torch.optim.SparseAdam: only rows in the batch move; S = 2D (m, v).

    g = grad + weight_decay * w;  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g*g;
    w -= lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps), t = the table's step.
    """

    betas = HyperParameter(_betas)
    eps = HyperParameter(non_negative)
    weight_decay = HyperParameter(non_negative)
    # float16 cannot hold the second moment: (1 - beta2) * g * g underflows to 0 for |g| below
    # about 8e-3, and the steps then grow up to 1 / sqrt(1 - beta2) times too large (0021).
    row_dtypes = (torch.float32, torch.float64, torch.bfloat16)

    def __init__(self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0):
        super().__init__(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    def state_dim(self, embedding_dim: int) -> int:
        return 2 * embedding_dim

    def update(self, weight, state, grad, step):
        beta1, beta2 = self.betas
        weight_decay = self.weight_decay
        if weight_decay:
            grad = grad.add(weight, alpha=weight_decay)
        D = weight.shape[1]
        exp_avg, exp_avg_sq = state[:, :D], state[:, D:]
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.add_(grad.square().sub_(exp_avg_sq).mul_(1 - beta2))
        step_size = self.lr * math.sqrt(1 - beta2**step) / (1 - beta1**step)
        weight.addcdiv_(exp_avg, exp_avg_sq.sqrt().add_(self.eps), value=-step_size)

    def native_update(self, step):
        beta1, beta2 = self.betas
        step_size = self.lr * math.sqrt(1 - beta2**step) / (1 - beta1**step)
        spec = {"kind": "adam", "lr": self.lr, "weight_decay": self.weight_decay, "eps": self.eps, "a": 1 - beta1, "b": 1 - beta2, "c": step_size}
        return _native(Adam, self, spec)


# The update and init_state each compiled kernel implements (dynemb.kernels.update / init),
# taken as the classes define them, so that a later patch of either is not bypassed.
_KERNEL_MATHS = {cls: (cls.update, cls.init_state) for cls in (SGD, Adagrad, RowWiseAdagrad, Adam)}
