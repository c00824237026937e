"""Checkpoints of dynemb tables: one open format (docs/format.md), full and delta saves,
crash-safe commits, checked loads that work across index geometries.

K keys of a table, D embedding dim, S optimizer state columns.

    dynemb.checkpoint.save(model, "ckpt/full-000")
    dynemb.checkpoint.save_delta(model, "ckpt/delta-001", base="ckpt/full-000")
    dynemb.checkpoint.load(model, "ckpt/delta-001")        # follows the chain to the full save

Only dynemb tables are saved (every DynamicTable and every table of a collection in the module
tree); dense parameters stay with the user's own checkpointing (``torch.save(model.state_dict())``
minus the tables, or ``dense=True`` to store ``model``'s other state_dict entries too).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file

from dynemb._version import __version__
from dynemb.checkpoint import files as _files
from dynemb.checkpoint.tables import DTYPE_NAMES, DTYPES, Entry, config_json, entries, optimizer_json
from dynemb.errors import CheckpointError
from dynemb.nn.changes import ChangeLog
from dynemb.nn.functional import TableEngine
from dynemb.nn.group import GroupEngine
from dynemb.table.index import unique_pairs
from dynemb.workspace import writable

__all__ = ["CheckpointError", "load", "save", "save_delta"]

_DENSE = "dense.safetensors"


def _progress(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # progress bars are optional
        return None
    return tqdm(total=total, desc=desc, unit="rows", unit_scale=True, leave=False)


@contextlib.contextmanager
def _locked(es: list[Entry]):
    """Hold every table module's lock: the checkpoint is one consistent snapshot."""
    with contextlib.ExitStack() as stack:
        seen = set()
        for e in es:
            if id(e.module) not in seen:
                seen.add(id(e.module))
                stack.enter_context(e.lock)
        yield


def _dense_state(model: torch.nn.Module, es: list[Entry]) -> dict[str, torch.Tensor]:
    prefixes = tuple((e.module_path + ".") if e.module_path else "" for e in es)
    if "" in prefixes:
        return {}
    return {k: v for k, v in model.state_dict().items() if not k.startswith(prefixes)}


def _size(e: Entry) -> int:
    engine, s, _ = e.location
    return engine.index.size() if s is None else int(engine.index.segment_sizes()[s])


def _write_table(writer: _files.Writer, e: Entry, chunk_rows: int, *, delta: bool, layout: bool, bar) -> dict:
    engine, s, _ = e.location
    D = engine.embedding_dim
    folder = _files.table_dir(e.name)
    out_files, rows_total, tomb_total = [], 0, 0
    dirty = e.changes().dirty if delta else None
    layout_slots = []
    for k, (keys, rows, scores) in enumerate(e.export(chunk_rows)):
        if dirty is not None:
            e.changes().reserve(int(rows.max()) + 1 if rows.numel() else 0)
            dirty = e.changes().dirty
            m = dirty.index_select(0, rows)
            keys, rows, scores = keys[m], rows[m], scores[m]
        if keys.numel() == 0:
            continue
        stored = getattr(engine.store, "data", None)
        if isinstance(stored, torch.Tensor):
            # Two gathers from column views give contiguous blocks: no copy before writing.
            emb, opt = stored[:, :D].index_select(0, rows), stored[:, D:].index_select(0, rows)
        else:
            data = engine.store.gather(rows)
            emb, opt = data[:, :D], data[:, D:]
        out_files.append(
            writer.write_tensors(
                f"{folder}/rows-{k:06d}.safetensors",
                {"keys": keys, "embeddings": emb, "optimizer_state": opt, "scores": scores},
                "rows",
                keys.numel(),
            )
        )
        rows_total += keys.numel()
        if layout:
            seg = None if s is None else torch.full_like(keys, s)
            layout_slots.append(engine.index._locate(keys, seg)[0])
        if bar is not None:
            bar.update(keys.numel())
    if delta:
        left, segs = e.changes().left_keys()
        if segs is not None:
            left = left[segs == s]
        left = torch.unique(left)
        if left.numel():
            left = left[~e.find_rows(left)[1]]
        if left.numel():
            out_files.append(writer.write_tensors(f"{folder}/tombstones-000000.safetensors", {"keys": left}, "tombstones", left.numel()))
            tomb_total = left.numel()
    if layout:
        index = engine.index
        lay = {
            "slots": torch.cat(layout_slots) if layout_slots else torch.empty(0, dtype=torch.int64),
            "num_buckets": torch.tensor(index.num_buckets),
            "bucket_capacity": torch.tensor(index.bucket_capacity),
            "max_buckets": torch.tensor(index.max_buckets),
        }
        if s is not None:
            lay["segment_buckets"] = index.segment_buckets.clone()
            lay["segment"] = torch.tensor(s)
        out_files.append(writer.write_tensors(f"{folder}/layout.safetensors", lay, "layout"))
    if e.admission is not None:
        out_files.append(writer.write_tensors(f"{folder}/admission.safetensors", e.admission.state_dict(), "admission"))
    out_files.append(writer.write_tensors(f"{folder}/generator.safetensors", {"state": e.generator.get_state()}, "generator"))
    config = e.config
    return {
        "kind": "collection" if e.is_collection else "table",
        "module": e.module_path,
        "table": e.table,
        "embedding_dim": D,
        "state_dim": engine.state_dim,
        "dtype": DTYPE_NAMES[config.dtype],
        "config": config_json(config),
        "optimizer": optimizer_json(e.optimizer),
        "counters": e.counters(),
        "rows": rows_total,
        "tombstones": tomb_total,
        "files": out_files,
    }


