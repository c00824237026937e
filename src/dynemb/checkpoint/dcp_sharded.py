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

Tables sharded by TorchRec's DMP (:class:`dynemb.checkpoint.tables.ShardedTables`) use the same
pieces for their own ``state_dict()``: :func:`table_state` / :func:`load_table_state`, under the
unsharded module's entry names (docs/design/0030-dmp-checkpoints.md).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardMetadata, init_from_local_shards

from dynemb.checkpoint.common import comm_of, locked
from dynemb.checkpoint.rebuild import current_rows, install, plan_engines
from dynemb.checkpoint.tables import Entry, entries
from dynemb.distributed.engine import Route
from dynemb.nn import DynamicEmbeddingBagCollection, DynamicEmbeddingCollection, DynamicTable

PREFIX = "dynemb_tables."
COUNTERS = ("step", "optimizer_step", "last_timestamp", "erased", "nonfinite_grads")


def table_prefixes(module: torch.nn.Module) -> tuple[str, ...]:
    """state_dict prefixes of every dynemb table or collection in ``module`` (both DCP paths),
    those of tables sharded by another framework (a DMP model's) included."""
    own = [
        f"{path}." if path else ""
        for path, m in module.named_modules()
        if isinstance(m, (DynamicTable, DynamicEmbeddingBagCollection, DynamicEmbeddingCollection))
    ]
    external = [f"{e.module_path}." if e.module_path else "" for e in entries(module) if e.shard_comm is not None]
    return tuple(dict.fromkeys(own + external))


