"""Find keys in the bucketed index: the flat slot of each key (-1 where absent).

N keys, B buckets, W slots per bucket. A key may live at any slot of its two candidate buckets
(b1, b2); its slot is the first match among b1's W slots, then b2's.

``locate_torch`` is the plain-torch twin; ``locate_native`` runs ``locate.cpp``, which computes
the candidates itself (the bits of :mod:`dynemb.hashing`) and can return the row ids too.
"""

from __future__ import annotations

import torch

from dynemb.kernels import library, ptr, slot_step, threads


def locate_torch(
    table_keys: torch.Tensor, tags: torch.Tensor, b1: torch.Tensor, b2: torch.Tensor, keys: torch.Tensor, workspace
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat slot of each key ([N] int64, -1 if absent) and whether it is present ([N] bool).

    Args:
        table_keys (Tensor[int64]), tags (Tensor[uint8]): [B, W] the index's slots (a slot is
            used where its tag is not 0).
        b1, b2 (Tensor[int64]): [N] each key's candidate buckets.
        keys (Tensor[int64]): [N].
        workspace: a :class:`dynemb.workspace.Workspace` for the [2N, W] candidates.
    """
    W = table_keys.shape[1]
    buckets = torch.stack([b1, b2], 1).view(-1)  # [2N]
    n = keys.numel()
    cand = torch.index_select(table_keys, 0, buckets, out=workspace.get("cand", 2 * n, (W,), torch.int64))
    cand_tags = torch.index_select(tags, 0, buckets, out=workspace.get("tags", 2 * n, (W,), torch.uint8))
    match = torch.eq(cand.view(n, 2 * W), keys[:, None], out=workspace.get("match", n, (2 * W,), torch.bool))
    match &= cand_tags.view(n, 2 * W) != 0
    # First matching slot among the 2W (when both candidates are one bucket it matches twice);
    # argmax is 0 where nothing matches, and the match there says whether the key was found.
    slot = match.view(torch.uint8).argmax(1)
    found = match.gather(1, slot[:, None]).squeeze(1)
    bucket = torch.where(slot < W, b1, b2)
    pos = torch.where(found, bucket * W + slot % W, -1)
    return pos, found


def locate_native(
    table_keys: torch.Tensor,
    tags: torch.Tensor,
    segments,
    keys: torch.Tensor,
    seg: torch.Tensor | None,
    table_rows: torch.Tensor | None = None,
    *,
    slots: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """As :func:`locate_torch`, candidates computed in the kernel; also each key's row id
    ([N] int64, -1 where absent) when ``table_rows`` ([B, W] int32 or int64) is given. With
    ``slots=False`` the slots are not written and None comes back in their place (a find needs
    the row ids only).

    Args:
        segments: the index's :class:`dynemb.table.geometry.Segments` (bucket counts, offsets).
        seg (Tensor[int64] | None): [N] segment of each key, None for an index of one segment.
    """
    if keys.is_cuda:
        from dynemb.kernels.gpu.locate import locate_triton

        return locate_triton(table_keys, tags, segments, keys, seg, table_rows)
    keys = keys.contiguous()
    seg = None if seg is None else seg.contiguous()
    n = keys.numel()
    pos = torch.empty(n, dtype=torch.int64) if slots else None
    found = torch.empty(n, dtype=torch.bool)
    rows = None if table_rows is None else torch.empty(n, dtype=torch.int64)
    library().dyn_locate(
        ptr(table_keys),
        slot_step(table_keys),
        ptr(tags),
        table_keys.shape[1],
        table_keys.shape[0],
        ptr(keys),
        ptr(seg),
        None if seg is None else ptr(segments.counts),
        None if seg is None else ptr(segments.offsets),
        n,
        ptr(pos),
        ptr(found),
        ptr(table_rows),
        0 if table_rows is None else table_rows.element_size(),
        1 if table_rows is None else slot_step(table_rows),
        ptr(rows),
        threads(),
    )
    return pos, found, rows


def candidates_native(segments, keys: torch.Tensor, seg: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The two candidate buckets of keys ([N] -> two [N] int64), bitwise
    :meth:`dynemb.table.geometry.Segments.candidates` (its plain-torch twin)."""
    if keys.is_cuda:
        from dynemb.kernels.gpu.locate import candidates_triton

        return candidates_triton(segments, keys, seg)
    keys = keys.contiguous()
    seg = None if seg is None else seg.contiguous()
    n = keys.numel()
    b1, b2 = torch.empty(n, dtype=torch.int64), torch.empty(n, dtype=torch.int64)
    library().dyn_candidates(
        ptr(keys),
        ptr(seg),
        None if seg is None else ptr(segments.counts),
        None if seg is None else ptr(segments.offsets),
        segments.total,
        n,
        ptr(b1),
        ptr(b2),
        threads(),
    )
    return b1, b2
