"""state_dict of a collection: per table its keys and rows, per group its index (exact restore).

K keys of a table, D its embedding dim, S optimizer state columns.

Entries (plain tensors, ``torch.load(weights_only=True)``):

* ``step``, ``last_timestamp``: 0-d int64, the collection's clock;
* per table ``<name>.keys`` [K] int64, ``<name>.embeddings`` [K, D], ``<name>.optimizer_state``
  [K, S], ``<name>.scores`` [K] int64, ``<name>.optimizer_step`` 0-d, ``<name>.counters`` [2]
  (erased, nonfinite_grads), ``<name>.generator_state`` (uint8), ``<name>.admission.*`` (tables
  with admission, as a DynamicTable's);
* per group ``groups.<g>.index.*``: the segmented index's own state.

Loading restores a group exactly (slots, row ids, free list) when its index state has this
collection's geometry, so further training is bitwise that of the saved collection; otherwise
every table's keys are re-inserted with their scores. Everything is built on fresh engines and
swapped in at the end: a state that does not fit raises ValueError and changes nothing.
"""

from __future__ import annotations

import torch

from dynemb.nn.functional import warn_nonfinite
from dynemb.nn.group import GroupEngine
from dynemb.nn.state import _tensor
from dynemb.workspace import writable

_TABLE_ENTRIES = ("keys", "embeddings", "optimizer_state", "scores", "optimizer_step", "counters", "generator_state")
_ADMISSION_ENTRIES = ("keys", "rows", "scores", "slots", "num_buckets", "bucket_capacity", "max_buckets", "free_high_water", "free", "counters", "counts", "rejections")
_INDEX_ENTRIES = (
    "keys", "rows", "scores", "slots", "num_buckets", "bucket_capacity", "max_buckets", "free_high_water", "free", "counters",
    "segment_buckets", "segment_counters",
)  # fmt: skip


def expected_entries(collection) -> list[str]:
    names = ["step", "last_timestamp"]
    for t, name in enumerate(collection.table_names):
        names += [f"{name}.{e}" for e in _TABLE_ENTRIES]
        if collection.admissions[t] is not None:
            names += [f"{name}.admission.{e}" for e in _ADMISSION_ENTRIES]
    for g in range(len(collection.engines)):
        names += [f"groups.{g}.index.{e}" for e in _INDEX_ENTRIES]
    return names


def _cat(chunks: list[dict], name: str, width: int | None) -> torch.Tensor:
    """One export entry over every chunk ([K] or [K, width]; empty when there is no chunk)."""
    if chunks:
        return torch.cat([c[name] for c in chunks])
    return torch.empty(0, *(() if width is None else (width,)))


def collection_state(collection) -> dict[str, torch.Tensor]:
    """Every entry of the collection's state_dict (without prefix)."""
    with collection._lock:
        state = {
            "step": torch.tensor(collection.step, dtype=torch.int64),
            "last_timestamp": torch.tensor(collection._last_timestamp, dtype=torch.int64),
        }
        for t, name in enumerate(collection.table_names):
            engine, s, _ = collection._engine_of(name)
            chunks = list(engine.export(s, 1 << 20))
            D = engine.embedding_dim
            state[f"{name}.keys"] = _cat(chunks, "keys", None).to(torch.int64).clone()
            state[f"{name}.embeddings"] = _cat(chunks, "embeddings", D).to(engine.dtype).clone()
            state[f"{name}.optimizer_state"] = _cat(chunks, "optimizer_state", engine.state_dim).to(engine.dtype).clone()
            state[f"{name}.scores"] = _cat(chunks, "scores", None).to(torch.int64).clone()
            state[f"{name}.optimizer_step"] = torch.tensor(engine.optimizer_steps[s], dtype=torch.int64)
            state[f"{name}.counters"] = torch.tensor([collection._erased[t], engine.nonfinite_grads[s]], dtype=torch.int64)
            state[f"{name}.generator_state"] = engine.initializers[s].generator.get_state()
            if collection.admissions[t] is not None:
                for k, v in collection.admissions[t].state_dict().items():
                    state[f"{name}.admission.{k}"] = v.clone()
        for g, engine in enumerate(collection.engines):
            for k, v in engine.index.state_dict().items():
                state[f"groups.{g}.index.{k}"] = v.clone()
    return state


