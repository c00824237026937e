"""Contract of a row-wise optimizer, and of the deferred owners it steps.

U rows updated in a call (one per unique key, gradients already summed per key), P keys with a
pending (deferred) gradient, D embedding dim, S state columns per row. A row stores
``[embedding (D) | state (S)]``; the optimizer defines S and the meaning of its state columns.

Fused tables apply :meth:`RowOptimizer.update` in backward. Deferred ones (``update="deferred"``,
docs/design/0011-deferred-updates.md) only accumulate the gradient in backward and register with
their optimizer as a *deferred owner*, an object with three methods (:class:`DeferredOwner`):

* ``deferred_step()``: apply one optimizer step to its rows with the pending gradient and
  clear it (nothing at all when nothing is pending); called by ``optimizer.step()``.
* ``deferred_clear()``: drop the pending gradient without applying it; called by
  ``optimizer.zero_grad()``.
* ``deferred_grad() -> Tensor | list[Tensor] | None``: the pending gradient [P, D] itself (not
  a copy; a list when the owner keeps several, e.g. one per group of a collection), so in-place
  scaling (clipping, ``GradScaler.unscale_``) changes what ``deferred_step`` applies; ``None``
  when the object does not defer (a fused table).

An owner registers with :meth:`RowOptimizer.register_deferred` together with a placeholder
``torch.nn.Parameter`` of shape [P, D] (zero-stride: no memory) whose ``.grad`` it keeps equal
to its pending gradient (an owner with several pending gradients registers once per
placeholder; it is still applied / cleared once per call). The placeholders are
``param_groups[0]["params"]``, which is where ``torch.amp.GradScaler`` and
``torch.nn.utils.clip_grad_norm_`` look for gradients. The optimizer holds owners by weak
reference: a table that is garbage collected leaves the registry and its placeholders leave
``param_groups``.
"""

from __future__ import annotations

import abc
import copy
import math
import weakref
from collections import defaultdict
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

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


@runtime_checkable
class DeferredOwner(Protocol):
    """What a :class:`RowOptimizer` calls on the objects (tables, collections) that defer their
    updates to ``step()``; see the module docstring."""

    def deferred_step(self) -> None: ...

    def deferred_clear(self) -> None: ...

    def deferred_grad(self) -> torch.Tensor | list[torch.Tensor] | None: ...


