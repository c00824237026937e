"""A key index whose buckets are split between segments: the tables of one collection group.

S segments, N keys in a call, B buckets in all, W slots per bucket.

Segment s owns the buckets ``[offset[s], offset[s] + buckets[s])``. A key of segment s hashes
onto that range only (the same two-choice multiply-shift bucketing as :class:`KeyIndex`, then
shifted by the offset), so keys of one segment never see, displace or evict keys of another:
each segment has its own capacity, scores and eviction, while one call places the keys of every
segment at once. Equal keys in different segments are different entries.

Segments do not grow: every segment is allocated at its full capacity (26 bytes per slot; rows
live in the store and are still handed out on demand by the shared free list). See
docs/design/0013-collections.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from dynemb.hashing import candidate_buckets
from dynemb.table.index import KeyIndex, _scalar, check_keys, unique_pairs
from dynemb.types import ScoreStrategy

_SEGMENT_COUNTERS = ("inserts", "evictions", "failed_inserts", "erased")


class SegmentedKeyIndex(KeyIndex):
    """Scored hash index over (segment, key) pairs, each segment with its own capacity.

    Every method of :class:`KeyIndex` that takes keys also takes ``segments=`` ([*] int64 like
    keys, each in ``[0, S)``), which is required here.

    Args:
        capacities: most keys of each segment ([S] ints >= 1); each is rounded up to whole
            buckets of ``bucket_capacity`` slots.
        bucket_capacity: W, slots per bucket (shared by every segment).
        score_strategy: meaning of scores, shared by every segment.
        device: where the index tensors live.
    """

    def __init__(
        self,
        *,
        capacities: Sequence[int],
        bucket_capacity: int = 16,
        score_strategy: ScoreStrategy | str = ScoreStrategy.TIMESTAMP,
        device: torch.device | str = "cpu",
    ):
        if not isinstance(capacities, (list, tuple)) or not capacities:
            raise ValueError(f"capacities={capacities!r}: must be a non-empty list of ints >= 1")
        for i, c in enumerate(capacities):
            if not isinstance(c, int) or isinstance(c, bool) or c < 1:
                raise ValueError(f"capacities[{i}]={c!r}: must be an int >= 1")
        if not isinstance(bucket_capacity, int) or isinstance(bucket_capacity, bool) or bucket_capacity < 1:
            raise ValueError(f"bucket_capacity={bucket_capacity!r}: must be an int >= 1")
        W = bucket_capacity
        buckets = [-(-c // W) for c in capacities]
        super().__init__(
            capacity=sum(buckets) * W,
            bucket_capacity=W,
            max_load_factor=1.0,
            score_strategy=score_strategy,
            device=device,
        )
        self.num_segments = len(buckets)
        self._set_segments(buckets)
        self._segment_stats = torch.zeros(len(_SEGMENT_COUNTERS), self.num_segments, dtype=torch.int64, device=self.device)

    def _set_segments(self, buckets: list[int]) -> None:
        with torch.inference_mode(False):
            self.segment_buckets = torch.tensor(buckets, dtype=torch.int64, device=self.device)
            self.segment_offsets = torch.cumsum(self.segment_buckets, 0) - self.segment_buckets
            self._segment_of_bucket = torch.repeat_interleave(torch.arange(len(buckets), device=self.device), self.segment_buckets)
        self._segment_buckets_list = list(buckets)

    # -- the hooks of KeyIndex -----------------------------------------------------------------

    def _buckets(self, keys: torch.Tensor, seg: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if seg is None:
            raise ValueError("segments=: a SegmentedKeyIndex needs the segment of every key")
        nb = self.segment_buckets.index_select(0, seg)
        off = self.segment_offsets.index_select(0, seg)
        b1, b2 = candidate_buckets(keys, nb)
        return b1 + off, b2 + off

    def _bucket_segments(self, buckets: torch.Tensor) -> torch.Tensor:
        return self._segment_of_bucket.index_select(0, buckets)

    def _count(self, name: str, positions: torch.Tensor | None = None, seg: torch.Tensor | None = None, n: int | None = None) -> None:
        super()._count(name, positions, seg, n)
        if name not in _SEGMENT_COUNTERS:
            return
        if positions is not None:
            seg = self._bucket_segments(positions // self.bucket_capacity)
        if seg is not None and seg.numel():
            row = self._segment_stats[_SEGMENT_COUNTERS.index(name)]
            row += torch.bincount(seg, minlength=self.num_segments)

    def _check_segments(self, segments: torch.Tensor | None, n: int) -> torch.Tensor:
        if segments is None:
            raise ValueError("segments=None: a SegmentedKeyIndex needs the segment of every key")
        seg = check_keys(segments, "segments", self.device)
        if seg.numel() != n:
            raise ValueError(f"segments has {seg.numel()} values for {n} keys")
        if seg.numel() and not bool(((seg >= 0) & (seg < self.num_segments)).all()):
            raise ValueError(f"segments: must lie in [0, {self.num_segments})")
        return seg

    def _can_grow(self) -> bool:
        return False

    def _state_buckets(self, keys: torch.Tensor, slots: torch.Tensor, num_buckets: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._buckets(keys, self._bucket_segments(slots // self.bucket_capacity))

    def _distinct_entries(self, keys: torch.Tensor, slots: torch.Tensor) -> int:
        return unique_pairs(self._bucket_segments(slots // self.bucket_capacity), keys)[2].numel()

    # -- per segment -----------------------------------------------------------------------------

    def segment_capacity(self, segment: int) -> int:
        """Most keys segment ``segment`` holds (its buckets times W)."""
        return self._segment_buckets_list[segment] * self.bucket_capacity

    def segment_sizes(self) -> torch.Tensor:
        """Keys held per segment ([S] int64)."""
        per_bucket = self._used.sum(1)
        return torch.zeros(self.num_segments, dtype=torch.int64, device=self.device).index_add_(0, self._segment_of_bucket, per_bucket)

    def segment_stats(self) -> list[dict[str, int | float]]:
        """Per segment: size, capacity, current_capacity, load_factor, inserts, evictions,
        failed_inserts, erased."""
        sizes = self.segment_sizes().tolist()
        counters = self._segment_stats.tolist()
        out = []
        for s, size in enumerate(sizes):
            cap = self.segment_capacity(s)
            entry = {"size": size, "capacity": cap, "current_capacity": cap, "load_factor": size / cap}
            entry.update({name: counters[i][s] for i, name in enumerate(_SEGMENT_COUNTERS)})
            out.append(entry)
        return out

    def export_segment(self, segment: int, chunk_size: int = 1 << 16):
        """Yield (keys, rows, scores) of one segment's keys, as :meth:`KeyIndex.export`."""
        if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
            raise ValueError(f"chunk_size={chunk_size!r}: must be an int >= 1")
        for keys, rows, scores, _ in self._export_slots(*self._segment_slots(segment), chunk_size):
            yield keys, rows, scores

    def _segment_slots(self, segment: int) -> tuple[int, int]:
        """The flat slot range [lo, hi) of one segment."""
        lo = int(self.segment_offsets[segment]) * self.bucket_capacity
        return lo, lo + self.segment_capacity(segment)

    # -- state ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """:meth:`KeyIndex.state_dict` plus ``segment_buckets`` [S] and ``segment_counters``
        [4, S] (inserts, evictions, failed_inserts, erased per segment)."""
        state = super().state_dict()
        state["segment_buckets"] = self.segment_buckets.clone()
        state["segment_counters"] = self._segment_stats.clone()
        return state

    def same_geometry(self, state: Mapping[str, torch.Tensor]) -> bool:
        seg = state.get("segment_buckets") if isinstance(state, Mapping) else None
        return (
            isinstance(seg, torch.Tensor)
            and seg.dtype == torch.int64
            and seg.tolist() == self._segment_buckets_list
            and super().same_geometry(state)
        )

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        counters = state.get("segment_counters") if isinstance(state, Mapping) else None
        if not isinstance(counters, torch.Tensor) or counters.dtype != torch.int64 or tuple(counters.shape) != tuple(self._segment_stats.shape):
            raise ValueError(f"state entry 'segment_counters': must be an int64 tensor of shape {tuple(self._segment_stats.shape)}")
        if bool((counters < 0).any()):
            raise ValueError("state entry 'segment_counters': counts must be >= 0")
        if not self.same_geometry(state):
            raise ValueError(
                f"state segment_buckets={state.get('segment_buckets')!r}, num_buckets={_scalar(state, 'num_buckets')}: not a "
                f"state of this index's geometry (segment buckets {self._segment_buckets_list}, bucket_capacity="
                f"{self.bucket_capacity}); re-insert its keys instead"
            )
        super().load_state_dict(state)
        with torch.inference_mode(False):
            self._segment_stats = counters.to(self.device).clone()

    def to(self, device: torch.device | str) -> SegmentedKeyIndex:
        super().to(device)
        with torch.inference_mode(False):
            self._segment_stats = self._segment_stats.to(self.device)
        self._set_segments(self._segment_buckets_list)
        return self
