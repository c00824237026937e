"""When the tables of a dynemb TorchRec module come to exist, and with which optimizer.

Both drop-in modules (``EmbeddingBagCollection``, ``EmbeddingCollection``) hold their dynemb
collection in ``self.collection``. Built on a real device, it exists from the constructor. Built
on ``meta`` (``device="meta"`` or inside ``with torch.device("meta")``), it does not: no memory is
taken until ``DistributedModelParallel`` shards the module (each rank builds its shard on DMP's
device), or ``module.to_empty(device=...)`` (also ``.to(device)``) builds it for unsharded use.

The optimizer (docs/design/0027-torchrec-optimizers.md, :mod:`dynemb.torchrec.optimizers`) is
settled at the first training forward (or when a sharder shards the module): until then a module
whose ``optimizer=`` was not passed holds frozen tables, and settling it on another optimizer
rebuilds them with the same rows (no optimizer step can have run on frozen tables).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from dynemb.config import TableConfig
from dynemb.nn.tables import DynamicTables
from dynemb.optim import RowOptimizer
from dynemb.torchrec.optimizers import UNSET, TableHandles, describe, resolve, same, table_dims

_META = torch.device("meta")


def is_meta(device: torch.device | str | None) -> bool:
    """Whether a module asked for ``device`` defers its tables (explicit meta, or the default
    device inside ``with torch.device("meta")``)."""
    if device is None:
        return torch.get_default_device().type == "meta"
    return torch.device(device).type == "meta"


def _probe_device(fn) -> torch.device | None:
    """The device a ``Module._apply`` function moves tensors to, or None when it keeps them on
    meta (a dtype cast): ``to_empty`` maps meta to a device, ``.to(device)`` refuses meta."""
    try:
        moved = fn(torch.empty(0, device=_META))
    except NotImplementedError:
        moved = fn(torch.empty(0))
    return None if moved.device.type == "meta" else moved.device


def unbuilt_error(owner: str) -> RuntimeError:
    """What a meta module says when its tables are needed before they exist."""
    return RuntimeError(
        f"{owner} was built on device='meta': its tables do not exist yet. DistributedModelParallel "
        "(with sharders=dynemb.torchrec.sharders()) creates them on each rank; for unsharded use call module.to_empty(device=...)"
    )


class TorchRecTables:
    """Mixin of the drop-in modules: their collection's construction, optimizer and device.

    The class using it defines ``new_collection(configs, optimizer) -> DynamicTables``.
    """

    def setup_tables(self, configs: list[TableConfig], optimizer: Any, update: str, deferred: bool) -> None:
        """Called by the constructor once TorchRec's bookkeeping exists.

        Args:
            configs: one ``dynemb.TableConfig`` per table (its device is a placeholder when
                ``deferred``).
            optimizer: the ``optimizer=`` argument (``UNSET`` when not passed).
            update: ``"fused"`` or ``"deferred"``.
            deferred: build nothing now (meta).
        """
        if optimizer is not UNSET and optimizer is not None and not isinstance(optimizer, RowOptimizer):
            raise TypeError(f"optimizer={optimizer!r}: must be a dynemb.optim optimizer (SGD, Adagrad, RowWiseAdagrad, Adam) or None")
        self.dynemb_configs = list(configs)
        self.given_optimizer = optimizer
        self.update_mode = update
        self.optimizer_handles = TableHandles(table_dims(configs), type(self).__name__)
        # The optimizer is settled once: given now, or at the first training forward / sharding.
        self.settled = optimizer is not UNSET
        self.settled_tags = repr({})
        if configs and not deferred:
            self.build(None if optimizer is UNSET else optimizer)

    # -- the collection -------------------------------------------------------------------------

    @property
    def collection(self) -> DynamicTables | None:
        """The dynemb collection holding this module's tables (``None`` with ``tables=[]``; built
        on first need when the module was built on meta and DMP materialised its handles unsharded)."""
        if not self.dynemb_configs:
            return None
        try:
            return torch.nn.Module.__getattr__(self, "collection")
        except AttributeError:
            pass
        if self.handles_device().type != "meta":
            return self.materialize(self.handles_device())
        raise unbuilt_error(type(self).__name__)

    def is_built(self) -> bool:
        return "collection" in dict(self.named_children())

    def handles_device(self) -> torch.device:
        """Where the table handles are: meta, unless DMP materialised them on its device (a
        dynemb module it left unsharded at world size 1), which is where the tables then go."""
        return next(iter(self.optimizer_handles.parameters())).device

    def flush(self) -> None:
        """Caching tables (``options`` with ``caching=True``): write the dirty cached rows back to
        their external stores; nothing for other tables, nor before the tables are built."""
        if self.is_built():
            self.collection.flush()

    def forward_collection(self) -> DynamicTables | None:
        """The collection a forward reads, its optimizer settled when training: ``None`` for a
        module without tables, or still on meta (the lookup then answers meta inputs only)."""
        if not self.dynemb_configs:
            return None
        if not self.is_built() and self.handles_device().type == "meta":
            return None
        if self.training and torch.is_grad_enabled():
            self.settle_optimizer()
        return self.collection

    def build(self, optimizer: RowOptimizer | None) -> DynamicTables:
        collection = self.new_collection(self.dynemb_configs, optimizer)
        # Not add_module: it asks hasattr(self, "collection"), which is this class's property.
        self._modules["collection"] = collection
        return collection

    def materialize(self, device: torch.device) -> DynamicTables:
        """Build the tables of a meta module on ``device`` (unsharded)."""
        self.dynemb_configs = [dataclasses.replace(c, device=device) for c in self.dynemb_configs]
        return self.build(self.given_optimizer if self.settled else None)

    def held_keys(self) -> dict[str, int]:
        """Table name -> keys held, for tables holding any (none before the tables exist)."""
        if not self.is_built():
            return {}
        return {name: s["size"] for name, s in self.collection.stats().items() if s["size"]}

    # -- the optimizer --------------------------------------------------------------------------

    def sharding_optimizer(self, fused_params: Mapping[str, Any] | None, warn_default: bool = True) -> RowOptimizer | None:
        """The optimizer of this module's tables when a sharder with ``fused_params`` shards it."""
        return resolve(type(self).__name__, self.given_optimizer, self.optimizer_handles, fused_params, warn_default)

    def settle_optimizer(self) -> None:
        """At a training forward: settle the optimizer once (rebuilding frozen provisional tables
        on the chosen one), and refuse an ``apply_optimizer_in_backward`` that came too late."""
        tags = repr(self.optimizer_handles.tagged())
        if self.settled and tags == self.settled_tags:
            return
        if not self.settled:
            optimizer = resolve(type(self).__name__, self.given_optimizer, self.optimizer_handles, None)
            old = self.collection
            new = self.build(optimizer)
            for name in old.table_names:
                for chunk in old.export(name):
                    new.insert(name, chunk["keys"], chunk["embeddings"], chunk["scores"])
            self.settled = True
        elif self.given_optimizer is not UNSET:
            resolve(type(self).__name__, self.given_optimizer, self.optimizer_handles, None)  # raises on a conflict
        else:
            # Tagged after the tables started training with the optimizer settled then.
            tagged = resolve(type(self).__name__, UNSET, self.optimizer_handles, None, warn_default=False)
            if not same(tagged, self.collection.optimizer):
                raise ValueError(
                    f"{type(self).__name__}: apply_optimizer_in_backward was called after the tables started training with "
                    f"{describe(self.collection.optimizer)}; call it before the first forward"
                )
        self.settled_tags = tags

    def move_tables(self, fn) -> bool:
        """``Module._apply`` of a meta module: build its tables where ``fn`` moves tensors.
        Returns whether the module is (now) built."""
        if self.is_built() or not self.dynemb_configs:
            return True
        device = _probe_device(fn)
        if device is None:
            return False
        self.materialize(device)
        return True
