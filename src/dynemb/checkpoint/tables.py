"""The dynemb tables inside a module tree, seen the way a checkpoint sees them.

K keys of a table, D embedding dim, S optimizer state columns.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Protocol, runtime_checkable

import torch

from dynemb.config import TableConfig
from dynemb.nn.changes import ChangeLog
from dynemb.nn.module import DynamicTable
from dynemb.nn.tables import DynamicTables

DTYPE_NAMES = {torch.float32: "float32", torch.float64: "float64", torch.bfloat16: "bfloat16", torch.float16: "float16"}
DTYPES = {v: k for k, v in DTYPE_NAMES.items()}


@dataclasses.dataclass(frozen=True)
class ShardedTables:
    """What a module whose dynemb tables another framework shards (TorchRec's DMP, through
    ``dynemb.torchrec``) shows the checkpoint: this rank's keys of each table, held in a local
    (unsharded) collection, and the process group they are split over, each key on rank
    ``dynemb.distributed.owner_of(key, W)``, as under ``dynemb.distributed.shard``.

    Args:
        path: where the unsharded module keeps its collection, below the module (``"collection"``
            for ``dynemb.torchrec``'s modules): a table is named ``<module path>.<path>.<table>``,
            as in the unsharded model.
        collections: table name -> the local collection holding this rank's keys of it (one
            collection may hold several tables), in the same order on every rank.
        comm: the ``dynemb.distributed.comm.Comm`` of the process group.
    """

    path: str
    collections: dict
    comm: object


@runtime_checkable
class ShardedElsewhere(Protocol):
    """A module presenting tables sharded by another framework (see :class:`ShardedTables`)."""

    def checkpoint_tables(self) -> ShardedTables: ...


@dataclasses.dataclass
class Entry:
    """One table: a DynamicTable, or table ``table`` of a collection; ``shard_comm``: the process
    group of a table sharded by another framework (its module holds this rank's keys)."""

    name: str
    module_path: str
    module: torch.nn.Module
    table: str | None
    shard_comm: object = None

    @property
    def comm(self):
        """The Comm of the process group the table is sharded over (None: unsharded)."""
        if self.shard_comm is not None:
            return self.shard_comm
        engine = self.engine
        return engine.comm if engine.collective else None

    @property
    def is_collection(self) -> bool:
        return self.table is not None

    @property
    def module_table(self) -> str:
        """The table's name in its module (a DynamicTable's one table has one too)."""
        return self.module.table_names[0] if self.table is None else self.table

    @property
    def table_index(self) -> int:
        """The table's index in its module's ``table_configs`` / ``admissions``."""
        return self.module.location(self.module_table)[2]

    @property
    def location(self) -> tuple:
        """(engine, segment or None, table index in a collection or None)."""
        engine, s, t = self.module.location(self.module_table)
        return engine, (s if engine.segmented else None), (None if self.table is None else t)

    @property
    def engine(self):
        return self.location[0]

    @property
    def config(self) -> TableConfig:
        return self.module.table_configs[self.table_index]

    @property
    def optimizer(self):
        return self.module.optimizer

    @property
    def state_dim(self) -> int:
        return self.engine.state_dim

    @property
    def lock(self):
        return self.module.lock

    @property
    def admission(self):
        return self.module.admissions[self.table_index]

    @property
    def generator(self) -> torch.Generator:
        engine, s, _ = self.location
        return engine.counters(s or 0)["generator"]

    def export(self, chunk_rows: int):
        engine, s, _ = self.location
        if s is None:
            yield from engine.index.export(chunk_rows)
        else:
            yield from engine.index.export_segment(s, chunk_rows)

    def export_slots(self, chunk_rows: int):
        """(keys, rows, scores, slots) chunks in slot order (slots: each key's flat index slot)."""
        engine, s, _ = self.location
        yield from engine.index.export_slots(chunk_rows, segment=s)

    def find_rows(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # The rank's own index (a sharded engine's find would be a collective call).
        engine, s, _ = self.location
        if s is None:
            return engine.index.find(keys)
        return engine.index.find(keys, segments=torch.full_like(keys, s))

    def counters(self) -> dict:
        """The table's counters as a manifest lists them (see docs/format.md)."""
        c = self.module.table_counters(self.module_table)
        return {k: c[k] for k in ("step", "optimizer_step", "last_timestamp", "erased", "nonfinite_grads", "index")}

    def changes(self) -> ChangeLog:
        """The engine's change log, created (empty) if it had none (a sharded engine's is its
        local shard's: each rank writes its own keys' changes)."""
        return self.engine.track_changes()


# TorchRec's DistributedModelParallel keeps the model in this child, inside a
# DistributedDataParallel's ``module`` when it wraps the dense part; its state_dict() names
# entries without either, and so do checkpoints (a DMP model's tables get the unsharded names).
_DMP_CHILD = "_dmp_wrapped_module"


def _walk(module: torch.nn.Module, path: str, in_dmp: bool, seen: set):
    """(path, module) of ``module`` and its descendants (each once), paths as the unsharded
    model names them; the tables of a :class:`ShardedElsewhere` module are its own."""
    if id(module) in seen:
        return
    seen.add(id(module))
    yield path, module
    if isinstance(module, ShardedElsewhere):
        return
    for name, child in module.named_children():
        wrapper = name == _DMP_CHILD or (in_dmp and name == "module" and isinstance(module, torch.nn.parallel.DistributedDataParallel))
        yield from _walk(child, path if wrapper else (f"{path}.{name}" if path else name), name == _DMP_CHILD, seen)


def entries(model: torch.nn.Module) -> list[Entry]:
    """Every dynemb table in ``model`` (itself included), named as in docs/format.md."""
    out: list[Entry] = []
    for path, module in _walk(model, "", False, set()):
        if isinstance(module, ShardedElsewhere):
            sharded = module.checkpoint_tables()
            base = ".".join(p for p in (path, sharded.path) if p)
            for t, collection in sharded.collections.items():
                out.append(Entry(f"{base}.{t}" if base else t, base, collection, t, sharded.comm))
        elif isinstance(module, DynamicTable):
            out.append(Entry(path or "table", path, module, None))
        elif isinstance(module, DynamicTables):
            for t in module.table_names:
                out.append(Entry(f"{path}.{t}" if path else t, path, module, t))
    names = [e.name for e in out]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"tables {dup}: two tables of the model get the same checkpoint name")
    return out


def config_json(config: TableConfig) -> dict:
    """TableConfig as JSON-able values (docs/format.md)."""

    def value(v):
        if isinstance(v, enum.Enum):
            return v.value
        if isinstance(v, torch.dtype):
            return DTYPE_NAMES.get(v, str(v))
        if isinstance(v, torch.device):
            return str(v)
        if dataclasses.is_dataclass(v):
            return {f.name: value(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, tuple):
            return [value(x) for x in v]
        return v

    out = {f.name: value(getattr(config, f.name)) for f in dataclasses.fields(config)}
    # A caching table's store is an object: the manifest names its type.
    out["external_storage"] = None if config.external_storage is None else type(config.external_storage).__name__
    return out


def optimizer_json(optimizer) -> dict | None:
    if optimizer is None:
        return None
    group = optimizer.param_groups[0]
    from dynemb.optim.base import HyperParameter

    hyper = {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items() if isinstance(getattr(type(optimizer), k, None), HyperParameter)}
    return {"type": type(optimizer).__name__, "hyper_parameters": hyper}