def _save(model, path, *, delta_of: tuple[Path, dict] | None, chunk_rows: int, overwrite: bool, layout: bool, dense: bool, progress: bool) -> str:
    if not isinstance(chunk_rows, int) or isinstance(chunk_rows, bool) or chunk_rows < 1:
        raise ValueError(f"chunk_rows={chunk_rows!r}: must be an int >= 1")
    es = entries(model)
    if not es:
        raise ValueError(f"model={type(model).__name__}: holds no dynemb table to save")
    writer = _files.Writer(path, overwrite=overwrite)
    ckpt_id = _files.new_id()
    try:
        with _locked(es):
            if delta_of is not None:
                base_dir, base = delta_of
                stale = [e.name for e in es if getattr(e.module, "_checkpoint_id", None) != base["id"] or e.engine.changes is None]
                if stale:
                    raise CheckpointError(
                        f"tables {stale} do not track changes since this checkpoint (their last save or load was another one); "
                        "save_delta needs the checkpoint most recently saved or loaded by this model as base",
                        base_dir,
                    )
            bar = _progress(sum(_size(e) for e in es), "dynemb save", progress)
            tables = {
                e.name: _write_table(writer, e, chunk_rows, delta=delta_of is not None, layout=layout and delta_of is None, bar=bar) for e in es
            }
            if bar is not None:
                bar.close()
            manifest = {
                "format": _files.FORMAT,
                "format_version": _files.FORMAT_VERSION,
                "dynemb_version": __version__,
                "kind": "full" if delta_of is None else "delta",
                "id": ckpt_id,
                "base": None,
                "chain": [],
                "created": _files.now_iso(),
                "tables": tables,
            }
            if delta_of is not None:
                base_dir, base = delta_of
                manifest["base"] = {"id": base["id"], "path": os.path.relpath(base_dir.resolve(), Path(path).resolve().parent)}
                manifest["chain"] = [*base.get("chain", []), base["id"]]
            if dense:
                state = _dense_state(model, es)
                if state:
                    manifest["dense"] = writer.write_tensors(_DENSE, state, "dense")
            writer.commit(manifest)
            for e in es:
                e.changes().reset()
                e.module._checkpoint_id = ckpt_id
    except BaseException:
        writer.abort()
        raise
    return ckpt_id


