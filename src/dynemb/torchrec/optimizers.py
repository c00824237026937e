"""The fused dynemb optimizer of a TorchRec module, chosen the TorchRec ways.

A TorchRec user picks the optimizer of embedding tables in one of four ways, and each becomes one
``dynemb.optim`` optimizer shared by the module's tables (docs/design/0027-torchrec-optimizers.md):

1. the dynemb module's ``optimizer=`` argument (``None`` on purpose: frozen tables);
2. ``apply_optimizer_in_backward(cls, module.parameters(), kwargs)`` (torch's, or TorchRec's
   deprecated wrapper) on the module's per-table handles (:class:`TableHandles`);
3. a sharder's ``fused_params`` (``{"optimizer": EmbOptimType..., "learning_rate": ...}``);
4. none of them: TorchRec's fused default (FBGEMM's ``EXACT_SGD``, lr 0.01), with a one-time
   warning that names it.

Ways 2 and 3 go through one table of FBGEMM names (:func:`from_fused_params`), as TorchRec turns an
optimizer class into an ``EmbOptimType`` plus fused params. Two ways that name different
optimizers raise. Under DMP, ``dmp.fused_optimizer`` holds one :class:`DynembFusedOptimizer` per
kernel: TorchRec's ``KeyedOptimizer`` whose param group drives the tables' hyper-parameters.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.tbe.config.optimizer_config import WeightDecayMode
from torchrec.distributed.utils import optimizer_type_to_emb_opt_type
from torchrec.optim.fused import FusedOptimizer

from dynemb.optim import SGD, Adagrad, Adam, RowOptimizer, RowWiseAdagrad
from dynemb.optim.base import HyperParameter


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"

    def __reduce__(self) -> str:
        return "UNSET"  # copies and pickles are the one UNSET (compared with ``is``)


#: The ``optimizer=`` default of dynemb's TorchRec modules: "not chosen here" (ways 2-4 above),
#: as opposed to ``None``, frozen tables on purpose.
UNSET: Any = _Unset()

# FBGEMM's defaults for the fused params a TorchRec user leaves out (SplitTableBatchedEmbeddingBagsCodegen).
_FBGEMM_DEFAULTS: dict[str, Any] = {
    "optimizer": EmbOptimType.EXACT_SGD,
    "learning_rate": 0.01,
    "eps": 1.0e-8,
    "beta1": 0.9,
    "beta2": 0.999,
    "weight_decay": 0.0,
    "weight_decay_mode": WeightDecayMode.NONE,
}
# Fused-param names of torch / TorchRec optimizer constructor arguments.
_KWARG_NAMES = {"lr": "learning_rate", "eps": "eps", "weight_decay": "weight_decay"}
# Constructor arguments whose default value means what dynemb does; any other value is refused.
_KWARG_DEFAULTS: dict[str, Any] = {"momentum": 0, "dampening": 0, "nesterov": False, "maximize": False, "lr_decay": 0.0, "amsgrad": False, "foreach": None}
_KWARG_DEFAULTS.update({"initial_accumulator_value": 0.0, "differentiable": False, "fused": None, "capturable": False})
_SUPPORTED = (EmbOptimType.EXACT_SGD, EmbOptimType.EXACT_ADAGRAD, EmbOptimType.EXACT_ROWWISE_ADAGRAD, EmbOptimType.ADAM)


def _number(where: str, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{where}: {key}={value!r}: must be a finite number >= 0")
    return float(value)


def from_fused_params(fused_params: Mapping[str, Any], where: str = "fused_params") -> RowOptimizer:
    """The dynemb optimizer that FBGEMM fused params describe.

    Args:
        fused_params: ``optimizer`` (``EmbOptimType``: ``EXACT_SGD``, ``EXACT_ADAGRAD``,
            ``EXACT_ROWWISE_ADAGRAD`` or ``ADAM``), ``learning_rate``, ``eps``, ``beta1``,
            ``beta2``, ``weight_decay``, ``weight_decay_mode`` (``NONE`` or ``L2``); a key left
            out takes FBGEMM's default (``EXACT_SGD``, lr 0.01, eps 1e-8, betas 0.9 / 0.999).
        where: how the error messages name the source.
    Raises:
        ValueError: a key dynemb does not support, an unsupported optimizer or weight decay mode,
            or a bad value; each message names the key and the value.
    """
    if not isinstance(fused_params, Mapping):
        raise TypeError(f"{where}={fused_params!r}: must be a dict of FBGEMM fused params")
    unknown = sorted(set(fused_params) - set(_FBGEMM_DEFAULTS))
    if unknown:
        raise ValueError(
            f"{where}: {unknown[0]}={fused_params[unknown[0]]!r} is not supported by dynemb tables "
            f"(they take {sorted(_FBGEMM_DEFAULTS)}; unsupported keys: {unknown})"
        )
    p = {**_FBGEMM_DEFAULTS, **fused_params}
    kind = p["optimizer"]
    if isinstance(kind, str):
        kind = next((t for t in EmbOptimType if t.value == kind or t.name == kind.upper()), kind)
    if kind not in _SUPPORTED:
        raise ValueError(f"{where}: optimizer={p['optimizer']!r} is not supported by dynemb tables (one of {[t.name for t in _SUPPORTED]})")
    mode = p["weight_decay_mode"]
    if mode not in (WeightDecayMode.NONE, WeightDecayMode.L2):
        raise ValueError(f"{where}: weight_decay_mode={mode!r} is not supported (dynemb applies WeightDecayMode.L2, or NONE)")
    lr, eps = _number(where, "learning_rate", p["learning_rate"]), _number(where, "eps", p["eps"])
    weight_decay = _number(where, "weight_decay", p["weight_decay"])
    if mode == WeightDecayMode.NONE and weight_decay:
        raise ValueError(f"{where}: weight_decay={weight_decay!r} with weight_decay_mode NONE has no effect; pass weight_decay_mode=WeightDecayMode.L2")
    if kind == EmbOptimType.EXACT_SGD:
        return SGD(lr=lr, weight_decay=weight_decay)
    if kind == EmbOptimType.EXACT_ADAGRAD:
        return Adagrad(lr=lr, eps=eps, weight_decay=weight_decay)
    if kind == EmbOptimType.EXACT_ROWWISE_ADAGRAD:
        return RowWiseAdagrad(lr=lr, eps=eps, weight_decay=weight_decay)
    betas = (_number(where, "beta1", p["beta1"]), _number(where, "beta2", p["beta2"]))
    return Adam(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


def from_optimizer_class(optimizer_class: type, kwargs: Mapping[str, Any], where: str) -> RowOptimizer:
    """The dynemb optimizer of ``apply_optimizer_in_backward(optimizer_class, ..., kwargs)``: the
    class becomes TorchRec's ``EmbOptimType`` (torch's and TorchRec's ``SGD``, ``Adagrad``,
    ``Adam``, TorchRec's ``RowWiseAdagrad``) and the kwargs fused params, as TorchRec's sharders do."""
    try:
        kind = optimizer_type_to_emb_opt_type(optimizer_class)
    except ValueError:
        kind = None
    if kind not in _SUPPORTED:
        raise ValueError(
            f"{where}: optimizer class {getattr(optimizer_class, '__qualname__', optimizer_class)!r} is not supported by dynemb tables "
            "(torch.optim.SGD / Adagrad / Adam, torchrec.optim SGD / Adagrad / Adam / RowWiseAdagrad)"
        )
    fused: dict[str, Any] = {"optimizer": kind}
    for key, value in kwargs.items():
        if key in _KWARG_NAMES:
            fused[_KWARG_NAMES[key]] = value
        elif key == "betas":
            fused["beta1"], fused["beta2"] = value
        elif key in _KWARG_DEFAULTS and value == _KWARG_DEFAULTS[key]:
            continue
        else:
            raise ValueError(f"{where}: {optimizer_class.__name__} argument {key}={value!r} is not supported by dynemb tables")
    if fused.get("weight_decay"):
        fused["weight_decay_mode"] = WeightDecayMode.L2  # torch's optimizers add weight_decay * w to the gradient
    return from_fused_params(fused, where)


def hyper_parameters(optimizer: RowOptimizer) -> dict[str, Any]:
    """The optimizer's current hyper-parameters (``lr``, ``eps``...), by name."""
    return {k: v for k, v in optimizer.param_groups[0].items() if isinstance(getattr(type(optimizer), k, None), HyperParameter)}


