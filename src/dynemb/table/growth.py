"""Growth of a key index: a segment doubles its buckets and every key is re-placed (keys, row
ids and scores; never rows).

M new keys of a call, S segments, K keys held, B buckets, W slots per bucket.

When a segment grows, multiply-shift bucketing sends its local bucket c to local buckets
``c * 2**d ... (c + 1) * 2**d - 1`` for both choices (d doublings), so a key moves to a child of
the candidate it sat in and re-placement never overflows. Segments that do not grow keep every
key's local bucket and slot; their buckets only shift when an earlier segment grows. Triggers
(docs/design/0025-one-index.md): before placing a batch, each segment whose load would pass
``max_load_factor`` doubles until it would not (or reaches its maximum); while placing, a
segment with keys that found no free slot doubles once more, below its maximum.
"""

from __future__ import annotations

import torch

from dynemb.table.geometry import Segments
from dynemb.table.placement import group_by_bucket


class Growth:
    """The growth steps of :class:`dynemb.table.index.KeyIndex` (a mixin, like
    :class:`dynemb.table.placement.BatchPlacement`)."""

    def _can_grow(self) -> bool:
        """Whether some segment is below its maximum buckets."""
        return self.num_buckets < self.max_buckets

    def _would_grow(self, missing: int, new_seg: torch.Tensor | None) -> bool:
        """Whether :meth:`_grow_before` would grow the index for these new keys (nothing changes)."""
        if not self._can_grow():
            return False
        if new_seg is None:
            return self._size + missing > self.max_load_factor * self.current_capacity()
        return any(self._doublings_before(new_seg))

    def _doublings_before(self, new_seg: torch.Tensor) -> list[int]:
        """How many times each segment must double so that placing its new keys (``new_seg``:
        [M] their segments) keeps it under ``max_load_factor``, within its maximum buckets."""
        W, limit = self.bucket_capacity, self.max_load_factor
        sizes = self._segment_size.tolist()
        adding = torch.bincount(new_seg, minlength=self.num_segments).tolist()
        doublings = []
        for size, add, buckets, most in zip(sizes, adding, self._segments.buckets, self._segment_max_buckets):
            d = 0
            while (buckets << d) < most and size + add > limit * ((buckets << d) * W):
                d += 1
            doublings.append(d)
        return doublings

    def _grow_before(self, missing: int, new_seg: torch.Tensor | None) -> bool:
        """Double every segment that placing its new keys would take past ``max_load_factor``
        (``missing``: M new keys; ``new_seg``: [M] their segments, None with one segment).
        Returns whether the index grew."""
        if not self._can_grow():
            return False
        if new_seg is None:
            grown = False
            while self._would_grow(missing, None):
                self._grow_segments([1])
                grown = True
            return grown
        doublings = self._doublings_before(new_seg)
        if not any(doublings):
            return False
        self._grow_segments(doublings)
        return True

    def _grow_for(self, pending_seg: torch.Tensor | None) -> bool:
        """Double once each segment below its maximum that has keys left without a free slot
        (``pending_seg``: [P] their segments, None with one segment). Returns whether it grew."""
        if not self._can_grow():
            return False
        if pending_seg is None:
            self._grow_segments([1])
            return True
        present = torch.bincount(pending_seg, minlength=self.num_segments).tolist()
        doublings = [int(bool(n) and b < most) for n, b, most in zip(present, self._segments.buckets, self._segment_max_buckets)]
        if not any(doublings):
            return False
        self._grow_segments(doublings)
        return True

    def _grow_segments(self, doublings: list[int]) -> None:
        """Double segment s's buckets ``doublings[s]`` times ([S] ints >= 0) and re-place every
        key; counts one growth per doubling. The new tensors are allocated first, so a failed
        allocation leaves the index as it was."""
        W = self.bucket_capacity
        old = self._segments
        new = Segments([b << d for b, d in zip(old.buckets, doublings)], self.device)
        tables = self._new_tables(new.total)
        used = self._tags.view(-1).nonzero().squeeze(1)  # [K]
        keys = self._keys.view(-1).index_select(0, used)
        if old.of_bucket is None:
            # A key in old bucket c (its first or second candidate) goes to that candidate's child.
            old1, _ = old.candidates(keys, None)
            new1, new2 = new.candidates(keys, None)
            order, bucket, rank = group_by_bucket(torch.where(old1 == used // W, new1, new2))
            src, pos = order, bucket * W + rank
        else:
            seg = old.of_bucket.index_select(0, used // W)
            grows = torch.tensor([d > 0 for d in doublings], device=self.device).index_select(0, seg)
            moved, kept = grows.nonzero().squeeze(1), (~grows).nonzero().squeeze(1)
            shift = (new.offsets - old.offsets).index_select(0, seg.index_select(0, kept)) * W
            m_keys, m_seg, m_used = keys.index_select(0, moved), seg.index_select(0, moved), used.index_select(0, moved)
            old1, _ = old.candidates(m_keys, m_seg)
            new1, new2 = new.candidates(m_keys, m_seg)
            order, bucket, rank = group_by_bucket(torch.where(old1 == m_used // W, new1, new2))
            src = torch.cat([kept, moved.index_select(0, order)])
            pos = torch.cat([used.index_select(0, kept) + shift, bucket * W + rank])
        at = used.index_select(0, src)
        new_keys, new_tags, new_rows, new_scores = tables
        for table, out in ((self._keys, new_keys), (self._tags, new_tags), (self._rows, new_rows), (self._scores, new_scores)):
            out.view(-1).scatter_(0, pos, table.view(-1).index_select(0, at))
        self._segments = new
        self._set_tables(tables)
        self._stats["growths"] += sum(doublings)