def save(model: torch.nn.Module, path, *, chunk_rows: int = 1 << 16, overwrite: bool = False, layout: bool = True, dense: bool = False, progress: bool = False) -> str:
    """Write every dynemb table of ``model`` to the checkpoint directory ``path``.

    Args:
        model: any module tree holding DynamicTables or collections (itself may be one).
        path: directory to create (atomically: a killed save leaves no checkpoint there).
        chunk_rows: keys per rows file; memory used by a save is about one chunk.
        overwrite: replace an existing checkpoint at ``path``.
        layout: also store each key's index slot, so that a load into tables of the same
            geometry restores placement exactly (further training bitwise equal).
        dense: also store ``model``'s other state_dict entries (dense parameters).
        progress: show a progress bar (tqdm).
    Returns:
        The checkpoint's id. From now on the tables track their changes for :func:`save_delta`.
    """
    return _save(model, path, delta_of=None, chunk_rows=chunk_rows, overwrite=overwrite, layout=layout, dense=dense, progress=progress)


def save_delta(model: torch.nn.Module, path, *, base, chunk_rows: int = 1 << 16, overwrite: bool = False, dense: bool = False, progress: bool = False) -> str:
    """Write only what changed since ``base``: rows of keys touched or updated since then, and
    tombstones for keys that left (evicted or erased).

    Args:
        base: the checkpoint (full or delta) most recently saved or loaded by this model.
        Others: as :func:`save`.
    Returns:
        The delta's id.
    """
    base_dir = _files.resolve_dir(base)
    manifest = _files.read_manifest(base_dir)
    return _save(model, path, delta_of=(base_dir, manifest), chunk_rows=chunk_rows, overwrite=overwrite, layout=False, dense=dense, progress=progress)


# -- loading -----------------------------------------------------------------------------------


def chain_of(path) -> list[tuple[Path, dict]]:
    """(directory, manifest) of the full checkpoint and every delta up to ``path``, in order."""
    directory = _files.resolve_dir(path)
    manifest = _files.read_manifest(directory)
    chain = [(directory, manifest)]
    while manifest["kind"] == "delta":
        base = manifest.get("base")
        if not isinstance(base, dict) or not isinstance(base.get("path"), str) or not isinstance(base.get("id"), str):
            raise CheckpointError("delta manifest has no valid 'base' {id, path}", directory / _files.MANIFEST)
        base_dir = _files.resolve_dir((directory.parent / base["path"]).resolve())
        base_manifest = _files.read_manifest(base_dir)
        if base_manifest["id"] != base["id"]:
            raise CheckpointError(f"its base at {base_dir} has id {base_manifest['id']}, the delta expects {base['id']}", directory / _files.MANIFEST)
        if len(chain) > 10_000:
            raise CheckpointError("delta chain longer than 10000 (a cycle?)", directory)
        directory, manifest = base_dir, base_manifest
        chain.append((directory, manifest))
    chain.reverse()
    names = set(chain[0][1]["tables"])
    for d, m in chain[1:]:
        if set(m["tables"]) != names:
            raise CheckpointError(f"delta lists tables {sorted(m['tables'])}, its full checkpoint {sorted(names)}", d / _files.MANIFEST)
    return chain


