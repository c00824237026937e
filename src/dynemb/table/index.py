"""Bucketed, scored hash index from int64 keys to row ids, in plain device-agnostic torch.

N keys in a batch, U unique keys, M new keys to place, O new keys that overflow their bucket,
B buckets, W slots per bucket (bucket capacity).

Layout: four [B, W] tensors (key, used flag, row id, score). A key lives in bucket
``bucket_of(mix64(key), B)`` at any free slot. Lookups compare a key against its bucket's W
slots at once. Growth doubles B and re-places keys and row ids (never rows); multiply-shift
bucketing sends old bucket b to new buckets 2b and 2b+1, so re-placement never overflows.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator
from typing import NamedTuple

import torch

from dynemb.errors import InsertionError
from dynemb.table.base import InsertResult, RowAllocator
from dynemb.table.hashing import bucket_of, mix64
from dynemb.types import CheckMode, ScoreStrategy

_EMPTY = torch.empty(0, dtype=torch.int64)


class _Plan(NamedTuple):
    """Placement of M new keys, in (bucket, score desc, key) order (all [M])."""

    order: torch.Tensor  # position of each planned key in the caller's sorted new keys
    keys: torch.Tensor
    scores: torch.Tensor
    bucket: torch.Tensor
    slot: torch.Tensor  # the free slot taken, meaningful where fits
    fits: torch.Tensor
    victim_rank: torch.Tensor  # for overflowing keys: which eviction candidate of the bucket


def plan_buckets(capacity: int, init_capacity: int | None, bucket_capacity: int) -> tuple[int, int]:
    """(initial buckets, maximum buckets) so that max = initial * 2**k and max*W >= capacity."""
    init = capacity if init_capacity is None else init_capacity
    doublings = 0
    while init << (doublings + 1) <= capacity:
        doublings += 1
    per_init = bucket_capacity << doublings
    init_buckets = -(-capacity // per_init)
    return init_buckets, init_buckets << doublings


def rounded_capacity(capacity: int, init_capacity: int | None, bucket_capacity: int) -> int:
    """The capacity an index of these arguments really has (>= capacity)."""
    return plan_buckets(capacity, init_capacity, bucket_capacity)[1] * bucket_capacity


class KeyIndex:
    """Scored hash index: every int64 key -> row id, growing from ``init_capacity`` to ``capacity``.

    Args:
        capacity: most keys held (rounded up, see :func:`plan_buckets`).
        allocator: gives row ids to new keys and takes back those of erased keys.
        init_capacity: keys held at creation (default ``capacity``).
        bucket_capacity: W, slots per bucket.
        max_load_factor: growth starts when an insert would pass this load factor.
        score_strategy: meaning of scores, see :class:`dynemb.ScoreStrategy`.
        check_mode: what failed inserts do, see :class:`dynemb.CheckMode`.
        device: where the index tensors live.

    ``step`` is the clock of the ``step`` and ``no_eviction`` strategies; the owner advances it.
    """

    def __init__(
        self,
        *,
        capacity: int,
        allocator: RowAllocator,
        init_capacity: int | None = None,
        bucket_capacity: int = 32,
        max_load_factor: float = 0.75,
        score_strategy: ScoreStrategy | str = ScoreStrategy.TIMESTAMP,
        check_mode: CheckMode | str = CheckMode.RAISE,
        device: torch.device | str = "cpu",
    ):
        for name, value in (("capacity", capacity), ("bucket_capacity", bucket_capacity)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: must be an int >= 1")
        if init_capacity is not None and not (isinstance(init_capacity, int) and 1 <= init_capacity <= capacity):
            raise ValueError(f"init_capacity={init_capacity!r}: must be an int in [1, capacity={capacity}]")
        if not 0 < max_load_factor <= 1:
            raise ValueError(f"max_load_factor={max_load_factor!r}: must be in (0, 1]")
        self.strategy = ScoreStrategy.parse(score_strategy, "score_strategy")
        self.check_mode = CheckMode.parse(check_mode, "check_mode")
        self.device = torch.device(device)
        self.bucket_capacity = bucket_capacity
        self.max_load_factor = float(max_load_factor)
        self.allocator = allocator
        self.num_buckets, self.max_buckets = plan_buckets(capacity, init_capacity, bucket_capacity)
        self.step = 0
        self._last_timestamp = 0
        self._size = 0
        self._slot_ids = torch.arange(bucket_capacity, device=self.device)
        self._allocate_tables(self.num_buckets)
        self.last_failed_keys = _EMPTY.to(self.device)
        self._stats = {"inserts": 0, "evictions": 0, "failed_inserts": 0, "growths": 0}

    def _allocate_tables(self, num_buckets: int) -> None:
        shape = (num_buckets, self.bucket_capacity)
        self._keys = torch.zeros(shape, dtype=torch.int64, device=self.device)
        self._used = torch.zeros(shape, dtype=torch.bool, device=self.device)
        self._rows = torch.full(shape, -1, dtype=torch.int64, device=self.device)
        self._scores = torch.zeros(shape, dtype=torch.int64, device=self.device)
        # Marks slots touched by the batch being placed; set and cleared per call, never reallocated.
        self._lock = torch.zeros(num_buckets * self.bucket_capacity, dtype=torch.bool, device=self.device)

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
        if not isinstance(keys, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of int64, got {type(keys).__name__}")
        if keys.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{name}.dtype={keys.dtype}: must be torch.int64 (or int32)")
        if keys.device != self.device:
            raise ValueError(f"{name}.device={keys.device}: the index lives on {self.device}")
        return keys.reshape(-1).to(torch.int64)

    def _locate(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat slot of each key (-1 if absent) and whether it is present ([N] int64, [N] bool)."""
        W = self.bucket_capacity
        bucket = bucket_of(mix64(keys), self.num_buckets)
        match = torch.eq(self._keys.index_select(0, bucket), keys[:, None])  # [N, W]
        match &= self._used.index_select(0, bucket)
        found = match.any(1)
        # A key occupies at most one slot, so the weighted sum is its slot.
        slot = (match.to(torch.int64) * self._slot_ids).sum(1)
        pos = torch.where(found, bucket * W + slot, -1)
        return pos, found

    def find(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Row ids of keys, without side effects.

        Args:
            keys (Tensor[int64]): [*] any shape.
        Returns:
            rows (Tensor[int64]): [*] row id, -1 where absent.
            found (Tensor[bool]): [*]
        """
        flat = self._check_keys(keys)
        pos, found = self._locate(flat)
        rows = torch.where(found, self._rows.view(-1).index_select(0, pos.clamp(min=0)), -1)
        return rows.view(keys.shape), found.view(keys.shape)

    def scores(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores of keys ([*] int64, 0 where absent) and whether found ([*] bool); no side effects."""
        flat = self._check_keys(keys)
        pos, found = self._locate(flat)
        scores = torch.where(found, self._scores.view(-1).index_select(0, pos.clamp(min=0)), 0)
        return scores.view(keys.shape), found.view(keys.shape)

    def _batch_scores(self, counts: torch.Tensor) -> torch.Tensor:
        """Score each of U unique keys gets from this batch under the strategy ([U] int64)."""
        if self.strategy is ScoreStrategy.LFU:
            return counts
        if self.strategy is ScoreStrategy.TIMESTAMP:
            now = max(time.time_ns(), self._last_timestamp + 1)
            self._last_timestamp = now
            return torch.full_like(counts, now)
        if self.strategy is ScoreStrategy.CUSTOMIZED:
            raise ValueError("score_strategy='customized' needs scores=: the caller gives every key's score")
        return torch.full_like(counts, self.step)

    def insert_and_evict(self, keys: torch.Tensor, scores: torch.Tensor | None = None) -> InsertResult:
        """Find keys, insert the missing ones, evicting low-scored keys of full buckets.

        Args:
            keys (Tensor[int64]): [N] duplicates allowed.
            scores (Tensor[int64] | None): [N] scores to assign (a key given several times gets
                the largest); ``None`` uses the strategy's own score.
        Returns:
            InsertResult for the N keys. Failed keys are also handled per ``check_mode``.
        """
        flat = self._check_keys(keys)
        unique, inverse, counts = torch.unique(flat, sorted=True, return_inverse=True, return_counts=True)
        given = None
        if scores is not None:
            scores = self._check_keys(scores, "scores")
            if scores.numel() != flat.numel():
                raise ValueError(f"scores has {scores.numel()} values for {flat.numel()} keys")
            given = torch.full_like(unique, torch.iinfo(torch.int64).min)
            given.scatter_reduce_(0, inverse, scores, reduce="amax")
        result = self.upsert_unique(unique, counts, given)
        self.report_failures(result.failed_keys, unique.numel())
        return InsertResult(
            rows=result.rows.index_select(0, inverse),
            found=result.found.index_select(0, inverse),
            ok=result.ok.index_select(0, inverse),
            evicted_keys=result.evicted_keys,
            evicted_rows=result.evicted_rows,
            evicted_scores=result.evicted_scores,
            failed_keys=result.failed_keys,
        )

    def find_or_insert(self, keys: torch.Tensor, scores: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Row ids of keys, inserting missing ones: (rows [N], found [N], ok [N]); see insert_and_evict."""
        r = self.insert_and_evict(keys, scores)
        return r.rows, r.found, r.ok

    def insert(self, keys: torch.Tensor, scores: torch.Tensor | None = None) -> torch.Tensor:
        """Insert keys (assigning ``scores`` where given); returns ok (Tensor[bool]: [N])."""
        return self.insert_and_evict(keys, scores).ok

    def report_failures(self, failed_keys: torch.Tensor, total: int) -> None:
        """Apply the check mode to keys that could not be placed (already counted in stats)."""
        self.last_failed_keys = failed_keys
        if failed_keys.numel() == 0 or self.check_mode is CheckMode.COUNT:
            return
        message = (
            f"{failed_keys.numel()} of {total} keys could not be inserted: their buckets hold only "
            f"keys used in this batch or scored higher (score_strategy='{self.strategy}', "
            f"size={self._size}, capacity={self.capacity()}). Increase capacity, or set "
            "check_mode='warn' or 'count' to continue; failed keys get their initial value and are "
            "not trained."
        )
        if self.check_mode is CheckMode.RAISE:
            raise InsertionError(message + " The keys are on this exception's .failed_keys.", failed_keys)
        warnings.warn(message, RuntimeWarning, stacklevel=3)

    def upsert_unique(self, unique: torch.Tensor, counts: torch.Tensor, given: torch.Tensor | None = None) -> InsertResult:
        """insert_and_evict on already unique keys, without applying the check mode.

        Args:
            unique (Tensor[int64]): [U] distinct keys, sorted ascending.
            counts (Tensor[int64]): [U] occurrences of each in the batch (lfu scores).
            given (Tensor[int64] | None): [U] scores to assign.
        Returns:
            InsertResult over the U keys. The caller must call :meth:`report_failures`.
        """
        batch_scores = given if given is not None else self._batch_scores(counts)
        while True:
            pos, found = self._locate(unique)
            missing = ~found
            new_keys = unique[missing]
            new_scores = batch_scores[missing]
            plan = self._plan(new_keys, new_scores)
            overflow = not bool(plan.fits.all())
            load = (self._size + new_keys.numel()) / self.current_capacity()
            if self.num_buckets < self.max_buckets and (overflow or load > self.max_load_factor):
                self._grow()
                continue
            break

        flat_scores = self._scores.view(-1)
        found_pos = pos[found]
        if self.strategy is ScoreStrategy.LFU and given is None:
            flat_scores.index_add_(0, found_pos, counts[found])
        else:
            flat_scores.index_copy_(0, found_pos, batch_scores[found])

        new_pos, evicted_keys, evicted_rows, evicted_scores = self._commit(plan, found_pos)
        pos = pos.masked_scatter(missing, new_pos)
        ok = pos >= 0
        rows = torch.where(ok, self._rows.view(-1).index_select(0, pos.clamp(min=0)), -1)
        failed_keys = new_keys[new_pos < 0]
        self._stats["failed_inserts"] += failed_keys.numel()
        return InsertResult(rows, found, ok, evicted_keys, evicted_rows, evicted_scores, failed_keys)

    def _plan(self, keys: torch.Tensor, scores: torch.Tensor) -> _Plan:
        """Where M new keys (sorted ascending) would go; pure.

        Keys are ordered by (bucket, score descending, key); the r-th key of a bucket takes the
        r-th free slot, the rest overflow.
        """
        M = keys.numel()
        order = torch.arange(M, device=self.device)
        if self.strategy in (ScoreStrategy.LFU, ScoreStrategy.CUSTOMIZED) and M:
            order = torch.sort(scores, descending=True, stable=True).indices
        bucket = bucket_of(mix64(keys.index_select(0, order)), self.num_buckets)
        by_bucket = torch.sort(bucket, stable=True)
        order = order.index_select(0, by_bucket.indices)
        bucket = by_bucket.values  # [M]
        idx = torch.arange(M, device=self.device)
        is_start = torch.ones(M, dtype=torch.bool, device=self.device)
        is_start[1:] = bucket[1:] != bucket[:-1]
        group_start = torch.cummax(torch.where(is_start, idx, 0), 0).values if M else idx
        rank = idx - group_start  # [M]
        free = ~self._used.index_select(0, bucket)  # [M, W]
        n_free = free.sum(1)
        target = free & (free.cumsum(1) == (rank + 1)[:, None])
        slot = (target.to(torch.int64) * self._slot_ids).sum(1)
        return _Plan(order, keys.index_select(0, order), scores.index_select(0, order), bucket, slot, rank < n_free, rank - n_free)

    def _commit(self, plan: _Plan, found_pos: torch.Tensor):
        """Write a plan: new keys take free slots, then overflowing keys evict unlocked keys.

        Returns:
            pos (Tensor[int64]): [M] slot of each new key in the plan's input order, -1 if failed.
            evicted keys, rows, scores (Tensor[int64]): [E] each.
        """
        W = self.bucket_capacity
        fits = plan.fits
        fit_pos = plan.bucket[fits] * W + plan.slot[fits]
        n_fit = fit_pos.numel()
        self._keys.view(-1).index_copy_(0, fit_pos, plan.keys[fits])
        self._used.view(-1).index_fill_(0, fit_pos, True)
        self._scores.view(-1).index_copy_(0, fit_pos, plan.scores[fits])
        self._rows.view(-1).index_copy_(0, fit_pos, self.allocator.allocate(n_fit))
        self._size += n_fit
        self._stats["inserts"] += n_fit
        pos_sorted = torch.where(fits, plan.bucket * W + plan.slot, -1)  # [M] in plan order

        evicted = (_EMPTY.to(self.device),) * 3
        over = ~fits
        if self.strategy is not ScoreStrategy.NO_EVICTION and bool(over.any()):
            evicted = self._evict_for(plan, over, found_pos, fit_pos, pos_sorted)
        pos = torch.empty_like(pos_sorted)
        pos[plan.order] = pos_sorted
        return (pos, *evicted)

    def _evict_for(self, plan: _Plan, over, found_pos, fit_pos, pos_sorted):
        """Give each overflowing key the slot of its bucket's lowest-scored unlocked key, if that
        key's score is not above its own. Updates ``pos_sorted`` in place."""
        W = self.bucket_capacity
        bucket = plan.bucket[over]  # [O]
        victim_rank = plan.victim_rank[over]
        new_scores = plan.scores[over]
        lock = self._lock
        lock.index_fill_(0, found_pos, True)
        lock.index_fill_(0, fit_pos, True)
        slots = bucket[:, None] * W + self._slot_ids  # [O, W]
        locked = lock.index_select(0, slots.view(-1)).view(slots.shape)
        lock.index_fill_(0, found_pos, False)
        lock.index_fill_(0, fit_pos, False)
        # Candidates ordered by (locked, score, slot): stable sorts, least significant first.
        by_score = torch.sort(self._scores.index_select(0, bucket), dim=1, stable=True)
        locked = locked.gather(1, by_score.indices)
        by_lock = torch.sort(locked.to(torch.uint8), dim=1, stable=True)
        cand_slot = by_score.indices.gather(1, by_lock.indices)
        cand_score = by_score.values.gather(1, by_lock.indices)
        r = victim_rank.clamp(max=W - 1)[:, None]
        victim_locked = by_lock.values.gather(1, r).squeeze(1).bool()
        victim_score = cand_score.gather(1, r).squeeze(1)
        wins = (victim_rank < W) & ~victim_locked & (new_scores >= victim_score)  # [O]
        victim_pos = bucket[wins] * W + cand_slot.gather(1, r).squeeze(1)[wins]
        flat_keys, flat_scores = self._keys.view(-1), self._scores.view(-1)
        evicted_keys = flat_keys.index_select(0, victim_pos)
        evicted_rows = self._rows.view(-1).index_select(0, victim_pos)
        evicted_scores = flat_scores.index_select(0, victim_pos)
        flat_keys.index_copy_(0, victim_pos, plan.keys[over][wins])
        flat_scores.index_copy_(0, victim_pos, new_scores[wins])
        over_idx = over.nonzero().squeeze(1)
        pos_sorted.index_copy_(0, over_idx[wins], victim_pos)
        self._stats["evictions"] += victim_pos.numel()
        self._stats["inserts"] += victim_pos.numel()
        return evicted_keys, evicted_rows, evicted_scores

    def _grow(self) -> None:
        """Double the buckets and re-place every key with its row id and score."""
        used = self._used.view(-1).nonzero().squeeze(1)
        keys = self._keys.view(-1).index_select(0, used)
        rows = self._rows.view(-1).index_select(0, used)
        scores = self._scores.view(-1).index_select(0, used)
        self.num_buckets *= 2
        self._allocate_tables(self.num_buckets)
        bucket = bucket_of(mix64(keys), self.num_buckets)
        by_bucket = torch.sort(bucket, stable=True)
        bucket, order = by_bucket.values, by_bucket.indices
        n = bucket.numel()
        idx = torch.arange(n, device=self.device)
        is_start = torch.ones(n, dtype=torch.bool, device=self.device)
        is_start[1:] = bucket[1:] != bucket[:-1]
        rank = idx - (torch.cummax(torch.where(is_start, idx, 0), 0).values if n else idx)
        pos = bucket * self.bucket_capacity + rank
        self._keys.view(-1).index_copy_(0, pos, keys.index_select(0, order))
        self._rows.view(-1).index_copy_(0, pos, rows.index_select(0, order))
        self._scores.view(-1).index_copy_(0, pos, scores.index_select(0, order))
        self._used.view(-1).index_fill_(0, pos, True)
        self._stats["growths"] += 1

    def erase(self, keys: torch.Tensor) -> torch.Tensor:
        """Remove keys and free their rows.

        Args:
            keys (Tensor[int64]): [N] duplicates allowed.
        Returns:
            Tensor[bool]: [N] the key was present.
        """
        flat = self._check_keys(keys)
        unique, inverse = torch.unique(flat, sorted=True, return_inverse=True)
        pos, found = self._locate(unique)
        pos = pos[found]
        self._used.view(-1).index_fill_(0, pos, False)
        self.allocator.release(self._rows.view(-1).index_select(0, pos))
        self._size -= pos.numel()
        return found.index_select(0, inverse).view(keys.shape)

    def export(self, chunk_size: int = 1 << 16) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Yield (keys, rows, scores), each Tensor[int64] [K], over every held key, in chunks of
        at most ``chunk_size`` slots scanned. Do not modify the index while iterating."""
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size={chunk_size!r}: must be an int >= 1")
        per_chunk = max(1, chunk_size // self.bucket_capacity)
        for start in range(0, self.num_buckets, per_chunk):
            stop = min(start + per_chunk, self.num_buckets)
            used = self._used[start:stop].reshape(-1)
            yield (
                self._keys[start:stop].reshape(-1)[used],
                self._rows[start:stop].reshape(-1)[used],
                self._scores[start:stop].reshape(-1)[used],
            )