def same(a: RowOptimizer | None, b: RowOptimizer | None) -> bool:
    """Whether two optimizers apply the same rule (type and hyper-parameters)."""
    if a is None or b is None:
        return a is b
    return type(a) is type(b) and hyper_parameters(a) == hyper_parameters(b)


def describe(optimizer: RowOptimizer | None) -> str:
    if optimizer is None:
        return "None (frozen)"
    return f"dynemb.optim.{type(optimizer).__name__}({', '.join(f'{k}={v!r}' for k, v in hyper_parameters(optimizer).items())})"


class TableHandles(torch.nn.Module):
    """One parameter per table (``[0, D]``, on ``meta``: no memory, no gradient) that stands for
    the table where TorchRec's tooling expects a weight.

    ``apply_optimizer_in_backward(cls, module.parameters(), kwargs)`` tags these, and the module
    reads the tags. They stay on ``meta`` through ``.to()`` / ``to_empty()`` and are not in
    ``state_dict()`` (the tables' rows are). ``DistributedModelParallel`` materialises meta
    parameters of the modules it did not shard and calls their ``reset_parameters()``: here that
    means a dynemb module was left unsharded under DMP, which raises at world size > 1.
    """

    def __init__(self, tables: Mapping[str, int], owner: str):
        super().__init__()
        self.owner = owner
        self.names = list(tables)
        for i, dim in enumerate(tables.values()):
            self.register_parameter(self.key(i), torch.nn.Parameter(torch.empty(0, dim, device="meta")))

    def key(self, i: int) -> str:
        name = self.names[i]
        return name if name.isidentifier() and not hasattr(torch.nn.Module, name) and name not in ("owner", "names", "key") else f"table_{i}"

    def by_table(self) -> dict[str, torch.nn.Parameter]:
        # named_parameters, not attribute access: under fx tracing that would give proxies.
        params = dict(self.named_parameters(recurse=False))
        return {name: params[self.key(i)] for i, name in enumerate(self.names)}

    def tagged(self) -> dict[str, tuple[type, dict[str, Any]]]:
        """Table name -> (optimizer class, kwargs) of every handle ``apply_optimizer_in_backward`` tagged."""
        out = {}
        for name, param in self.by_table().items():
            classes = getattr(param, "_optimizer_classes", None)
            if classes:
                kwargs = getattr(param, "_optimizer_kwargs", [{}])
                if len(classes) != 1:
                    raise ValueError(f"{self.owner}: table {name!r} was given {len(classes)} optimizers by apply_optimizer_in_backward; dynemb takes one")
                out[name] = (classes[0], dict(kwargs[0]))
        return out

    def reset_parameters(self) -> None:
        """Called by DMP for a module it left unsharded (see the class docstring)."""
        if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            raise RuntimeError(
                f"{self.owner} is under DistributedModelParallel without dynemb's sharders: each of the "
                f"{torch.distributed.get_world_size()} ranks would train its own copy of tables {self.names}. "
                "Pass sharders=dynemb.torchrec.sharders() (plus TorchRec's, e.g. + get_default_sharders(), for TorchRec's own modules)"
            )

    def _apply(self, fn, recurse=True):
        # Stay on meta (a handle has no data to move) but follow dtype casts; the Parameter objects
        # stay, with their apply_optimizer_in_backward tags.
        for param in self.parameters():
            try:
                moved = fn(param.data)
            except NotImplementedError:  # .to(device) refuses meta tensors
                continue
            if moved.device.type == "meta":
                param.data = moved
        return self

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        pass  # the tables' rows are the module's state, not these

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        pass


