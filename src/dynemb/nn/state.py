"""state_dict of tables and collections: plain tensors out, validated and rebuilt on load.

K keys of a table, D embedding dim, S optimizer state columns.

A DynamicTable's entries (docs/design/0009-state-dict.md): ``keys`` [K], ``embeddings`` [K, D],
``optimizer_state`` [K, S], ``scores`` [K], ``step``, ``optimizer_step``, ``last_timestamp``,
``counters`` [2] (erased, nonfinite_grads), ``generator_state``, ``index.*`` (its index) and
``admission.*``. A collection's: ``step``, ``last_timestamp``; per table ``<name>.keys``,
``.embeddings``, ``.optimizer_state``, ``.scores``, ``.optimizer_step``, ``.counters``,
``.generator_state``, ``.admission.*``; per engine ``groups.<g>.index.*``.

Both load the same way (:func:`rebuilt_engine`): every table's keys and rows are parsed and
checked first; each engine is rebuilt on the side, exactly (slots, row ids, free list: further
training is bitwise that of the saved module) when its index state has this engine's geometry,
else by re-inserting the keys with their scores; then everything is swapped in. A state that
does not fit raises ValueError and changes nothing.
"""

from __future__ import annotations

import torch

from dynemb.nn.clock import loaded_scores
from dynemb.nn.functional import warn_nonfinite
from dynemb.storage.caching import bind_held
from dynemb.table.index import unique_pairs
from dynemb.workspace import writable

_INDEX = ("rows", "slots", "num_buckets", "bucket_capacity", "max_buckets", "free_high_water", "free", "counters")
_ADMISSION = ("keys", "rows", "scores", "slots", "num_buckets", "bucket_capacity", "max_buckets", "free_high_water", "free", "counters", "counts", "rejections")
_TABLE = ("keys", "embeddings", "optimizer_state", "scores", "step", "optimizer_step", "last_timestamp", "counters", "generator_state")
_PER_TABLE = ("keys", "embeddings", "optimizer_state", "scores", "optimizer_step", "counters", "generator_state")
_GROUP_INDEX = ("keys", "scores", *_INDEX, "segment_buckets", "segment_counters")


def _tensor(state: dict, name: str, dtype: torch.dtype | None, shape: tuple | None) -> torch.Tensor:
    """state[name] checked for type, dtype and shape (None in shape: any size)."""
    value = state[name]
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"state entry '{name}' is a {type(value).__name__}, not a tensor")
    if dtype is not None and value.dtype != dtype:
        raise ValueError(f"state entry '{name}' has dtype {value.dtype}, expected {dtype}")
    if shape is not None and (value.dim() != len(shape) or any(s is not None and s != v for s, v in zip(shape, value.shape))):
        raise ValueError(f"state entry '{name}' has shape {tuple(value.shape)}, expected {tuple('*' if s is None else s for s in shape)}")
    return value


def load_own_entries(module, expected: list[str], load, state_dict, prefix, strict, missing_keys, unexpected_keys, error_msgs) -> None:
    """``_load_from_state_dict`` of a module whose state is entries of its own (no children):
    collect ``expected`` under ``prefix``, report missing / unexpected ones as torch does, and
    call ``load(entries)``, turning its ValueError into an error message (nothing changed)."""
    present = {name: state_dict[prefix + name] for name in expected if prefix + name in state_dict}
    missing = [prefix + name for name in expected if name not in present]
    missing_keys.extend(missing)
    if strict:
        known = set(expected)
        unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k[len(prefix) :] not in known)
    if missing:
        error_msgs.append(f"{type(module).__name__} at '{prefix}': missing entries {missing}; it was not changed")
        return
    try:
        load(present)
    except ValueError as e:
        error_msgs.append(f"{type(module).__name__} at '{prefix}': {e}; it was not changed")


