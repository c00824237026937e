"""Place new keys into free slots of their candidate buckets, round by round.

P keys (in priority order), B buckets, W slots per bucket. The rule (docs/design/0006): in each
round a key tries the candidate with more free slots (ties by a bit of the buckets, the other
candidate in the last round); the r-th key of a bucket takes its r-th free slot while r is below
the round's limit (half the free slots, rounded up, in the first rounds). The plain-torch twin is
``BatchPlacement._place_free`` (:mod:`dynemb.table.placement`); ``place_free_native`` runs
``place.cpp`` and gives the same slots.
"""

from __future__ import annotations

import torch

from dynemb.kernels import library, ptr, slot_step, threads

# As place.cpp: at most 8 halving rounds, then one filling the preferred candidate, one the other.
MAX_ROUNDS = 10


def place_free_native(
    table_keys: torch.Tensor,
    tags: torch.Tensor,
    table_scores: torch.Tensor,
    segments,
    keys: torch.Tensor,
    scores: torch.Tensor,
    seg: torch.Tensor | None,
    workspace,
    per_segment: torch.Tensor | None = None,
    keep: str | None = None,
    pre_free: torch.Tensor | None = None,
    pre_at: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Write keys and scores into free slots (in place) and say where.

    Args:
        table_keys (Tensor[int64]), tags (Tensor[uint8], 0 where empty), table_scores (Tensor[int32|int64]):
            [B, W] the index's slots, written in place.
        segments: the index's :class:`dynemb.table.geometry.Segments`.
        keys, scores (Tensor[int64]): [P]; scores already fit ``table_scores``' dtype.
        seg (Tensor[int64] | None): [P] segment of each key.
        workspace: a :class:`dynemb.workspace.Workspace` for the kernel's [8P] scratch.
        per_segment (Tensor[int64] | None): [S] with ``seg``: each segment's placed keys are
            added to it (the index's counters, without mapping slots back to segments).
        keep (str | None): a name: ``pos`` and ``order`` are then views of ``workspace``
            buffers of that name, valid until its next call with the same name.
        pre_free, pre_at (Tensor[int64] | None): the first round's free slots of key i's
            candidates, ``pre_free[pre_at[i]]`` (from
            :func:`dynemb.kernels.upsert.found_and_missing_native` on the table as it is now),
            so that the round does not read the tag lines again; None: read them.
    Returns:
        pos (Tensor[int64]): [P] slot taken, -1 where not placed.
        order (Tensor[int64]): [M] the M slots taken, in the order row ids are handed out
            (each round's slots ascending, the rounds in turn), as the twin allocates them.
        rounds (list[int]): slots taken by each round that placed keys (they sum to M): the
            twin asks the free list for each round's row ids in turn.
    """
    keys, scores = keys.contiguous(), scores.contiguous()
    pre_at = None if pre_free is None else pre_at.contiguous()
    seg = None if seg is None else seg.contiguous()
    n = keys.numel()
    if keep is None:
        pos, order = torch.empty(n, dtype=torch.int64), torch.empty(n, dtype=torch.int64)
    else:
        pos, order = (workspace.get(f"{keep}.{name}", n, (), torch.int64) for name in ("pos", "order"))
    rounds = torch.zeros(MAX_ROUNDS, dtype=torch.int64)
    cap = 8 * n
    m = library().dyn_place_free(
        ptr(table_keys),
        slot_step(table_keys),
        ptr(tags),
        ptr(table_scores),
        ptr(keys),
        ptr(scores),
        table_keys.shape[1],
        table_keys.shape[0],
        table_scores.element_size(),
        slot_step(table_scores),
        ptr(seg),
        None if seg is None else ptr(segments.counts),
        None if seg is None else ptr(segments.offsets),
        n,
        ptr(pos),
        ptr(order),
        ptr(rounds),
        ptr(workspace.get("place", cap, (), torch.int64)),
        cap,
        ptr(per_segment),
        ptr(pre_free),
        ptr(pre_at),
        threads(),
    )
    return pos, order[:m], [r for r in rounds.tolist() if r]
