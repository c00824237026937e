"""Cuckoo moves: free one slot in each full bucket of a list by moving one of its keys to its
other candidate bucket, recursively up to a depth (docs/design/0006).

The plain-torch twins are ``BatchPlacement._make_room`` and its ``_move_out``
(:mod:`dynemb.table.placement`); ``make_room_native`` runs ``move.cpp`` in one call (the
pending keys' buckets, the same moves in the same order, which keys have room now).

Slots known before the moves (the batch's found keys, the new keys placed) follow them:
``follow_torch`` (a sort and a binary search per step) and ``follow_native`` (``dyn_follow``: a
small hash table of the moved slots per step, each position looked up once) give the same slots.
"""

from __future__ import annotations

import torch

from dynemb.kernels import library, move_args, ptr, threads

# The deepest chain the kernel's output bounds cover (the index's MOVE_DEPTH).
MAX_DEPTH = 2


def make_room_native(
    table_keys: torch.Tensor,
    tags: torch.Tensor,
    table_rows: torch.Tensor,
    table_scores: torch.Tensor,
    segments,
    keys: torch.Tensor,
    seg: torch.Tensor | None,
    depth: int,
    deep_limit: int,
) -> tuple[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """``BatchPlacement._make_room`` of P pending keys (``seg``: their segments or None) by
    ``dyn_make_room``: the same moves in the same order, the same room and stuck flags. The
    index must have a free slot (the method returns early otherwise).

    Returns:
        room, stuck (Tensor[bool]): [P] as ``_make_room``; moves: (from, to) slot tensors, one
        pair per step, in the order applied.
    """
    if depth > MAX_DEPTH:
        raise ValueError(f"depth={depth}: the move kernel covers chains of at most {MAX_DEPTH}")
    keys = keys.contiguous()
    seg = None if seg is None else seg.contiguous()
    p, W = keys.numel(), table_keys.shape[1]
    capacity = 2 * p * (W + 2)
    room, stuck = torch.empty(p, dtype=torch.bool), torch.empty(p, dtype=torch.bool)
    src, dst = torch.empty(capacity, dtype=torch.int64), torch.empty(capacity, dtype=torch.int64)
    steps = torch.empty(8, dtype=torch.int64)
    n_out = torch.zeros(2, dtype=torch.int64)
    of_bucket = segments.of_bucket
    s = library().dyn_make_room(
        *move_args(table_keys, tags, table_rows, table_scores),
        ptr(of_bucket),
        None if of_bucket is None else ptr(segments.counts),
        None if of_bucket is None else ptr(segments.offsets),
        ptr(keys),
        ptr(seg),
        p,
        depth,
        deep_limit,
        ptr(room),
        ptr(stuck),
        ptr(src),
        ptr(dst),
        capacity,
        ptr(steps),
        steps.numel(),
        ptr(n_out),
        threads(),
    )
    if s < 0:
        raise RuntimeError("move kernel: more moves than its output bounds (a bug: the index is unchanged only if none ran)")
    moves, start = [], 0
    for n in steps[:s].tolist():
        moves.append((src[start : start + n], dst[start : start + n]))
        start += n
    return room, stuck, moves


def follow_torch(positions: torch.Tensor, moves: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Flat slots after keys moved: each step's (from, to) slots ([m] each, from distinct)
    applied in order to positions ([n], -1 for none); returns a new [n] tensor."""
    for src, dst in moves:
        if src.numel() == 0:
            continue
        by_src = torch.sort(src)
        at = torch.searchsorted(by_src.values, positions).clamp_(max=src.numel() - 1)
        hit = by_src.values.index_select(0, at) == positions
        positions = torch.where(hit, dst.index_select(0, by_src.indices.index_select(0, at)), positions)
    return positions


def follow_native(positions: torch.Tensor, moves: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """:func:`follow_torch` by ``dyn_follow``, one call a step (bitwise the same)."""
    return follow_all_native([positions], moves)[0]


def follow_all_native(tensors: list[torch.Tensor], moves: list[tuple[torch.Tensor, torch.Tensor]], *, inplace: bool = False) -> list[torch.Tensor]:
    """:func:`follow_native` of several position tensors at once (each step's moves hashed once
    for all); ``inplace``: each contiguous tensor is updated in place (no fresh copy to page in)."""
    outs = [t if inplace and t.is_contiguous() else t.clone(memory_format=torch.contiguous_format) for t in tensors]
    addresses = torch.tensor([t.data_ptr() for t in outs], dtype=torch.int64)
    lens = torch.tensor([t.numel() for t in outs], dtype=torch.int64)
    for src, dst in moves:
        if src.numel():
            src, dst = src.contiguous(), dst.contiguous()
            library().dyn_follow(ptr(addresses), ptr(lens), len(outs), ptr(src), ptr(dst), src.numel(), threads())
    return outs
