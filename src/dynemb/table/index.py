"""Bucketed, scored hash index from int64 keys to row ids, in plain device-agnostic torch.

N keys in a call, U unique keys, M new keys to place, P keys pending (not placed yet), Q buckets
asked to make room, F full buckets among them, K keys held, B buckets, W slots per bucket.

Layout: four [B, W] tensors (key, used flag, row id, score). Two-choice hashing: a key may live
at any slot of either of its two candidate buckets (``candidate_buckets``); lookups compare it
against those 2W slots at once. A new key goes to the candidate with more free slots, else to the
other. When both are full and the index cannot grow, resident keys of those buckets move to their
own other candidate (cuckoo displacement, up to ``MOVE_DEPTH`` moves in a chain) to free a slot;
only when that fails does the new key evict the lowest-scored unlocked key among its 2W slots (a
key is locked while the batch that uses it is being placed). See docs/design/0006.

Growth doubles B and re-places keys and row ids (never rows); multiply-shift bucketing sends old
bucket b to new buckets 2b and 2b+1 for both choices, so re-placement never overflows.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Mapping

import torch

from dynemb.config import resolve_device
from dynemb.hashing import candidate_buckets
from dynemb.table.base import IndexResult
from dynemb.table.free_list import FreeList
from dynemb.types import ScoreStrategy
from dynemb.workspace import Workspace

_INT64_MIN = torch.iinfo(torch.int64).min
_MAX_SCORE = torch.iinfo(torch.int64).max
# Bytes per slot of the index tensors: key, row id and score (int64 each), used and lock flags.
_BYTES_PER_SLOT = 8 + 8 + 8 + 1 + 1
# Longest chain of resident moves tried to free a slot for a new key (1: a resident of the key's
# buckets moves to its other bucket; 2: first a resident of that other bucket moves on, ...).
MOVE_DEPTH = 2
# Displacement stops for the rest of a call after a pass that made room for fewer than one key
# in GIVE_UP of those it tried.
GIVE_UP = 8
_COUNTERS = ("inserts", "evictions", "failed_inserts", "growths")
_CLOCKED = (ScoreStrategy.TIMESTAMP, ScoreStrategy.STEP, ScoreStrategy.NO_EVICTION)


def check_keys(keys: torch.Tensor, name: str, device: torch.device) -> torch.Tensor:
    """Validate int64 (or int32) keys of any shape on ``device``; returns them flat ([N] int64)."""
    if not isinstance(keys, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int64, got {type(keys).__name__}")
    if keys.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name}.dtype={keys.dtype}: must be torch.int64 (or int32)")
    if keys.device != device:
        raise ValueError(f"{name}.device={keys.device}: the table lives on {device}")
    return keys.reshape(-1).to(torch.int64)


def _check_now(now) -> int:
    """The clock as a Python int in int64 range, or ValueError naming ``now``."""
    try:
        if isinstance(now, bool):
            raise TypeError
        value = operator.index(now)
    except TypeError:
        raise ValueError(f"now={now!r}: must be an int (the step or timestamp of this call)") from None
    if not _INT64_MIN <= value <= _MAX_SCORE:
        raise ValueError(f"now={value}: must fit in int64")
    return value


def _group_by_bucket(bucket: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stable sort of bucket ids ([P] int64) -> (order, sorted buckets, rank within its bucket)."""
    by_bucket = torch.sort(bucket, stable=True)
    sorted_bucket = by_bucket.values
    idx = torch.arange(sorted_bucket.numel(), device=bucket.device)
    is_start = torch.ones_like(sorted_bucket, dtype=torch.bool)
    is_start[1:] = sorted_bucket[1:] != sorted_bucket[:-1]
    rank = idx - torch.cummax(torch.where(is_start, idx, 0), 0).values
    return by_bucket.indices, sorted_bucket, rank


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


def index_bytes(num_slots: int) -> int:
    """Bytes the index tensors take for ``num_slots`` slots (the free list adds at most 8 bytes
    per released row id)."""
    return _BYTES_PER_SLOT * num_slots


def _pick(values: torch.Tensor | None, at: torch.Tensor) -> torch.Tensor | None:
    """values[at] ([n] -> [m]), or None when there are no values (an index without segments)."""
    return None if values is None else values.index_select(0, at)


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


