"""Loading a table's state_dict: validate everything, then restore exactly or re-insert.

K keys in the state, D embedding dim, S optimizer state columns. The layout is described in
docs/design/0009-state-dict.md.
"""

from __future__ import annotations

import torch

from dynemb.nn.functional import TableEngine, warn_nonfinite
from dynemb.workspace import writable

_SCALARS = ("step", "optimizer_step", "last_timestamp")


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


def load_table_state(table, state: dict[str, torch.Tensor]) -> None:
    """Restore ``table`` (a DynamicTable, lock held by the caller) from its state entries.

    Same index geometry (bucket width and maximum buckets): the index is restored slot by slot,
    so further training is bitwise that of the saved table. Another geometry: the keys are
    re-inserted into a fresh engine with their scores; if any key cannot be placed, ValueError
    is raised and the table is left as it was.
    """
    if any(getattr(e, "collective", False) for e in [table.engine]):
        # Each rank holds only its keys; a state_dict is one rank's: restoring a sharded table
        # goes through dynemb.checkpoint (every rank reads the keys it owns).
        raise ValueError("load_state_dict on a sharded table is not supported: use dynemb.checkpoint.save / load, which reshard by key")
    D, S = table.embedding_dim, table.state_dim
    keys = _tensor(state, "keys", torch.int64, (None,))
    K = keys.numel()
    embeddings = _tensor(state, "embeddings", None, (K, None))
    optimizer_state = _tensor(state, "optimizer_state", None, (K, None))
    scores = _tensor(state, "scores", torch.int64, (K,))
    if embeddings.shape[1] != D or not embeddings.is_floating_point():
        raise ValueError(f"state entry 'embeddings' is [{K}, {embeddings.shape[1]}] {embeddings.dtype}; this table has embedding_dim={D}")
    if optimizer_state.shape[1] != S or not optimizer_state.is_floating_point():
        raise ValueError(
            f"state entry 'optimizer_state' has {optimizer_state.shape[1]} columns; this table's optimizer "
            f"({table.optimizer!r}) keeps {S} per row: load into a table with the same optimizer"
        )
    scalars = {name: int(_tensor(state, name, torch.int64, ())) for name in _SCALARS}
    for name, value in scalars.items():
        if value < 0:
            raise ValueError(f"state entry '{name}'={value}: must be >= 0")
    counters = _tensor(state, "counters", torch.int64, (2,)).tolist()
    generator_state = _tensor(state, "generator_state", torch.uint8, (None,))
    if generator_state.numel() != table.engine.initializer.generator.get_state().numel():
        raise ValueError(f"state entry 'generator_state' has {generator_state.numel()} bytes, not a {table.device.type} generator state")
    if K and torch.unique(keys).numel() != K:
        raise ValueError(f"state entry 'keys' holds {K - torch.unique(keys).numel()} duplicate key(s)")
    # Non-finite rows (nonfinite_grads='apply') load as they were saved, with a warning.
    warn_nonfinite(keys, torch.cat([embeddings, optimizer_state], 1), "state entries 'embeddings' / 'optimizer_state'")
    index_state = {name[len("index.") :]: value for name, value in state.items() if name.startswith("index.")}
    index_state.update(keys=keys, scores=scores)
    admission_state = {name[len("admission.") :]: value for name, value in state.items() if name.startswith("admission.")}
    device, dtype = table.device, table.config.dtype
    values = torch.cat([embeddings, optimizer_state], 1).to(device=device, dtype=dtype)

    with writable():
        backup = None
        if table.admission is not None:
            backup = table.admission.state_dict()
            table.admission.load_state_dict(admission_state)
        try:
            engine = table.engine
            if table.index.same_geometry(index_state):
                # Raises ValueError (leaving the index as it was) on bad slots, rows or free list.
                engine.index.load_state_dict({k: v.to(device) for k, v in index_state.items()})
                engine.store.reserve(engine.index.free_list.high_water)
                engine.store.scatter(index_state["rows"].to(device), values)
            else:
                engine = TableEngine(table.config, table.optimizer, None)
                order = torch.argsort(keys).to(device)
                sorted_keys = keys.to(device).index_select(0, order)
                r = engine.resolve(
                    sorted_keys,
                    train=True,
                    now=scalars["step"],
                    scores=scores.to(device).index_select(0, order),
                    init_rows=False,
                )
                lost = r.failed_keys.numel() + r.evicted_keys.numel()
                if lost:
                    raise ValueError(
                        f"the state holds {K} keys and {lost} of them do not fit this table "
                        f"(capacity={table.index.capacity()}, bucket_capacity={table.config.bucket_capacity}); "
                        "load it into a table with a larger capacity"
                    )
                engine.store.scatter(r.rows, values.index_select(0, order))
        except Exception:
            if backup is not None:
                table.admission.load_state_dict(backup)
            raise
        engine.optimizer_step = scalars["optimizer_step"]
        engine.nonfinite_grads = counters[1]
        engine.initializer.generator.set_state(generator_state)
        engine.version += 1
        # Rows changed wholesale: a checkpoint delta on an earlier save would miss them.
        engine.changes = None
        table.engine = engine
        table.step = scalars["step"]
        table._last_timestamp = scalars["last_timestamp"]
        table._erased = counters[0]
