"""The placement passes after the first, for an index that cannot grow, in one call.

M new keys of a call (priority order), P of them pending, U keys in the call. The plain-torch
twin is the loop of ``BatchPlacement._place_rest`` (:mod:`dynemb.table.placement`) without its
growth and displacement branches: try the hopeful pending keys (at most 4x the free slots),
make room by cuckoo moves (``_make_room``), follow the call's slots through the moves, place the
keys that got room (``_place_free``, one free-list allocation a round), and again, until every
key is placed or no tried key got room. ``place_rest_native`` runs ``rest.cpp``, which calls the
same compiled kernels in the same order (``dyn_make_room``, ``dyn_follow``, ``dyn_place_free``),
so the slots, row ids and moves are those of the loop on the native backend (docs/design/0045).
"""

from __future__ import annotations

import torch

from dynemb.kernels import library, move_args, ptr, threads
from dynemb.kernels.place import MAX_ROUNDS

# Placement calls the kernel makes before it hands back (each adds at most MAX_ROUNDS
# allocations); a call that needs more stops there with keys pending, and the caller goes on.
MAX_PASSES = 64


def place_rest_native(
    table_keys: torch.Tensor,
    tags: torch.Tensor,
    table_rows: torch.Tensor,
    table_scores: torch.Tensor,
    segments,
    keys: torch.Tensor,
    scores: torch.Tensor,
    seg: torch.Tensor | None,
    pending: torch.Tensor,
    waiting: torch.Tensor,
    hopeful: torch.Tensor,
    pos: torch.Tensor,
    new_pos: torch.Tensor,
    free_slots: int,
    depth: int,
    give_up: int,
    free_ids: torch.Tensor,
    high_water: int,
    per_segment: torch.Tensor | None = None,
    segment_free: torch.Tensor | None = None,
) -> tuple[int, torch.Tensor, bool, list[int], int]:
    """Place the ``pending`` new keys by cuckoo moves and free slots, in place.

    Args:
        table_keys (Tensor[int64]), tags (Tensor[uint8]), table_rows, table_scores
            (Tensor[int32|int64]): [B, W] the index's slots, written as keys move and are placed.
        segments: the index's :class:`dynemb.table.geometry.Segments`.
        keys, scores (Tensor[int64]): [M] the new keys in priority order, their scores (which
            fit ``table_scores``); seg (Tensor[int64] | None): [M] their segments.
        pending (Tensor[int64]): [P] ranks into ``keys`` waiting for a slot, ascending.
        waiting, hopeful (Tensor[bool]): [M] contiguous, updated in place: the keys waiting, and
            those moves may still help.
        pos (Tensor[int64]): [U], new_pos (Tensor[int64]): [M] contiguous: the call's slots and
            the new keys' (-1: none), followed through the moves and filled in place.
        free_slots: empty slots of the index; depth: the longest chain of moves; give_up: moves
            stop for the call after a pass that made room for fewer than 1 in ``give_up`` keys.
        free_ids (Tensor[int64]): the free list's reusable ids; high_water: its first fresh id.
        per_segment (Tensor[int64] | None): [S] with ``seg``: each segment's placed keys are added.
        segment_free (Tensor[int64] | None): [S] with ``seg``, contiguous: each segment's empty
            slots, taken in place as keys are placed; the pending keys of a segment with none
            lose hope before a pass (as ``BatchPlacement._hope_in_room``).
    Returns:
        (code, pending, gave_up, allocations, placed): 0 every key placed; 1 the last pass had no
        key to place (the caller goes on with displacement, then eviction); 2 handed back after
        MAX_PASSES placement calls, keys pending (call again); -1 a kernel's output bound was
        exceeded (a bug; the passes before it are done and reported). Then the ranks still
        pending ([P'], ascending); whether moves were given up for the rest of the call; the row
        ids each placement round took (the free list's allocations to commit, in turn); the keys
        placed.
    """
    for name, t in (("waiting", waiting), ("hopeful", hopeful), ("pos", pos), ("new_pos", new_pos)):
        if not t.is_contiguous():
            raise ValueError(f"{name}: must be contiguous (it is updated in place)")
    keys, scores, free_ids = keys.contiguous(), scores.contiguous(), free_ids.contiguous()
    seg = None if seg is None else seg.contiguous()
    pending = pending.to(torch.int64, copy=True)
    of_bucket = segments.of_bucket
    with_segments = seg is not None or of_bucket is not None
    allocations = torch.zeros(MAX_PASSES * MAX_ROUNDS, dtype=torch.int64)
    out = torch.zeros(4, dtype=torch.int64)
    code = library().dyn_place_rest(
        *move_args(table_keys, tags, table_rows, table_scores),
        ptr(of_bucket),
        ptr(segments.counts) if with_segments else None,
        ptr(segments.offsets) if with_segments else None,
        ptr(keys),
        ptr(scores),
        ptr(seg),
        keys.numel(),
        ptr(pending),
        pending.numel(),
        ptr(waiting),
        ptr(hopeful),
        ptr(pos),
        pos.numel(),
        ptr(new_pos),
        free_slots,
        depth,
        give_up,
        ptr(free_ids),
        free_ids.numel(),
        high_water,
        ptr(allocations),
        allocations.numel(),
        ptr(per_segment),
        ptr(segment_free if seg is not None else None),
        ptr(out),
        threads(),
    )
    left, gave_up, n_alloc, placed = out.tolist()
    return code, pending[:left], bool(gave_up), allocations[:n_alloc].tolist(), placed
