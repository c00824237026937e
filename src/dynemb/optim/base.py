"""Contract of a fused row-wise optimizer.

U rows updated in a call (one per unique key, gradients already summed per key), D embedding
dim, S state columns per row. A row stores ``[embedding (D) | state (S)]``; the optimizer defines
S and the meaning of its state columns.
"""

from __future__ import annotations

import abc
import copy
import math
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch


def non_negative(value: Any) -> float:
    """A hyper-parameter that must be a finite Python number >= 0, as a float."""
    # Fast path: every update reads its hyper-parameters through this check (NaN fails both).
    if type(value) is float and 0.0 <= value < math.inf:
        return value
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
        raise ValueError("must be a finite number >= 0")
    return float(value)


class HyperParameter:
    """A hyper-parameter kept in ``optimizer.param_groups[0]``, where torch's schedulers write.

    Assigning the attribute validates and stores the value in the group; reading it validates the
    group's value again (a scheduler writes the group directly), so a bad value raises a
    ``ValueError`` naming the field and the value at the next update, never trains silently.

    Args:
        check: returns the value in canonical form or raises ``ValueError`` saying what it must be.
    """

    def __init__(self, check: Callable[[Any], Any]):
        self.check = check

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, optimizer: RowOptimizer | None, owner: type | None = None) -> Any:
        if optimizer is None:
            return self
        return self.validate(optimizer, optimizer.param_groups[0][self.name])

    def __set__(self, optimizer: RowOptimizer, value: Any) -> None:
        optimizer.param_groups[0][self.name] = self.validate(optimizer, value)

    def validate(self, optimizer: RowOptimizer, value: Any) -> Any:
        try:
            return self.check(value)
        except ValueError as e:
            raise ValueError(f"{type(optimizer).__name__}.{self.name}={value!r}: {e}") from None


class RowOptimizer(torch.optim.Optimizer, abc.ABC):
    """Hyper-parameters of a fused optimizer and its update rule.

    The tables apply ``update`` in backward. For torch's tooling this is a ``torch.optim.Optimizer``
    with one parameter group and no parameters: ``param_groups[0]`` holds every hyper-parameter
    (``opt.lr`` reads and writes ``param_groups[0]["lr"]``), so ``torch.optim.lr_scheduler``
    schedulers drive it. ``lr`` (and the other hyper-parameters) may be changed between steps; the
    next backward uses the new value. One optimizer object may serve several tables: they share
    its hyper-parameters, while each table keeps its own step count and per-row state.

    Args:
        **hyper_parameters: initial value of each hyper-parameter, each declared on the class as a
            :class:`HyperParameter`; they become ``defaults`` and ``param_groups[0]``.
    """

    lr = HyperParameter(non_negative)

    def __init__(self, **hyper_parameters: Any):
        defaults = {}
        for name, value in hyper_parameters.items():
            declared = getattr(type(self), name, None)
            if not isinstance(declared, HyperParameter):
                raise TypeError(f"{type(self).__name__} declares no hyper-parameter {name!r}")
            defaults[name] = declared.validate(self, value)
        # torch.optim.Optimizer.__init__ refuses an empty parameter list. Its __setstate__ is the
        # path that builds an optimizer without __init__ (unpickling): it creates the hook tables
        # and wraps step() so step hooks fire, which is what its methods and the schedulers need.
        torch.optim.Optimizer.__setstate__(
            self, {"defaults": defaults, "state": defaultdict(dict), "param_groups": [{"params": [], **defaults}]}
        )

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

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Nothing to do: the tables applied the update in backward.

        It exists so the standard loop ``loss.backward(); opt.step(); scheduler.step()`` runs
        unchanged and the scheduler sees ``step()`` called. Step hooks fire as in torch.

        Args:
            closure: if given, called with grad enabled (its backward applies the update) and its
                loss returned.
        """
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: a fused optimizer keeps no ``.grad`` (the gradient is consumed in backward)."""

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused: a fused optimizer updates table rows, not parameters."""
        raise TypeError(f"{type(self).__name__} holds no parameters: the tables it serves apply it to their rows")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load hyper-parameters saved by :meth:`state_dict` (inherited from torch).

        The saved group must hold every hyper-parameter of this class; each is validated. Other
        keys (a scheduler's ``initial_lr``, ``max_lr``, ...) are kept as they are, as torch does.
        Per-row state lives in the tables and is saved with them. Load-state-dict hooks fire.

        Args:
            state_dict: ``{"state": {}, "param_groups": [{hyper-parameters..., "params": []}]}``.
        """
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        name = type(self).__name__
        groups = state_dict["param_groups"]
        if len(groups) != 1 or groups[0].get("params") or state_dict.get("state"):
            raise ValueError(f"{name}.load_state_dict: expected one parameter group with no params and no state")
        saved = copy.deepcopy(groups[0])
        for key in self.param_groups[0]:
            declared = getattr(type(self), key, None)
            if isinstance(declared, HyperParameter):
                if key not in saved:
                    raise ValueError(f"{name}.load_state_dict: param_groups[0] has no {key!r}")
                saved[key] = declared.validate(self, saved[key])
        saved["params"] = []
        group = self.param_groups[0]
        group.clear()
        group.update(saved)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def __repr__(self) -> str:
        group = self.param_groups[0]
        declared = [k for k in group if isinstance(getattr(type(self), k, None), HyperParameter)]
        fields = ", ".join(f"{k}={group[k]!r}" for k in declared)
        return f"{type(self).__name__}({fields})"