def is_sharded_model(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds sharded dynemb tables (:func:`dynemb.distributed.shard`, or DMP)."""
    es = entries(module)
    return bool(es) and comm_of(es) is not None


def sharded_rows(local: torch.Tensor, offset: int, total: int, group=None) -> ShardedTensor:
    """Rows [n, *] of this rank at ``offset`` in a global [total, *] row-sharded tensor
    (collective over ``group``, default: the default group)."""
    rank = dist.get_rank(group)
    meta = ShardMetadata(shard_offsets=[offset] + [0] * (local.dim() - 1), shard_sizes=list(local.shape), placement=f"rank:{rank}/{local.device}")
    return init_from_local_shards([Shard(local.contiguous(), meta)], [total, *local.shape[1:]], process_group=group)


def even_block(n: int, group=None) -> tuple[int, int]:
    """This rank's rows [lo, hi) of n rows split evenly over the ranks (a load template)."""
    W, r = dist.get_world_size(group), dist.get_rank(group)
    per = -(-n // W) if n else 0
    return min(n, r * per), min(n, (r + 1) * per)


def local_rows(e: Entry, comm) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int, list[int]]:
    """This rank's keys [K_r], whole rows [K_r, D+S] and scores [K_r] of table ``e``, their
    offset among all ranks' rows, N, and the table's counters (``COUNTERS``) over all ranks
    (collective: one object exchange)."""
    keys, values, scores = current_rows(e)
    counts = comm.all_gather_object((keys.numel(), [e.counters()[c] for c in COUNTERS]))
    r = comm.rank
    offset, total = sum(c for c, _ in counts[:r]), sum(c for c, _ in counts)
    merged = [max(c[1][i] for c in counts) for i in range(3)] + [sum(c[1][i] for c in counts) for i in range(3, 5)]
    return keys, values, scores, offset, total, merged


def state_dict(module: torch.nn.Module, saved: dict) -> dict:
    """The sharded model's DCP state; with ``saved`` (sizes from the checkpoint being loaded)
    the table entries are empty templates split evenly over the ranks."""
    es = entries(module)
    comm = comm_of(es)
    prefixes = table_prefixes(module)
    state = {k: v for k, v in module.state_dict().items() if not k.startswith(prefixes)}
    with locked(es):
        for e in es:
            name = f"{PREFIX}{e.name}."
            width = e.engine.width
            if f"{name}keys" in saved:
                n = int(saved[f"{name}keys"][0][0])
                lo, hi = even_block(n)
                state[f"{name}keys"] = sharded_rows(torch.empty(hi - lo, dtype=torch.int64), lo, n)
                state[f"{name}values"] = sharded_rows(torch.empty(hi - lo, width, dtype=saved[f"{name}values"][1]), lo, n)
                state[f"{name}scores"] = sharded_rows(torch.empty(hi - lo, dtype=torch.int64), lo, n)
                state[f"{name}counters"] = torch.zeros(len(COUNTERS), dtype=torch.int64)
                continue
            keys, values, scores, offset, total, merged = local_rows(e, comm)
            state[f"{name}keys"] = sharded_rows(keys, offset, total)
            state[f"{name}values"] = sharded_rows(values, offset, total)
            state[f"{name}scores"] = sharded_rows(scores, offset, total)
            state[f"{name}counters"] = torch.tensor(merged, dtype=torch.int64)
    return state


def local_shard(t) -> torch.Tensor:
    """This rank's block of a loaded row-sharded tensor (a plain tensor: itself)."""
    shards = t.local_shards() if isinstance(t, ShardedTensor) else None
    if shards is None:
        return t
    return shards[0].tensor if shards else torch.empty(0)


def install_rows(es: list[Entry], comm, loaded: dict[str, tuple], then=None) -> None:
    """Rebuild the tables named in ``loaded`` (table name -> keys [K], whole rows [K, D+S],
    scores [K], counters by ``COUNTERS`` name: any block of a table's rows on each rank): every
    row goes to its key's owner (one all-to-all per tensor), each rank re-inserts the keys it
    owns. ``then()`` runs once every engine is built, before any is swapped in (nothing has
    changed when a table does not fit)."""
    data = {}
    for e in es:
        if e.name not in loaded:
            continue
        keys, values, scores, counters = loaded[e.name]
        route = Route(comm, keys)
        keys, values, scores = (route.out(t) for t in (keys, values.reshape(-1, e.engine.width), scores))
        counters = {**counters, "index": [keys.numel(), 0, 0, 0]}
        data[e.name] = {"keys": keys, "values": values, "scores": scores, "entry": {"counters": counters}}
    with locked(es):
        plans, _ = plan_engines(es, data, on_overflow="raise", use_layout=False)
        if then is not None:
            then()
        for members, fresh, parts in plans:
            install(members, fresh, parts, data, True)


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
    loaded = {}
    for e in es:
        name = f"{PREFIX}{e.name}."
        if e.name in held:
            keys, values, scores = (local_shard(state[f"{name}{t}"]) for t in ("keys", "values", "scores"))
            loaded[e.name] = (keys, values, scores, dict(zip(COUNTERS, state[f"{name}counters"].tolist())))

    def copy_dense() -> None:
        # Copied in place into the model's own parameters and buffers.
        with torch.no_grad():
            for k, v in dense.items():
                if k in mine:
                    mine[k].copy_(v)

    install_rows(es, comm, loaded, then=copy_dense)


def _table_entries(e: Entry) -> list[str]:
    """The state entries of one table sharded elsewhere (as its unsharded module names them)."""
    names = ["keys", "embeddings", "scores", "optimizer_step", "counters"]
    return names + (["optimizer_state"] if e.engine.state_dim else [])


def table_state(es: list[Entry], prefix: str) -> dict[str, torch.Tensor]:
    """The state_dict entries of tables sharded by another framework (a DMP model's), under the
    names of the unsharded module's entries: per table ``keys`` [N], ``embeddings`` [N, D],
    ``optimizer_state`` [N, S] (S > 0) and ``scores`` [N] as row-sharded tensors (rank r's
    block: its own keys), ``optimizer_step`` [] (the largest over ranks) and ``counters`` [2]
    (erased keys, skipped non-finite updates: sums); per module ``step`` and ``last_timestamp``
    [] (the largest). Collective over the tables' process group."""
    comm = comm_of(es)
    group = comm.group
    state: dict[str, torch.Tensor] = {}
    clocks: dict[str, list[int]] = {}
    with locked(es):
        for e in es:
            keys, values, scores, offset, total, merged = local_rows(e, comm)
            D, name = e.engine.embedding_dim, f"{prefix}{e.name}."
            state[f"{name}keys"] = sharded_rows(keys, offset, total, group)
            state[f"{name}embeddings"] = sharded_rows(values[:, :D], offset, total, group)
            if e.engine.state_dim:
                state[f"{name}optimizer_state"] = sharded_rows(values[:, D:], offset, total, group)
            state[f"{name}scores"] = sharded_rows(scores, offset, total, group)
            counters = dict(zip(COUNTERS, merged))
            state[f"{name}optimizer_step"] = torch.tensor(counters["optimizer_step"])
            state[f"{name}counters"] = torch.tensor([counters["erased"], counters["nonfinite_grads"]])
            clock = clocks.setdefault(f"{prefix}{e.module_path}." if e.module_path else prefix, [0, 0])
            clock[0], clock[1] = max(clock[0], counters["step"]), max(clock[1], counters["last_timestamp"])
    for name, (step, last) in clocks.items():
        state[f"{name}step"], state[f"{name}last_timestamp"] = torch.tensor(step), torch.tensor(last)
    return state


def load_table_state(es: list[Entry], state: dict, prefix: str) -> tuple[list[str], list[str]]:
    """Load the entries :func:`table_state` makes (each rank: any block of each table's rows,
    e.g. the even split of a DCP load) into the tables ``es``: every row goes to its key's
    owner, each rank rebuilds its tables. A table whose entries are all absent keeps its rows;
    one with some absent is not loaded. Collective. Returns (missing, unexpected) entry names.
    Raises ValueError (no table changed) for entries of another shape."""
    comm = comm_of(es)
    known: set[str] = set()
    missing: list[str] = []
    loaded = {}
    for e in es:
        name, D, S = f"{prefix}{e.name}.", e.engine.embedding_dim, e.engine.state_dim
        clock = f"{prefix}{e.module_path}." if e.module_path else prefix
        needed = [f"{name}{n}" for n in _table_entries(e)] + [f"{clock}step", f"{clock}last_timestamp"]
        known.update(needed)
        absent = [n for n in needed if n not in state]
        if absent:
            missing.extend(absent)
            continue
        keys, emb, scores = (local_shard(state[f"{name}{n}"]) for n in ("keys", "embeddings", "scores"))
        emb = emb.reshape(keys.numel(), -1)
        opt = local_shard(state[f"{name}optimizer_state"]).reshape(keys.numel(), -1) if S else emb.new_empty(keys.numel(), 0)
        if emb.shape[1] != D or opt.shape[1] != S or scores.shape != keys.shape:
            raise ValueError(
                f"state entries '{name}*': [{keys.numel()}] keys, embeddings [{tuple(emb.shape)}], optimizer_state {tuple(opt.shape)}, "
                f"scores {tuple(scores.shape)}; this table has embedding_dim={D} and {S} optimizer state columns"
            )
        erased, nonfinite = (int(v) for v in state[f"{name}counters"].tolist())
        counters = {
            "step": int(state[f"{clock}step"]),
            "optimizer_step": int(state[f"{name}optimizer_step"]),
            "last_timestamp": int(state[f"{clock}last_timestamp"]),
            "erased": erased,
            "nonfinite_grads": nonfinite,
        }
        loaded[e.name] = (keys, torch.cat([emb, opt.to(emb.dtype)], 1), scores, counters)
    install_rows(es, comm, loaded)
    return sorted(set(missing)), sorted(k for k in state if k not in known)
