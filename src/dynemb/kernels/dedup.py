"""A batch's distinct keys (or (segment, key) pairs), the inverse of each input and the counts.

N inputs, U distinct. Output order: ascending key (by segment, then key, with segments), as
``torch.unique(sorted=True)`` gives. ``dedup_torch`` is the plain-torch twin; ``dedup_native``
runs ``dedup.cpp`` (one hashing pass, a sort of the U distinct keys) and can also group the
inputs by key (``order``: input indices, each key's inputs together in input order, the keys in
output order), which lets a backward sum per key with one gather-sum.
"""

from __future__ import annotations

import torch

from dynemb.kernels import library, ptr, threads


def unique_pairs(first: torch.Tensor, second: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor, torch.Tensor]:
    """Distinct (first, second) pairs of two [N] int64 tensors, sorted by first, then second.

    Returns:
        (first, second) of the U distinct pairs ([U] each), inverse ([N], the pair of each
        input) and counts ([U]).
    """
    n = first.numel()
    if n:
        # Rank the second values, then one unique of (first - min) * ranks + rank: two uniques
        # instead of two stable sorts and their gathers, when the product fits in int64.
        second_values, rank = torch.unique(second, sorted=True, return_inverse=True)
        low, high = int(first.min()), int(first.max())
        width = second_values.numel()
        if (high - low + 1) * width < (1 << 62):
            composite = (first - low) * width + rank
            pairs, inverse, counts = torch.unique(composite, sorted=True, return_inverse=True, return_counts=True)
            return (pairs // width + low, second_values.index_select(0, pairs % width)), inverse, counts
    by_second = torch.sort(second, stable=True)
    by_first = torch.sort(first.index_select(0, by_second.indices), stable=True)
    order = by_second.indices.index_select(0, by_first.indices)  # [N] input index in pair order
    f, s = by_first.values, second.index_select(0, order)
    start = torch.ones_like(f, dtype=torch.bool)
    if f.numel() > 1:
        start[1:] = (f[1:] != f[:-1]) | (s[1:] != s[:-1])
    group = start.cumsum(0) - 1  # [N] pair id in sorted order
    inverse = torch.empty_like(group).scatter_(0, order, group)
    starts = start.nonzero().squeeze(1)
    counts = torch.diff(starts, append=starts.new_tensor([f.numel()]))
    return (f.index_select(0, starts), s.index_select(0, starts)), inverse, counts


def dedup_torch(keys: torch.Tensor, seg: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """(unique [U], their segments [U] or None, inverse [N], counts [U]) of keys [N] (seg [N])."""
    if seg is None:
        unique, inverse, counts = torch.unique(keys, sorted=True, return_inverse=True, return_counts=True)
        return unique, None, inverse, counts
    (useg, unique), inverse, counts = unique_pairs(seg, keys)
    return unique, useg, inverse, counts


def dedup_native(
    keys: torch.Tensor, seg: torch.Tensor | None = None, *, grouping: bool = False, workspace=None
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """As :func:`dedup_torch` (bitwise), plus ``order`` ([N] int64) with ``grouping``, else None.

    Args:
        keys (Tensor[int64]): [N] contiguous, on CPU.
        seg (Tensor[int64] | None): [N] segment of each key.
        workspace: a :class:`dynemb.workspace.Workspace` that keeps the hash table between
            calls (a fresh one each call page-faults), or None.
    """
    keys = keys.contiguous()
    if seg is None:
        return sort_unique_native(keys, grouping=grouping, workspace=workspace)
    seg = seg.contiguous()
    n = keys.numel()
    unique = torch.empty(n, dtype=torch.int64)
    useg = None if seg is None else torch.empty(n, dtype=torch.int64)
    inverse = torch.empty(n, dtype=torch.int64)
    counts = torch.empty(n, dtype=torch.int64)
    order = torch.empty(n, dtype=torch.int64) if grouping else None
    cap = 16
    while cap < 2 * n:
        cap *= 2
    scratch = torch.empty(3 * cap, dtype=torch.int64) if workspace is None else workspace.get("dedup", 3 * cap, (), torch.int64)
    u = library().dyn_dedup(ptr(keys), n, ptr(seg), ptr(unique), ptr(useg), ptr(inverse), ptr(counts), ptr(order), ptr(scratch), cap, threads())
    return unique[:u], None if useg is None else useg[:u], inverse, counts[:u], order


def sort_unique_native(
    keys: torch.Tensor, *, grouping: bool = False, workspace=None, segments: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`dedup_native` of keys without segments by ``dyn_sort_unique`` (a parallel sort:
    one most-significant-digit pass, then small sorts), bitwise ``torch.unique(sorted=True,
    return_inverse=True, return_counts=True)``; ``workspace`` keeps its [2N] scratch.

    ``segments`` ([N] int64, the table each key is read through) only labels the keys: the
    second output is then the segment of each distinct key's first input ([U], as
    ``segments[order[starts]]``), or None when some key's inputs lie in several segments (the
    caller then forms (segment, key) pairs). Without ``segments`` it is None."""
    keys = keys.contiguous()
    n = keys.numel()
    unique = torch.empty(n, dtype=torch.int64)
    inverse = torch.empty(n, dtype=torch.int64)
    counts = torch.empty(n, dtype=torch.int64)
    order = torch.empty(n, dtype=torch.int64) if grouping else None
    scratch = torch.empty(2 * n, dtype=torch.int64) if workspace is None else workspace.get("sort_unique", 2 * n, (), torch.int64)
    useg = mixed = None
    if segments is not None:
        segments = segments.contiguous()
        useg, mixed = torch.empty(n, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    u = library().dyn_sort_unique(
        ptr(keys), n, ptr(unique), ptr(inverse), ptr(counts), ptr(order), ptr(scratch), ptr(segments), ptr(useg), ptr(mixed), None, threads()
    )
    if useg is not None:
        useg = None if int(mixed) else useg[:u]
    return unique[:u], useg, inverse, counts[:u], order


def sort_unique_first_torch(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Distinct keys of ``keys`` ([N] int64) ascending [U], the inverse [N] and each distinct
    key's first place in ``keys`` [U]: ``torch.unique`` and a scatter of the smallest place."""
    unique, inverse = torch.unique(keys, sorted=True, return_inverse=True)
    places = torch.arange(keys.numel(), device=keys.device)
    first = torch.full_like(unique, keys.numel()).scatter_reduce_(0, inverse, places, reduce="amin")
    return unique, inverse, first


def sort_unique_first_native(keys: torch.Tensor, *, workspace=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`sort_unique_first_torch` by ``dyn_sort_unique`` (bitwise the same): the first
    places come out of the sort's last pass, which meets each key's inputs in input order.
    With a ``workspace`` the outputs are views of its buffers, valid until the next call with it
    (no fresh [N] tensors to page in)."""
    keys = keys.contiguous()
    n = keys.numel()
    if workspace is None:
        unique, inverse, counts, first = (torch.empty(n, dtype=torch.int64) for _ in range(4))
        scratch = torch.empty(2 * n, dtype=torch.int64)
    else:
        unique, inverse, counts, first = (workspace.get(f"sort_unique_first.{name}", n, (), torch.int64) for name in ("unique", "inverse", "counts", "first"))
        scratch = workspace.get("sort_unique", 2 * n, (), torch.int64)
    u = library().dyn_sort_unique(ptr(keys), n, ptr(unique), ptr(inverse), ptr(counts), None, ptr(scratch), None, None, None, ptr(first), threads())
    return unique[:u], inverse, first[:u]


def dedup(
    keys: torch.Tensor, seg: torch.Tensor | None = None, *, native: bool, grouping: bool = False, workspace=None
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """(unique [U], segments [U] or None, inverse [N], counts [U], grouping) of keys [N].

    ``grouping`` is (order [N], starts [U]) from the native kernel when asked for (the inputs
    grouped by key and where each key's group starts: what ``F.embedding_bag`` sums per key
    with), else None. ``workspace``: as :func:`dedup_native`.
    """
    if not native:
        return (*dedup_torch(keys, seg), None)
    unique, useg, inverse, counts, order = dedup_native(keys, seg, grouping=grouping, workspace=workspace)
    return unique, useg, inverse, counts, None if order is None else (order, counts.cumsum(0).sub_(counts))
