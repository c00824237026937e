"""Cuckoo moves: free one slot in each full bucket of a list by moving one of its keys to its
other candidate bucket, recursively up to a depth (docs/design/0006).

The plain-torch twin is ``BatchPlacement._move_out`` (:mod:`dynemb.table.placement`);
``move_out_native`` runs ``move.cpp`` and makes the same moves in the same order.
"""

from __future__ import annotations

import torch

from dynemb.kernels import library, ptr

# The deepest chain the kernel's output bounds cover (the index's MOVE_DEPTH).
MAX_DEPTH = 2


def move_out_native(
    table_keys: torch.Tensor,
    tags: torch.Tensor,
    table_rows: torch.Tensor,
    table_scores: torch.Tensor,
    segments,
    buckets: torch.Tensor,
    depth: int,
    deep_limit: int,
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Move keys out of the full buckets of ``buckets`` ([Q] distinct); the index's slots are
    written in place.

    Args:
        table_keys (Tensor[int64]), tags (Tensor[uint8], 0 where empty), table_rows (Tensor[int32|int64]),
            table_scores (Tensor[int32|int64]): [B, W] the index's slots.
        segments: the index's :class:`dynemb.table.geometry.Segments`.
        depth: at most :data:`MAX_DEPTH`; deep_limit: buckets explored one level deeper.
    Returns:
        The buckets none of whose keys could move ([S] int64) and the moves, one (from, to) pair
        of [m] slot tensors per invocation that met a full bucket, in call order.
    """
    if depth > MAX_DEPTH:
        raise ValueError(f"depth={depth}: the move kernel covers chains of at most {MAX_DEPTH}")
    buckets = buckets.contiguous()
    q, W = buckets.numel(), table_keys.shape[1]
    capacity = q * (W + 2)
    stuck = torch.empty(q, dtype=torch.int64)
    src, dst = torch.empty(capacity, dtype=torch.int64), torch.empty(capacity, dtype=torch.int64)
    steps = torch.empty(8, dtype=torch.int64)
    n_out = torch.zeros(2, dtype=torch.int64)
    of_bucket = segments.of_bucket
    s = library().dyn_move_out(
        ptr(table_keys),
        ptr(tags),
        ptr(table_rows),
        table_rows.element_size(),
        ptr(table_scores),
        table_scores.element_size(),
        W,
        table_keys.shape[0],
        ptr(of_bucket),
        None if of_bucket is None else ptr(segments.counts),
        None if of_bucket is None else ptr(segments.offsets),
        ptr(buckets),
        q,
        depth,
        deep_limit,
        ptr(stuck),
        ptr(src),
        ptr(dst),
        capacity,
        ptr(steps),
        steps.numel(),
        ptr(n_out),
    )
    if s < 0:
        raise RuntimeError("move kernel: more moves than its output bounds (a bug: the index is unchanged only if none ran)")
    moves, start = [], 0
    for n in steps[: int(n_out[1])].tolist():
        moves.append((src[start : start + n], dst[start : start + n]))
        start += n
    return stuck[:s], moves
