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
from dynemb.checkpoint import leftovers
from dynemb.checkpoint.tables import DTYPE_NAMES, DTYPES, Entry, config_json, entries, optimizer_json
from dynemb.errors import CheckpointError
from dynemb.nn.admission import FrequencyAdmission
from dynemb.nn.functional import warn_nonfinite, warn_nonfinite_keys
from dynemb.table.exact import place_exact, state_from_layout, state_from_slots
from dynemb.table.index import unique_pairs
from dynemb.workspace import writable

__all__ = ["CheckpointError", "load", "save", "save_delta"]

_DENSE = "dense.safetensors"
# The old name of the index's exact placement, still imported by tests/checkpoint/test_warm_start.py.
_place_exact = place_exact


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


def _write_table(writer: _files.Writer, e: Entry, chunk_rows: int, *, delta: bool, layout: bool, bar, rank: int | None = None) -> dict:
    """Write one table's files; ``rank``: this rank's part of a sharded save (its keys, files
    named ``rows-r<rank>-<k>``; rank 0 also writes the generator)."""
    engine, s, _ = e.location
    D = engine.embedding_dim
    folder = _files.table_dir(e.name)
    out_files, rows_total, tomb_total = [], 0, 0
    tag = "" if rank is None else f"r{rank:05d}-"
    dirty = e.changes().dirty if delta else None
    layout_slots = []
    nonfinite: list[torch.Tensor] = []
    stored = getattr(engine.store, "data", None)
    # Rows are gathered into a ring of reused blocks (fresh ones would cost a page fault per 4
    # KiB, more than the gather itself): a block is refilled once its file is hashed, and the
    # writer keeps at most two files waiting for the hasher, so three blocks never wait.
    ring: list[tuple[torch.Tensor, torch.Tensor, dict | None]] = []
    for k, (keys, rows, scores, slots) in enumerate(e.export_slots(chunk_rows)):
        if dirty is not None:
            m = dirty.index_select(0, rows)
            keys, rows, scores, slots = keys[m], rows[m], scores[m], slots[m]
        n = keys.numel()
        if n == 0:
            continue
        if isinstance(stored, torch.Tensor):
            if len(ring) < 3:
                width = min(chunk_rows, _size(e))
                ring.append((stored.new_empty(width, D), stored.new_empty(width, stored.shape[1] - D), None))
            emb_block, opt_block, previous = ring.pop(0)
            if previous is not None:
                writer.wait_hashed(previous)
            emb, opt = emb_block[:n], opt_block[:n]
            # Two gathers from column views give contiguous blocks: no copy before writing.
            torch.index_select(stored[:, :D], 0, rows, out=emb)
            torch.index_select(stored[:, D:], 0, rows, out=opt)
        else:
            data = engine.store.gather(rows)
            emb, opt = data[:, :D], data[:, D:]
        # Non-finite rows (nonfinite_grads='apply') are written as they are; load reads them.
        if not (bool(torch.isfinite(emb.sum())) and bool(torch.isfinite(opt.sum()))):
            nonfinite.append(keys[~(torch.isfinite(emb).all(1) & torch.isfinite(opt).all(1))])
        entry = writer.write_tensors(
            f"{folder}/rows-{tag}{k:06d}.safetensors",
            {"keys": keys, "embeddings": emb, "optimizer_state": opt, "scores": scores},
            "rows",
            n,
        )
        if isinstance(stored, torch.Tensor):
            ring.append((emb_block, opt_block, entry))
        out_files.append(entry)
        rows_total += n
        if layout:
            layout_slots.append(slots)
        if bar is not None:
            bar.update(keys.numel())
    # (A sum of large finite values can overflow: only keys the exact check found count.)
    nonfinite_keys = torch.cat(nonfinite) if nonfinite else None
    if nonfinite_keys is not None and nonfinite_keys.numel():
        warn_nonfinite_keys(nonfinite_keys, f"saving table {e.name!r}")
    if delta:
        left, segs = e.changes().left_keys()
        if segs is not None:
            left = left[segs == s]
        left = torch.unique(left)
        if left.numel():
            left = left[~e.find_rows(left)[1]]
        if left.numel():
            out_files.append(writer.write_tensors(f"{folder}/tombstones-{tag}000000.safetensors", {"keys": left}, "tombstones", left.numel()))
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
    if not rank:
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


