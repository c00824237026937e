"""Loading: verify every file, read every table, rebuild every engine, then swap them in.

K keys of a table, D embedding dim, S optimizer state columns.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file

from dynemb.checkpoint import files as _files
from dynemb.checkpoint import leftovers
from dynemb.checkpoint.chain import chain_of, counter, read_table
from dynemb.checkpoint.common import comm_of, dense_entries, locked, progress_bar
from dynemb.checkpoint.rebuild import admission_of, install, plan_engines
from dynemb.checkpoint.tables import entries
from dynemb.errors import CheckpointError


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
    comm = comm_of(es)
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
    bar = progress_bar(len(chain), "dynemb verify", progress)
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
        d = read_table(chain, name, check_hash=verify)
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
            d["admission"] = admission_of(e, d)
        if owns is not None:
            mask = owns(d["keys"])
            if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.shape != d["keys"].shape:
                raise ValueError(f"owns(keys) must return a bool tensor of shape {tuple(d['keys'].shape)}, got {mask!r}")
            d["keys"], d["values"], d["scores"] = d["keys"][mask], d["values"][mask], d["scores"][mask]
        for c in ("step", "optimizer_step", "last_timestamp", "erased", "nonfinite_grads"):
            counter(d["entry"], c, last_dir)
        data[name] = d
    dense_state = None
    if dense:
        if "dense" not in last:
            raise CheckpointError("dense=True but the checkpoint holds no dense state (saved without dense=True)", last_dir)
        dense_state = _files.read_tensors(last_dir, last["dense"], {k: (None, None) for k in load_file(last_dir / last["dense"]["path"])})
        mine = dense_entries(model, es)
        wrong = sorted(k for k in dense_state if k not in mine or mine[k].shape != dense_state[k].shape)
        absent = sorted(k for k in mine if k not in dense_state)
        if wrong or (strict and absent):
            raise CheckpointError(
                f"dense entries do not match the model: unknown or of another shape {wrong[:8]}, missing {absent[:8]}", last_dir / last["dense"]["path"]
            )

    # Build every engine first; nothing in the model changes until all of them fit.
    use_layout = len(chain) == 1 and owns is None
    with locked(es):
        plans, report = plan_engines(es, data, on_overflow=on_overflow, use_layout=use_layout)
        if dense_state is not None:
            # Copied in place into the model's own parameters and buffers (shapes checked above).
            with torch.no_grad():
                for k, v in dense_state.items():
                    mine[k].copy_(v)
        # Swap in.
        for members, fresh, parts in plans:
            install(members, fresh, parts, data, optimizer_state)
        # A delta can follow this checkpoint only where the tables now hold exactly its content.
        exact = {id(e.module) for e in es}
        for e in es:
            if e.name not in data or report[e.name]["dropped"] or partial or not optimizer_state:
                exact.discard(id(e.module))
        for e in es:
            e.module.checkpoint_id = last["id"] if id(e.module) in exact else None
            e.changes()  # start tracking changes for the next delta
    return report
