"""The new keys of a find_or_insert under one clock value: placed, given row ids and put into the
call's result in one call, from the missing keys as the upsert's probe left them (repeats
included, in the call's order).

U keys in the call, m places of missing keys among them. The plain-torch twin is the sequence
``insert_new_native`` replaces in ``BatchPlacement._upsert`` (:mod:`dynemb.table.placement`): the
missing keys sorted and de-duplicated (``sort_unique_first_torch``), placed in priority order
(``BatchPlacement._place_free``, the rule of ``place.py``), one free-list allocation of row ids
per placement round, and ``rows_of_new_torch``. The kernel gives the same slots, row ids, free
list and result without sorting the keys (docs/design/0043).
"""

from __future__ import annotations

import torch

from dynemb.kernels import library, ptr, slot_args, slot_step, threads
from dynemb.kernels.place import MAX_ROUNDS

# int64 scratch entries per missing place (insert.cpp's SCRATCH_PER_KEY).
SCRATCH_PER_KEY = 12


def insert_new_native(
    table_keys: torch.Tensor,
    tags: torch.Tensor,
    table_scores: torch.Tensor,
    table_rows: torch.Tensor,
    segments,
    keys: torch.Tensor,
    seg: torch.Tensor | None,
    missing: torch.Tensor,
    score: int,
    pre_free: torch.Tensor | None,
    free_ids: torch.Tensor,
    high_water: int,
    pos: torch.Tensor,
    rows: torch.Tensor,
    workspace,
    per_segment: torch.Tensor | None = None,
) -> tuple[list[int], torch.Tensor] | None:
    """Place the missing keys of one segment's index, in place; returns the slots each round took
    (the free list's allocations to commit, in turn) and the places left without a slot ([left],
    in ``missing``'s order, a view of ``workspace``; empty: every new key placed), or None where
    the kernel cannot take the call (nothing was written: buckets of more than
    ``PACKED_FREE_MAX_W`` slots, or 2^31 buckets or more).

    Args:
        table_keys (Tensor[int64]), tags (Tensor[uint8]), table_scores (Tensor[int32|int64]),
            table_rows (Tensor[int32|int64]): [B, W] the index's slots, written where keys are placed.
        segments: the index's :class:`dynemb.table.geometry.Segments`.
        keys (Tensor[int64]): [U] the call's keys; seg (Tensor[int64] | None): [U] their
            segments (None: one segment); missing (Tensor[int64]): [m] places in ``keys`` of the
            missing ones (a key may repeat only without ``seg``).
        score: the call's score, every new key's (fits ``table_scores``' dtype).
        pre_free (Tensor[int64] | None): [U] the first round's choice of each place's candidate
            as the probe saw them (``pack_choice``, from
            :func:`dynemb.kernels.upsert.found_and_missing_native`), or None.
        free_ids (Tensor[int64]): the free list's reusable ids (:meth:`FreeList.reusable`);
            high_water: its first never-used id.
        pos, rows (Tensor[int64]): [U] the call's result, written at the places of placed keys.
        workspace: a :class:`dynemb.workspace.Workspace` for the kernel's scratch.
        per_segment (Tensor[int64] | None): [S] with ``seg``: each segment's placed keys are added.
    """
    keys, missing, free_ids = keys.contiguous(), missing.contiguous(), free_ids.contiguous()
    seg = None if seg is None else seg.contiguous()
    m = missing.numel()
    rounds = torch.zeros(MAX_ROUNDS, dtype=torch.int64)
    left_places = workspace.get("insert_new.left", m, (), torch.int64)
    cap = SCRATCH_PER_KEY * m
    left = library().dyn_insert_new(
        *slot_args(table_keys, tags, table_scores),
        ptr(table_rows),
        table_rows.element_size(),
        slot_step(table_rows),
        ptr(keys),
        ptr(seg),
        None if seg is None else ptr(segments.counts),
        None if seg is None else ptr(segments.offsets),
        ptr(missing),
        m,
        score,
        ptr(pre_free),
        ptr(free_ids),
        free_ids.numel(),
        high_water,
        ptr(pos),
        ptr(rows),
        ptr(rounds),
        ptr(per_segment),
        ptr(left_places),
        ptr(workspace.get("insert_new", cap, (), torch.int64)),
        cap,
        threads(),
    )
    return None if left < 0 else ([r for r in rounds.tolist() if r], left_places[:left])