def _comm_of(es: list[Entry]):
    """The Comm of a sharded model's tables (None when unsharded); all or none must be sharded."""
    of = [e.engine.comm if e.engine.collective else None for e in es]
    comms = {id(c): c for c in of}
    if len(comms) == 1:
        return next(iter(comms.values()))
    found = [c for c in comms.values() if c is not None]
    if None in comms.values() or any((c.rank, c.world_size) != (found[0].rank, found[0].world_size) for c in found):
        raise ValueError("model: some dynemb tables are sharded and others not (or over other groups); shard all of them with one shard() call")
    return found[0]


def _merge_tables(parts: list[dict]) -> dict:
    """One manifest's tables from every rank's entries of a sharded save (rank 0's first)."""
    merged = {}
    for name, first in parts[0].items():
        entry = dict(first)
        ranks = [p[name] for p in parts]
        entry["files"] = [f for r in ranks for f in r["files"]]
        entry["rows"] = sum(r["rows"] for r in ranks)
        entry["tombstones"] = sum(r["tombstones"] for r in ranks)
        counters = dict(first["counters"])
        for c in ("step", "optimizer_step", "last_timestamp"):
            counters[c] = max(r["counters"][c] for r in ranks)
        for c in ("erased", "nonfinite_grads"):
            counters[c] = sum(r["counters"][c] for r in ranks)
        counters["index"] = [sum(v) for v in zip(*(r["counters"]["index"] for r in ranks))]
        entry["counters"] = counters
        config = dict(first["config"])
        if isinstance(config.get("capacity"), int):
            # The table's capacity over all ranks (each rank holds capacity // world size).
            config["capacity"] = sum(r["config"]["capacity"] for r in ranks)
        entry["config"] = config
        merged[name] = entry
    return merged


def _save(model, path, *, delta_of: tuple[Path, dict] | None, chunk_rows: int, overwrite: bool, layout: bool, dense: bool, progress: bool) -> str:
    if not isinstance(chunk_rows, int) or isinstance(chunk_rows, bool) or chunk_rows < 1:
        raise ValueError(f"chunk_rows={chunk_rows!r}: must be an int >= 1")
    es = entries(model)
    if not es:
        raise ValueError(f"model={type(model).__name__}: holds no dynemb table to save")
    # A sharded model saves from every rank: rank 0 makes the temporary directory and writes the
    # manifest, every rank writes its own keys' files into it (docs/format.md, "Sharded saves").
    comm = _comm_of(es)
    rank = None if comm is None else comm.rank
    writer, ckpt_id, error = None, _files.new_id(), None
    if not rank:
        try:
            writer = _files.Writer(path, overwrite=overwrite)
        except BaseException as err:
            if comm is None:
                raise
            error = err
    if comm is not None:
        tmp, ckpt_id, problem = comm.all_gather_object((None if writer is None else str(writer.tmp), ckpt_id, repr(error) if error else None))[0]
        if error is not None:
            raise error
        if problem is not None:
            raise RuntimeError(f"dynemb.checkpoint: rank 0 could not start the save to {path}: {problem}")
        if rank:
            writer = _files.Writer(path, overwrite=overwrite, tmp=Path(tmp))
        layout = False  # a rank's slots mean nothing at another world size
    try:
        with _locked(es):
            problem = None
            try:
                if delta_of is not None:
                    base_dir, base = delta_of
                    stale = [e.name for e in es if e.module.checkpoint_id != base["id"] or e.engine.changes is None]
                    if stale:
                        raise CheckpointError(
                            f"tables {stale} do not track changes since this checkpoint (their last save or load was another one); "
                            "save_delta needs the checkpoint most recently saved or loaded by this model as base",
                            base_dir,
                        )
                bar = _progress(sum(_size(e) for e in es), "dynemb save", progress)
                tables = {
                    e.name: _write_table(writer, e, chunk_rows, delta=delta_of is not None, layout=layout and delta_of is None, bar=bar, rank=rank) for e in es
                }
                if bar is not None:
                    bar.close()
                writer.finish()
            except BaseException as err:
                if comm is None:
                    raise
                problem, tables = err, None
            if comm is not None:
                parts = comm.all_gather_object((tables, None if problem is None else f"{type(problem).__name__}: {problem}"))
                failed = [(r, p[1]) for r, p in enumerate(parts) if p[1] is not None]
                if problem is not None:
                    raise problem
                if failed:
                    raise RuntimeError(f"dynemb.checkpoint: the save failed on rank {failed[0][0]}: {failed[0][1]}")
                tables = _merge_tables([p[0] for p in parts])
            committed = None
            if not rank:
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
                if comm is not None:
                    manifest["world_size"] = comm.world_size
                if delta_of is not None:
                    base_dir, base = delta_of
                    manifest["base"] = {"id": base["id"], "path": os.path.relpath(base_dir.resolve(), Path(path).resolve().parent)}
                    manifest["chain"] = [*base.get("chain", []), base["id"]]
                try:
                    if dense:
                        state = _dense_state(model, es)
                        if state:
                            manifest["dense"] = writer.write_tensors(_DENSE, state, "dense")
                    writer.commit(manifest)
                except BaseException as err:
                    if comm is None:
                        raise
                    committed = err
            if comm is not None:
                outcome = comm.all_gather_object(None if committed is None else repr(committed))[0]
                if committed is not None:
                    raise committed
                if outcome is not None:
                    raise RuntimeError(f"dynemb.checkpoint: rank 0 could not commit the save to {path}: {outcome}")
            for e in es:
                e.changes().reset()
                e.module.checkpoint_id = ckpt_id
    except BaseException:
        if not rank:
            writer.abort()
        raise
    return ckpt_id


