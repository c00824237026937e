"""The engine's row stores: which store a table or group gets (one tensor, tiers or a cache over
external storage), the memory check of each against its medium, and the scores a tiered store
places rows by. docs/design/0032-tiers.md, 0034-caching-external-storage.md.

U keys resolved in a call, T tiers.
"""

from __future__ import annotations

import dataclasses
import os
import shutil

import torch

from dynemb.config import TableConfig, Tier, tier_layout
from dynemb.nn.functional import device_memory
from dynemb.storage.base import RowStore
from dynemb.storage.caching import CachingRowStore
from dynemb.storage.device_store import DeviceRowStore
from dynemb.storage.tiered import TieredRowStore, placement_bytes
from dynemb.table.index import index_bytes


def group_key(config: TableConfig) -> tuple:
    """Tables with equal keys share an engine (and so one index call and one update per batch)."""
    c = config
    # A caching table's store is keyed by its keys alone: tables sharing one would collide.
    caching = id(c.external_storage) if c.caching else None
    return (c.embedding_dim, c.dtype, str(c.device), c.bucket_capacity, c.score_strategy, c.nonfinite_grads, caching, tier_layout(c.tiers), c.backend)


def group_tiers(configs: list[TableConfig]) -> list[Tier] | None:
    """The tiers of a group's store: the tables' tiers summed per kind (a group's tables share
    their tier layout, :func:`dynemb.nn.engine.group_key`)."""
    if configs[0].tiers is None:
        return None
    return [dataclasses.replace(t, rows=sum(c.tiers[i].rows for c in configs)) for i, t in enumerate(configs[0].tiers)]


def check_tier_memory(configs: list[TableConfig], slots: int, width: int, index_size: int) -> None:
    """Raise ValueError naming every tier's budget when a tier does not fit its medium: device
    memory (index, placement and device tier; a CPU table's host tier too), host memory, free
    disk under the disk tier's path. ``slots``: the index's row ids (rows beyond the tiers'
    sum join the last tier)."""
    tiers, first = group_tiers(configs), configs[0]
    rows = [t.rows for t in tiers]
    rows[-1] += slots - sum(rows)
    row_bytes = width * torch.empty(0, dtype=first.dtype).element_size()
    device = first.device
    # (what, bytes needed, medium, bytes it has or None if unknown)
    need = {str(device): [index_size + placement_bytes(slots) * slots, None]}
    budgets = []
    for tier, n in zip(tiers, rows):
        if tier.kind == "disk":
            if not os.path.isdir(tier.path):
                raise ValueError(f"Tier.path={tier.path!r}: the disk tier's directory does not exist")
            budgets.append((f"disk tier {n:,} rows", n * row_bytes, f"disk under {tier.path!r}", shutil.disk_usage(tier.path).free))
            continue
        medium = str(device) if tier.kind == "device" or device.type == "cpu" else "host memory"
        need.setdefault(medium, [0, None])[0] += n * row_bytes
        budgets.append((f"{tier.kind} tier {n:,} rows", n * row_bytes, medium, None))
    for medium, entry in need.items():
        entry[1] = device_memory(torch.device("cpu") if medium == "host memory" else device)
    lines = [f"{what} x {width} {first.dtype} columns: {size:,} bytes on {medium}" for what, size, medium, _ in budgets]
    lines.append(f"index and placement of {slots:,} rows: {index_size + placement_bytes(slots) * slots:,} bytes on {device}")
    short = [f"{medium} needs {n:,} bytes, has {have:,}" for medium, (n, have) in need.items() if have is not None and n > have]
    short += [f"{medium} needs {size:,} bytes, has {have:,} free" for _, size, medium, have in budgets if have is not None and size > have]
    if short:
        names = [c.name for c in configs]
        raise ValueError(f"tiers of table(s) {names} do not fit: {'; '.join(short)} (budgets: {'; '.join(lines)})")


def tiered_store(configs: list[TableConfig], width: int, capacity: int, init_rows: int) -> TieredRowStore | None:
    """The store of a table or group with tiers (None without)."""
    tiers = group_tiers(configs)
    if tiers is None:
        return None
    return TieredRowStore(width, tiers, capacity, dtype=configs[0].dtype, device=configs[0].device, init_rows=init_rows)


def touch_resolved(index, store, keys: torch.Tensor, rows: torch.Tensor, segments: torch.Tensor | None) -> None:
    """Give the store the index's scores of the rows of keys [U] just resolved (-1 rows skipped)."""
    sel = (rows >= 0).nonzero().squeeze(1)
    keys, rows = keys.index_select(0, sel), rows.index_select(0, sel)
    scores, _ = index.scores(keys) if segments is None else index.scores(keys, segments=segments.index_select(0, sel))
    store.touch(rows, scores)


def check_memory(configs: list[TableConfig], slots: int, width: int, what: str, cache_rows: int | None) -> int:
    """Bytes of a full table or group (index and rows in memory; a caching table's cache only),
    raising ValueError when they cannot fit: each tier against its own medium, else the device."""
    first = configs[0]
    index_size = index_bytes(slots)
    full_bytes = index_size + (cache_rows or slots) * width * torch.empty(0, dtype=first.dtype).element_size()
    if first.tiers is not None:
        check_tier_memory(configs, slots, width, index_size)
        return full_bytes
    total = device_memory(first.device)
    if total is not None and full_bytes > total:
        raise ValueError(
            f"{what} {full_bytes:,} bytes (index and rows of {width} x {first.dtype} columns), more than the {total:,} bytes of memory on {first.device}"
        )
    return full_bytes


def default_store(configs: list[TableConfig], width: int, capacity: int, current_capacity: int, cache_rows: int | None) -> RowStore:
    """The store a table or group gets when none is given: a cache over its external storage
    (caching), its tiers, or one tensor on its device growing from ``current_capacity`` rows."""
    first = configs[0]
    if first.caching:
        return CachingRowStore(width, capacity, first.external_storage, cache_rows=cache_rows, dtype=first.dtype, device=first.device)
    tiered = tiered_store(configs, width, capacity, current_capacity)
    if tiered is not None:
        return tiered
    return DeviceRowStore(width, capacity, dtype=first.dtype, device=first.device, init_rows=current_capacity)
