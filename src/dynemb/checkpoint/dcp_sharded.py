"""DCP (torch.distributed.checkpoint) for sharded models: tables as row-sharded tensors.

N keys of a table over all ranks, K_r on rank r, D embedding dim, S optimizer state columns.

Used by :class:`dynemb.checkpoint.dcp.Stateful` when the module's tables are sharded by
:func:`dynemb.distributed.shard` (a plain tensor of the same name on every rank would be taken
by DCP as replicated and saved once). Per table ``<name>`` the state holds, under
``dynemb_tables.<name>.``:

- ``keys`` [N] int64, ``values`` [N, D+S], ``scores`` [N] int64: ShardedTensors whose rank r
  holds a contiguous block of rows (its own keys when saving);
- ``counters`` [5] int64, the same on every rank: step, optimizer step, last timestamp (the
  largest over ranks), erased and non-finite gradient counts (sums).

Loading at any world size: :func:`dynemb.checkpoint.dcp.prepare_load` reads N from the
checkpoint's metadata, the template splits the N rows evenly over the ranks, DCP fills each
rank's block, and every rank sends each row to the key's owner (one all-to-all per tensor), then
re-inserts the keys it owns (as :func:`dynemb.checkpoint.load` does). The module's other
entries (dense parameters) are plain tensors, replicated.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardMetadata, init_from_local_shards

from dynemb.checkpoint.common import comm_of, locked
from dynemb.checkpoint.rebuild import current_rows, install, plan_engines
from dynemb.checkpoint.tables import entries
from dynemb.distributed.engine import Route
from dynemb.nn import DynamicEmbeddingBagCollection, DynamicEmbeddingCollection, DynamicTable

PREFIX = "dynemb_tables."
_COUNTERS = ("step", "optimizer_step", "last_timestamp", "erased", "nonfinite_grads")


def table_prefixes(module: torch.nn.Module) -> tuple[str, ...]:
    """state_dict prefixes of every dynemb table or collection in ``module`` (both DCP paths)."""
    return tuple(
        f"{path}." if path else ""
        for path, m in module.named_modules()
        if isinstance(m, (DynamicTable, DynamicEmbeddingBagCollection, DynamicEmbeddingCollection))
    )


def is_sharded_model(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds dynemb tables sharded by :func:`dynemb.distributed.shard`."""
    es = entries(module)
    return bool(es) and comm_of(es) is not None


def _sharded(local: torch.Tensor, offset: int, total: int) -> ShardedTensor:
    """Rows [n, *] of this rank at ``offset`` in a global [total, *] row-sharded tensor."""
    rank = dist.get_rank()
    meta = ShardMetadata(shard_offsets=[offset] + [0] * (local.dim() - 1), shard_sizes=list(local.shape), placement=f"rank:{rank}/{local.device}")
    return init_from_local_shards([Shard(local, meta)], [total, *local.shape[1:]])


def state_dict(module: torch.nn.Module, saved: dict) -> dict:
    """The sharded model's DCP state; with ``saved`` (sizes from the checkpoint being loaded)
    the table entries are empty templates split evenly over the ranks."""
    es = entries(module)
    comm = comm_of(es)
    prefixes = table_prefixes(module)
    state = {k: v for k, v in module.state_dict().items() if not k.startswith(prefixes)}
    W, r = dist.get_world_size(), dist.get_rank()
    with locked(es):
        for e in es:
            name = f"{PREFIX}{e.name}."
            width = e.engine.width
            if f"{name}keys" in saved:
                n = int(saved[f"{name}keys"][0][0])
                per = -(-n // W) if n else 0
                lo, hi = min(n, r * per), min(n, (r + 1) * per)
                state[f"{name}keys"] = _sharded(torch.empty(hi - lo, dtype=torch.int64), lo, n)
                state[f"{name}values"] = _sharded(torch.empty(hi - lo, width, dtype=saved[f"{name}values"][1]), lo, n)
                state[f"{name}scores"] = _sharded(torch.empty(hi - lo, dtype=torch.int64), lo, n)
                state[f"{name}counters"] = torch.zeros(len(_COUNTERS), dtype=torch.int64)
                continue
            keys, values, scores = current_rows(e)
            counts = comm.all_gather_object((keys.numel(), [e.counters()[c] for c in _COUNTERS]))
            offset, total = sum(c for c, _ in counts[:r]), sum(c for c, _ in counts)
            state[f"{name}keys"] = _sharded(keys, offset, total)
            state[f"{name}values"] = _sharded(values, offset, total)
            state[f"{name}scores"] = _sharded(scores, offset, total)
            merged = [max(c[1][i] for c in counts) for i in range(3)] + [sum(c[1][i] for c in counts) for i in range(3, 5)]
            state[f"{name}counters"] = torch.tensor(merged, dtype=torch.int64)
    return state


def _local(t) -> torch.Tensor:
    shards = t.local_shards() if isinstance(t, ShardedTensor) else None
    if shards is None:
        return t
    return shards[0].tensor if shards else torch.empty(0)


def load_state_dict(module: torch.nn.Module, state: dict, *, strict: bool = True) -> None:
    """Send every loaded row to its key's owner, rebuild each rank's tables, copy dense entries."""
    es = entries(module)
    comm = comm_of(es)
    prefixes = table_prefixes(module)
    mine = {k: v for k, v in module.state_dict().items() if not k.startswith(prefixes)}
    dense = {k: v for k, v in state.items() if not k.startswith(PREFIX)}
    if strict and set(dense) != set(mine):
        raise RuntimeError(f"dense entries differ: missing {sorted(set(mine) - set(dense))[:8]}, unexpected {sorted(set(dense) - set(mine))[:8]}")
    names = {e.name for e in es}
    held = {k[len(PREFIX) :].rsplit(".", 1)[0] for k in state if k.startswith(PREFIX)}
    if strict and held != names:
        raise RuntimeError(f"tables differ: missing {sorted(names - held)}, unexpected {sorted(held - names)}")
    data = {}
    for e in es:
        name = f"{PREFIX}{e.name}."
        if e.name not in held:
            continue
        keys, values, scores = (_local(state[f"{name}{t}"]) for t in ("keys", "values", "scores"))
        # Each row to its key's owner.
        route = Route(comm, keys)
        keys, values, scores = (route.out(t) for t in (keys, values.reshape(-1, e.engine.width), scores))
        counters = dict(zip(_COUNTERS, state[f"{name}counters"].tolist()))
        counters["index"] = [keys.numel(), 0, 0, 0]
        data[e.name] = {"keys": keys, "values": values, "scores": scores, "entry": {"counters": counters}}
    with locked(es):
        plans, _ = plan_engines(es, data, on_overflow="raise", use_layout=False)
        with torch.no_grad():
            for k, v in dense.items():
                if k in mine:
                    mine[k].copy_(v)
        for members, fresh, parts in plans:
            install(members, fresh, parts, data, True)