def _follow(positions: torch.Tensor, moves: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Flat slots after keys moved: each step's (from, to) slots ([m] each, distinct) applied in
    order to positions ([n], -1 for none); returns [n]."""
    for src, dst in moves:
        if src.numel() == 0:
            continue
        by_src = torch.sort(src)
        at = torch.searchsorted(by_src.values, positions).clamp_(max=src.numel() - 1)
        hit = by_src.values.index_select(0, at) == positions
        positions = torch.where(hit, dst.index_select(0, by_src.indices.index_select(0, at)), positions)
    return positions


class KeyIndex:
    """Scored hash index: every int64 key -> row id, growing from ``init_capacity`` to ``capacity``.

    Implements :class:`dynemb.table.base.Index`. The index owns its row ids: ``free_list`` hands
    them out over ``[0, capacity())``; its ``high_water`` says how many rows a store must address.

    Args:
        capacity: most keys held; rounded up to whole buckets, at most to 2x (see
            :func:`plan_buckets`; :meth:`capacity` is the real figure).
        init_capacity: keys held at creation (default ``capacity``); the initial allocation may
            be larger, to keep the rounding of ``capacity`` within 2x.
        bucket_capacity: W, slots per bucket (``capacity`` if that is smaller).
        max_load_factor: growth starts when an insert would pass this load factor.
        score_strategy: meaning of scores, see :class:`dynemb.ScoreStrategy`.
        device: where the index tensors live.
    """

    def __init__(
        self,
        *,
        capacity: int,
        init_capacity: int | None = None,
        bucket_capacity: int = 16,
        max_load_factor: float = 0.85,
        score_strategy: ScoreStrategy | str = ScoreStrategy.TIMESTAMP,
        device: torch.device | str = "cpu",
    ):
        for name, value in (("capacity", capacity), ("bucket_capacity", bucket_capacity)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r}: must be an int >= 1")
        if init_capacity is not None and not (isinstance(init_capacity, int) and not isinstance(init_capacity, bool) and 1 <= init_capacity <= capacity):
            raise ValueError(f"init_capacity={init_capacity!r}: must be an int in [1, capacity={capacity}]")
        if not (isinstance(max_load_factor, (int, float)) and 0 < max_load_factor <= 1):
            raise ValueError(f"max_load_factor={max_load_factor!r}: must be in (0, 1]")
        self.strategy = ScoreStrategy.parse(score_strategy, "score_strategy")
        self.device = resolve_device(device)
        self.bucket_capacity = bucket_width(capacity, bucket_capacity)
        self.max_load_factor = float(max_load_factor)
        self.init_buckets, self.max_buckets = plan_buckets(capacity, init_capacity, bucket_capacity)
        self.num_buckets = self.init_buckets
        self._size = 0
        self._stats = dict.fromkeys(_COUNTERS, 0)
        self._workspace = Workspace(self.device)
        slots = self.current_capacity()
        try:
            self._set_tables(self._new_tables(self.num_buckets))
        except RuntimeError as error:
            name, value = ("capacity", capacity) if init_capacity is None else ("init_capacity", init_capacity)
            raise ValueError(
                f"{name}={value}: the index needs {index_bytes(slots):,} bytes for its {slots:,} initial slots "
                f"on {self.device} and could not allocate them ({str(error).splitlines()[0]})"
            ) from None
        self.free_list = FreeList(self.capacity(), self.device)

    def _new_tables(self, num_buckets: int) -> tuple[torch.Tensor, ...]:
        """Fresh (keys, used, rows, scores) [B, W] and lock [B * W], all slots empty."""
        shape = (num_buckets, self.bucket_capacity)
        # Kept across calls: never inference tensors, even when created under inference mode.
        with torch.inference_mode(False):
            return (
                torch.zeros(shape, dtype=torch.int64, device=self.device),
                torch.zeros(shape, dtype=torch.bool, device=self.device),
                torch.full(shape, -1, dtype=torch.int64, device=self.device),
                torch.zeros(shape, dtype=torch.int64, device=self.device),
                # Slots locked by the batch being placed; set and cleared within a call.
                torch.zeros(num_buckets * self.bucket_capacity, dtype=torch.bool, device=self.device),
            )

    def _set_tables(self, tables: tuple[torch.Tensor, ...]) -> None:
        self._keys, self._used, self._rows, self._scores, self._lock = tables
        self.num_buckets = self._keys.shape[0]
        with torch.inference_mode(False):
            self._slot_ids = torch.arange(self.bucket_capacity, device=self.device)

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

    def stats(self) -> dict[str, int | float]:
        """Counters: size, capacity, current_capacity, load_factor, inserts, evictions,
        failed_inserts, growths."""
        return {
            "size": self._size,
            "capacity": self.capacity(),
            "current_capacity": self.current_capacity(),
            "load_factor": self.load_factor(),
            **self._stats,
        }

    def _check_keys(self, keys: torch.Tensor, name: str = "keys") -> torch.Tensor:
        return check_keys(keys, name, self.device)

    def _buckets(self, keys: torch.Tensor, seg: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The two candidate buckets of keys ([N] -> two [N]); ``seg`` ([N] segment of each key)
        is only meaningful for a :class:`dynemb.table.segmented.SegmentedKeyIndex`."""
        return candidate_buckets(keys, self.num_buckets)

    def _bucket_segments(self, buckets: torch.Tensor) -> torch.Tensor | None:
        """Segment of each bucket ([N] -> [N]); None for an index without segments."""
        return None

    def _count(self, name: str, positions: torch.Tensor | None = None, seg: torch.Tensor | None = None, n: int | None = None) -> None:
        """Add to counter ``name`` the keys at flat ``positions`` (or of segments ``seg``, or ``n``)."""
        if name in self._stats:
            self._stats[name] += (positions if positions is not None else seg).numel() if n is None else n

    def _state_buckets(self, keys: torch.Tensor, slots: torch.Tensor, num_buckets: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Candidate buckets of keys saved at flat ``slots`` in a state of ``num_buckets`` buckets."""
        return candidate_buckets(keys, num_buckets)

    def _distinct_entries(self, keys: torch.Tensor, slots: torch.Tensor) -> int:
        """Number of distinct entries among keys saved at flat ``slots``."""
        return torch.unique(keys).numel()

    def _candidate_slots(self, keys: torch.Tensor, seg: torch.Tensor | None = None) -> torch.Tensor:
        """Flat positions of the 2W candidate slots of each key ([N] -> [N, 2W]), bucket 1 first."""
        b1, b2 = self._buckets(keys, seg)
        W = self.bucket_capacity
        return (torch.stack([b1, b2], 1) * W)[:, :, None].add(self._slot_ids).view(-1, 2 * W)

    def _locate(self, keys: torch.Tensor, seg: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat slot of each key (-1 if absent) and whether it is present ([N] int64, [N] bool)."""
        W = self.bucket_capacity
        b1, b2 = self._buckets(keys, seg)
        buckets = torch.stack([b1, b2], 1).view(-1)  # [2N]
        n = keys.numel()
        ws = self._workspace
        cand = torch.index_select(self._keys, 0, buckets, out=ws.get("cand", 2 * n, (W,), torch.int64))
        used = torch.index_select(self._used, 0, buckets, out=ws.get("used", 2 * n, (W,), torch.bool))
        match = torch.eq(cand.view(n, 2 * W), keys[:, None], out=ws.get("match", n, (2 * W,), torch.bool))
        match &= used.view(n, 2 * W)
        # First matching slot among the 2W (when both candidates are one bucket it matches twice);
        # argmax is 0 where nothing matches, and the match there says whether the key was found.
        slot = match.view(torch.uint8).argmax(1)
        found = match.gather(1, slot[:, None]).squeeze(1)
        bucket = torch.where(slot < W, b1, b2)
        pos = torch.where(found, bucket * W + slot % W, -1)
        return pos, found

    def _check_segments(self, segments: torch.Tensor | None, n: int) -> torch.Tensor | None:
        """The segment of each of n keys ([n] int64), validated; an index without segments takes none."""
        if segments is not None:
            raise ValueError("segments=: this index has no segments (see dynemb.table.segmented.SegmentedKeyIndex)")
        return None

    def find(self, keys: torch.Tensor, *, segments: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Row ids of keys, without side effects.

        Args:
            keys (Tensor[int64]): [*] any shape.
            segments (Tensor[int64] | None): [*] like keys, the segment (table) of each key
                (segmented indexes only).
        Returns:
            rows (Tensor[int64]): [*] row id, -1 where absent.
            found (Tensor[bool]): [*]
        """
        flat = self._check_keys(keys)
        pos, found = self._locate(flat, self._check_segments(segments, flat.numel()))
        rows = torch.where(found, self._rows.view(-1).index_select(0, pos.clamp(min=0)), -1)
        return rows.view(keys.shape), found.view(keys.shape)

    def scores(self, keys: torch.Tensor, *, segments: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores of keys ([*] int64, 0 where absent) and whether found ([*] bool); no side effects."""
        flat = self._check_keys(keys)
        pos, found = self._locate(flat, self._check_segments(segments, flat.numel()))
        scores = torch.where(found, self._scores.view(-1).index_select(0, pos.clamp(min=0)), 0)
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
        return torch.full_like(counts, now)

    def find_or_insert(self, keys: torch.Tensor, *, now: int | None = None, scores: torch.Tensor | None = None) -> IndexResult:
        """Find keys, insert the missing ones, evicting low-scored keys where the index is full.

        Args:
            keys (Tensor[int64]): [*] any shape, flattened to [N]; duplicates allowed.
            now: the clock (step or timestamp) of this call; required by the ``timestamp``,
                ``step`` and ``no_eviction`` strategies unless ``scores`` is given.
            scores (Tensor[int64] | None): [*] like keys, scores to assign (a key given several
                times gets the largest); ``None`` uses the strategy's own score.
        Returns:
            IndexResult over the N keys (failed keys are returned, never raised).
        """
        flat = self._check_keys(keys)
        unique, inverse, counts = torch.unique(flat, sorted=True, return_inverse=True, return_counts=True)
        given = None
        if scores is not None:
            flat_scores = self._check_keys(scores, "scores")
            if flat_scores.numel() != flat.numel():
                raise ValueError(f"scores has {flat_scores.numel()} values for {flat.numel()} keys")
            given = torch.full_like(unique, _INT64_MIN).scatter_reduce_(0, inverse, flat_scores, reduce="amax")
        r = self.upsert_unique(unique, counts, now=now, given=given)
        return IndexResult(
            positions=r.positions.index_select(0, inverse),
            rows=r.rows.index_select(0, inverse),
            found=r.found.index_select(0, inverse),
            inserted=r.inserted.index_select(0, inverse),
            evicted_keys=r.evicted_keys,
            evicted_rows=r.evicted_rows,
            evicted_scores=r.evicted_scores,
            failed_keys=r.failed_keys,
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
        into free slots, growing the index below its capacity, then by moving resident keys to
        their other bucket, then by eviction (except ``no_eviction``). Keys that fit nowhere fail.

        Args:
            unique (Tensor[int64]): [U] distinct keys, sorted ascending (not checked).
            counts (Tensor[int64]): [U] occurrences of each in the batch (the lfu score).
            now: the clock (timestamp or step) for the ``timestamp``, ``step`` and
                ``no_eviction`` strategies; required by them unless ``given`` is passed.
            given (Tensor[int64] | None): [U] scores to assign (``customized``; any strategy).
            segments (Tensor[int64] | None): [U] segment of each key (segmented indexes only);
                the (segment, key) pairs are distinct and sorted by segment, then key.
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
            now = _check_now(now)
        seg = self._check_segments(segments, unique.numel())
        batch_scores = self._batch_scores(counts, now, given)
        # Every tensor the index keeps is written here: mutate outside inference mode.
        with torch.inference_mode(False):
            return self._upsert(unique, counts, batch_scores, given is None, seg)

    def _upsert(self, unique: torch.Tensor, counts: torch.Tensor, batch_scores: torch.Tensor, own: bool, seg: torch.Tensor | None = None) -> IndexResult:
        """upsert_unique after argument checks; ``own``: the scores are the strategy's (not given);
        ``seg``: [U] segment of each key (segmented indexes)."""
        lfu_add = own and self.strategy is ScoreStrategy.LFU
        # With one clock value for every key, priority order is already that of the keys.
        uniform = own and self.strategy in _CLOCKED
        pos, found = self._locate(unique, seg)
        found_pos = pos[found]
        flat_scores = self._scores.view(-1)
        if lfu_add:
            # Saturating add: a key pinned at the largest score must not wrap to the smallest.
            old = flat_scores.index_select(0, found_pos)
            add = counts[found]
            flat_scores.scatter_(0, found_pos, torch.where(old > _MAX_SCORE - add, _MAX_SCORE, old + add))
        else:
            flat_scores.scatter_(0, found_pos, batch_scores[found])

        missing = (~found).nonzero().squeeze(1)  # [M] into unique
        if not uniform:
            # Priority order: higher score first, then smaller key (unique is sorted).
            by_score = torch.sort(batch_scores.index_select(0, missing), descending=True, stable=True)
            missing = missing.index_select(0, by_score.indices)
        new_keys = unique.index_select(0, missing)
        new_scores = batch_scores.index_select(0, missing)
        new_seg = None if seg is None else seg.index_select(0, missing)
        grown = False
        while self._can_grow() and self._size + missing.numel() > self.max_load_factor * self.current_capacity():
            self._grow()
            grown = True
        if grown:
            pos, _ = self._locate(unique, seg)
        new_pos = torch.full_like(missing, -1)  # [M] slot of each new key once placed
        waiting = torch.ones_like(missing, dtype=torch.bool)  # [M] not placed yet
        # New keys for which moving residents may still free a slot: a key none of whose
        # buckets' keys could move is not tried again in this call.
        hopeful = torch.ones_like(missing, dtype=torch.bool)  # [M]
        pending = to_place = torch.arange(missing.numel(), device=self.device)  # ranks into missing
        # Each pass places at least one more key, or rules keys out of displacement, or improves
        # the priority of the placed ones (_displace), or ends. The host syncs per pass (sizes of
        # masked selections) are what lets the loop stop as soon as every key is placed.
        while to_place.numel():
            placed, placed_pos = self._place_free(
                new_keys.index_select(0, to_place), new_scores.index_select(0, to_place), _pick(new_seg, to_place)
            )
            done = to_place[placed]
            new_pos.scatter_(0, done, placed_pos[placed])
            waiting.index_fill_(0, done, False)
            pending = waiting.nonzero().squeeze(1)
            if pending.numel() == 0:
                break
            if self._can_grow():
                self._grow()
                # Growth moved every key: find the batch's keys again.
                pos, _ = self._locate(unique, seg)
                new_pos = torch.where(waiting, -1, pos.index_select(0, missing))
                to_place = pending
                continue
            to_place = pending[:0]
            while to_place.numel() == 0:
                # No more than the free slots can be filled: trying a few times as many keys
                # at once bounds the cost of displacement when the index is nearly full.
                tried = pending[hopeful.index_select(0, pending)][: 4 * (self.current_capacity() - self._size)]
                if tried.numel() == 0:
                    break
                room, stuck, moves = self._make_room(new_keys.index_select(0, tried), _pick(new_seg, tried))
                hopeful.index_fill_(0, tried[stuck], False)
                pos, new_pos = _follow(pos, moves), _follow(new_pos, moves)
                to_place = tried[room]
                if to_place.numel() * GIVE_UP < tried.numel():
                    # Few keys got room: the free slots left are hard to reach. Stop trying in
                    # this call, so that a nearly full index does not spend many passes per call.
                    hopeful.zero_()
            if to_place.numel():
                continue
            # Full: keys that found no free slot take slots of lower-priority keys of the batch;
            # displaced keys go round again (their other bucket may have room).
            pending, displaced = self._displace(new_keys, new_scores, pending, new_pos, new_seg)
            if not displaced:
                break
            waiting.zero_().index_fill_(0, pending, True)
            to_place = pending
        pos = pos.index_copy(0, missing, new_pos)

        evicted = (torch.empty(0, dtype=torch.int64, device=self.device),) * 4
        if pending.numel() and self.strategy is not ScoreStrategy.NO_EVICTION:
            victim_pos, *evicted = self._evict_for(new_keys[pending], new_scores[pending], pos[pos >= 0], _pick(new_seg, pending))
            pos.scatter_(0, missing[pending], victim_pos)
        *evicted, taken = evicted
        ok = pos >= 0
        rows = torch.where(ok, self._rows.view(-1).index_select(0, pos.clamp(min=0)), -1)
        failed_keys = unique[~ok]
        failed_seg = None if seg is None else seg[~ok]
        self._count("failed_inserts", seg=failed_seg, n=failed_keys.numel())
        evicted_seg = None if seg is None else self._bucket_segments(taken // self.bucket_capacity)
        return IndexResult(pos, rows, found, ok & ~found, *evicted, failed_keys, evicted_seg, failed_seg)

    def _can_grow(self) -> bool:
        return self.num_buckets < self.max_buckets

    def _place_free(self, keys: torch.Tensor, scores: torch.Tensor, seg: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Put P keys (in priority order) into free slots of their candidate buckets.

        A batch places its keys in rounds, each key going to its candidate with more free slots;
        while keys compete, a bucket takes at most half of its free slots per round, so a batch
        spreads over both candidates the way keys inserted one by one would. Then a round fills
        the preferred candidate completely, and a last one the other candidate.

        Returns:
            placed (Tensor[bool]): [P]
            pos (Tensor[int64]): [P] slot taken, meaningful where placed.
        """
        placed = torch.zeros_like(keys, dtype=torch.bool)
        pos = torch.full_like(keys, -1)
        if self._size == self.current_capacity():
            return placed, pos
        b1, b2 = self._buckets(keys, seg)
        # Ties between equally free candidates go by a bit of the buckets, not always to bucket 1.
        tie_second = ((b1 ^ b2) & 1).bool()
        W = self.bucket_capacity

        def one_round(halve: bool, other: bool) -> int:
            todo = (~placed).nonzero().squeeze(1)
            t1, t2 = b1.index_select(0, todo), b2.index_select(0, todo)
            free1 = W - self._used.index_select(0, t1).sum(1)
            free2 = W - self._used.index_select(0, t2).sum(1)
            # Keys whose buckets are both full wait (for displacement or eviction).
            room = ((free1 > 0) | (free2 > 0)).nonzero().squeeze(1)
            if room.numel() == 0:
                return 0
            if room.numel() < todo.numel():
                todo, t1, t2, free1, free2 = (x.index_select(0, room) for x in (todo, t1, t2, free1, free2))
            second = (free2 > free1) | ((free2 == free1) & tie_second.index_select(0, todo))
            bucket = torch.where(second ^ other, t2, t1)
            fits, slot_pos = self._fill(keys.index_select(0, todo), scores.index_select(0, todo), bucket, halve)
            done = todo[fits]
            placed.index_fill_(0, done, True)
            pos.scatter_(0, done, slot_pos[fits])
            return done.numel()

        for _ in range(8):
            if one_round(halve=True, other=False) == 0:
                break
        one_round(halve=False, other=False)
        one_round(halve=False, other=True)
        return placed, pos

    def _fill(self, keys: torch.Tensor, scores: torch.Tensor, bucket: torch.Tensor, halve: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Give the r-th key of each bucket (in priority order) the bucket's r-th free slot.

        Args:
            keys, scores, bucket (Tensor[int64]): [P] each.
            halve: take at most half (rounded up) of each bucket's free slots.
        Returns:
            fits (Tensor[bool]): [P]
            pos (Tensor[int64]): [P] slot taken, meaningful where fits.
        """
        order, bucket, rank = _group_by_bucket(bucket)  # [P] each
        fits, pos = self._free_slots(bucket, rank, halve)
        fit_pos = pos[fits]
        fit_idx = order[fits]
        self._keys.view(-1).scatter_(0, fit_pos, keys.index_select(0, fit_idx))
        self._used.view(-1).index_fill_(0, fit_pos, True)
        self._scores.view(-1).scatter_(0, fit_pos, scores.index_select(0, fit_idx))
        self._rows.view(-1).scatter_(0, fit_pos, self.free_list.allocate(fit_pos.numel()))
        self._size += fit_pos.numel()
        self._count("inserts", fit_pos)
        out_fits = torch.zeros_like(fits).scatter_(0, order, fits)
        out_pos = torch.empty_like(pos).scatter_(0, order, pos)
        return out_fits, out_pos

    def _free_slots(self, bucket: torch.Tensor, rank: torch.Tensor, halve: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The rank-th free slot of each bucket (buckets and ranks [P] from _group_by_bucket).

        Returns:
            fits (Tensor[bool]): [P] the bucket has that many free slots (at most half of them,
                rounded up, with ``halve``).
            pos (Tensor[int64]): [P] flat slot, meaningful where fits.
        """
        free = ~self._used.index_select(0, bucket)  # [P, W]
        n_free = free.sum(1)
        fits = rank < ((n_free + 1) // 2 if halve else n_free)
        target = free & (free.cumsum(1) == (rank + 1)[:, None])
        return fits, bucket * self.bucket_capacity + target.view(torch.uint8).argmax(1)

    def _make_room(self, keys: torch.Tensor, seg: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Free slots in the full candidate buckets of P pending keys by moving resident keys to
        their other candidate bucket (cuckoo displacement; a moved key keeps its row id and
        score).

        Returns:
            room (Tensor[bool]): [P] one of the key's buckets has a free slot now.
            stuck (Tensor[bool]): [P] no key of either of its buckets could move (another try
                in this call would fail too).
            moves: (from, to) flat slots of the keys moved, one pair of tensors per step, in
                the order applied (see :func:`_follow`).
        """
        moves: list[tuple[torch.Tensor, torch.Tensor]] = []
        free = self.current_capacity() - self._size
        if free == 0:
            nothing = torch.zeros_like(keys, dtype=torch.bool)
            return nothing, ~nothing, moves
        b1, b2 = self._buckets(keys, seg)
        needy = torch.unique(torch.cat([b1, b2]))  # [Q]
        # Chains of two moves look at W times more keys; they are tried for at most as many
        # buckets as there are free slots, which bounds their cost when the index is nearly full.
        stuck = self._move_out(needy, MOVE_DEPTH, free, moves)
        used = self._used
        room = ~(used.index_select(0, b1).all(1) & used.index_select(0, b2).all(1))
        return room, ~room & torch.isin(b1, stuck) & torch.isin(b2, stuck), moves

    def _move_out(self, buckets: torch.Tensor, depth: int, deep_limit: int, moves: list) -> torch.Tensor:
        """Free one slot in each full bucket of ``buckets`` ([Q] distinct): move one of its keys
        to that key's other candidate bucket, the one with the most free slots (ties: lower
        slot). With ``depth`` > 1, up to ``deep_limit`` buckets none of whose keys can move
        first get room made in those other buckets (recursively), then try again. Appends the
        (from, to) slots of the moves to ``moves``.

        Returns:
            Tensor[int64]: [S] the buckets none of whose keys could move.
        """
        W = self.bucket_capacity
        full = buckets[self._used.index_select(0, buckets).all(1)]  # [F]
        F = full.numel()
        if F == 0:
            return full
        residents = self._keys.index_select(0, full).view(-1)  # [F * W]
        own = full.repeat_interleave(W)
        r1, r2 = self._buckets(residents, self._bucket_segments(own))
        alt = torch.where(r1 == own, r2, r1)  # [F * W], == own when both candidates coincide
        free_alt = (W - self._used.index_select(0, alt).sum(1)).masked_fill_(alt == own, 0).view(F, W)
        alt = alt.view(F, W)
        best_free = free_alt.amax(1)  # [F]
        best = (free_alt == best_free[:, None]).view(torch.uint8).argmax(1)  # [F] first such slot
        can_move = best_free > 0
        movable = can_move.nonzero().squeeze(1)  # [F'] into full
        best = best.index_select(0, movable)
        src = full.index_select(0, movable) * W + best
        dst_bucket = alt.index_select(0, movable).gather(1, best[:, None]).squeeze(1)
        # Several keys may head for one bucket: the r-th (by source bucket) takes its r-th free
        # slot, if it has that many (the others try again in the caller's next pass). Sources
        # (full buckets) and targets (not full) never overlap.
        order, dst_bucket, rank = _group_by_bucket(dst_bucket)
        fits, dst = self._free_slots(dst_bucket, rank)
        src, dst = src.index_select(0, order)[fits], dst[fits]
        for table in (self._keys, self._rows, self._scores):
            flat = table.view(-1)
            flat.scatter_(0, dst, flat.index_select(0, src))
        self._used.view(-1).index_fill_(0, dst, True).index_fill_(0, src, False)
        moves.append((src, dst))
        stuck = (~can_move).nonzero().squeeze(1)  # [S] into full
        if depth > 1 and deep_limit > 0 and stuck.numel():
            explore, rest = stuck[:deep_limit], stuck[deep_limit:]
            explore_alt = alt.index_select(0, explore)  # [S', W]
            explore = full.index_select(0, explore)
            deeper = torch.unique(explore_alt[explore_alt != explore[:, None]])
            if deeper.numel():
                self._move_out(deeper, depth - 1, deep_limit, moves)
                return torch.cat([self._move_out(explore, 1, 0, moves), full.index_select(0, rest)])
        return full.index_select(0, stuck)

    def _displace(self, keys: torch.Tensor, scores: torch.Tensor, pending: torch.Tensor, pos: torch.Tensor, seg: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
        """Restore priority after batched placement: a pending key takes the slot of the
        lowest-priority key this batch placed in its candidate buckets, if that key ranks below
        it; the displaced key becomes pending and may displace in turn.

        Args:
            keys, scores (Tensor[int64]): [M] new keys in priority order (index = rank).
            pending (Tensor[int64]): [P] ranks of keys not placed.
            pos (Tensor[int64]): [M] slot of each placed key, -1 otherwise; updated in place.
        Returns:
            ranks still pending (Tensor[int64], ascending) and how many keys were displaced.
        """
        flat_keys, flat_scores = self._keys.view(-1), self._scores.view(-1)
        active = pending
        displaced = 0
        while active.numel():
            placed = (pos >= 0).nonzero().squeeze(1)  # ranks of placed keys, ascending
            if placed.numel() == 0:
                break
            by_pos = torch.sort(pos.index_select(0, placed))
            cand = self._candidate_slots(keys.index_select(0, active), _pick(seg, active))  # [A, 2W]
            at = torch.searchsorted(by_pos.values, cand).clamp_(max=placed.numel() - 1)
            hit = by_pos.values.index_select(0, at.view(-1)).view(cand.shape) == cand
            rank = torch.where(hit, placed.index_select(0, by_pos.indices.index_select(0, at.view(-1))).view(cand.shape), -1)
            victim_rank, best = rank.max(1)  # lowest-priority batch key among the candidates
            eligible = victim_rank > active
            active, victim_rank = active[eligible], victim_rank[eligible]
            if active.numel() == 0:
                break
            victim_pos = cand[eligible].gather(1, best[eligible][:, None]).squeeze(1)
            # Two keys wanting one slot: the higher priority (lower rank) wins; active is ascending.
            by_victim = torch.sort(victim_pos, stable=True)
            first = torch.ones_like(victim_pos, dtype=torch.bool)
            first[1:] = by_victim.values[1:] != by_victim.values[:-1]
            winner = torch.zeros_like(first).index_fill_(0, by_victim.indices[first], True)
            w_rank, w_pos, loser_rank = active[winner], victim_pos[winner], victim_rank[winner]
            # The winner inherits the displaced key's slot and row id.
            flat_keys.scatter_(0, w_pos, keys.index_select(0, w_rank))
            flat_scores.scatter_(0, w_pos, scores.index_select(0, w_rank))
            pos.scatter_(0, w_rank, w_pos)
            pos.index_fill_(0, loser_rank, -1)
            displaced += loser_rank.numel()
            pending = torch.cat([pending[~torch.isin(pending, w_rank)], loser_rank])
            active = torch.sort(torch.cat([active[~winner], loser_rank])).values
        return torch.sort(pending).values, displaced

    def _evict_for(self, keys: torch.Tensor, scores: torch.Tensor, locked_pos: torch.Tensor, seg: torch.Tensor | None = None):
        """Place P keys (priority order) whose buckets are full by evicting, for each, the
        lowest-scored unlocked key of its 2W candidate slots (ties: bucket 1 before bucket 2,
        lower slot first), if that score is not above its own (lfu: whatever its score).
        Keys proceed in priority order wherever they share a bucket; the others wait a round.

        Returns:
            pos (Tensor[int64]): [P] slot taken, -1 if the key failed.
            evicted keys, rows, scores (Tensor[int64]): [E] each.
        """
        W = self.bucket_capacity
        lock = self._lock
        lock.index_fill_(0, locked_pos, True)
        flat_keys, flat_scores, flat_rows = self._keys.view(-1), self._scores.view(-1), self._rows.view(-1)
        flat_used = self._used.view(-1)
        candidates = self._candidate_slots(keys, seg)  # [P, 2W]
        pos = torch.full_like(keys, -1)
        active = torch.arange(keys.numel(), device=self.device)
        won = []
        while active.numel():
            cand = candidates.index_select(0, active)  # [A, 2W]
            flat = cand.view(-1)
            # An empty slot is never a victim (free slots were offered before eviction).
            blocked = (lock.index_select(0, flat) | ~flat_used.index_select(0, flat)).view(cand.shape)
            masked = flat_scores.index_select(0, flat).view(cand.shape).masked_fill_(blocked, _MAX_SCORE)
            victim_score = masked.amin(1)  # [A]
            # Unblocked slots holding the lowest score; "unblocked" matters when that score is
            # the int64 maximum, which blocked slots were filled with.
            lowest = (masked == victim_score[:, None]) & ~blocked
            best = lowest.view(torch.uint8).argmax(1)  # [A] first lowest: the tie order
            eligible = lowest.any(1)
            if self.strategy is not ScoreStrategy.LFU:
                eligible &= scores.index_select(0, active) >= victim_score
            victim = cand.gather(1, best[:, None]).squeeze(1)
            active, victim = active[eligible], victim[eligible]
            if active.numel() == 0:
                break
            # A key waits while a higher-priority key still contends for one of its buckets (else
            # it could take a slot that key needs next round); the top key always proceeds.
            buckets = cand[eligible][:, [0, W]] // W  # [A, 2]
            shared, inverse = torch.unique(buckets.reshape(-1), return_inverse=True)
            top = torch.full_like(shared, _MAX_SCORE).scatter_reduce_(0, inverse, active.repeat_interleave(2), reduce="amin")
            winner = (top.index_select(0, inverse).view(-1, 2) >= active[:, None]).all(1)
            w_keys, w_pos = active[winner], victim[winner]
            won.append((flat_keys.index_select(0, w_pos), flat_rows.index_select(0, w_pos), flat_scores.index_select(0, w_pos), w_pos))
            flat_keys.scatter_(0, w_pos, keys.index_select(0, w_keys))
            flat_scores.scatter_(0, w_pos, scores.index_select(0, w_keys))
            lock.index_fill_(0, w_pos, True)
            pos.scatter_(0, w_keys, w_pos)
            active = active[~winner]
        lock.index_fill_(0, locked_pos, False)
        lock.index_fill_(0, pos[pos >= 0], False)
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        *evicted, taken = [torch.cat(parts) for parts in zip(*won)] if won else [empty] * 4
        self._count("evictions", taken)
        self._count("inserts", taken)
        return (pos, *evicted, taken)

    def _grow(self) -> None:
        """Double the buckets and re-place every key with its row id and score; a key in old
        bucket c (its first or second candidate) moves to that candidate's child, 2c or 2c+1.
        The new tensors are allocated first, so a failed allocation leaves the index as it was."""
        W = self.bucket_capacity
        tables = self._new_tables(2 * self.num_buckets)
        used = self._used.view(-1).nonzero().squeeze(1)
        keys = self._keys.view(-1).index_select(0, used)
        rows = self._rows.view(-1).index_select(0, used)
        scores = self._scores.view(-1).index_select(0, used)
        old1, _ = candidate_buckets(keys, self.num_buckets)
        in_first = old1 == used // W
        new1, new2 = candidate_buckets(keys, 2 * self.num_buckets)
        bucket = torch.where(in_first, new1, new2)
        order, bucket, rank = _group_by_bucket(bucket)
        pos = bucket * W + rank
        new_keys, new_used, new_rows, new_scores, _ = tables
        new_keys.view(-1).scatter_(0, pos, keys.index_select(0, order))
        new_rows.view(-1).scatter_(0, pos, rows.index_select(0, order))
        new_scores.view(-1).scatter_(0, pos, scores.index_select(0, order))
        new_used.view(-1).index_fill_(0, pos, True)
        self._set_tables(tables)
        self._stats["growths"] += 1

    def erase(self, keys: torch.Tensor, *, segments: torch.Tensor | None = None) -> IndexResult:
        """Remove keys and give their row ids back to the free list.

        Args:
            keys (Tensor[int64]): [*] any shape, flattened to [N]; duplicates allowed.
        Returns:
            IndexResult over the N keys: ``found`` says which were present; ``rows`` and
            ``positions`` are -1 and ``inserted`` False everywhere; ``evicted_*`` are the erased
            keys (each once, ascending), their former row ids and scores; no failed keys.
        """
        flat = self._check_keys(keys)
        seg = self._check_segments(segments, flat.numel())
        if seg is None:
            unique, inverse = torch.unique(flat, sorted=True, return_inverse=True)
            useg = None
        else:
            (useg, unique), inverse, _ = unique_pairs(seg, flat)
        with torch.inference_mode(False):
            pos, found = self._locate(unique, useg)
            hit = pos[found]
            erased = unique[found]
            erased_rows = self._rows.view(-1).index_select(0, hit)
            erased_scores = self._scores.view(-1).index_select(0, hit)
            self._used.view(-1).index_fill_(0, hit, False)
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

    def export(self, chunk_size: int = 1 << 16) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Yield (keys, rows, scores), each Tensor[int64] [K'], over every held key in slot order,
        in chunks of at most ``chunk_size`` slots scanned. Do not modify the index while iterating."""
        if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
            raise ValueError(f"chunk_size={chunk_size!r}: must be an int >= 1")
        for keys, rows, scores, _ in self._export_slots(0, self._used.numel(), chunk_size):
            yield keys, rows, scores

    def _export_slots(self, lo: int, hi: int, chunk_size: int):
        """Yield (keys, rows, scores, slots) of the held keys in flat slots [lo, hi), in slot
        order, scanning ``chunk_size`` slots at a time (slots: each key's flat slot)."""
        keys, rows, scores, used = (t.view(-1) for t in (self._keys, self._rows, self._scores, self._used))
        for start in range(lo, hi, chunk_size):
            end = min(start + chunk_size, hi)
            at = used[start:end].nonzero().squeeze(1)
            yield keys[start:end].index_select(0, at), rows[start:end].index_select(0, at), scores[start:end].index_select(0, at), at + start

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Plain int64 tensors that restore this index exactly (``torch.load(weights_only=True)``).

        Entries: ``keys``, ``rows``, ``scores``, ``slots`` [K] (flat slot of each key, ascending);
        0-d ``num_buckets``, ``bucket_capacity``, ``max_buckets``, ``free_high_water``; ``free``
        [n] (released row ids, first released first); ``counters`` [4] (inserts, evictions,
        failed_inserts, growths).
        """
        slots = self._used.view(-1).nonzero().squeeze(1)
        free = self.free_list.state()

        def scalar(value: int) -> torch.Tensor:
            return torch.tensor(value, dtype=torch.int64, device=self.device)

        return {
            "keys": self._keys.view(-1).index_select(0, slots),
            "rows": self._rows.view(-1).index_select(0, slots),
            "scores": self._scores.view(-1).index_select(0, slots),
            "slots": slots,
            "num_buckets": scalar(self.num_buckets),
            "bucket_capacity": scalar(self.bucket_capacity),
            "max_buckets": scalar(self.max_buckets),
            "free_high_water": scalar(free["high_water"]),
            "free": free["free"],
            "counters": torch.tensor([self._stats[c] for c in _COUNTERS], dtype=torch.int64, device=self.device),
        }

    def same_geometry(self, state: Mapping[str, torch.Tensor]) -> bool:
        """Whether :meth:`load_state_dict` can restore ``state`` exactly: its bucket width and
        maximum buckets are this index's and its ``num_buckets`` is one this index passes
        through as it grows. (Other states must be re-inserted key by key.)"""
        try:
            B, W, B_max = (_scalar(state, name) for name in ("num_buckets", "bucket_capacity", "max_buckets"))
        except ValueError:
            return False
        return W == self.bucket_capacity and B_max == self.max_buckets and self.init_buckets <= B <= B_max and B_max % B == 0 and (B_max // B).bit_count() == 1

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore :meth:`state_dict` of an index of the same geometry (:meth:`same_geometry`),
        exactly: same slots, row ids, free list and counters, so later calls behave bitwise as
        they would have on the saved index. Everything is checked first: a bad or foreign state
        raises ValueError naming the entry and leaves this index unchanged.
        """
        if not isinstance(state, Mapping):
            raise ValueError(f"state: must be a mapping of tensors, got {type(state).__name__}")
        B, W, B_max = (_scalar(state, name) for name in ("num_buckets", "bucket_capacity", "max_buckets"))
        if not self.same_geometry(state):
            raise ValueError(
                f"state num_buckets={B}, bucket_capacity={W}, max_buckets={B_max}: not a state of this index's "
                f"geometry (bucket_capacity={self.bucket_capacity}, buckets {self.init_buckets} doubling to "
                f"{self.max_buckets}); re-insert its keys instead"
            )
        keys, rows, scores, slots = (_vector(state, name) for name in ("keys", "rows", "scores", "slots"))
        K = keys.numel()
        for name, t in (("rows", rows), ("scores", scores), ("slots", slots)):
            if t.numel() != K:
                raise ValueError(f"state entry '{name}' has {t.numel()} values for {K} keys")
        counters = _vector(state, "counters")
        if counters.numel() != len(_COUNTERS) or bool((counters < 0).any()):
            raise ValueError(f"state entry 'counters': must hold {len(_COUNTERS)} counts >= 0 {_COUNTERS}")
        high_water = _scalar(state, "free_high_water")
        free = _vector(state, "free")
        device = self.device
        keys, rows, scores, slots, free = (t.to(device) for t in (keys, rows, scores, slots, free))
        slot_count = B * W
        if K > slot_count:
            raise ValueError(f"state entry 'keys' holds {K} keys for {slot_count} slots")
        if K:
            if not bool(((slots >= 0) & (slots < slot_count)).all()):
                raise ValueError(f"state entry 'slots': must lie in [0, {slot_count})")
            if torch.unique(slots).numel() != K:
                raise ValueError("state entry 'slots': must be distinct")
            if self._distinct_entries(keys, slots) != K:
                raise ValueError("state entry 'keys': must be distinct")
            b1, b2 = self._state_buckets(keys, slots, B)
            bucket = slots // W
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
            tables = self._new_tables(B)
            new_keys, new_used, new_rows, new_scores, _ = tables
            new_keys.view(-1).scatter_(0, slots, keys)
            new_rows.view(-1).scatter_(0, slots, rows)
            new_scores.view(-1).scatter_(0, slots, scores)
            new_used.view(-1).index_fill_(0, slots, True)
            self.free_list.load_state(high_water, free)
        self._set_tables(tables)
        self._size = K
        self._stats = dict(zip(_COUNTERS, counters.tolist()))

    def to(self, device: torch.device | str) -> KeyIndex:
        """Move every index tensor and the free list to ``device``."""
        device = resolve_device(device)
        with torch.inference_mode(False):
            tables = tuple(t.to(device) for t in (self._keys, self._used, self._rows, self._scores, self._lock))
        self.device = device
        self._set_tables(tables)
        self.free_list.to(device)
        self._workspace.to(device)
        return self


def _scalar(state: Mapping[str, torch.Tensor], name: str) -> int:
    value = state.get(name) if isinstance(state, Mapping) else None
    if not isinstance(value, torch.Tensor) or value.dtype != torch.int64 or value.dim() != 0:
        raise ValueError(f"state entry '{name}': must be a 0-d int64 tensor, got {_describe(value)}")
    return int(value)


def _vector(state: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
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