def _read_table(chain: list[tuple[Path, dict]], name: str) -> dict:
    """Merge a table's rows over the chain: keys [K], values [K, D+S], scores [K] (sorted by key)."""
    first = chain[0][1]["tables"][name]
    D, S, dtype = first["embedding_dim"], first["state_dim"], DTYPES[first["dtype"]]
    keys = torch.empty(0, dtype=torch.int64)
    values = torch.empty(0, D + S, dtype=dtype)
    scores = torch.empty(0, dtype=torch.int64)
    for directory, manifest in chain:
        entry = manifest["tables"][name]
        if (entry["embedding_dim"], entry["state_dim"], entry["dtype"]) != (D, S, first["dtype"]):
            raise CheckpointError(f"table {name!r}: embedding_dim / state_dim / dtype change along the delta chain", directory / _files.MANIFEST)
        new_k, new_v, new_s, tomb = [], [], [], []
        for f in entry["files"]:
            if f["role"] == "rows":
                n = f["rows"]
                t = _files.read_tensors(
                    directory, f, {"keys": (torch.int64, (n,)), "embeddings": (dtype, (n, D)), "optimizer_state": (dtype, (n, S)), "scores": (torch.int64, (n,))}
                )
                new_k.append(t["keys"])
                new_v.append(torch.cat([t["embeddings"], t["optimizer_state"]], 1))
                new_s.append(t["scores"])
            elif f["role"] == "tombstones":
                tomb.append(_files.read_tensors(directory, f, {"keys": (torch.int64, (f["rows"],))})["keys"])
        add_k = torch.cat(new_k) if new_k else keys[:0]
        if torch.unique(add_k).numel() != add_k.numel():
            raise CheckpointError(f"table {name!r}: a key appears twice in its rows files", directory)
        # A sum is finite when every value is (overflow of finite values is checked exactly).
        if not all(bool(torch.isfinite(v.sum())) or bool(torch.isfinite(v).all()) for v in new_v):
            raise CheckpointError(f"table {name!r}: rows hold non-finite values", directory)
        drop = torch.cat([*tomb, add_k]) if tomb else add_k
        if drop.numel() and keys.numel():
            keep = ~torch.isin(keys, drop)
            keys, values, scores = keys[keep], values[keep], scores[keep]
        if new_k:
            keys = torch.cat([keys, add_k])
            values = torch.cat([values, *new_v])
            scores = torch.cat([scores, *new_s])
    order = torch.argsort(keys)
    last_dir, last = chain[-1]
    entry = last["tables"][name]
    extra = {}
    for f in entry["files"]:
        if f["role"] == "admission":
            try:
                extra["admission"] = load_file(last_dir / f["path"])
            except Exception as e:  # safetensors raises several types
                raise CheckpointError(f"not a readable safetensors file ({e})", last_dir / f["path"]) from None
        elif f["role"] == "generator":
            extra["generator"] = _files.read_tensors(last_dir, f, {"state": (torch.uint8, (None,))})["state"]
        elif f["role"] == "layout" and len(chain) == 1:
            try:
                extra["layout"] = load_file(last_dir / f["path"])
            except Exception as e:
                raise CheckpointError(f"not a readable safetensors file ({e})", last_dir / f["path"]) from None
    if "layout" in extra:
        slots = extra["layout"].get("slots")
        if isinstance(slots, torch.Tensor) and slots.shape == order.shape:
            extra["layout"]["slots"] = slots[order]
        else:
            del extra["layout"]
    return {
        "keys": keys[order],
        "values": values[order],
        "scores": scores[order],
        "entry": entry,
        "D": D,
        "S": S,
        **extra,
    }


def _counter(entry: dict, name: str, path) -> int:
    v = entry["counters"].get(name)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise CheckpointError(f"counter '{name}'={v!r} must be an int >= 0", path)
    return v


def _layout_state(engine, parts: list[tuple[int | None, dict]], index_counters) -> dict | None:
    """An index state_dict placing every key at its saved slot, or None if the layout does not
    apply (missing, or another geometry). parts: (segment, table data) of every table of the engine."""
    index = engine.index
    keys, slots, scores = [], [], []
    for seg, data in parts:
        lay = data.get("layout")
        if lay is None:
            return None
        try:
            geometry = (int(lay["num_buckets"]), int(lay["bucket_capacity"]), int(lay["max_buckets"]))
            if seg is not None and (lay["segment_buckets"].tolist() != index.segment_buckets.tolist() or int(lay["segment"]) != seg):
                return None
        except (KeyError, RuntimeError, ValueError):
            return None
        if lay["slots"].shape != data["keys"].shape:
            return None
        keys.append(data["keys"])
        slots.append(lay["slots"])
        scores.append(data["scores"])
    K = sum(k.numel() for k in keys)
    state = {
        "keys": torch.cat(keys),
        "rows": torch.arange(K),
        "scores": torch.cat(scores),
        "slots": torch.cat(slots),
        "num_buckets": torch.tensor(geometry[0]),
        "bucket_capacity": torch.tensor(geometry[1]),
        "max_buckets": torch.tensor(geometry[2]),
        "free_high_water": torch.tensor(K),
        "free": torch.empty(0, dtype=torch.int64),
        "counters": torch.tensor(index_counters, dtype=torch.int64),
    }
    if parts[0][0] is not None:
        state["segment_buckets"] = index.segment_buckets.cpu().clone()
        state["segment_counters"] = index._segment_stats.cpu().clone()
    state = {k: v.to(index.device) for k, v in state.items()}
    return state if index.same_geometry(state) else None


