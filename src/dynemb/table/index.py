"""Bucketed, scored hash index from int64 keys to row ids, in plain device-agnostic torch.

N keys in a call, U unique keys, K keys held, S segments, B buckets, W slots per bucket.

Layout: four [B, W] tensors (key int64, tag byte: 0 empty else the key's tag, row id int32 below 2**31 slots, score int32
until a score does not fit, then int64): 17 bytes a slot, 20 a key at the default maximum load
factor 0.85 (docs/design/0035). While row ids and scores are int32, key, row id and score are
views of one packed [B, W, 2] int64 tensor, a slot's three in 16 bytes (docs/design/0041).
Every method takes and returns int64. Two-choice hashing: a key may live
at any slot of either of its two candidate buckets; lookups compare it against those 2W slots
at once. Placement of new keys (free slots, cuckoo moves, eviction) is in
:mod:`dynemb.table.placement`, growth in :mod:`dynemb.table.growth`, the state in
:mod:`dynemb.table.state`.

Segments: the buckets are split between S segments (the tables of a collection group; a plain
table is an index of one segment). Segment s owns a contiguous bucket range and its keys hash
onto that range only (:mod:`dynemb.table.geometry`), so each segment has its own capacity,
growth, scores, eviction and counters, while one call places the keys of every segment. Equal
keys in different segments are different entries. See docs/design/0013 and 0025.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dynemb.config import resolve_device
from dynemb.kernels import check_backend, uses_native, uses_triton
from dynemb.kernels.dedup import dedup_torch, sort_unique_native
from dynemb.kernels.locate import candidates_native, locate_native, locate_torch
from dynemb.kernels.rows import rows_at_native, rows_at_torch
from dynemb.table.base import IndexResult
from dynemb.table.free_list import FreeList
from dynemb.table.geometry import SCORE_MAX, SCORE_MIN, Segments, bucket_width, bytes_per_slot, index_bytes, plan_buckets, rounded_capacity, row_dtype
from dynemb.table.growth import Growth
from dynemb.table.keys import INT64_MIN, check_keys, check_now, check_segments, unique_pairs
from dynemb.table.placement import CLOCKED, GIVE_UP, MOVE_DEPTH, BatchPlacement
from dynemb.table.report import IndexReport
from dynemb.table.state import COUNTERS, SEGMENT_COUNTERS, IndexState
from dynemb.types import ScoreStrategy
from dynemb.workspace import Workspace, huge_pages_zeros, writable

__all__ = [
    "GIVE_UP",
    "MOVE_DEPTH",
    "KeyIndex",
    "bucket_width",
    "check_keys",
    "index_bytes",
    "plan_buckets",
    "rounded_capacity",
    "unique_pairs",
]


def _positive_int(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r}: must be an int >= 1")
    return value


def _plan_segments(capacities, init_capacities, W: int) -> list[tuple[int, int]]:
    """(initial, maximum) buckets of W slots for each segment, checking the arguments."""
    if not isinstance(capacities, (list, tuple)) or not capacities:
        raise ValueError(f"capacities={capacities!r}: must be a non-empty list of ints >= 1")
    for i, c in enumerate(capacities):
        _positive_int(f"capacities[{i}]", c)
    inits = [None] * len(capacities) if init_capacities is None else init_capacities
    if not isinstance(inits, (list, tuple)) or len(inits) != len(capacities):
        raise ValueError(f"init_capacities={init_capacities!r}: must be a list of {len(capacities)} ints (or None), one per segment")
    for i, (c, init) in enumerate(zip(capacities, inits)):
        if init is not None and not (isinstance(init, int) and not isinstance(init, bool) and 1 <= init <= c):
            raise ValueError(f"init_capacities[{i}]={init!r}: must be None or an int in [1, capacities[{i}]={c}]")
    # A segment of fewer keys than W is still one bucket of W slots: every segment has width W.
    return [plan_buckets(c, init, W) for c, init in zip(capacities, inits)]


class KeyIndex(BatchPlacement, Growth, IndexState, IndexReport):
    """Scored hash index: every int64 key -> row id, of one or several segments, each growing
    from its initial to its maximum capacity.

    Implements :class:`dynemb.table.base.Index`. The index owns its row ids: ``free_list`` hands
    them out over ``[0, capacity())``; its ``high_water`` says how many rows a store must address.

    Every method that takes keys also takes ``segments=`` ([*] int64 like keys, each in
    ``[0, S)``): required with several segments, optional (None or zeros) with one.

    Args:
        capacity: most keys held (one segment); rounded up to whole buckets, at most to 2x (see
            :func:`plan_buckets`; :meth:`capacity` is the real figure).
        init_capacity: keys held at creation (default ``capacity``); the initial allocation may
            be larger, to keep the rounding of ``capacity`` within 2x.
        capacities: instead of ``capacity``: most keys of each segment ([S] ints >= 1), each
            rounded up as ``capacity`` is, with buckets of exactly ``bucket_capacity`` slots.
            Such an index reports segments in its results and its state (a collection group),
            even with one segment.
        init_capacities: with ``capacities``: keys of each segment at creation ([S] ints or
            None; None, the default, allocates every segment at full size).
        bucket_capacity: W, slots per bucket (``capacity`` if that is smaller).
        max_load_factor: a segment grows when an insert would pass this load factor.
        score_strategy: meaning of scores, see :class:`dynemb.ScoreStrategy`.
        device: where the index tensors live.
        backend: ``"auto"``, ``"native"`` or ``"torch"``: whether the compiled CPU kernels
            run the probes, placement and de-duplication (:mod:`dynemb.kernels`).
    """

    def __init__(
        self,
        *,
        capacity: int | None = None,
        init_capacity: int | None = None,
        capacities: Sequence[int] | None = None,
        init_capacities: Sequence[int | None] | None = None,
        bucket_capacity: int = 16,
        max_load_factor: float = 0.85,
        score_strategy: ScoreStrategy | str = ScoreStrategy.TIMESTAMP,
        device: torch.device | str = "cpu",
        backend: str = "auto",
    ):
        if (capacity is None) == (capacities is None):
            raise ValueError(f"capacity={capacity!r}, capacities={capacities!r}: pass exactly one of them")
        _positive_int("bucket_capacity", bucket_capacity)
        if not (isinstance(max_load_factor, (int, float)) and 0 < max_load_factor <= 1):
            raise ValueError(f"max_load_factor={max_load_factor!r}: must be in (0, 1]")
        self.segmented = capacities is not None
        if self.segmented:
            if init_capacity is not None:
                raise ValueError(f"init_capacity={init_capacity!r}: with capacities=, pass init_capacities= (one per segment)")
            self.bucket_capacity = bucket_capacity
            plan = _plan_segments(capacities, init_capacities, bucket_capacity)
        else:
            if init_capacities is not None:
                raise ValueError(f"init_capacities={init_capacities!r}: goes with capacities=, not capacity=")
            _positive_int("capacity", capacity)
            if init_capacity is not None and not (isinstance(init_capacity, int) and not isinstance(init_capacity, bool) and 1 <= init_capacity <= capacity):
                raise ValueError(f"init_capacity={init_capacity!r}: must be an int in [1, capacity={capacity}]")
            self.bucket_capacity = bucket_width(capacity, bucket_capacity)
            plan = [plan_buckets(capacity, init_capacity, bucket_capacity)]
        self.strategy = ScoreStrategy.parse(score_strategy, "score_strategy")
        self.device = resolve_device(device)
        self.backend = check_backend(backend)
        self.native = uses_native(self.backend, self.device)
        self.triton = uses_triton(self.backend, self.device)
        self.max_load_factor = float(max_load_factor)
        self.num_segments = len(plan)
        self._segment_init_buckets = [p[0] for p in plan]
        self._segment_max_buckets = [p[1] for p in plan]
        self.init_buckets, self.max_buckets = sum(self._segment_init_buckets), sum(self._segment_max_buckets)
        self._segments = Segments(self._segment_init_buckets, self.device)
        self.num_buckets = self.init_buckets
        self._size = 0
        self._stats = dict.fromkeys(COUNTERS, 0)
        # Erased keys of an index without segment counters (capacity=); see counters().
        self._erased = 0
        self._segment_stats = torch.zeros(len(SEGMENT_COUNTERS), self.num_segments, dtype=torch.int64, device=self.device) if self.segmented else None
        self._workspace = Workspace(self.device)
        self._row_dtype = row_dtype(self.capacity())
        # Widened to int64 (for good) by the first score outside int32: see _fit_scores.
        self._score_dtype = torch.int32
        slots = self.current_capacity()
        try:
            self._set_tables(self._new_tables(self.num_buckets))
        except RuntimeError as error:
            if self.segmented:
                name, value = ("capacities", list(capacities)) if init_capacities is None else ("init_capacities", list(init_capacities))
            else:
                name, value = ("capacity", capacity) if init_capacity is None else ("init_capacity", init_capacity)
            raise ValueError(
                f"{name}={value}: the index needs {index_bytes(slots, self.capacity()):,} bytes for its {slots:,} initial slots "
                f"on {self.device} and could not allocate them ({str(error).splitlines()[0]})"
            ) from None
        self._recount_segment_sizes()
        self.free_list = FreeList(self.capacity(), self.device)

    def _packed(self) -> bool:
        """Whether this index's slots are packed: a slot's key, row id and score in 16 bytes (one
        cache line holds all three), which needs int32 row ids and scores (docs/design/0041)."""
        return self._row_dtype is torch.int32 and self._score_dtype is torch.int32

    def _new_tables(self, num_buckets: int, device: torch.device | None = None) -> tuple[torch.Tensor, ...]:
        """Fresh (keys, tags, rows, scores) [B, W], all slots empty (tag 0), in the stored dtypes.

        Packed (int32 row ids and scores): keys, rows and scores are views of one [B, W, 2]
        int64 tensor, each slot's key then its row id and score, on huge pages where the system
        allows (docs/design/0041); else four tensors of their own."""
        shape = (num_buckets, self.bucket_capacity)
        device = self.device if device is None else device
        # Kept across calls: never inference tensors, even when created under inference mode.
        with torch.inference_mode(False):
            tags = huge_pages_zeros(shape, dtype=torch.uint8, device=device)
            if self._packed():
                slots = huge_pages_zeros((*shape, 2), dtype=torch.int64, device=device)
                words = slots.view(torch.int32)  # [B, W, 4]: key (two words), row id, score
                rows = words[..., 2]
                rows.fill_(-1)
                return slots[..., 0], tags, rows, words[..., 3]
            return (
                torch.zeros(shape, dtype=torch.int64, device=device),
                tags,
                torch.full(shape, -1, dtype=self._row_dtype, device=device),
                torch.zeros(shape, dtype=self._score_dtype, device=device),
            )

    def _copy_tables(self, device: torch.device | None = None) -> tuple[torch.Tensor, ...]:
        """The index's tables copied into fresh ones of the current layout (on ``device``)."""
        tables = self._new_tables(self.num_buckets, device)
        with torch.inference_mode(False):
            for out, table in zip(tables, (self._keys, self._tags, self._rows, self._scores)):
                out.copy_(table)
        return tables

    def _set_tables(self, tables: tuple[torch.Tensor, ...]) -> None:
        self._keys, self._tags, self._rows, self._scores = tables
        self.num_buckets = self._keys.shape[0]
        with torch.inference_mode(False):
            self._slot_ids = torch.arange(self.bucket_capacity, device=self.device)

    def _fit_scores(self, values: torch.Tensor) -> None:
        """Widen the stored scores to int64 (for good) if some of ``values`` ([n] int64, scores
        about to be stored) lie outside int32; call before any score of a call is written."""
        if self._scores.dtype is torch.int64 or values.numel() == 0:
            return
        low, high = torch.stack(torch.aminmax(values)).tolist()  # one host sync
        if low < SCORE_MIN or high > SCORE_MAX:
            self._widen_scores()

    def _widen_scores(self) -> None:
        """Store scores as int64 from now on (0035): the slots are unpacked (0041)."""
        self._score_dtype = torch.int64
        self._set_tables(self._copy_tables())

    def _rows_at(self, pos: torch.Tensor) -> torch.Tensor:
        """Row ids at flat slots ``pos`` ([n], -1 where there is no slot) as int64, -1 there."""
        return rows_at_native(self._rows, pos) if self.native else rows_at_torch(self._rows, pos)

    def _scores_at(self, pos: torch.Tensor) -> torch.Tensor:
        """Scores at flat slots ``pos`` ([n], each >= 0) as int64."""
        return self._scores.view(-1).index_select(0, pos).to(torch.int64)

    def index_bytes_per_slot(self) -> int:
        """Bytes one slot of this index takes now (its row id and score dtypes)."""
        return bytes_per_slot(self.capacity(), self._scores.dtype is torch.int64)

    def _recount_segment_sizes(self) -> None:
        """Keys held per segment ([S] int64), kept up to date by _count, for growth with several segments."""
        self._segment_size = None
        if self.num_segments > 1:
            with torch.inference_mode(False):
                self._segment_size = torch.zeros(self.num_segments, dtype=torch.int64, device=self.device).index_add_(
                    0, self._segments.of_bucket, (self._tags != 0).sum(1)
                )

    @property
    def compiled(self) -> bool:
        """Whether compiled kernels locate this index's keys, and update and initialise its
        table's rows: C++ on CPU (``native``), Triton on CUDA (``triton``)."""
        return self.native or self.triton

    @property
    def segment_buckets(self) -> torch.Tensor:
        """Buckets of each segment now ([S] int64)."""
        return self._segments.counts

    @property
    def segment_offsets(self) -> torch.Tensor:
        """First bucket of each segment ([S] int64)."""
        return self._segments.offsets

    def size(self) -> int:
        """Number of keys held."""
        return self._size

    def capacity(self) -> int:
        """Most keys the index can hold (after rounding)."""
        return self.max_buckets * self.bucket_capacity

    def current_capacity(self) -> int:
        """Slots allocated now (grows by doubling up to :meth:`capacity`)."""
        return self.num_buckets * self.bucket_capacity

    def load_factor(self) -> float:
        """size / current capacity."""
        return self._size / self.current_capacity()

    def _check_keys(self, keys: torch.Tensor, name: str = "keys") -> torch.Tensor:
        return check_keys(keys, name, self.device)

    def _check_segments(self, segments: torch.Tensor | None, n: int) -> torch.Tensor | None:
        """The segment of each of n keys ([n] int64), validated; None for an index of one segment."""
        return check_segments(segments, n, self.num_segments, self.device)

    def _buckets(self, keys: torch.Tensor, seg: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The two candidate buckets of keys ([N] -> two [N]); ``seg``: [N] segment of each key,
        None for an index of one segment."""
        if self.compiled:
            return candidates_native(self._segments, keys, seg)
        return self._segments.candidates(keys, seg)

    def _bucket_segments(self, buckets: torch.Tensor) -> torch.Tensor | None:
        """Segment of each bucket ([N] -> [N]); None for an index of one segment."""
        return self._segments.segment_of(buckets)

    def _candidate_slots(self, keys: torch.Tensor, seg: torch.Tensor | None = None) -> torch.Tensor:
        """Flat positions of the 2W candidate slots of each key ([N] -> [N, 2W]), bucket 1 first."""
        b1, b2 = self._buckets(keys, seg)
        W = self.bucket_capacity
        return (torch.stack([b1, b2], 1) * W)[:, :, None].add(self._slot_ids).view(-1, 2 * W)

    def _locate(self, keys: torch.Tensor, seg: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat slot of each key (-1 if absent) and whether it is present ([N] int64, [N] bool)."""
        if self.compiled:
            pos, found, _ = locate_native(self._keys, self._tags, self._segments, keys, seg)
            return pos, found
        b1, b2 = self._buckets(keys, seg)
        return locate_torch(self._keys, self._tags, b1, b2, keys, self._workspace)

    def _dedup(self, keys: torch.Tensor, seg: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """(unique [U], their segments [U] or None, inverse [N], counts [U]) of keys [N].

        Native without segments: ``dyn_sort_unique``, a parallel sort (1.0 vs 2.2 ms for
        torch.unique on W2's 65,536 random keys, perf-log 2026-11-26; the hashing kernel took
        7.0); else plain torch (torch.unique's parallel sort, bitwise the same)."""
        if self.native and seg is None:
            unique, _, inverse, counts, _ = sort_unique_native(keys, workspace=self._workspace)
            return unique, None, inverse, counts
        return dedup_torch(keys, seg)

    def candidate_buckets(self, keys: torch.Tensor, segments: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The two buckets each key may live in now: keys [*] (segments [*]) -> two [N] int64
        (flat, in [0, num_buckets)); they may coincide."""
        flat = self._check_keys(keys)
        return self._buckets(flat, self._check_segments(segments, flat.numel()))

    def locate(self, keys: torch.Tensor, segments: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat slot of each key ([N] int64, -1 if absent; slot = bucket * W + position in the
        bucket) and whether it is held ([N] bool); keys [*] flattened, no side effects."""
        flat = self._check_keys(keys)
        return self._locate(flat, self._check_segments(segments, flat.numel()))

    def find(self, keys: torch.Tensor, *, segments: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Row ids of keys, without side effects.

        Args:
            keys (Tensor[int64]): [*] any shape.
            segments (Tensor[int64] | None): [*] like keys, the segment (table) of each key.
        Returns:
            rows (Tensor[int64]): [*] row id, -1 where absent.
            found (Tensor[bool]): [*]
        """
        flat = self._check_keys(keys)
        seg = self._check_segments(segments, flat.numel())
        if self.compiled:
            _, found, rows = locate_native(self._keys, self._tags, self._segments, flat, seg, self._rows, slots=False)
            return rows.view(keys.shape), found.view(keys.shape)
        pos, found = self._locate(flat, seg)
        rows = self._rows_at(pos)
        return rows.view(keys.shape), found.view(keys.shape)

    def scores(self, keys: torch.Tensor, *, segments: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores of keys ([*] int64, 0 where absent) and whether found ([*] bool); no side effects."""
        flat = self._check_keys(keys)
        pos, found = self._locate(flat, self._check_segments(segments, flat.numel()))
        scores = torch.where(found, self._scores_at(pos.clamp(min=0)), 0)
        return scores.view(keys.shape), found.view(keys.shape)

    def _batch_scores(self, counts: torch.Tensor, now: int | None, given: torch.Tensor | None) -> torch.Tensor:
        """Score each of U unique keys gets from this call under the strategy ([U] int64)."""
        if given is not None:
            return given
        if self.strategy is ScoreStrategy.LFU:
            return counts
        if self.strategy is ScoreStrategy.CUSTOMIZED:
            raise ValueError("score_strategy='customized' needs scores=: the caller gives every key's score")
        if now is None:
            raise ValueError(f"now=None: score_strategy='{self.strategy}' scores keys by the clock; pass now=")
        # One value for every key: a stride-0 view (no [U] tensor to fill; the kernels read it as
        # such, torch reads it as any tensor, and nothing writes into it).
        return torch.full((1,), now, dtype=torch.int64, device=counts.device).expand(counts.numel())

    def find_or_insert(
        self, keys: torch.Tensor, *, now: int | None = None, scores: torch.Tensor | None = None, segments: torch.Tensor | None = None
    ) -> IndexResult:
        """Find keys, insert the missing ones, evicting low-scored keys where the index is full.

        Args:
            keys (Tensor[int64]): [*] any shape, flattened to [N]; duplicates allowed.
            now: the clock (step or timestamp) of this call; required by the ``timestamp``,
                ``step`` and ``no_eviction`` strategies unless ``scores`` is given.
            scores (Tensor[int64] | None): [*] like keys, scores to assign (a key given several
                times gets the largest); ``None`` uses the strategy's own score.
            segments (Tensor[int64] | None): [*] like keys, the segment of each key.
        Returns:
            IndexResult over the N keys (failed keys are returned, never raised).
        """
        flat = self._check_keys(keys)
        seg = self._check_segments(segments, flat.numel())
        if scores is None and self.strategy in CLOCKED:
            # One clock value for every key: probe the keys as they come and sort only the
            # missing ones (most keys of a call are usually present); same slots, rows and
            # result as through upsert_unique (0040).
            now = None if now is None else check_now(now)
            batch_scores = self._batch_scores(flat, now, None)
            with writable():
                return self._upsert(flat, flat, batch_scores, True, seg, distinct=False, clock=now)
        unique, useg, inverse, counts = self._dedup(flat, seg)
        given = None
        if scores is not None:
            flat_scores = self._check_keys(scores, "scores")
            if flat_scores.numel() != flat.numel():
                raise ValueError(f"scores has {flat_scores.numel()} values for {flat.numel()} keys")
            given = torch.full_like(unique, INT64_MIN).scatter_reduce_(0, inverse, flat_scores, reduce="amax")
        r = self.upsert_unique(unique, counts, now=now, given=given, segments=useg)
        return IndexResult(
            positions=r.positions.index_select(0, inverse),
            rows=r.rows.index_select(0, inverse),
            found=r.found.index_select(0, inverse),
            inserted=r.inserted.index_select(0, inverse),
            evicted_keys=r.evicted_keys,
            evicted_rows=r.evicted_rows,
            evicted_scores=r.evicted_scores,
            failed_keys=r.failed_keys,
            evicted_segments=r.evicted_segments,
            failed_segments=r.failed_segments,
        )

    def upsert_unique(
        self,
        unique: torch.Tensor,
        counts: torch.Tensor,
        *,
        now: int | None = None,
        given: torch.Tensor | None = None,
        segments: torch.Tensor | None = None,
    ) -> IndexResult:
        """Find U distinct, ascending keys and insert the missing ones, evicting where full.

        Found keys get this call's score (``now``; lfu adds ``counts``, saturating; ``given``
        replaces). Missing keys are placed in priority order (higher score, then smaller key):
        into free slots, growing their segment below its capacity, then by moving resident keys
        to their other bucket, then by eviction (except ``no_eviction``). Keys that fit nowhere fail.

        Args:
            unique (Tensor[int64]): [U] distinct keys, sorted ascending (not checked).
            counts (Tensor[int64]): [U] occurrences of each in the batch (the lfu score).
            now: the clock (timestamp or step) for the ``timestamp``, ``step`` and
                ``no_eviction`` strategies; required by them unless ``given`` is passed.
            given (Tensor[int64] | None): [U] scores to assign (``customized``; any strategy).
            segments (Tensor[int64] | None): [U] segment of each key; the (segment, key) pairs
                are distinct and sorted by segment, then key.
        Returns:
            IndexResult over the U keys.
        """
        unique = self._check_keys(unique, "unique")
        counts = self._check_keys(counts, "counts")
        if counts.numel() != unique.numel():
            raise ValueError(f"counts has {counts.numel()} values for {unique.numel()} keys")
        if given is not None:
            given = self._check_keys(given, "given")
            if given.numel() != unique.numel():
                raise ValueError(f"given has {given.numel()} values for {unique.numel()} keys")
        if now is not None:
            now = check_now(now)
        seg = self._check_segments(segments, unique.numel())
        batch_scores = self._batch_scores(counts, now, given)
        # Every tensor the index keeps is written here: mutate outside inference mode.
        with writable():
            return self._upsert(unique, counts, batch_scores, given is None, seg, clock=now)

    def erase(self, keys: torch.Tensor, *, segments: torch.Tensor | None = None) -> IndexResult:
        """Remove keys and give their row ids back to the free list.

        Args:
            keys (Tensor[int64]): [*] any shape, flattened to [N]; duplicates allowed.
            segments (Tensor[int64] | None): [*] like keys, the segment of each key.
        Returns:
            IndexResult over the N keys: ``found`` says which were present; ``rows`` and
            ``positions`` are -1 and ``inserted`` False everywhere; ``evicted_*`` are the erased
            keys (each once, ascending by segment, then key), their former row ids and scores;
            no failed keys.
        """
        flat = self._check_keys(keys)
        seg = self._check_segments(segments, flat.numel())
        unique, useg, inverse, _ = self._dedup(flat, seg)
        if useg is None and self.segmented:
            useg = torch.zeros_like(unique)
        with torch.inference_mode(False):
            pos, found = self._locate(unique, None if seg is None else useg)
            hit = pos[found]
            erased = unique[found]
            erased_rows = self._rows_at(hit)
            erased_scores = self._scores_at(hit)
            self._tags.view(-1).index_fill_(0, hit, 0)
            self.free_list.release(erased_rows)
            self._size -= hit.numel()
            self._count("erased", hit)
        n = flat.numel()
        absent = torch.full((n,), -1, dtype=torch.int64, device=self.device)
        return IndexResult(
            positions=absent,
            rows=absent.clone(),
            found=found.index_select(0, inverse),
            inserted=torch.zeros(n, dtype=torch.bool, device=self.device),
            evicted_keys=erased,
            evicted_rows=erased_rows,
            evicted_scores=erased_scores,
            failed_keys=torch.empty(0, dtype=torch.int64, device=self.device),
            evicted_segments=None if useg is None else useg[found],
            failed_segments=None if useg is None else useg[:0],
        )

    def to(self, device: torch.device | str) -> KeyIndex:
        """Move every index tensor and the free list to ``device``."""
        device = resolve_device(device)
        tables = (self._keys, self._tags, self._rows, self._scores) if device == self.device else self._copy_tables(device)
        with torch.inference_mode(False):
            if self._segment_stats is not None:
                self._segment_stats = self._segment_stats.to(device)
            if self._segment_size is not None:
                self._segment_size = self._segment_size.to(device)
        self.device = device
        self.native = uses_native(self.backend, device)
        self.triton = uses_triton(self.backend, device)
        self._segments = self._segments.to(device)
        self._set_tables(tables)
        self.free_list.to(device)
        self._workspace.to(device)
        return self
