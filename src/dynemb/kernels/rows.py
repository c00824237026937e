"""The index's row ids at flat slots: read (-1 where there is no slot) or written.

n slots. ``rows_at_torch`` / ``put_rows_torch`` are the plain-torch twins (an ``index_select``
or ``scatter_`` of the flat [B * W] row ids); ``rows_at_native`` / ``put_rows_native`` run
``rows.cpp``: the same values, with the slots' lines prefetched ahead on every thread (a
65,536-key batch reads or writes that many random lines of a table of tens of MiB). The row
ids may be a view into the index's packed slots (docs/design/0041): slot p's at ``p * step``.

``rows_of_new_torch`` / ``rows_of_new_native``: an upsert's new keys put into its result (their
slots into ``pos``, their row ids into ``rows``, at every place they occur in the call's keys):
three passes of plain torch, one of the kernel.
"""

from __future__ import annotations

import torch

from dynemb.kernels import library, ptr, slot_step, threads


def rows_at_torch(table_rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Row id at each flat slot ([n] int64), -1 where ``pos`` < 0.

    Args:
        table_rows (Tensor[int32|int64]): [B, W] the index's row ids.
        pos (Tensor[int64]): [n] flat slots, -1 for none.
    """
    return torch.where(pos >= 0, table_rows.view(-1).index_select(0, pos.clamp(min=0)).to(torch.int64), -1)


def rows_at_native(table_rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """:func:`rows_at_torch` by ``dyn_rows_at`` (bitwise the same)."""
    pos = pos.contiguous()
    out = torch.empty(pos.numel(), dtype=torch.int64)
    library().dyn_rows_at(ptr(table_rows), table_rows.element_size(), slot_step(table_rows), ptr(pos), pos.numel(), ptr(out), threads())
    return out


def put_rows_torch(table_rows: torch.Tensor, pos: torch.Tensor, ids: torch.Tensor) -> None:
    """Write row ids ``ids`` ([n] int64) at distinct flat slots ``pos`` ([n] int64) of
    ``table_rows`` ([B, W] int32 or int64), in place."""
    table_rows.view(-1).scatter_(0, pos, ids.to(table_rows.dtype))


def put_rows_native(table_rows: torch.Tensor, pos: torch.Tensor, ids: torch.Tensor) -> None:
    """:func:`put_rows_torch` by ``dyn_rows_put``."""
    pos, ids = pos.contiguous(), ids.contiguous()
    library().dyn_rows_put(ptr(table_rows), table_rows.element_size(), slot_step(table_rows), ptr(pos), ptr(ids), pos.numel(), threads())


def rows_of_new_torch(
    table_rows: torch.Tensor, occurrences: torch.Tensor, spread: torch.Tensor | None, new_pos: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor
) -> None:
    """Put M new keys' slots and row ids into an upsert's result over U keys, in place:
    ``pos[occurrences[j]]`` = the slot of new key ``spread[j]`` (key j without ``spread``) and
    ``rows[occurrences[j]]`` its row id (-1 where it got no slot).

    Args:
        table_rows (Tensor[int32|int64]): [B, W] the index's row ids.
        occurrences (Tensor[int64]): [m] places of the new keys in the call's keys.
        spread (Tensor[int64] | None): [m] the new key at each place, or None (m = M).
        new_pos (Tensor[int64]): [M] each new key's slot, -1 for none.
        pos, rows (Tensor[int64]): [U] the result's slots and row ids, written at occurrences.
    """
    at = new_pos if spread is None else new_pos.index_select(0, spread)
    pos.index_copy_(0, occurrences, at)
    rows.index_copy_(0, occurrences, rows_at_torch(table_rows, at))


def rows_of_new_native(
    table_rows: torch.Tensor, occurrences: torch.Tensor, spread: torch.Tensor | None, new_pos: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor
) -> None:
    """:func:`rows_of_new_torch` by ``dyn_rows_of_new`` (bitwise the same); ``pos`` and ``rows``
    must be contiguous (they are written through their data pointers)."""
    if not (pos.is_contiguous() and rows.is_contiguous()):
        raise ValueError("pos and rows: must be contiguous (written in place by the kernel)")
    occurrences, new_pos = occurrences.contiguous(), new_pos.contiguous()
    spread = None if spread is None else spread.contiguous()
    library().dyn_rows_of_new(
        ptr(table_rows),
        table_rows.element_size(),
        slot_step(table_rows),
        ptr(occurrences),
        ptr(spread),
        occurrences.numel(),
        ptr(new_pos),
        ptr(pos),
        ptr(rows),
        threads(),
    )