def _build_engine(sample: Entry, parts: list[tuple[int | None, dict, Entry]], *, optimizer_state: bool, on_overflow: str, use_layout: bool) -> tuple[object, dict]:
    """A fresh engine for one DynamicTable or one collection group, filled with ``parts``
    (segment, data, entry); returns it and the keys dropped per table."""
    engine = sample.engine
    fresh = TableEngine(engine.config, engine.optimizer) if isinstance(engine, TableEngine) else GroupEngine(engine.configs, engine.optimizer)
    device = fresh.device
    D = fresh.embedding_dim
    dropped = {}
    keys = torch.cat([d["keys"] for _, d, _ in parts]).to(device)
    segs = torch.cat([torch.full((d["keys"].numel(),), 0 if s is None else s, dtype=torch.int64) for s, d, _ in parts]).to(device)
    values = torch.cat([d["values"] if optimizer_state else d["values"][:, :D] for _, d, _ in parts]).to(device=device, dtype=fresh.store.dtype)
    scores = torch.cat([d["scores"] for _, d, _ in parts]).to(device)
    with writable():
        state = None
        if use_layout:
            if isinstance(fresh, TableEngine):
                c = parts[0][1]["entry"]["counters"].get("index", [0, 0, 0, 0])
            else:
                c = [0, 0, 0, 0]
            state = _layout_state(fresh, [(s, d) for s, d, _ in parts], c)
        if state is not None:
            fresh.index.load_state_dict(state)
            fresh.store.reserve(keys.numel())
            rows = torch.arange(keys.numel(), device=device)
            if values.shape[1] != fresh.width:
                fresh.store.scatter(rows, fresh.new_rows(keys) if isinstance(fresh, TableEngine) else fresh.new_rows(keys, segs))
            fresh.store.scatter(rows, values)
        elif keys.numel():
            if isinstance(fresh, TableEngine):
                order = torch.argsort(keys)
                k, sc = keys.index_select(0, order), scores.index_select(0, order)
                r = fresh.resolve(k, train=True, now=0, scores=sc, init_rows=values.shape[1] != fresh.width)
                failed_segs = torch.zeros_like(r.failed_keys)
            else:
                (us, k), inverse, _ = unique_pairs(segs, keys)
                order = torch.empty_like(inverse).index_copy_(0, inverse, torch.arange(keys.numel(), device=device))
                r = fresh.resolve(k, us, train=True, now=0, scores=scores.index_select(0, order), init_rows=values.shape[1] != fresh.width)
                failed_segs = r.failed_segments
            lost = r.failed_keys.numel() + r.evicted_keys.numel()
            if lost and on_overflow != "evict":
                names = [e.name for _, _, e in parts]
                raise CheckpointError(
                    f"{lost} of the {keys.numel()} keys of tables {names} do not fit (capacity or bucket overflow); "
                    "load into larger tables, or pass on_overflow='evict' to keep the highest-scored keys"
                )
            ok = r.ok.nonzero().squeeze(1)
            fresh.store.scatter(r.rows.index_select(0, ok), values.index_select(0, order).index_select(0, ok))
            for s, _, e in parts:
                dropped[e.name] = int((failed_segs == (0 if s is None else s)).sum()) if lost else 0
        fresh.version += 1
    for _, _, e in parts:
        dropped.setdefault(e.name, 0)
    return fresh, dropped


