"""Place keys whose candidate buckets are full by evicting, for each, the lowest-scored unlocked
key of its 2W candidate slots, round by round in priority order (docs/design/0006).

The plain-torch twin is ``BatchPlacement._evict_for`` (:mod:`dynemb.table.placement`);
``evict_for_native`` runs ``evict.cpp`` and gives the same slots, victims and order.
"""

from __future__ import annotations

import torch

from dynemb.kernels import library, ptr, slot_args, threads


def evict_for_native(
    table_keys: torch.Tensor,
    tags: torch.Tensor,
    table_scores: torch.Tensor,
    segments,
    keys: torch.Tensor,
    scores: torch.Tensor,
    seg: torch.Tensor | None,
    locked: torch.Tensor,
    lfu: bool,
    workspace,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Evict for P keys (in priority order); the table's keys and scores are written in place.

    Args:
        table_keys (Tensor[int64]), tags (Tensor[uint8], 0 where empty), table_scores (Tensor[int32|int64]):
            [B, W] the index's slots.
        segments: the index's :class:`dynemb.table.geometry.Segments`.
        keys, scores (Tensor[int64]): [P]; seg (Tensor[int64] | None): [P] their segments.
        locked (Tensor[int64]): [L] slots of the batch's keys, never victims.
        lfu: no score comparison (a new key evicts whatever the lowest score).
        workspace: a :class:`dynemb.workspace.Workspace` for the kernel's scratch.
    Returns:
        pos [P] (slot taken, -1 where the key failed), and the E slots taken with the keys and
        scores they held ([E] each), round by round, each round in priority order.
    """
    keys, scores, locked = keys.contiguous(), scores.contiguous(), locked.contiguous()
    seg = None if seg is None else seg.contiguous()
    n = keys.numel()
    pos = torch.empty(n, dtype=torch.int64)
    taken, old_keys, old_scores = (torch.empty(n, dtype=torch.int64) for _ in range(3))
    lib = library()
    B, W = table_keys.shape
    scratch_bytes = lib.dyn_evict_scratch_bytes(n, W, B)
    scratch = workspace.get("evict_for", (scratch_bytes + 7) // 8, (), torch.int64)
    e = lib.dyn_evict_for(
        *slot_args(table_keys, tags, table_scores),
        ptr(keys),
        ptr(scores),
        ptr(seg),
        None if seg is None else ptr(segments.counts),
        None if seg is None else ptr(segments.offsets),
        n,
        ptr(locked),
        locked.numel(),
        int(lfu),
        ptr(pos),
        ptr(taken),
        ptr(old_keys),
        ptr(old_scores),
        ptr(scratch),
        scratch_bytes,
        threads(),
    )
    if e < 0:
        raise RuntimeError(f"evict_for_native: scratch of {scratch.numel() * 8} bytes, {scratch_bytes} needed")
    return pos, taken[:e], old_keys[:e], old_scores[:e]