def resolve(
    where: str,
    given: Any,
    handles: TableHandles | None = None,
    fused_params: Mapping[str, Any] | None = None,
    warn_default: bool = True,
) -> RowOptimizer | None:
    """The one optimizer of a module's tables from the four ways of the module docstring.

    Args:
        where: the module, for messages.
        given: the module's ``optimizer=`` (:data:`UNSET` when not passed).
        handles: the module's table handles (their ``apply_optimizer_in_backward`` tags).
        fused_params: a sharder's fused params (``None``: not sharded, or none given).
        warn_default: warn (once per process) when no way chose an optimizer.
    Raises:
        ValueError: two ways that choose different optimizers, tables tagged with different
            optimizers, or an unsupported choice (naming it).
    """
    choices: list[tuple[str, RowOptimizer | None]] = []
    if given is not UNSET:
        choices.append(("optimizer=", given))
    tags = handles.tagged() if handles is not None else {}
    if tags:
        untagged = [n for n in handles.names if n not in tags]
        first = next(iter(tags))
        built = {n: from_optimizer_class(cls, kw, f"{where}: apply_optimizer_in_backward on table {n!r}") for n, (cls, kw) in tags.items()}
        odd = [n for n in built if not same(built[n], built[first])]
        if untagged or odd:
            raise ValueError(
                f"{where}: apply_optimizer_in_backward gave tables different optimizers ({ {n: describe(o) for n, o in built.items()} }, "
                f"untagged {untagged}); dynemb's tables of one module share one optimizer: apply one to all of module.parameters()"
            )
        choices.append(("apply_optimizer_in_backward", built[first]))
    if fused_params:
        # A sharder's fused params name a whole optimizer (FBGEMM's defaults fill the gaps).
        choices.append(("fused_params", from_fused_params(fused_params, f"{where}: fused_params")))
    for name, optimizer in choices[1:]:
        if not same(optimizer, choices[0][1]):
            raise ValueError(f"{where}: {choices[0][0]} chose {describe(choices[0][1])} but {name} chose {describe(optimizer)}; choose one")
    if choices:
        return choices[0][1]  # optimizer= first: the user's own object
    optimizer = from_fused_params({}, "TorchRec's default")
    if warn_default:
        _warn_default(where, optimizer)
    return optimizer


