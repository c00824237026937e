"""The first part of an upsert of U distinct keys: locate them, give the found keys this
call's score (lfu: add their counts, saturating at the int64 maximum), and list the missing
keys in priority order (higher score first, ties in key order; key order alone when every key
has the same score).

The plain-torch twin is ``BatchPlacement._found_and_missing`` (:mod:`dynemb.table.placement`);
``found_and_missing_native`` runs ``upsert.cpp`` and gives the same slots, scores and order.
"""

from __future__ import annotations

import torch

from dynemb.kernels import library, ptr, slot_args, slot_step, threads

# As common.h: the widest bucket whose free slots pack_choice can hold.
PACKED_FREE_MAX_W = 65534
# pack_choice holds bucket ids below 2^31.
PACKED_MAX_BUCKETS = 1 << 31


def found_and_missing_native(
    table_keys: torch.Tensor,
    tags: torch.Tensor,
    table_scores: torch.Tensor,
    segments,
    keys: torch.Tensor,
    seg: torch.Tensor | None,
    batch_scores: torch.Tensor,
    counts: torch.Tensor,
    lfu_add: bool,
    uniform: bool,
    table_rows: torch.Tensor | None = None,
    workspace=None,
    free_info: bool = False,
    absent: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None] | None:
    """Returns pos [U] (-1 where missing), found [U], missing [M] (indices into keys), with
    ``table_rows`` ([B, W] int32 or int64) the found keys' row ids ([U] int64, -1 where
    missing; read in the probe, from the score's line when the slots are packed), else None,
    the free slots asked for with ``free_info`` (else None), and with ``absent`` ~found ([U]
    bool, written by the probe beside found: no tensor operation after it), else None; None in
    all when a score of this call does not fit ``table_scores``' int32 (then nothing was written).

    Args:
        table_keys (Tensor[int64]), tags (Tensor[uint8], 0 where empty), table_scores (Tensor[int32|int64]):
            [B, W] the index's slots; the found keys' scores are written in place.
        segments: the index's :class:`dynemb.table.geometry.Segments`.
        keys (Tensor[int64]): [U] distinct; seg (Tensor[int64] | None): [U] their segments.
        batch_scores, counts (Tensor[int64]): [U] this call's score and count of each key (the
            scores may be a stride-0 view of one value).
        workspace: a :class:`dynemb.workspace.Workspace` or None; with one, ``missing`` (and
            the free slots below) are views of its buffers, valid until the next call with it.
        free_info: also return, for each missing key, the first placement round's choice
            between its two candidate buckets as the probe saw them ([U] int64, ``pack_choice``
            of common.h: the bucket, its first free slot and free slots; meaningful at the
            missing keys), for the first round of :func:`dynemb.kernels.place.place_free_native`
            and :func:`dynemb.kernels.insert.insert_new_native`; None when not asked for, with
            ``lfu_add`` or with buckets too wide to pack.
    """
    keys, counts = keys.contiguous(), counts.contiguous()
    # One score for every key may come as a stride-0 view (KeyIndex._batch_scores): read as such.
    if batch_scores.numel() > 1 and batch_scores.stride(0) == 0:
        score_stride = 0
    else:
        batch_scores, score_stride = batch_scores.contiguous(), 1
    seg = None if seg is None else seg.contiguous()
    n = keys.numel()
    pos = torch.empty(n, dtype=torch.int64)
    found = torch.empty(n, dtype=torch.bool)
    not_found = torch.empty(n, dtype=torch.bool) if absent else None
    missing = torch.empty(n, dtype=torch.int64) if workspace is None else workspace.get("missing", n, (), torch.int64)
    rows = None if table_rows is None else torch.empty(n, dtype=torch.int64)
    info = None
    if free_info and not lfu_add and table_keys.shape[1] <= PACKED_FREE_MAX_W and table_keys.shape[0] < PACKED_MAX_BUCKETS:
        info = torch.empty(n, dtype=torch.int64) if workspace is None else workspace.get("free_info", n, (), torch.int64)
    m = library().dyn_upsert_found(
        *slot_args(table_keys, tags, table_scores),
        ptr(table_rows),
        0 if table_rows is None else table_rows.element_size(),
        1 if table_rows is None else slot_step(table_rows),
        ptr(keys),
        ptr(seg),
        None if seg is None else ptr(segments.counts),
        None if seg is None else ptr(segments.offsets),
        n,
        ptr(batch_scores),
        score_stride,
        ptr(counts),
        int(lfu_add),
        int(uniform),
        ptr(pos),
        ptr(found),
        ptr(missing),
        ptr(rows),
        ptr(info),
        ptr(not_found),
        threads(),
    )
    if m < 0:
        return None
    # Every key missing (an insert): the buffer itself, no view (a tensor operation after the
    # kernel costs tens of microseconds).
    return pos, found, missing if m == n else missing[:m], rows, info, not_found