def load(
    model: torch.nn.Module,
    path,
    *,
    strict: bool = True,
    optimizer_state: bool = True,
    owns: Callable[[torch.Tensor], torch.Tensor] | None = None,
    on_overflow: str = "raise",
    verify: bool = True,
    dense: bool = False,
    progress: bool = False,
) -> dict[str, dict[str, int]]:
    """Load a checkpoint (full, or a delta with its chain) into the dynemb tables of ``model``.

    Every file is checked against its manifest first (size, SHA-256, tensors, no extra files);
    any problem raises :class:`dynemb.CheckpointError` naming the file before a table changes.
    Tables of the same geometry get their exact placement back (full checkpoints); others get
    their keys re-inserted by score.

    Args:
        strict: the model's tables and the checkpoint's must be the same set (by name).
        optimizer_state: also load optimizer state (``False``: fresh state of the model's
            optimizer, e.g. to fine-tune with another one; step counts restart at 0).
        owns: ``owns(keys [K]) -> Tensor[bool] [K]``: load only the keys it accepts (a shard).
        on_overflow: ``"raise"`` (default) when keys do not fit a table, or ``"evict"`` to keep
            the highest-scored ones (the count dropped is in the returned report).
        verify: check SHA-256 of every file (size and tensor checks always run).
        dense: also load the dense entries saved with ``save(..., dense=True)``.
        progress: show a progress bar.
    Returns:
        Per table name: ``{"rows": loaded, "dropped": dropped}``.
    """
    if on_overflow not in ("raise", "evict"):
        raise ValueError(f"on_overflow={on_overflow!r}: must be 'raise' or 'evict'")
    chain = chain_of(path)
    bar = _progress(len(chain), "dynemb verify", progress)
    for directory, manifest in chain:
        if verify:
            _files.verify_files(directory, manifest)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    last_dir, last = chain[-1]
    es = entries(model)
    by_name = {e.name: e for e in es}
    names = set(last["tables"])
    if strict and set(by_name) != names:
        raise CheckpointError(
            f"tables differ: missing from the checkpoint {sorted(set(by_name) - names)}, not in the model {sorted(names - set(by_name))} "
            "(pass strict=False to load the common ones)",
            last_dir,
        )
    data = {}
    for name in sorted(names & set(by_name)):
        e = by_name[name]
        d = _read_table(chain, name)
        engine = e.engine
        if d["D"] != engine.embedding_dim:
            raise CheckpointError(f"table {name!r} has embedding_dim {d['D']}, the model's {engine.embedding_dim}", last_dir)
        if optimizer_state:
            saved = d["entry"].get("optimizer") or {}
            mine = type(e.optimizer).__name__ if e.optimizer is not None else None
            if d["S"] != engine.state_dim or saved.get("type") != mine:
                raise CheckpointError(
                    f"table {name!r} was saved with optimizer {saved.get('type')} ({d['S']} state columns); the model's is {mine} "
                    f"({engine.state_dim}): pass optimizer_state=False to load embeddings only",
                    last_dir,
                )
        if owns is not None:
            mask = owns(d["keys"])
            if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.shape != d["keys"].shape:
                raise ValueError(f"owns(keys) must return a bool tensor of shape {tuple(d['keys'].shape)}, got {mask!r}")
            d["keys"], d["values"], d["scores"] = d["keys"][mask], d["values"][mask], d["scores"][mask]
        for c in ("step", "optimizer_step", "last_timestamp", "erased", "nonfinite_grads"):
            _counter(d["entry"], c, last_dir)
        data[name] = d
    dense_state = None
    if dense:
        if "dense" not in last:
            raise CheckpointError("dense=True but the checkpoint holds no dense state (saved without dense=True)", last_dir)
        dense_state = _files.read_tensors(last_dir, last["dense"], {k: (None, None) for k in load_file(last_dir / last["dense"]["path"])})

    # Build every engine first; nothing in the model changes until all of them fit.
    use_layout = len(chain) == 1 and owns is None
    plans = []  # (module, engine index or None, fresh engine, parts)
    report = {}
    with _locked(es):
        groups: dict[int, list[Entry]] = {}
        for e in es:
            groups.setdefault(id(e.engine), []).append(e)
        for members in groups.values():
            if not any(e.name in data for e in members):
                continue
            parts = []
            for e in members:
                engine, s, _ = e.location
                if e.name in data:
                    parts.append((s, data[e.name], e))
                else:
                    # Not in the checkpoint (strict=False): keep its current rows.
                    chunks = list(e.export(1 << 20))
                    k = torch.cat([c[0] for c in chunks]).cpu() if chunks else torch.empty(0, dtype=torch.int64)
                    rows = torch.cat([c[1] for c in chunks]) if chunks else torch.empty(0, dtype=torch.int64)
                    sc = torch.cat([c[2] for c in chunks]).cpu() if chunks else torch.empty(0, dtype=torch.int64)
                    vals = engine.store.gather(rows.to(engine.device)).cpu()
                    parts.append((s, {"keys": k, "values": vals if optimizer_state else vals[:, : engine.embedding_dim], "scores": sc}, e))
            fresh, dropped = _build_engine(members[0], parts, optimizer_state=optimizer_state, on_overflow=on_overflow, use_layout=use_layout and all(e.name in data for e in members))
            plans.append((members, fresh, parts))
            for _, d, e in parts:
                if e.name in data:
                    report[e.name] = {"rows": int(d["keys"].numel()) - dropped[e.name], "dropped": dropped[e.name]}
        if dense_state is not None:
            missing, unexpected = model.load_state_dict(dense_state, strict=False)
            del missing, unexpected
        # Swap in.
        for members, fresh, parts in plans:
            _install(members, fresh, parts, data, optimizer_state)
        for e in es:
            if e.name in data or not strict:
                e.module._checkpoint_id = last["id"]
            changes = e.engine.changes
            if changes is None:
                e.engine.changes = ChangeLog(0, e.engine.device)
    return report


