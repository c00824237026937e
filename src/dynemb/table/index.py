"""Bucketed, scored hash index from int64 keys to row ids, in plain device-agnostic torch.

N keys in a batch, U unique keys, M new keys to place, O new keys that overflow their bucket,
B buckets, W slots per bucket (bucket capacity).

Layout: four [B, W] tensors (key, used flag, row id, score). Two-choice hashing: a key may live
at any slot of either of its two candidate buckets (``candidate_buckets``); lookups compare it
against those 2W slots at once. A new key goes to the candidate with more free slots, else to the
other; only when both are full does it evict the lowest-scored unlocked key among the 2W (a key
is locked while the batch that uses it is being placed). Two choices let the index fill past 90%
before any bucket overflows, where one choice overflows some buckets at about 60%.

Growth doubles B and re-places keys and row ids (never rows); multiply-shift bucketing sends old
bucket b to new buckets 2b and 2b+1 for both choices, so re-placement never overflows.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator

import torch

from dynemb.config import resolve_device
from dynemb.errors import InsertionError
from dynemb.table.base import InsertResult, RowAllocator
from dynemb.hashing import candidate_buckets
from dynemb.workspace import Workspace
from dynemb.types import CheckMode, ScoreStrategy

_EMPTY = torch.empty(0, dtype=torch.int64)
_MAX_SCORE = torch.iinfo(torch.int64).max


def check_keys(keys: torch.Tensor, name: str, device: torch.device) -> torch.Tensor:
    """Validate int64 (or int32) keys of any shape on ``device``; returns them flat ([N] int64)."""
    if not isinstance(keys, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int64, got {type(keys).__name__}")
    if keys.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name}.dtype={keys.dtype}: must be torch.int64 (or int32)")
    if keys.device != device:
        raise ValueError(f"{name}.device={keys.device}: the table lives on {device}")
    return keys.reshape(-1).to(torch.int64)


def _group_by_bucket(bucket: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stable sort of bucket ids ([P] int64) -> (order, sorted buckets, rank within its bucket)."""
    by_bucket = torch.sort(bucket, stable=True)
    sorted_bucket = by_bucket.values
    idx = torch.arange(sorted_bucket.numel(), device=bucket.device)
    is_start = torch.ones_like(sorted_bucket, dtype=torch.bool)
    is_start[1:] = sorted_bucket[1:] != sorted_bucket[:-1]
    rank = idx - torch.cummax(torch.where(is_start, idx, 0), 0).values
    return by_bucket.indices, sorted_bucket, rank


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
        bucket_capacity: int = 16,
        max_load_factor: float = 0.85,
        score_strategy: ScoreStrategy | str = ScoreStrategy.TIMESTAMP,
        check_mode: CheckMode | str = CheckMode.RAISE,
        device: torch.device | str = "cpu",
    ):
        for name, value in (("capacity", capacity), ("bucket_capacity", bucket_capacity)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r}: must be an int >= 1")
        if init_capacity is not None and not (isinstance(init_capacity, int) and 1 <= init_capacity <= capacity):
            raise ValueError(f"init_capacity={init_capacity!r}: must be an int in [1, capacity={capacity}]")
        if not (isinstance(max_load_factor, (int, float)) and 0 < max_load_factor <= 1):
            raise ValueError(f"max_load_factor={max_load_factor!r}: must be in (0, 1]")
        self.strategy = ScoreStrategy.parse(score_strategy, "score_strategy")
        self.check_mode = CheckMode.parse(check_mode, "check_mode")
        self.device = resolve_device(device)
        self.bucket_capacity = bucket_capacity
        self.max_load_factor = float(max_load_factor)
        self.allocator = allocator
        self.num_buckets, self.max_buckets = plan_buckets(capacity, init_capacity, bucket_capacity)
        self.step = 0
        self._last_timestamp = 0
        self._size = 0
        self._slot_ids = torch.arange(bucket_capacity, device=self.device)
        self._workspace = Workspace(self.device)
        self._allocate_tables(self.num_buckets)
        self.last_failed_keys = _EMPTY.to(self.device)
        self._stats = {"inserts": 0, "evictions": 0, "failed_inserts": 0, "growths": 0}

    def _allocate_tables(self, num_buckets: int) -> None:
        shape = (num_buckets, self.bucket_capacity)
        self._keys = torch.zeros(shape, dtype=torch.int64, device=self.device)
        self._used = torch.zeros(shape, dtype=torch.bool, device=self.device)
        self._rows = torch.full(shape, -1, dtype=torch.int64, device=self.device)
        self._scores = torch.zeros(shape, dtype=torch.int64, device=self.device)
        # Marks slots locked by the batch being placed; set and cleared per call, never reallocated.
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
        return check_keys(keys, name, self.device)

    def _candidate_slots(self, keys: torch.Tensor) -> torch.Tensor:
        """Flat positions of the 2W candidate slots of each key ([N] -> [N, 2W]), bucket 1 first."""
        b1, b2 = candidate_buckets(keys, self.num_buckets)
        W = self.bucket_capacity
        return (torch.stack([b1, b2], 1) * W)[:, :, None].add(self._slot_ids).view(-1, 2 * W)

    def _locate(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat slot of each key (-1 if absent) and whether it is present ([N] int64, [N] bool)."""
        W = self.bucket_capacity
        b1, b2 = candidate_buckets(keys, self.num_buckets)
        buckets = torch.stack([b1, b2], 1).view(-1)  # [2N]
        n = keys.numel()
        ws = self._workspace
        cand = torch.index_select(self._keys, 0, buckets, out=ws.get("cand", 2 * n, (W,), torch.int64))
        used = torch.index_select(self._used, 0, buckets, out=ws.get("used", 2 * n, (W,), torch.bool))
        match = torch.eq(cand.view(n, 2 * W), keys[:, None], out=ws.get("match", n, (2 * W,), torch.bool))
        match &= used.view(n, 2 * W)
        found = match.any(1)
        # First matching slot among the 2W (when both candidates are one bucket it matches twice).
        slot = match.view(torch.uint8).argmax(1)
        bucket = torch.where(slot < W, b1, b2)
        pos = torch.where(found, bucket * W + slot % W, -1)
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
        """Find keys, insert the missing ones, evicting low-scored keys where both buckets are full.

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
            f"{failed_keys.numel()} of {total} keys could not be inserted: both their buckets hold "
            f"only keys used in this batch or scored higher (score_strategy='{self.strategy}', "
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
        pos, found = self._locate(unique)
        found_pos = pos[found]
        flat_scores = self._scores.view(-1)
        if self.strategy is ScoreStrategy.LFU and given is None:
            # Saturating add: a key pinned at the largest score must not wrap to the smallest.
            old = flat_scores.index_select(0, found_pos)
            add = counts[found]
            flat_scores.index_copy_(0, found_pos, torch.where(old > _MAX_SCORE - add, _MAX_SCORE, old + add))
        else:
            flat_scores.index_copy_(0, found_pos, batch_scores[found])

        missing = (~found).nonzero().squeeze(1)  # [M] into unique
        if (given is not None or self.strategy in (ScoreStrategy.LFU, ScoreStrategy.CUSTOMIZED)) and missing.numel():
            # Priority order: higher score first, then smaller key (unique is sorted).
            by_score = torch.sort(batch_scores.index_select(0, missing), descending=True, stable=True)
            missing = missing.index_select(0, by_score.indices)
        new_keys = unique.index_select(0, missing)
        new_scores = batch_scores.index_select(0, missing)
        grown = False
        while self._can_grow() and self._size + missing.numel() > self.max_load_factor * self.current_capacity():
            self._grow()
            grown = True
        new_pos = torch.full_like(missing, -1)
        pending = torch.arange(missing.numel(), device=self.device)  # [P] ranks into missing
        while pending.numel():
            placed, placed_pos = self._place_free(new_keys.index_select(0, pending), new_scores.index_select(0, pending))
            new_pos.index_copy_(0, pending[placed], placed_pos[placed])
            pending = pending[~placed]
            if pending.numel() == 0:
                break
            if self._can_grow():
                self._grow()
                grown = True
                # Growth moved keys: find this batch's placed keys again.
                at, present = self._locate(new_keys)
                new_pos = torch.where(present, at, -1)
                continue
            # Full: keys that found no free slot take slots of lower-priority keys of the batch;
            # displaced keys go round again (their other bucket may have room).
            pending, displaced = self._displace(new_keys, new_scores, pending, new_pos)
            if not displaced:
                break
        if grown:
            pos, _ = self._locate(unique)
        else:
            pos = pos.index_copy(0, missing, new_pos)

        evicted = (_EMPTY.to(self.device),) * 3
        if pending.numel() and self.strategy is not ScoreStrategy.NO_EVICTION:
            victim_pos, *evicted = self._evict_for(new_keys[pending], new_scores[pending], pos[pos >= 0])
            pos.index_copy_(0, missing[pending], victim_pos)
        ok = pos >= 0
        rows = torch.where(ok, self._rows.view(-1).index_select(0, pos.clamp(min=0)), -1)
        failed_keys = unique[~ok]
        self._stats["failed_inserts"] += failed_keys.numel()
        return InsertResult(rows, found, ok, *evicted, failed_keys)

    def _can_grow(self) -> bool:
        return self.num_buckets < self.max_buckets

    def _place_free(self, keys: torch.Tensor, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Put P keys (in priority order) into free slots of their candidate buckets.

        A batch places its keys in rounds, each key going to its candidate with more free slots;
        while keys compete, a bucket takes at most half of its free slots per round, so a batch
        spreads over both candidates the way keys inserted one by one would. Then a round fills
        the preferred candidate completely, and a last one the other candidate.

        Returns:
            placed (Tensor[bool]): [P]
            pos (Tensor[int64]): [P] slot taken, meaningful where placed.
        """
        b1, b2 = candidate_buckets(keys, self.num_buckets)
        # Ties between equally free candidates go by a bit of the buckets, not always to bucket 1.
        tie_second = ((b1 ^ b2) & 1).bool()
        W = self.bucket_capacity
        placed = torch.zeros_like(keys, dtype=torch.bool)
        pos = torch.full_like(keys, -1)

        def one_round(halve: bool, other: bool) -> int:
            todo = (~placed).nonzero().squeeze(1)
            if todo.numel() == 0:
                return 0
            t1, t2 = b1.index_select(0, todo), b2.index_select(0, todo)
            free1 = W - self._used.index_select(0, t1).sum(1)
            free2 = W - self._used.index_select(0, t2).sum(1)
            second = (free2 > free1) | ((free2 == free1) & tie_second.index_select(0, todo))
            bucket = torch.where(second ^ other, t2, t1)
            fits, slot_pos = self._fill(keys.index_select(0, todo), scores.index_select(0, todo), bucket, halve)
            done = todo[fits]
            placed.index_fill_(0, done, True)
            pos.index_copy_(0, done, slot_pos[fits])
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
        W = self.bucket_capacity
        order, bucket, rank = _group_by_bucket(bucket)  # [P] each
        free = ~self._used.index_select(0, bucket)  # [P, W]
        n_free = free.sum(1)
        fits = rank < ((n_free + 1) // 2 if halve else n_free)
        target = free & (free.cumsum(1) == (rank + 1)[:, None])
        pos = bucket * W + target.view(torch.uint8).argmax(1)
        fit_pos = pos[fits]
        fit_idx = order[fits]
        self._keys.view(-1).index_copy_(0, fit_pos, keys.index_select(0, fit_idx))
        self._used.view(-1).index_fill_(0, fit_pos, True)
        self._scores.view(-1).index_copy_(0, fit_pos, scores.index_select(0, fit_idx))
        self._rows.view(-1).index_copy_(0, fit_pos, self.allocator.allocate(fit_pos.numel()))
        self._size += fit_pos.numel()
        self._stats["inserts"] += fit_pos.numel()
        out_fits = torch.zeros_like(fits).index_copy_(0, order, fits)
        out_pos = torch.empty_like(pos).index_copy_(0, order, pos)
        return out_fits, out_pos

    def _displace(self, keys: torch.Tensor, scores: torch.Tensor, pending: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, int]:
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
            cand = self._candidate_slots(keys.index_select(0, active))  # [A, 2W]
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
            flat_keys.index_copy_(0, w_pos, keys.index_select(0, w_rank))
            flat_scores.index_copy_(0, w_pos, scores.index_select(0, w_rank))
            pos.index_copy_(0, w_rank, w_pos)
            pos.index_fill_(0, loser_rank, -1)
            displaced += loser_rank.numel()
            pending = torch.cat([pending[~torch.isin(pending, w_rank)], loser_rank])
            active = torch.sort(torch.cat([active[~winner], loser_rank])).values
        return torch.sort(pending).values, displaced

    def _evict_for(self, keys: torch.Tensor, scores: torch.Tensor, locked_pos: torch.Tensor):
        """Place P keys (priority order) whose buckets are full by evicting, for each, the
        lowest-scored unlocked key of its 2W candidate slots, if that score is not above its own.
        Keys proceed in priority order wherever they share a bucket; the others wait a round.

        Returns:
            pos (Tensor[int64]): [P] slot taken, -1 if the key failed.
            evicted keys, rows, scores (Tensor[int64]): [E] each.
        """
        W = self.bucket_capacity
        lock = self._lock
        lock.index_fill_(0, locked_pos, True)
        flat_keys, flat_scores, flat_rows = self._keys.view(-1), self._scores.view(-1), self._rows.view(-1)
        candidates = self._candidate_slots(keys)  # [P, 2W]
        pos = torch.full_like(keys, -1)
        active = torch.arange(keys.numel(), device=self.device)
        won = []
        while active.numel():
            cand = candidates.index_select(0, active)  # [A, 2W]
            flat = cand.view(-1)
            # Candidates ordered by (locked, score, bucket 1 before 2, slot): stable sorts.
            by_score = torch.sort(flat_scores.index_select(0, flat).view(cand.shape), dim=1, stable=True)
            # An empty slot is never a victim (free slots were offered before eviction).
            blocked = lock.index_select(0, flat) | ~self._used.view(-1).index_select(0, flat)
            locked = blocked.view(cand.shape).gather(1, by_score.indices)
            best = torch.sort(locked.to(torch.uint8), dim=1, stable=True).indices[:, :1]  # [A, 1]
            victim_locked = locked.gather(1, best).squeeze(1)
            victim_score = by_score.values.gather(1, best).squeeze(1)
            victim = cand.gather(1, by_score.indices.gather(1, best)).squeeze(1)  # [A]
            eligible = ~victim_locked & (scores.index_select(0, active) >= victim_score)
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
            won.append((flat_keys.index_select(0, w_pos), flat_rows.index_select(0, w_pos), flat_scores.index_select(0, w_pos)))
            flat_keys.index_copy_(0, w_pos, keys.index_select(0, w_keys))
            flat_scores.index_copy_(0, w_pos, scores.index_select(0, w_keys))
            lock.index_fill_(0, w_pos, True)
            pos.index_copy_(0, w_keys, w_pos)
            active = active[~winner]
        lock.index_fill_(0, locked_pos, False)
        lock.index_fill_(0, pos[pos >= 0], False)
        evicted = [torch.cat(parts) for parts in zip(*won)] if won else [_EMPTY.to(self.device)] * 3
        self._stats["evictions"] += evicted[0].numel()
        self._stats["inserts"] += evicted[0].numel()
        return (pos, *evicted)

    def _grow(self) -> None:
        """Double the buckets and re-place every key with its row id and score; a key in old
        bucket c (its first or second candidate) moves to that candidate's child, 2c or 2c+1."""
        W = self.bucket_capacity
        used = self._used.view(-1).nonzero().squeeze(1)
        keys = self._keys.view(-1).index_select(0, used)
        rows = self._rows.view(-1).index_select(0, used)
        scores = self._scores.view(-1).index_select(0, used)
        old1, _ = candidate_buckets(keys, self.num_buckets)
        in_first = old1 == used // W
        self.num_buckets *= 2
        self._allocate_tables(self.num_buckets)
        new1, new2 = candidate_buckets(keys, self.num_buckets)
        bucket = torch.where(in_first, new1, new2)
        order, bucket, rank = _group_by_bucket(bucket)
        pos = bucket * W + rank
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
        if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
            raise ValueError(f"chunk_size={chunk_size!r}: must be an int >= 1")
        keys, rows, scores, used = (t.view(-1) for t in (self._keys, self._rows, self._scores, self._used))
        for start in range(0, used.numel(), chunk_size):
            mask = used[start : start + chunk_size]
            yield (
                keys[start : start + chunk_size][mask],
                rows[start : start + chunk_size][mask],
                scores[start : start + chunk_size][mask],
            )