def _table_rows(module, t: int) -> dict[str, torch.Tensor]:
    """One table's keys [K], embeddings [K, D], optimizer_state [K, S] and scores [K] (copies)."""
    engine, s, _ = module.location(module.table_names[t])
    chunks = list(engine.export(s, 1 << 20))
    D, S = engine.embedding_dim, engine.state_dim

    def cat(name: str, width: int | None, dtype: torch.dtype) -> torch.Tensor:
        if not chunks:
            return torch.empty(0, *(() if width is None else (width,)), dtype=dtype, device=engine.device)
        return torch.cat([c[name] for c in chunks]).to(dtype).clone()

    return {
        "keys": cat("keys", None, torch.int64),
        "embeddings": cat("embeddings", D, engine.dtype),
        "optimizer_state": cat("optimizer_state", S, engine.dtype),
        "scores": cat("scores", None, torch.int64),
    }


def _per_table(module, t: int, *, rows: bool = True) -> dict[str, torch.Tensor]:
    """The entries every table has, without prefix (rows unless ``rows=False``, step count,
    counters, generator, admission)."""
    c = module.table_counters(module.table_names[t])
    out = {
        **(_table_rows(module, t) if rows else {}),
        "optimizer_step": torch.tensor(c["optimizer_step"], dtype=torch.int64),
        "counters": torch.tensor([c["erased"], c["nonfinite_grads"]], dtype=torch.int64),
        "generator_state": c["generator"].get_state(),
    }
    if module.admissions[t] is not None:
        for k, v in module.admissions[t].state_dict().items():
            out[f"admission.{k}"] = v.clone()
    return out


def table_entries(table) -> dict[str, torch.Tensor]:
    """A DynamicTable's entries (lock held by the caller). Rows are listed in the index's slot
    order, so that ``index.rows`` pairs with them."""
    index = table.engine.index.state_dict()
    data = table.engine.gather(index["rows"])
    D = table.embedding_dim
    entry = _per_table(table, 0, rows=False)
    clock = table.clock()
    state = {
        "keys": index["keys"].clone(),
        "embeddings": data[:, :D].clone(),
        "optimizer_state": data[:, D:].clone(),
        "scores": index["scores"].clone(),
        "step": torch.tensor(clock["step"], dtype=torch.int64),
        "optimizer_step": entry["optimizer_step"],
        "last_timestamp": torch.tensor(clock["last_timestamp"], dtype=torch.int64),
        "counters": entry["counters"],
        "generator_state": entry["generator_state"],
    }
    for name in _INDEX:
        state["index." + name] = index[name].clone()
    state.update({k: v for k, v in entry.items() if k.startswith("admission.")})
    return state


def expected_table_entries(table) -> list[str]:
    names = list(_TABLE) + ["index." + n for n in _INDEX]
    if table.admission is not None:
        names += ["admission." + n for n in _ADMISSION]
    return names


def collection_entries(collection) -> dict[str, torch.Tensor]:
    """A collection's entries (lock held by the caller)."""
    clock = collection.clock()
    state = {"step": torch.tensor(clock["step"], dtype=torch.int64), "last_timestamp": torch.tensor(clock["last_timestamp"], dtype=torch.int64)}
    for t, name in enumerate(collection.table_names):
        state.update({f"{name}.{k}": v for k, v in _per_table(collection, t).items()})
    for g, engine in enumerate(collection.engines):
        for k, v in engine.index.state_dict().items():
            state[f"groups.{g}.index.{k}"] = v.clone()
    return state


def expected_collection_entries(collection) -> list[str]:
    names = ["step", "last_timestamp"]
    for t, name in enumerate(collection.table_names):
        names += [f"{name}.{e}" for e in _PER_TABLE]
        if collection.admissions[t] is not None:
            names += [f"{name}.admission.{e}" for e in _ADMISSION]
    for g in range(len(collection.engines)):
        names += [f"groups.{g}.index.{e}" for e in _GROUP_INDEX]
    return names


