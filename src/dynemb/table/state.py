"""state_dict of a key index: plain int64 tensors that restore it exactly, and their checks.

K keys held, B buckets, W slots per bucket, S segments.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from dynemb.hashing import tag_of
from dynemb.table.geometry import SCORE_MAX, SCORE_MIN, Segments, is_doubling_of
from dynemb.table.keys import unique_pairs

COUNTERS = ("inserts", "evictions", "failed_inserts", "growths")
SEGMENT_COUNTERS = ("inserts", "evictions", "failed_inserts", "erased")


def scalar(state: Mapping[str, torch.Tensor], name: str) -> int:
    """Entry ``name`` of a state as an int, or ValueError naming the entry."""
    value = state.get(name) if isinstance(state, Mapping) else None
    if not isinstance(value, torch.Tensor) or value.dtype != torch.int64 or value.dim() != 0:
        raise ValueError(f"state entry '{name}': must be a 0-d int64 tensor, got {_describe(value)}")
    return int(value)


def vector(state: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    """Entry ``name`` of a state, a 1-d int64 tensor, or ValueError naming the entry."""
    value = state.get(name)
    if not isinstance(value, torch.Tensor) or value.dtype != torch.int64 or value.dim() != 1:
        raise ValueError(f"state entry '{name}': must be a 1-d int64 tensor, got {_describe(value)}")
    return value


def _describe(value) -> str:
    if value is None:
        return "nothing"
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__


class IndexState:
    """state_dict / same_geometry / load_state_dict of :class:`dynemb.table.index.KeyIndex`
    (a mixin, like :class:`dynemb.table.placement.BatchPlacement`)."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Plain int64 tensors that restore this index exactly (``torch.load(weights_only=True)``);
        row ids and scores are int64 here whatever their stored dtype (docs/design/0035).

        Entries: ``keys``, ``rows``, ``scores``, ``slots`` [K] (flat slot of each key, ascending);
        0-d ``num_buckets``, ``bucket_capacity``, ``max_buckets``, ``free_high_water``; ``free``
        [n] (released row ids, first released first); ``counters`` [4] (inserts, evictions,
        failed_inserts, growths). An index built with ``capacities=`` adds ``segment_buckets``
        [S] (buckets of each segment now) and ``segment_counters`` [4, S] (inserts, evictions,
        failed_inserts, erased per segment).
        """
        slots = self._tags.view(-1).nonzero().squeeze(1)
        free = self.free_list.state()

        def as_tensor(value: int) -> torch.Tensor:
            return torch.tensor(value, dtype=torch.int64, device=self.device)

        state = {
            "keys": self._keys.view(-1).index_select(0, slots),
            "rows": self._rows_at(slots),
            "scores": self._scores_at(slots),
            "slots": slots,
            "num_buckets": as_tensor(self.num_buckets),
            "bucket_capacity": as_tensor(self.bucket_capacity),
            "max_buckets": as_tensor(self.max_buckets),
            "free_high_water": as_tensor(free["high_water"]),
            "free": free["free"],
            "counters": torch.tensor([self._stats[c] for c in COUNTERS], dtype=torch.int64, device=self.device),
        }
        if self.segmented:
            state["segment_buckets"] = self._segments.counts.clone()
            state["segment_counters"] = self._segment_stats.clone()
        return state

    def _state_segments(self, state: Mapping[str, torch.Tensor]) -> list[int] | None:
        """The segment buckets of a state, if it is one this index passes through as it grows
        (bucket width and maxima are this index's); else None."""
        try:
            B, W, B_max = (scalar(state, name) for name in ("num_buckets", "bucket_capacity", "max_buckets"))
        except ValueError:
            return None
        if W != self.bucket_capacity or B_max != self.max_buckets:
            return None
        if not self.segmented:
            return [B] if is_doubling_of(B, self.init_buckets, self.max_buckets) else None
        seg = state.get("segment_buckets")
        if not isinstance(seg, torch.Tensor) or seg.dtype != torch.int64 or seg.dim() != 1 or seg.numel() != self.num_segments:
            return None
        buckets = seg.tolist()
        fits = all(is_doubling_of(b, i, m) for b, i, m in zip(buckets, self._segment_init_buckets, self._segment_max_buckets))
        return buckets if fits and sum(buckets) == B else None

    def same_geometry(self, state: Mapping[str, torch.Tensor]) -> bool:
        """Whether :meth:`load_state_dict` can restore ``state`` exactly: its bucket width and
        maximum buckets are this index's and its ``num_buckets`` (and ``segment_buckets``, for
        an index built with ``capacities=``) are ones this index passes through as it grows.
        (Other states must be re-inserted key by key.)"""
        return isinstance(state, Mapping) and self._state_segments(state) is not None

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore :meth:`state_dict` of an index of the same geometry (:meth:`same_geometry`),
        exactly: same slots, row ids, free list and counters, so later calls behave bitwise as
        they would have on the saved index. Everything is checked first: a bad or foreign state
        raises ValueError naming the entry and leaves this index unchanged.
        """
        if not isinstance(state, Mapping):
            raise ValueError(f"state: must be a mapping of tensors, got {type(state).__name__}")
        seg_counters = None
        if self.segmented:
            seg_counters = state.get("segment_counters")
            shape = (len(SEGMENT_COUNTERS), self.num_segments)
            if not isinstance(seg_counters, torch.Tensor) or seg_counters.dtype != torch.int64 or tuple(seg_counters.shape) != shape:
                raise ValueError(f"state entry 'segment_counters': must be an int64 tensor of shape {shape}")
            if bool((seg_counters < 0).any()):
                raise ValueError("state entry 'segment_counters': counts must be >= 0")
        B, W, B_max = (scalar(state, name) for name in ("num_buckets", "bucket_capacity", "max_buckets"))
        buckets = self._state_segments(state)
        if buckets is None:
            where = f"segment_buckets={state.get('segment_buckets')!r}, " if self.segmented else ""
            raise ValueError(
                f"state {where}num_buckets={B}, bucket_capacity={W}, max_buckets={B_max}: not a state of this index's "
                f"geometry (bucket_capacity={self.bucket_capacity}, segment buckets {self._segment_init_buckets} doubling "
                f"to {self._segment_max_buckets}); re-insert its keys instead"
            )
        keys, rows, scores, slots = (vector(state, name) for name in ("keys", "rows", "scores", "slots"))
        K = keys.numel()
        for name, t in (("rows", rows), ("scores", scores), ("slots", slots)):
            if t.numel() != K:
                raise ValueError(f"state entry '{name}' has {t.numel()} values for {K} keys")
        counters = vector(state, "counters")
        if counters.numel() != len(COUNTERS) or bool((counters < 0).any()):
            raise ValueError(f"state entry 'counters': must hold {len(COUNTERS)} counts >= 0 {COUNTERS}")
        high_water = scalar(state, "free_high_water")
        free = vector(state, "free")
        device = self.device
        keys, rows, scores, slots, free = (t.to(device) for t in (keys, rows, scores, slots, free))
        layout = Segments(buckets, device)
        slot_count = B * W
        if K > slot_count:
            raise ValueError(f"state entry 'keys' holds {K} keys for {slot_count} slots")
        if K:
            if not bool(((slots >= 0) & (slots < slot_count)).all()):
                raise ValueError(f"state entry 'slots': must lie in [0, {slot_count})")
            if torch.unique(slots).numel() != K:
                raise ValueError("state entry 'slots': must be distinct")
            bucket = slots // W
            seg = layout.segment_of(bucket)
            distinct = torch.unique(keys).numel() if seg is None else unique_pairs(seg, keys)[2].numel()
            if distinct != K:
                raise ValueError("state entry 'keys': must be distinct")
            b1, b2 = layout.candidates(keys, seg)
            if not bool(((bucket == b1) | (bucket == b2)).all()):
                raise ValueError("state entry 'slots': a key sits outside its candidate buckets")
            if not bool(((rows >= 0) & (rows < self.capacity())).all()):
                raise ValueError(f"state entry 'rows': must lie in [0, {self.capacity()})")
            if torch.unique(rows).numel() != K:
                raise ValueError("state entry 'rows': must be distinct")
            if not bool((rows < high_water).all()):
                raise ValueError(f"state entry 'rows': must lie below free_high_water={high_water}")
        try:
            self.free_list.check_state(high_water, free)
        except ValueError as error:
            raise ValueError(f"state entries 'free_high_water' / 'free': {error}") from None
        if free.numel() + K != high_water:
            raise ValueError(f"state entries 'free' / 'rows': {free.numel()} free and {K} used row ids do not make up free_high_water={high_water}")
        if K and free.numel() and bool(torch.isin(free, rows).any()):
            raise ValueError("state entries 'free' / 'rows': a row id is both free and in use")

        with torch.inference_mode(False):
            # Stored scores are int32 again unless the state's do not fit (docs/design/0035).
            wide = K and (int(scores.min()) < SCORE_MIN or int(scores.max()) > SCORE_MAX)
            self._score_dtype = torch.int64 if wide else torch.int32
            tables = self._new_tables(B)
            new_keys, new_tags, new_rows, new_scores = tables
            new_keys.view(-1).scatter_(0, slots, keys)
            new_rows.view(-1).scatter_(0, slots, rows.to(new_rows.dtype))
            new_scores.view(-1).scatter_(0, slots, scores.to(new_scores.dtype))
            new_tags.view(-1).scatter_(0, slots, tag_of(keys))
            self.free_list.load_state(high_water, free)
            if seg_counters is not None:
                self._segment_stats = seg_counters.to(device).clone()
        self._segments = layout
        self._set_tables(tables)
        self._size = K
        self._stats = dict(zip(COUNTERS, counters.tolist()))
        self._recount_segment_sizes()