def load_collection_state(collection, state: dict[str, torch.Tensor]) -> None:
    """Restore ``collection`` (lock held by the caller) from its entries; see the module docstring."""
    if any(getattr(e, "collective", False) for e in collection.engines):
        # Each rank holds only its keys; a state_dict is one rank's: restoring a sharded table
        # goes through dynemb.checkpoint (every rank reads the keys it owns).
        raise ValueError("load_state_dict on a sharded table is not supported: use dynemb.checkpoint.save / load, which reshard by key")
    step = int(_tensor(state, "step", torch.int64, ()))
    last_timestamp = int(_tensor(state, "last_timestamp", torch.int64, ()))
    tables = {}
    for t, name in enumerate(collection.table_names):
        engine, s, _ = collection._engine_of(name)
        D, S = engine.embedding_dim, engine.state_dim
        keys = _tensor(state, f"{name}.keys", torch.int64, (None,))
        K = keys.numel()
        emb = _tensor(state, f"{name}.embeddings", None, (K, D))
        opt = _tensor(state, f"{name}.optimizer_state", None, (K, S))
        scores = _tensor(state, f"{name}.scores", torch.int64, (K,))
        if not emb.is_floating_point() or not opt.is_floating_point():
            raise ValueError(f"state entries '{name}.embeddings' / '{name}.optimizer_state' must be floating point")
        if K and torch.unique(keys).numel() != K:
            raise ValueError(f"state entry '{name}.keys' holds duplicate keys")
        # Non-finite rows (nonfinite_grads='apply') load as they were saved, with a warning.
        warn_nonfinite(keys, torch.cat([emb, opt], 1), f"state entries '{name}.embeddings' / '{name}.optimizer_state'")
        optimizer_step = int(_tensor(state, f"{name}.optimizer_step", torch.int64, ()))
        counters = _tensor(state, f"{name}.counters", torch.int64, (2,)).tolist()
        generator = _tensor(state, f"{name}.generator_state", torch.uint8, (None,))
        admission = {k[len(f"{name}.admission.") :]: v for k, v in state.items() if k.startswith(f"{name}.admission.")}
        tables[t] = (keys, torch.cat([emb, opt], 1), scores, optimizer_step, counters, generator, admission)

    new_engines = []
    with writable():
        for g, (group, engine) in enumerate(zip(collection._groups, collection.engines)):
            fresh = GroupEngine(engine.configs, engine.optimizer)
            device = fresh.device
            index_state = {k[len(f"groups.{g}.index.") :]: v.to(device) for k, v in state.items() if k.startswith(f"groups.{g}.index.")}
            keys = torch.cat([tables[t][0] for t in group.tables]).to(device)
            segs = torch.cat([torch.full((tables[t][0].numel(),), s, dtype=torch.int64) for s, t in enumerate(group.tables)]).to(device)
            values = torch.cat([tables[t][1] for t in group.tables]).to(device=device, dtype=fresh.dtype)
            scores = torch.cat([tables[t][2] for t in group.tables]).to(device)
            exact = fresh.index.same_geometry(index_state)
            if exact:
                fresh.index.load_state_dict(index_state)
                rows, found = fresh.index.find(keys, segments=segs)
                if not bool(found.all()) or fresh.index.size() != keys.numel():
                    exact = False
                    fresh = GroupEngine(engine.configs, engine.optimizer)
            if exact:
                fresh.store.reserve(fresh.index.free_list.high_water)
                fresh.store.scatter(rows, values)
            else:
                from dynemb.table.index import unique_pairs

                (usegs, ukeys), inverse, _ = unique_pairs(segs, keys)
                order = torch.empty_like(inverse).index_copy_(0, inverse, torch.arange(keys.numel(), device=device))
                r = fresh.resolve(ukeys, usegs, train=True, now=step, scores=scores.index_select(0, order), init_rows=False)
                lost = r.failed_keys.numel() + r.evicted_keys.numel()
                if lost:
                    names = [collection.table_names[t] for t in group.tables]
                    raise ValueError(f"{lost} of the {keys.numel()} keys of tables {names} do not fit this collection's capacities; load into larger tables")
                fresh.store.scatter(r.rows, values.index_select(0, order))
            for s, t in enumerate(group.tables):
                fresh.optimizer_steps[s] = tables[t][3]
                fresh.nonfinite_grads[s] = tables[t][4][1]
                fresh.initializers[s].generator.set_state(tables[t][5])
            new_engines.append(fresh)
        backups = []
        try:
            for t, adm in enumerate(collection.admissions):
                if adm is not None:
                    backups.append((adm, adm.state_dict()))
                    adm.load_state_dict(tables[t][6])
        except Exception:
            for adm, backup in backups:
                adm.load_state_dict(backup)
            raise
    collection.engines = new_engines
    collection.step = step
    collection._last_timestamp = last_timestamp
    collection._erased = [tables[t][4][0] for t in range(len(collection.table_names))]