def _install(members: list[Entry], fresh, parts, data: dict, optimizer_state: bool) -> None:
    first = members[0]
    module = first.module
    for s, d, e in parts:
        if e.name not in data:
            continue
        c = d["entry"]["counters"]
        gen = d.get("generator")
        if first.table is None:
            fresh.optimizer_step = c["optimizer_step"] if optimizer_state else 0
            fresh.nonfinite_grads = c["nonfinite_grads"]
            if gen is not None:
                fresh.initializer.generator.set_state(gen)
            idx = c.get("index")
            if isinstance(idx, list) and len(idx) == 4:
                fresh.index._stats.update(dict(zip(("inserts", "evictions", "failed_inserts", "growths"), idx)))
            module.step = c["step"]
            module._last_timestamp = c["last_timestamp"]
            module._erased = c["erased"]
        else:
            _, _, t = e.location
            fresh.optimizer_steps[s] = c["optimizer_step"] if optimizer_state else 0
            fresh.nonfinite_grads[s] = c["nonfinite_grads"]
            if gen is not None:
                fresh.initializers[s].generator.set_state(gen)
            idx = c.get("index")
            if isinstance(idx, list) and len(idx) == 4:
                fresh.index._segment_stats[:, s] = torch.tensor(idx, device=fresh.device)
            module.step = c["step"]
            module._last_timestamp = c["last_timestamp"]
            module._erased[t] = c["erased"]
        adm = d.get("admission")
        if e.admission is not None and adm is not None:
            e.admission.load_state_dict(adm)
    if first.table is None:
        module.engine = fresh
        if getattr(module, "_pending", None) is not None:
            module._pending.clear()
    else:
        g = module.engines.index(first.engine)
        module.engines[g] = fresh
        if getattr(module, "_pending", None) is not None:
            module._pending[g].clear()
