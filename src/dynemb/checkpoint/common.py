"""Helpers every checkpoint path shares: progress bars, one lock over every table, the dense state, the process group.

K keys of a table, D embedding dim, S optimizer state columns.
"""

from __future__ import annotations

import contextlib

import torch

from dynemb.checkpoint.tables import Entry


def progress_bar(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # progress bars are optional
        return None
    return tqdm(total=total, desc=desc, unit="rows", unit_scale=True, leave=False)


@contextlib.contextmanager
def locked(es: list[Entry]):
    """Hold every table module's lock: the checkpoint is one consistent snapshot."""
    with contextlib.ExitStack() as stack:
        seen = set()
        for e in es:
            if id(e.module) not in seen:
                seen.add(id(e.module))
                stack.enter_context(e.lock)
        yield


def dense_entries(model: torch.nn.Module, es: list[Entry]) -> dict[str, torch.Tensor]:
    prefixes = tuple((e.module_path + ".") if e.module_path else "" for e in es)
    if "" in prefixes:
        return {}
    return {k: v for k, v in model.state_dict().items() if not k.startswith(prefixes)}


def comm_of(es: list[Entry]):
    """The Comm of a sharded model's tables (None when unsharded); all or none must be sharded."""
    of = [e.comm for e in es]
    comms = {id(c): c for c in of}
    if len(comms) == 1:
        return next(iter(comms.values()))
    found = [c for c in comms.values() if c is not None]
    if None in comms.values() or any((c.rank, c.world_size) != (found[0].rank, found[0].world_size) for c in found):
        raise ValueError("model: some dynemb tables are sharded and others not (or over other groups); shard all of them with one shard() call")
    return found[0]
