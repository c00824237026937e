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

from dynemb.checkpoint import _build_engine, _comm_of, _install, _locked
from dynemb.checkpoint.tables import Entry, entries
from dynemb.distributed.comm import owner_of

PREFIX = "dynemb_tables."
_COUNTERS = ("step", "optimizer_step", "last_timestamp", "erased", "nonfinite_grads")


def is_sharded_model(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds dynemb tables sharded by :func:`dynemb.distributed.shard`."""
    es = entries(module)
    return bool(es) and _comm_of(es) is not None


def _table_prefixes(module: torch.nn.Module) -> tuple[str, ...]:
    from dynemb.checkpoint.dcp import _table_prefixes as prefixes

    return prefixes(module)


def _sharded(local: torch.Tensor, offset: int, total: int) -> ShardedTensor:
    """Rows [n, *] of this rank at ``offset`` in a global [total, *] row-sharded tensor."""
    rank = dist.get_rank()
    meta = ShardMetadata(shard_offsets=[offset] + [0] * (local.dim() - 1), shard_sizes=list(local.shape), placement=f"rank:{rank}/{local.device}")
    return init_from_local_shards([Shard(local, meta)], [total, *local.shape[1:]])


def _local_rows(e: Entry) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's keys [K_r], whole rows [K_r, D+S] and scores [K_r] of one table."""
    engine = e.engine
    chunks = list(e.export(1 << 20))
    if not chunks:
        empty = torch.empty(0, dtype=torch.int64)
        return empty, torch.empty(0, engine.width, dtype=engine.store.dtype), empty
    keys = torch.cat([c[0] for c in chunks])
    rows = torch.cat([c[1] for c in chunks])
    scores = torch.cat([c[2] for c in chunks])
    return keys.cpu(), engine.store.gather(rows).cpu(), scores.cpu()


def state_dict(module: torch.nn.Module, saved: dict) -> dict:
    """The sharded model's DCP state; with ``saved`` (sizes from the checkpoint being loaded)
    the table entries are empty templates split evenly over the ranks."""
    es = entries(module)
    comm = _comm_of(es)
    prefixes = _table_prefixes(module)
    state = {k: v for k, v in module.state_dict().items() if not k.startswith(prefixes)}
    W, r = dist.get_world_size(), dist.get_rank()
    with _locked(es):
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
            keys, values, scores = _local_rows(e)
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
    comm = _comm_of(es)
    prefixes = _table_prefixes(module)
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
        by_owner = torch.sort(owner_of(keys, comm.world_size), stable=True)
        send = torch.bincount(by_owner.values, minlength=comm.world_size).tolist()
        recv = comm.counts(send)
        order = by_owner.indices
        keys = comm.exchange(keys.index_select(0, order), send, recv)
        values = comm.exchange(values.reshape(-1, e.engine.width).index_select(0, order), send, recv)
        scores = comm.exchange(scores.index_select(0, order), send, recv)
        counters = dict(zip(_COUNTERS, state[f"{name}counters"].tolist()))
        counters["index"] = [keys.numel(), 0, 0, 0]
        data[e.name] = {"keys": keys, "values": values, "scores": scores, "entry": {"counters": counters}}
    with _locked(es):
        groups: dict[int, list[Entry]] = {}
        for e in es:
            groups.setdefault(id(e.engine), []).append(e)
        plans = []
        for members in groups.values():
            if not any(e.name in data for e in members):
                continue
            parts = [(e.location[1], data[e.name], e) for e in members if e.name in data]
            fresh, _ = _build_engine(members[0], parts, on_overflow="raise", use_layout=False)
            plans.append((members, fresh, parts))
        with torch.no_grad():
            for k, v in dense.items():
                if k in mine:
                    mine[k].copy_(v)
        for members, fresh, parts in plans:
            _install(members, fresh, parts, data, True)