_warned: set[str] = set()


def _warn_default(where: str, optimizer: RowOptimizer) -> None:
    if "default" in _warned:
        return
    _warned.add("default")
    warnings.warn(
        f"{where}: no optimizer was chosen for the dynemb tables (optimizer=, apply_optimizer_in_backward or a sharder's "
        f"fused_params), so they train with TorchRec's fused default, {describe(optimizer)} (FBGEMM's EXACT_SGD). "
        "Pass optimizer=None to freeze them.",
        UserWarning,
        stacklevel=4,
    )


class DynembFusedOptimizer(FusedOptimizer):
    """TorchRec's ``KeyedOptimizer`` face of the dynemb optimizer of one kernel's tables.

    ``params``: table weight name -> the table's handle; one param group holding the dynemb
    optimizer's hyper-parameters (``lr``...). ``step()`` writes the group's values into the dynemb
    optimizer (as TorchRec's fused optimizers set FBGEMM's learning rate at ``step()``, so an LR
    scheduler on ``dmp.fused_optimizer`` drives the tables) and runs its ``step()`` (which applies
    deferred updates; fused tables are updated in backward). The per-row optimizer state lives in
    the rows (``state`` is empty here): checkpoints carry it with the tables.
    """

    def __init__(self, optimizer: RowOptimizer, params: Mapping[str, torch.Tensor]):
        group = hyper_parameters(optimizer)
        super().__init__(dict(params), {}, [{"params": list(params.values()), **group}])
        self.optimizer = optimizer

    def push(self) -> None:
        """Write the param group's hyper-parameters into the dynemb optimizer (validated there)."""
        for key in hyper_parameters(self.optimizer):
            setattr(self.optimizer, key, self.param_groups[0][key])

    def step(self, closure: Any = None) -> None:
        self.push()
        self.optimizer.step()

    def zero_grad(self, set_to_none: bool = False) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.push()


def table_dims(configs: Iterable[Any]) -> dict[str, int]:
    """Table name -> embedding dim of TorchRec configs."""
    return {c.name: c.embedding_dim for c in configs}