def _parse_table(module, t: int, state: dict, prefix: str) -> dict:
    """One table's entries under ``prefix``, checked: keys, whole rows [K, D+S], scores,
    optimizer_step, counters (erased, nonfinite_grads), generator state, admission state."""
    engine = module.engines[module.table_group[t][0]]
    D, S = engine.embedding_dim, engine.state_dim
    keys = _tensor(state, f"{prefix}keys", torch.int64, (None,))
    K = keys.numel()
    emb = _tensor(state, f"{prefix}embeddings", None, (K, None))
    opt = _tensor(state, f"{prefix}optimizer_state", None, (K, None))
    scores = _tensor(state, f"{prefix}scores", torch.int64, (K,))
    if emb.shape[1] != D or not emb.is_floating_point():
        raise ValueError(f"state entry '{prefix}embeddings' is [{K}, {emb.shape[1]}] {emb.dtype}; this table has embedding_dim={D}")
    if opt.shape[1] != S or not opt.is_floating_point():
        raise ValueError(
            f"state entry '{prefix}optimizer_state' has {opt.shape[1]} columns; this table's optimizer "
            f"({module.optimizer!r}) keeps {S} per row: load into a table with the same optimizer"
        )
    optimizer_step = int(_tensor(state, f"{prefix}optimizer_step", torch.int64, ()))
    if optimizer_step < 0:
        raise ValueError(f"state entry '{prefix}optimizer_step'={optimizer_step}: must be >= 0")
    counters = _tensor(state, f"{prefix}counters", torch.int64, (2,)).tolist()
    generator = _tensor(state, f"{prefix}generator_state", torch.uint8, (None,))
    if generator.numel() != engine.counters(0)["generator"].get_state().numel():
        raise ValueError(f"state entry '{prefix}generator_state' has {generator.numel()} bytes, not a {engine.device.type} generator state")
    if K and torch.unique(keys).numel() != K:
        raise ValueError(f"state entry '{prefix}keys' holds {K - torch.unique(keys).numel()} duplicate key(s)")
    values = torch.cat([emb, opt], 1)
    # Non-finite rows (nonfinite_grads='apply') load as they were saved, with a warning.
    warn_nonfinite(keys, values, f"state entries '{prefix}embeddings' / '{prefix}optimizer_state'")
    admission = {k[len(f"{prefix}admission.") :]: v for k, v in state.items() if k.startswith(f"{prefix}admission.")}
    return {
        "keys": keys,
        "values": values,
        "scores": scores,
        "optimizer_step": optimizer_step,
        "counters": counters,
        "generator": generator,
        "admission": admission,
    }


def rebuilt_engine(engine, parts: list[dict], index_state: dict[str, torch.Tensor] | None, *, now: int, names: list[str]):
    """A fresh engine like ``engine`` holding ``parts`` (one per table, in segment order: keys
    [K], whole rows ``values`` [K, D+S], ``scores`` [K]): placed exactly by ``index_state`` when
    it has the engine's geometry and holds exactly these keys, else re-inserted by score.
    Raises ValueError when keys do not fit."""
    # A DynamicTable's own row store is kept (nothing can fail once rows are written below).
    fresh = engine.fresh(share_store=True)
    device = fresh.device
    keys = torch.cat([p["keys"] for p in parts]).to(device)
    segs = torch.cat([torch.full((p["keys"].numel(),), s, dtype=torch.int64) for s, p in enumerate(parts)]).to(device)
    seg_arg = segs if fresh.segmented else None
    values = torch.cat([p["values"] for p in parts]).to(device=device, dtype=fresh.dtype)
    scores = torch.cat([p["scores"] for p in parts]).to(device)
    with writable():
        exact = index_state is not None and fresh.index.same_geometry(index_state)
        if exact:
            # Raises ValueError (leaving the index as it was) on bad slots, rows or free list.
            fresh.index.load_state_dict({k: v.to(device) for k, v in index_state.items()})
            rows, found = fresh.find(keys, seg_arg)
            if not bool(found.all()) or fresh.size() != keys.numel():
                exact, fresh = False, engine.fresh(share_store=True)
        if exact:
            fresh.store.reserve(fresh.index.free_list.high_water)
            bind_held(fresh.store, fresh.index, fresh.num_tables if fresh.segmented else None)
            fresh.store.scatter(rows, values)
        else:
            if fresh.segmented:
                (usegs, ukeys), inverse, _ = unique_pairs(segs, keys)
                order = torch.empty_like(inverse).index_copy_(0, inverse, torch.arange(keys.numel(), device=device))
            else:
                usegs, (ukeys, order) = None, torch.sort(keys)
            r = fresh.resolve(ukeys, usegs, train=True, now=now, scores=scores.index_select(0, order), init_rows=False)
            lost = r.failed_keys.numel() + r.evicted_keys.numel()
            if lost:
                capacity = [fresh.table_stats(s)["capacity"] for s in range(fresh.num_tables)]
                raise ValueError(
                    f"the state holds {keys.numel()} keys of tables {names} and {lost} of them do not fit "
                    f"(capacity={capacity}, bucket_capacity={fresh.configs[0].bucket_capacity}); load it into tables with a larger capacity"
                )
            fresh.store.scatter(r.rows, values.index_select(0, order))
        # Past the version of the engine it replaces: a backward in flight finds its keys again.
        fresh.version = engine.version + 1
        for s, p in enumerate(parts):
            fresh.set_counters(s, optimizer_step=p["optimizer_step"], nonfinite_grads=p["counters"][1], generator_state=p["generator"])
    return fresh


