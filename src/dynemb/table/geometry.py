"""Geometry of a key index: how many buckets, of how many slots, and which segment owns which.

S segments, N keys, B buckets in all, W slots per bucket.

Segment s owns the buckets ``[offset[s], offset[s] + buckets[s])`` and a key of segment s
hashes onto that range only: the two-choice multiply-shift bucketing of
:func:`dynemb.hashing.candidate_buckets` over ``buckets[s]`` buckets, shifted by the offset. An
index of one segment hashes over all its buckets, with no shift and no segment tensors.
"""

from __future__ import annotations

import torch

from dynemb.hashing import candidate_buckets

# Row ids are int32 while every row id of the index fits (capacity <= 2**31), else int64.
ROW_ID_LIMIT = 1 << 31
# Scores are stored as int32 until one does not fit; then the index widens them to int64.
SCORE_MIN, SCORE_MAX = -(1 << 31), (1 << 31) - 1


def row_dtype(capacity: int) -> torch.dtype:
    """Dtype of the stored row ids of an index of ``capacity`` slots (its row ids lie in
    ``[0, capacity)``)."""
    return torch.int32 if capacity <= ROW_ID_LIMIT else torch.int64


def bucket_width(capacity: int, bucket_capacity: int) -> int:
    """W an index really uses: ``bucket_capacity``, or ``capacity`` when that is smaller (one bucket)."""
    return min(bucket_capacity, capacity)


def plan_buckets(capacity: int, init_capacity: int | None, bucket_capacity: int) -> tuple[int, int]:
    """(initial buckets, maximum buckets) of :func:`bucket_width` slots each.

    The maximum is ``initial * 2**k`` with ``capacity <= maximum * W <= 2 * capacity``: k is the
    largest number of doublings, at most the ``floor(log2(capacity / init_capacity))`` that
    ``init_capacity`` implies, that keeps the rounding within 2x (k = 0 always does, as
    ``ceil(C / W) * W < C + W``). Then ``initial * W >= init_capacity``, and it may be larger.
    When ``capacity < bucket_capacity`` the index is one bucket of ``capacity`` slots.
    """
    if capacity < bucket_capacity:
        return 1, 1
    W = bucket_capacity
    init = capacity if init_capacity is None else init_capacity
    doublings = (capacity // init).bit_length() - 1
    needed = -(-capacity // W)
    for k in range(doublings, -1, -1):
        max_buckets = ((needed + (1 << k) - 1) >> k) << k
        if max_buckets * W <= 2 * capacity:
            return max_buckets >> k, max_buckets
    raise AssertionError("unreachable: k = 0 always fits")


def rounded_capacity(capacity: int, init_capacity: int | None, bucket_capacity: int) -> int:
    """The capacity an index of these arguments really has (in [capacity, 2 * capacity])."""
    return plan_buckets(capacity, init_capacity, bucket_capacity)[1] * bucket_width(capacity, bucket_capacity)


def bytes_per_slot(capacity: int, wide_scores: bool = False) -> int:
    """Bytes of one slot of an index of ``capacity`` slots: key (int64), row id (int32 below
    2**31 slots, else int64), score (int32, int64 once widened) and the tag byte (0: empty; docs/design/0039). See
    docs/design/0035-index-memory.md."""
    return 8 + row_dtype(capacity).itemsize + (8 if wide_scores else 4) + 1


def index_bytes(num_slots: int, capacity: int | None = None, wide_scores: bool = False) -> int:
    """Bytes the index tensors take for ``num_slots`` slots of an index of ``capacity`` slots
    at most (default ``num_slots``); the free list adds at most 8 bytes per released row id."""
    return bytes_per_slot(num_slots if capacity is None else capacity, wide_scores) * num_slots


def is_doubling_of(buckets: int, initial: int, maximum: int) -> bool:
    """Whether an index planned to grow from ``initial`` to ``maximum`` buckets passes through ``buckets``."""
    return initial <= buckets <= maximum and maximum % buckets == 0 and (maximum // buckets).bit_count() == 1


class Segments:
    """The bucket ranges of S segments laid end to end (segment 0 first).

    Attributes:
        buckets (list[int]): [S] buckets of each segment now.
        total (int): B, their sum.
        counts, offsets (Tensor[int64]): [S] buckets and first bucket of each segment (on the
            index's device).
        of_bucket (Tensor[int64] | None): [B] segment of each bucket; None for one segment.
    """

    def __init__(self, buckets: list[int], device: torch.device):
        self.buckets = list(buckets)
        self.total = sum(self.buckets)
        # Kept across calls: never inference tensors, even when created under inference mode.
        with torch.inference_mode(False):
            self.counts = torch.tensor(self.buckets, dtype=torch.int64, device=device)
            self.offsets = torch.cumsum(self.counts, 0) - self.counts
            many = len(self.buckets) > 1
            self.of_bucket = torch.repeat_interleave(torch.arange(len(self.buckets), device=device), self.counts) if many else None

    def candidates(self, keys: torch.Tensor, seg: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The two candidate buckets of keys ([N] -> two [N] int64, global bucket ids); ``seg``
        ([N] segment of each key) is None for an index of one segment."""
        if seg is None:
            return candidate_buckets(keys, self.total)
        b1, b2 = candidate_buckets(keys, self.counts.index_select(0, seg))
        off = self.offsets.index_select(0, seg)
        return b1 + off, b2 + off

    def segment_of(self, buckets: torch.Tensor) -> torch.Tensor | None:
        """Segment of each bucket ([N] -> [N]); None for one segment."""
        return None if self.of_bucket is None else self.of_bucket.index_select(0, buckets)

    def slot_range(self, segment: int, W: int) -> tuple[int, int]:
        """Flat slots [lo, hi) of one segment."""
        lo = sum(self.buckets[:segment]) * W
        return lo, lo + self.buckets[segment] * W

    def to(self, device: torch.device) -> Segments:
        return Segments(self.buckets, device)