class RowOptimizer(torch.optim.Optimizer, abc.ABC):
    """Hyper-parameters of a row-wise optimizer and its update rule.

    Fused tables apply ``update`` in backward; deferred tables (``update="deferred"``) at
    :meth:`step`. For torch's tooling this is a ``torch.optim.Optimizer`` with one parameter
    group: ``param_groups[0]`` holds every hyper-parameter (``opt.lr`` reads and writes
    ``param_groups[0]["lr"]``), so ``torch.optim.lr_scheduler`` schedulers drive it, and its
    ``params`` hold one placeholder per deferred table (none for fused tables) whose ``.grad`` is
    the table's pending gradient, so ``torch.amp.GradScaler`` and gradient clipping see it.
    ``lr`` (and the other hyper-parameters) may be changed between steps; the next update uses
    the new value. One optimizer object may serve several tables: they share its
    hyper-parameters, while each table keeps its own step count and per-row state.

    Args:
        **hyper_parameters: initial value of each hyper-parameter, each declared on the class as a
            :class:`HyperParameter`; they become ``defaults`` and ``param_groups[0]``.
    """

    lr = HyperParameter(non_negative)
    # Row dtypes whose optimizer state this optimizer can train in (docs/design/0021-dtype-moves.md).
    row_dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float64, torch.bfloat16, torch.float16)

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
        self.__setstate__({"defaults": defaults, "state": defaultdict(dict), "param_groups": [{"params": [], **defaults}]})

    def __getstate__(self) -> dict[str, Any]:
        # A copy (deepcopy, pickle) serves no table yet: tables register again when copied.
        groups = [{**group, "params": []} for group in self.param_groups]
        return {"defaults": self.defaults, "state": self.state, "param_groups": groups}

    def __setstate__(self, state: dict[str, Any]) -> None:
        torch.optim.Optimizer.__setstate__(self, state)
        # (weak reference to the owner, its placeholder parameter), in registration order.
        self._owners: list[tuple[weakref.ref, torch.nn.Parameter]] = []

    def register_deferred(self, owner: DeferredOwner, placeholder: torch.nn.Parameter) -> None:
        """Have :meth:`step` / :meth:`zero_grad` apply / clear ``owner``'s pending gradient.

        Args:
            owner: a :class:`DeferredOwner`, held by weak reference.
            placeholder: a ``torch.nn.Parameter`` that the owner keeps of shape [P, D] with
                ``.grad`` its pending gradient; appended to ``param_groups[0]["params"]``. An
                owner may register several placeholders (one per pending gradient); registering
                the same pair again does nothing.
        """
        if not isinstance(owner, DeferredOwner):
            raise TypeError(f"owner={owner!r}: must implement deferred_step, deferred_clear and deferred_grad")
        if not isinstance(placeholder, torch.nn.Parameter):
            raise TypeError(f"placeholder={placeholder!r}: must be a torch.nn.Parameter")
        if any(ref() is owner and p is placeholder for ref, p in self._owners):
            return
        this = weakref.ref(self)

        def forget(_ref: weakref.ref, placeholder: torch.nn.Parameter = placeholder) -> None:
            optimizer = this()
            if optimizer is not None:
                optimizer.forget_placeholder(placeholder)

        self._owners.append((weakref.ref(owner, forget), placeholder))
        self.param_groups[0]["params"].append(placeholder)

    def unregister_deferred(self, owner: DeferredOwner) -> None:
        """Stop stepping ``owner`` and drop its placeholders (its pending gradient is left as it is)."""
        for ref, placeholder in list(self._owners):
            if ref() is owner:
                self.forget_placeholder(placeholder)

    def forget_placeholder(self, placeholder: torch.nn.Parameter) -> None:
        """Drop ``placeholder`` from the registry and from ``param_groups`` (its owner was
        collected or unregistered); an unknown placeholder is ignored."""
        self._owners = [(r, p) for r, p in self._owners if p is not placeholder]
        params = self.param_groups[0]["params"]
        # Identity, not ==: tensors compare element-wise.
        params[:] = [p for p in params if p is not placeholder]

    def deferred_owners(self) -> list[DeferredOwner]:
        """The live deferred owners, each once, in registration order."""
        owners: list[DeferredOwner] = []
        for ref, _ in self._owners:
            owner = ref()
            if owner is not None and not any(o is owner for o in owners):
                owners.append(owner)
        return owners

    @abc.abstractmethod
    def state_dim(self, embedding_dim: int) -> int:
        """S, optimizer state columns per row for embeddings of D columns."""

    def init_state(self, state: torch.Tensor) -> None:
        """Fill the state of new rows in place (Tensor: [n, S]); zeros unless overridden."""
        state.zero_()

    def initial_state_value(self) -> float | None:
        """The constant :meth:`init_state` fills every state column with, or None when it is
        not one constant (a subclass overriding init_state): the compiled row initialisation
        writes it."""
        return 0.0 if type(self).init_state is _BASE_INIT_STATE else None

    @abc.abstractmethod
    def update(self, weight: torch.Tensor, state: torch.Tensor, grad: torch.Tensor, step: int) -> None:
        """Apply one step in place.

        Args:
            weight (Tensor): [U, D] embeddings of the rows (may be a strided view).
            state (Tensor): [U, S] their optimizer state (may be a strided view).
            grad (Tensor): [U, D] summed gradient per row.
            step: 1-based count of updates this table has applied, this one included.
        """

    def native_update(self, step: int) -> dict[str, object] | None:
        """This optimizer's step at ``step`` as the compiled update kernel takes it (see
        :func:`dynemb.kernels.update.update_rows_native`), or None where it has no native twin
        (then the engine runs :meth:`update_rows`). A subclass that changes :meth:`update`
        must return None here unless the kernel does what it does."""
        return None

    def check_row_dtype(self, dtype: torch.dtype, where: str = "a table") -> None:
        """Raise ``ValueError`` naming ``dtype`` if this optimizer cannot train rows of ``dtype``."""
        if dtype not in self.row_dtypes:
            allowed = ", ".join(str(d) for d in self.row_dtypes)
            raise ValueError(
                f"dtype={dtype}: {type(self).__name__} cannot train {where} with rows of this dtype (its state would not hold the "
                f"updates, docs/design/0021-dtype-moves.md); train in {allowed} (e.g. .float()), or read the rows in eval mode"
            )

    def update_rows(self, rows: torch.Tensor, embedding_dim: int, grad: torch.Tensor, step: int) -> None:
        """Apply one step in place to whole rows ``[embedding | state]``: what the engines call.

        Rows of a 16-bit dtype (float16, bfloat16) are updated in float32 and rounded once, as
        torch's fused CUDA optimizers and AMP do: in float16 the default eps (1e-8, 1e-10)
        rounds to 0, so a zero gradient on zero state would write 0/0 = NaN, and each
        intermediate rounding would lose bits. float16 state saturates at float16's largest
        value instead of becoming inf, which would freeze the row for good (an Adagrad
        accumulator past 65504 keeps decaying the step no further). See
        docs/design/0021-dtype-moves.md.

        Args:
            rows (Tensor): [U, D + S] the rows (contiguous or not), updated in place.
            embedding_dim: D.
            grad (Tensor): [U, D] summed gradient per row (any float dtype; used in the rows'
                arithmetic dtype).
            step: as for :meth:`update`.
        Raises:
            ValueError: the rows' dtype is not in :attr:`row_dtypes`; no row changed.
        """
        self.check_row_dtype(rows.dtype)
        D = embedding_dim
        if rows.dtype in (torch.float16, torch.bfloat16):
            work = rows.float()  # [U, D + S]
            self.update(work[:, :D], work[:, D:], grad.float(), step)
            if rows.dtype == torch.float16 and work.shape[1] > D:
                big = torch.finfo(torch.float16).max
                work[:, D:].clamp_(-big, big)
            rows.copy_(work)
        else:
            self.update(rows[:, :D], rows[:, D:], grad.to(rows.dtype), step)

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Apply one update to every deferred table with its pending gradient, and clear it.

        Fused tables applied their update in backward: for them this does nothing, and exists so
        the standard loop ``loss.backward(); opt.step(); scheduler.step()`` runs unchanged and the
        scheduler sees ``step()`` called. Step hooks fire as in torch. Deferred owners are stepped
        in registration order; one that raises (``nonfinite_grads="raise"``) stops the step there
        and keeps its pending gradient.

        Args:
            closure: if given, called first with grad enabled (its backward accumulates or
                applies the gradient) and its loss returned.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for owner in self.deferred_owners():
            owner.deferred_step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the pending gradient of every deferred table (fused tables keep none).

        Args:
            set_to_none: accepted for torch's signature; either way the pending gradient becomes
                empty ([0, D]).
        """
        for owner in self.deferred_owners():
            owner.deferred_clear()

    def state_dict(self) -> dict[str, Any]:
        """``{"state": {}, "param_groups": [{hyper-parameters..., "params": []}]}``.

        The placeholders of deferred tables are not saved (their pending gradient is not state:
        save after ``step()``). State-dict hooks fire; post hooks see torch's packed form.
        """
        state_dict = super().state_dict()
        for group in state_dict["param_groups"]:
            group["params"] = []
        return state_dict

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused: a fused optimizer updates table rows, not parameters."""
        raise TypeError(f"{type(self).__name__} holds no parameters: the tables it serves apply it to their rows")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load hyper-parameters saved by :meth:`state_dict` (inherited from torch).

        The saved group must hold every hyper-parameter of this class; each is validated. Other
        keys (a scheduler's ``initial_lr``, ``max_lr``, ...) are kept as they are, as torch does.
        Per-row state lives in the tables and is saved with them; the registered deferred tables
        stay registered. Load-state-dict hooks fire.

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
        group = self.param_groups[0]
        saved["params"] = group["params"]
        group.clear()
        group.update(saved)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def __repr__(self) -> str:
        group = self.param_groups[0]
        declared = [k for k in group if isinstance(getattr(type(self), k, None), HyperParameter)]
        fields = ", ".join(f"{k}={group[k]!r}" for k in declared)
        return f"{type(self).__name__}({fields})"


# RowOptimizer.init_state as defined here (a later patch of it is not bypassed by the kernels).
_BASE_INIT_STATE = RowOptimizer.init_state
