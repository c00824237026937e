"""Row-wise sharding of dynemb tables over torch.distributed (gloo on CPU, NCCL on GPU).

    import torch.distributed as dist
    dist.init_process_group("gloo")            # torchrun sets rank and world size
    model = build_model()                      # DynamicEmbedding(Bag), collections, or any module
    dynemb.distributed.shard(model)            # every dynemb table inside, in place
    loss = model(local_batch)...; loss.backward()   # on every rank, in lockstep

Every key has one owner rank (a hash of the key, on bits the bucket choice does not use); a
rank's table holds its keys only, with ``capacity // world_size`` rows. A lookup de-duplicates
the rank's ids, sends each key to its owner, which resolves it (inserting in training) and sends
its row back; pooling happens on the asking rank. Backward sends each key's gradient to its
owner, which sums the ranks' gradients and applies the fused (or, with ``update="deferred"``,
at ``optimizer.step()``) update. With per-key initialisation (the default) and the same clock
(step) on every rank, the sharded model trains like the unsharded one on the concatenated
batch (docs/design/0015-sharding.md).

Collective calls (every rank calls them, each with its own keys, the same calls on the same
tables in the same order): forward and backward of lookups, ``find`` / ``contains``,
``optimizer.step()`` of deferred tables, ``insert``, ``erase``, checkpoint saves. Local calls
(this rank's shard): ``export``, ``stats``, ``len``, ``state_dict``. ``load_state_dict`` raises on
a sharded table (a state_dict is one rank's shard): ``dynemb.checkpoint.load`` reshards by key.
``shard`` takes empty tables only (load a checkpoint afterwards) and refuses tables that use
admission (its counters would be per rank). The ranks agree on each call before any data moves: a rank that raised
before a call (bad input), or ranks making different calls, make every rank raise with the
tables unchanged; a rank that leaves a call half-way leaves the ranks out of step, and every
further collective raises until the model is restored from a checkpoint (docs/design/0019).
"""

from __future__ import annotations

import datetime

import torch

from dynemb.config import local_share
from dynemb.distributed.comm import Comm, ShardingError, owner_of
from dynemb.distributed.engine import ShardedEngine

__all__ = ["ShardingError", "is_sharded", "owner_of", "shard"]


def _local_config(config, world_size: int):
    """The config of one rank's shard: capacity (and each tier's rows) divided by the world size."""
    return local_share(config, world_size)


def is_sharded(module: torch.nn.Module) -> bool:
    """Whether a dynemb table or collection was sharded by :func:`shard`."""
    from dynemb.nn.tables import DynamicTables

    return isinstance(module, DynamicTables) and any(e.collective for e in module.engines)


def shard(module: torch.nn.Module, process_group=None, *, timeout: datetime.timedelta = datetime.timedelta(seconds=60)) -> torch.nn.Module:
    """Shard every dynemb table in ``module`` row-wise over ``process_group``, in place.

    Args:
        module: a dynemb table or collection, or any module holding them. Every rank calls
            ``shard`` on the same model (same tables, in the same order). Tables must be empty
            (load checkpoints after sharding: each rank reads its keys).
        process_group: the group to shard over (default: the default group).
        timeout: the longest wait of one collective; a rank that dies, raises or hangs makes the
            others raise :class:`ShardingError` naming it within about this time.
    Returns:
        ``module``.
    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: a table holds keys, uses admission, or was sharded already.
    """
    from dynemb.nn.engine import Engine
    from dynemb.nn.module import DynamicTable
    from dynemb.nn.tables import DynamicTables

    targets = [(n, m) for n, m in module.named_modules() if isinstance(m, DynamicTables)]
    if not targets:
        raise ValueError(f"module={type(module).__name__}: holds no dynemb table to shard")
    for name, m in targets:
        where = f"table {name!r}" if name else type(m).__name__
        if is_sharded(m):
            raise ValueError(f"{where}: is sharded already")
        if isinstance(m, DynamicTable):
            if len(m):
                raise ValueError(f"{where}: holds {len(m)} keys; shard empty tables, then load a checkpoint (each rank reads its keys)")
            if m.admission is not None:
                raise ValueError(f"{where}: admission is not supported on sharded tables yet (its counters would be per rank)")
        else:
            held = {t: s["size"] for t, s in m.stats().items() if s["size"]}
            if held:
                raise ValueError(f"{where}: tables {held} hold keys; shard empty collections, then load a checkpoint")
            admitting = [n for n, a in zip(m.table_names, m.admissions) if a is not None]
            if admitting:
                raise ValueError(f"{where}: tables {admitting} use admission, not supported on sharded tables yet")
    comm = Comm(process_group, timeout)
    W = comm.world_size
    for name, m in targets:
        # Names for errors; the engines' ids follow this order, the same on every rank.
        where = f"table {name!r}" if name else type(m).__name__
        for g, e in enumerate(m.engines):
            configs = [_local_config(c, W) for c in e.configs]
            local = Engine(configs if e.segmented else configs[0], e.optimizer)
            m.install_engine(g, ShardedEngine(local, comm, where if isinstance(m, DynamicTable) else f"{where} tables {[c.name for c in e.configs]}"))
    return module