def _load(module, tables: dict[int, dict], index_states: list[dict | None], step: int, last_timestamp: int) -> None:
    """Rebuild every engine of ``module`` from parsed ``tables``, then swap everything in."""
    # A timestamp table's nanosecond scores (states of before docs/design/0036) in seconds.
    for t, parsed in tables.items():
        parsed["scores"] = loaded_scores(parsed["scores"], module.table_configs[t].score_strategy)
    for group, index_state in zip(module.groups, index_states):
        if index_state is not None and "scores" in index_state:
            index_state["scores"] = loaded_scores(index_state["scores"], module.table_configs[group.tables[0]].score_strategy)
    # Admission counters first (restored if anything below raises); the engines are rebuilt on
    # the side, a DynamicTable's into its own store, which nothing after the rebuild can fail.
    backups = []
    try:
        for t, adm in enumerate(module.admissions):
            if adm is not None:
                backups.append((adm, adm.state_dict()))
                adm.load_state_dict(tables[t]["admission"])
        fresh = [
            rebuilt_engine(engine, [tables[t] for t in group.tables], index_states[g], now=step, names=[module.table_names[t] for t in group.tables])
            for g, (group, engine) in enumerate(zip(module.groups, module.engines))
        ]
    except Exception:
        for adm, backup in backups:
            adm.load_state_dict(backup)
        raise
    for g, engine in enumerate(fresh):
        module.install_engine(g, engine)
    module.set_clock(step, last_timestamp)
    for t, name in enumerate(module.table_names):
        module.restore_table(name, erased=tables[t]["counters"][0], admission=module.admissions[t])


def _refuse_sharded(module) -> None:
    if any(e.collective for e in module.engines):
        # Each rank holds only its keys; a state_dict is one rank's: restoring a sharded table
        # goes through dynemb.checkpoint (every rank reads the keys it owns).
        raise ValueError("load_state_dict on a sharded table is not supported: use dynemb.checkpoint.save / load, which reshard by key")


def _clock(state: dict) -> tuple[int, int]:
    step, last = (int(_tensor(state, name, torch.int64, ())) for name in ("step", "last_timestamp"))
    for name, value in (("step", step), ("last_timestamp", last)):
        if value < 0:
            raise ValueError(f"state entry '{name}'={value}: must be >= 0")
    return step, last


def load_table_entries(table, state: dict[str, torch.Tensor]) -> None:
    """Restore a DynamicTable (lock held by the caller) from its entries; see the module docstring."""
    _refuse_sharded(table)
    step, last_timestamp = _clock(state)
    parsed = _parse_table(table, 0, state, "")
    index_state = {name[len("index.") :]: value for name, value in state.items() if name.startswith("index.")}
    index_state.update(keys=parsed["keys"], scores=parsed["scores"])
    _load(table, {0: parsed}, [index_state], step, last_timestamp)


def load_collection_entries(collection, state: dict[str, torch.Tensor]) -> None:
    """Restore a collection (lock held by the caller) from its entries; see the module docstring."""
    _refuse_sharded(collection)
    step, last_timestamp = _clock(state)
    tables = {t: _parse_table(collection, t, state, f"{name}.") for t, name in enumerate(collection.table_names)}
    index_states = [{k[len(f"groups.{g}.index.") :]: v for k, v in state.items() if k.startswith(f"groups.{g}.index.")} for g in range(len(collection.engines))]
    _load(collection, tables, index_states, step, last_timestamp)
