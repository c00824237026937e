"""Saving: full and delta checkpoints, written crash-safe, one rows file per chunk of keys.

K keys of a table, D embedding dim, S optimizer state columns.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from dynemb._version import __version__
from dynemb.checkpoint import files as _files
from dynemb.checkpoint.common import comm_of, dense_entries, locked, progress_bar
from dynemb.checkpoint.tables import DTYPE_NAMES, Entry, config_json, entries, optimizer_json
from dynemb.errors import CheckpointError
from dynemb.nn.functional import warn_nonfinite_keys

_DENSE = "dense.safetensors"


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
    comm = comm_of(es)
    # (The same on every rank: their tables have the same configs.)
    admitting = [e.name for e in es if e.shard_comm is not None and e.admission is not None]
    if admitting:
        raise ValueError(f"tables {admitting}: saving tables with admission sharded by DMP is not supported (every rank would write its counter to one file)")
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
        with locked(es):
            # A caching table's external store then holds every row the checkpoint holds.
            for engine in {id(e.engine): e.engine for e in es}.values():
                engine.flush()
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
                bar = progress_bar(sum(_size(e) for e in es), "dynemb save", progress)
                tables = {
                    e.name: _write_table(writer, e, chunk_rows, delta=delta_of is not None, layout=layout and delta_of is None, bar=bar, rank=rank) for e in es
                }
                if bar is not None:
                    bar.close()
                # On every rank: a DMP model's state_dict() is collective (its tables' row blocks).
                dense_state = dense_entries(model, es) if dense else None
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
                    if dense_state:
                        manifest["dense"] = writer.write_tensors(_DENSE, dense_state, "dense")
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