def save(
    model: torch.nn.Module, path, *, chunk_rows: int = 1 << 16, overwrite: bool = False, layout: bool = True, dense: bool = False, progress: bool = False
) -> str:
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
    # The delta names the base by the path given, not by where it was found (a replacing save
    # killed between its renames leaves it under a temporary name for a while).
    return _save(model, path, delta_of=(Path(base), manifest), chunk_rows=chunk_rows, overwrite=overwrite, layout=False, dense=dense, progress=progress)


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


def _read_table(chain: list[tuple[Path, dict]], name: str, check_hash: bool = False) -> dict:
    """Merge a table's rows over the chain: keys [K], values [K, D+S], scores [K] (in file order).

    The full checkpoint's rows are read into one preallocated block, file by file, so reading
    needs memory for the table plus one file."""
    first = chain[0][1]["tables"][name]
    D, S, dtype = first["embedding_dim"], first["state_dim"], DTYPES[first["dtype"]]
    keys = torch.empty(0, dtype=torch.int64)
    values = torch.empty(0, D + S, dtype=dtype)
    scores = torch.empty(0, dtype=torch.int64)
    for position, (directory, manifest) in enumerate(chain):
        entry = manifest["tables"][name]
        if (entry["embedding_dim"], entry["state_dim"], entry["dtype"]) != (D, S, first["dtype"]):
            raise CheckpointError(f"table {name!r}: embedding_dim / state_dim / dtype change along the delta chain", directory / _files.MANIFEST)
        new_k, new_v, new_s, tomb = [], [], [], []
        # The full checkpoint's rows go straight into one block (its size is in the manifest).
        block = torch.empty(entry["rows"], D + S, dtype=dtype) if position == 0 else None
        filled = 0
        for f in entry["files"]:
            if f["role"] == "rows":
                n = f["rows"]
                t = _files.read_tensors(
                    directory,
                    f,
                    {"keys": (torch.int64, (n,)), "embeddings": (dtype, (n, D)), "optimizer_state": (dtype, (n, S)), "scores": (torch.int64, (n,))},
                    check_hash=check_hash,
                )
                new_k.append(t["keys"])
                if block is not None:
                    block[filled : filled + n, :D] = t["embeddings"]
                    block[filled : filled + n, D:] = t["optimizer_state"]
                    filled += n
                else:
                    new_v.append(torch.cat([t["embeddings"], t["optimizer_state"]], 1))
                new_s.append(t["scores"])
                del t
            elif f["role"] == "tombstones":
                tomb.append(_files.read_tensors(directory, f, {"keys": (torch.int64, (f["rows"],))})["keys"])
        add_k = torch.cat(new_k) if new_k else keys[:0]
        if torch.unique(add_k).numel() != add_k.numel():
            raise CheckpointError(f"table {name!r}: a key appears twice in its rows files", directory)
        if block is not None:
            keys, values, scores = add_k, block, torch.cat(new_s) if new_s else scores
            continue
        drop = torch.cat([*tomb, add_k]) if tomb else add_k
        if drop.numel() and keys.numel():
            keep = ~torch.isin(keys, drop)
            keys, values, scores = keys[keep], values[keep], scores[keep]
        if new_k:
            keys = torch.cat([keys, add_k])
            values = torch.cat([values, *new_v])
            scores = torch.cat([scores, *new_s])
    # Non-finite rows (written by nonfinite_grads='apply') load as they were saved, with a warning.
    warn_nonfinite(keys, values, f"table {name!r} of {chain[-1][0]}")
    last_dir, last = chain[-1]
    entry = last["tables"][name]
    extra = {}
    for f in entry["files"]:
        if f["role"] == "admission":
            try:
                extra["admission"] = load_file(last_dir / f["path"])
                extra["admission_path"] = last_dir / f["path"]
            except Exception as e:  # safetensors raises several types
                raise CheckpointError(f"not a readable safetensors file ({e})", last_dir / f["path"]) from None
        elif f["role"] == "generator":
            extra["generator"] = _files.read_tensors(last_dir, f, {"state": (torch.uint8, (None,))})["state"]
            extra["generator_path"] = last_dir / f["path"]
        elif f["role"] == "layout" and len(chain) == 1:
            try:
                extra["layout"] = load_file(last_dir / f["path"])
            except Exception as e:
                raise CheckpointError(f"not a readable safetensors file ({e})", last_dir / f["path"]) from None
    if "layout" in extra and not (isinstance(extra["layout"].get("slots"), torch.Tensor) and extra["layout"]["slots"].shape == keys.shape):
        del extra["layout"]
    return {
        "keys": keys,
        "values": values,
        "scores": scores,
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


def _build_engine(sample: Entry, parts: list[tuple[int | None, dict, Entry]], *, on_overflow: str, use_layout: bool) -> tuple[object, dict]:
    """A fresh engine for one DynamicTable or one collection group, filled with ``parts``
    (segment, data with whole rows [K, D+S], entry); returns it and the keys dropped per table.
    Raises CheckpointError (nothing changed) if keys do not fit and ``on_overflow`` is "raise"."""
    # A sharded table's engine wraps the rank's local one: the fresh engine is a local one too.
    engine = sample.engine.local if sample.engine.collective else sample.engine
    grouped = engine.segmented

    def new_engine():
        return engine.fresh()

    fresh = new_engine()
    device = fresh.device
    names = [e.name for _, _, e in parts]
    keys = torch.cat([d["keys"] for _, d, _ in parts]).to(device)
    segs = torch.cat([torch.full((d["keys"].numel(),), 0 if s is None else s, dtype=torch.int64) for s, d, _ in parts]).to(device)
    # One table's block is used as it is (no copy); a group's tables are concatenated.
    values = (parts[0][1]["values"] if len(parts) == 1 else torch.cat([d["values"] for _, d, _ in parts])).to(device=device, dtype=fresh.store.dtype)
    scores = torch.cat([d["scores"] for _, d, _ in parts]).to(device)
    lost = torch.empty(0, dtype=torch.int64, device=device)  # segments of the keys dropped
    with writable():
        state = None
        if use_layout:
            c = parts[0][1]["entry"]["counters"].get("index", [0, 0, 0, 0]) if not grouped else [0, 0, 0, 0]
            state = state_from_layout(fresh.index, [(s, d.get("layout"), d["keys"], d["scores"]) for s, d, _ in parts], c)
        if state is not None:
            try:
                fresh.index.load_state_dict(state)
            except ValueError:
                # A layout that does not hold together (a damaged file, verify=False): re-insert.
                state = None
        if state is not None:
            fresh.store.reserve(keys.numel())
            fresh.store.scatter(torch.arange(keys.numel(), device=device), values)
        elif keys.numel():
            # The order resolve wants: by segment, then key.
            if grouped:
                (segs, keys), inverse, _ = unique_pairs(segs, keys)
                order = torch.empty_like(inverse).index_copy_(0, inverse, torch.arange(inverse.numel(), device=device))
            else:
                keys, order = torch.sort(keys)
            # Values stay in file order: src[i] is the value row of the i-th key in resolve order.
            src, scores = order, scores.index_select(0, order)
            # Keys beyond a table's capacity cannot fit: only the highest-priority ones (higher
            # score, then smaller key) go in first; the others may take slots left free.
            keep = torch.ones_like(keys, dtype=torch.bool)
            for s in torch.unique(segs).tolist():
                members = (segs == s).nonzero().squeeze(1)
                capacity = fresh.index.segment_capacity(s) if grouped else fresh.index.capacity()
                if members.numel() > capacity:
                    by_priority = torch.sort(scores.index_select(0, members), descending=True, stable=True).indices
                    keep.index_fill_(0, members.index_select(0, by_priority[capacity:]), False)
            if not bool(keep.all()) and on_overflow != "evict":
                raise CheckpointError(
                    f"{int((~keep).sum())} of the {keys.numel()} keys of tables {names} exceed the tables' capacity; "
                    "load into larger tables, or pass on_overflow='evict' to keep the highest-scored keys"
                )
            seg_arg = (segs[keep],) if grouped else ()
            r = fresh.resolve(keys[keep], *seg_arg, train=True, now=0, scores=scores[keep], init_rows=False)
            if bool(keep.all()) and not r.failed_keys.numel() and not r.evicted_keys.numel():
                fresh.store.scatter(torch.empty_like(src).index_copy_(0, src, r.rows), values)
            else:
                # A batch insert does not always find a placement of a nearly full index even
                # where one exists: place the keys it left out along cuckoo paths, then build
                # the index from the slots found.
                slots = torch.full_like(keys, -1)
                slots[keep] = fresh.index.locate(keys[keep], *seg_arg)[0]
                slots = place_exact(fresh.index, keys, segs if grouped else None, scores, slots, evict=on_overflow == "evict", optional=~keep)
                placed = slots >= 0
                if not bool(placed.all()):
                    if on_overflow != "evict":
                        raise CheckpointError(
                            f"{int((~placed).sum())} of the {keys.numel()} keys of tables {names} do not fit (bucket overflow); "
                            "load into larger tables, or pass on_overflow='evict' to keep the highest-scored keys"
                        )
                    lost = segs[~placed]
                    keys, segs, src, scores, slots = keys[placed], segs[placed], src[placed], scores[placed], slots[placed]
                index = fresh.index
                geometry = (index.num_buckets, index.bucket_capacity, index.max_buckets)
                fresh = new_engine()
                fresh.index.load_state_dict(state_from_slots(fresh.index, keys, slots, scores, geometry, [0, 0, 0, 0], index.segment_buckets.tolist()))
                fresh.store.reserve(keys.numel())
                if src.numel() == values.shape[0]:
                    fresh.store.scatter(torch.empty_like(src).index_copy_(0, src, torch.arange(src.numel(), device=device)), values)
                else:
                    fresh.store.scatter(torch.arange(src.numel(), device=device), values.index_select(0, src))
        fresh.version += 1
    dropped = {e.name: int((lost == (0 if s is None else s)).sum()) for s, _, e in parts}
    return fresh, dropped


def _current_rows(e: Entry) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A table's keys [K], whole rows [K, D+S] and scores [K] as it holds them now (on CPU)."""
    engine = e.engine
    chunks = list(e.export(1 << 20))
    if not chunks:
        empty = torch.empty(0, dtype=torch.int64)
        return empty, torch.empty(0, engine.width, dtype=engine.store.dtype), empty
    rows = torch.cat([c[1] for c in chunks])
    keys, scores = (torch.cat([c[i] for c in chunks]).cpu() for i in (0, 2))
    return keys, engine.store.gather(rows.to(engine.device)).cpu(), scores


def _plan_engines(es: list[Entry], data: dict, *, on_overflow: str, use_layout: bool) -> tuple[list, dict]:
    """A fresh engine for every table module or collection group that ``data`` (table name ->
    keys, whole rows, scores, manifest entry) covers; tables it does not cover keep their
    current rows. Returns the plans (members, fresh engine, parts) for :func:`_install` and the
    report ``{name: {"rows", "dropped"}}``; raises (nothing changed) when keys do not fit."""
    plans, report = [], {}
    groups: dict[int, list[Entry]] = {}
    for e in es:
        groups.setdefault(id(e.engine), []).append(e)
    for members in groups.values():
        if not any(e.name in data for e in members):
            continue
        parts = []
        for e in members:
            if e.name in data:
                parts.append((e.location[1], data[e.name], e))
            else:
                # Not in the checkpoint (strict=False): keep its current rows.
                k, vals, sc = _current_rows(e)
                parts.append((e.location[1], {"keys": k, "values": vals, "scores": sc}, e))
        fresh, dropped = _build_engine(members[0], parts, on_overflow=on_overflow, use_layout=use_layout and all(e.name in data for e in members))
        plans.append((members, fresh, parts))
        for _, d, e in parts:
            if e.name in data:
                report[e.name] = {"rows": int(d["keys"].numel()) - dropped[e.name], "dropped": dropped[e.name]}
    return plans, report


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
        owns: ``owns(keys [K]) -> Tensor[bool] [K]``: load only the keys it accepts (a shard; no
            delta can follow such a load). A sharded model needs none: each rank keeps its keys.
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
    # Killed saves' temporary directories next to the checkpoint go (only those of dead writers).
    leftovers.sweep(Path(path).parent)
    chain = chain_of(path)
    es = entries(model)
    comm = _comm_of(es)
    # Keys the caller's ``owns`` leaves out make the tables partial (no delta can follow); a
    # sharded model's own split does not: every key is loaded on the rank that owns it.
    partial = owns is not None
    if comm is not None and owns is None:
        # A sharded model: each rank keeps the keys it owns at the current world size.
        from dynemb.distributed.comm import owner_of

        def owns(keys: torch.Tensor) -> torch.Tensor:
            return owner_of(keys, comm.world_size) == comm.rank

    by_name = {e.name: e for e in es}
    names = set(chain[-1][1]["tables"])
    # Rows files of the tables read below are hashed as they are read (one read per file);
    # every other file is hashed here.
    read_here = names & set(by_name)
    bar = _progress(len(chain), "dynemb verify", progress)
    for directory, manifest in chain:
        if verify:
            skip = {f["path"] for n in read_here for f in manifest["tables"][n]["files"] if f["role"] == "rows"}
            _files.verify_files(directory, manifest, skip_paths=skip)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    last_dir, last = chain[-1]
    if strict and set(by_name) != names:
        raise CheckpointError(
            f"tables differ: missing from the checkpoint {sorted(set(by_name) - names)}, not in the model {sorted(names - set(by_name))} "
            "(pass strict=False to load the common ones)",
            last_dir,
        )
    data = {}
    for name in sorted(names & set(by_name)):
        e = by_name[name]
        d = _read_table(chain, name, check_hash=verify)
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
        if not optimizer_state:
            # Embeddings with the model's initial optimizer state: whole rows [K, D+S].
            state = torch.empty(d["keys"].numel(), engine.state_dim, dtype=d["values"].dtype)
            if e.optimizer is not None:
                e.optimizer.init_state(state)
            d["values"] = torch.cat([d["values"][:, : d["D"]], state], 1)
        gen = d.get("generator")
        if gen is not None and gen.numel() != e.generator.get_state().numel():
            raise CheckpointError(f"table {name!r}: {gen.numel()} bytes, not a {e.engine.device.type} generator state", d["generator_path"])
        if gen is not None:
            # torch checks the state itself when it is set: try it on a scratch generator now,
            # not while the tables are being swapped in.
            try:
                torch.Generator(device=e.generator.device).set_state(gen)
            except RuntimeError as err:
                raise CheckpointError(f"table {name!r}: not a valid generator state ({err})", d["generator_path"]) from None
        if e.admission is not None:
            d["admission"] = _admission(e, d)
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
        mine = _dense_state(model, es)
        wrong = sorted(k for k in dense_state if k not in mine or mine[k].shape != dense_state[k].shape)
        absent = sorted(k for k in mine if k not in dense_state)
        if wrong or (strict and absent):
            raise CheckpointError(
                f"dense entries do not match the model: unknown or of another shape {wrong[:8]}, missing {absent[:8]}", last_dir / last["dense"]["path"]
            )

    # Build every engine first; nothing in the model changes until all of them fit.
    use_layout = len(chain) == 1 and owns is None
    with _locked(es):
        plans, report = _plan_engines(es, data, on_overflow=on_overflow, use_layout=use_layout)
        if dense_state is not None:
            # Copied in place into the model's own parameters and buffers (shapes checked above).
            with torch.no_grad():
                for k, v in dense_state.items():
                    mine[k].copy_(v)
        # Swap in.
        for members, fresh, parts in plans:
            _install(members, fresh, parts, data, optimizer_state)
        # A delta can follow this checkpoint only where the tables now hold exactly its content.
        exact = {id(e.module) for e in es}
        for e in es:
            if e.name not in data or report[e.name]["dropped"] or partial or not optimizer_state:
                exact.discard(id(e.module))
        for e in es:
            e.module.checkpoint_id = last["id"] if id(e.module) in exact else None
            e.changes()  # start tracking changes for the next delta
    return report


def _admission(e: Entry, d: dict):
    """A new admission counter for table ``e`` holding the checkpoint's counts (empty if the
    checkpoint has none)."""
    current = e.admission
    adm = FrequencyAdmission(e.config.admission, current.counts.device)
    if d.get("admission") is not None:
        try:
            adm.load_state_dict(d["admission"])
        except (ValueError, KeyError, RuntimeError, TypeError) as error:
            raise CheckpointError(f"table {e.name!r}: not an admission counter state ({error})", d["admission_path"]) from None
    return adm


def _install(members: list[Entry], fresh, parts, data: dict, optimizer_state: bool) -> None:
    """Swap ``fresh`` (built by :func:`_build_engine`) into the module of ``members`` with the
    checkpoint's counters; tables of the group that the checkpoint does not hold (strict=False)
    keep their step count, counters and generator."""
    module = members[0].module
    for s, d, e in parts:
        table = module.table_names[0] if e.table is None else e.table
        segment = s or 0
        if e.name not in data:
            old = e.engine.counters(segment)
            fresh.set_counters(
                segment,
                optimizer_step=old["optimizer_step"],
                nonfinite_grads=old["nonfinite_grads"],
                index=old["index"],
                generator_state=old["generator"].get_state(),
            )
            continue
        c = d["entry"]["counters"]
        idx = c.get("index")
        fresh.set_counters(
            segment,
            optimizer_step=c["optimizer_step"] if optimizer_state else 0,
            nonfinite_grads=c["nonfinite_grads"],
            index=idx if isinstance(idx, list) and len(idx) == 4 else None,
            generator_state=d.get("generator"),
        )
        module.set_clock(c["step"], c["last_timestamp"])
        module.restore_table(table, erased=c["erased"], admission=d.get("admission"))
    old_engine = members[0].engine
    if old_engine.collective:
        fresh = old_engine.rebuilt(fresh)
    module.install_engine(module.engines.index(old_engine), fresh)
