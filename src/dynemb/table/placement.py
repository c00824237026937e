"""Placing a batch of new keys: free slots, growth, cuckoo moves, displacement, eviction.

U unique keys in a call, M new keys to place, P keys pending (not placed yet), Q buckets asked
to make room, F full buckets among them, B buckets, W slots per bucket.

Two-choice hashing: a key may live at any slot of either of its two candidate buckets. A new key
goes to the candidate with more free slots, else to the other. When both are full and its segment
cannot grow, resident keys of those buckets move to their own other candidate (cuckoo
displacement, up to ``MOVE_DEPTH`` moves in a chain) to free a slot; only when that fails does
the new key evict the lowest-scored unlocked key among its 2W slots (a key is locked while the
batch that uses it is being placed). See docs/design/0006. Keys of one segment only ever see
their own segment's buckets, so every rule here holds per segment.

:class:`BatchPlacement` holds these steps as methods of :class:`dynemb.table.index.KeyIndex`.
"""

from __future__ import annotations

import functools

import torch

from dynemb.hashing import tag_of
from dynemb.kernels.dedup import sort_unique_first_native
from dynemb.kernels.evict import evict_for_native
from dynemb.kernels.insert import insert_new_native
from dynemb.kernels.move import MAX_DEPTH as MOVE_KERNEL_DEPTH
from dynemb.kernels.move import follow_all_native, follow_torch, make_room_native
from dynemb.kernels.place import place_free_native
from dynemb.kernels.rest import place_rest_native
from dynemb.kernels.rows import put_rows_native, rows_of_new_native
from dynemb.kernels.upsert import found_and_missing_native
from dynemb.table.base import IndexResult
from dynemb.table.keys import INT64_MAX as _MAX_SCORE
from dynemb.types import ScoreStrategy

# Longest chain of resident moves tried to free a slot for a new key (1: a resident of the key's
# buckets moves to its other bucket; 2: first a resident of that other bucket moves on, ...).
MOVE_DEPTH = 2
# Displacement stops for the rest of a call after a pass that made room for fewer than one key
# in GIVE_UP of those it tried.
GIVE_UP = 8
# Strategies that score every key of a call with the call's clock.
CLOCKED = (ScoreStrategy.TIMESTAMP, ScoreStrategy.STEP, ScoreStrategy.NO_EVICTION)


def group_by_bucket(bucket: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stable sort of bucket ids ([P] int64) -> (order, sorted buckets, rank within its bucket)."""
    by_bucket = torch.sort(bucket, stable=True)
    sorted_bucket = by_bucket.values
    idx = torch.arange(sorted_bucket.numel(), device=bucket.device)
    is_start = torch.ones_like(sorted_bucket, dtype=torch.bool)
    is_start[1:] = sorted_bucket[1:] != sorted_bucket[:-1]
    rank = idx - torch.cummax(torch.where(is_start, idx, 0), 0).values
    return by_bucket.indices, sorted_bucket, rank


def _pick(values: torch.Tensor | None, at: torch.Tensor) -> torch.Tensor | None:
    """values[at] ([n] -> [m]), or None when there are no values (an index of one segment)."""
    return None if values is None else values.index_select(0, at)


class BatchPlacement:
    """The placement steps of :class:`dynemb.table.index.KeyIndex` (a mixin: it reads and
    writes the index's tensors ``_keys``, ``_tags``, ``_rows``, ``_scores``)."""

    def _upsert(
        self,
        unique: torch.Tensor,
        counts: torch.Tensor,
        batch_scores: torch.Tensor,
        own: bool,
        seg: torch.Tensor | None = None,
        distinct: bool = True,
        clock: int | None = None,
    ) -> IndexResult:
        """upsert_unique after argument checks; ``own``: the scores are the strategy's (not given);
        ``seg``: [U] segment of each key (segmented indexes). ``distinct=False`` (own clocked
        scores only): ``unique`` may repeat keys; the probe takes them all and only the missing
        ones are de-duplicated, so a call whose keys are mostly present skips sorting them all
        (0040). The result is then over the keys as given. ``clock``: the call's ``now`` (under
        own clocked scores, every key's score, given as the int it is)."""
        lfu_add = own and self.strategy is ScoreStrategy.LFU
        # With one clock value for every key, priority order is already that of the keys.
        uniform = own and self.strategy in CLOCKED
        if not (distinct or uniform):
            raise AssertionError("repeated keys are probed as they come only under one clock value")
        found_rows = None  # [U] the found keys' row ids (-1 for the missing), where the probe read them
        pre_free = None  # [U] the missing keys' candidates' free slots, where the probe read them
        if self.native:
            pos, found, missing, found_rows, pre_free, absent = self._found_and_missing_native(unique, counts, batch_scores, lfu_add, uniform, seg)
        else:
            pos, found, missing = self._found_and_missing(unique, counts, batch_scores, lfu_add, uniform, seg)
        occurrences, spread = missing, None  # with repeated keys: [M'] every missing key's place, [M'] its rank
        # After the compiled insert, the keys it left go on alone; should displacement need every
        # new key's rank, widen() builds them (see _place_rest).
        widen = None
        # Where the compiled insert's rest passes left keys pending: the state to go on from.
        rest = None
        if uniform and self.native and missing.numel() and (distinct or seg is None) and self._places_without_growth(missing.numel(), _pick(seg, missing)):
            # The result's empty tensors, made before the insert's kernel (a tensor operation
            # right after it costs tens of microseconds: perf-log, sixteenth session).
            none = unique[:0]
            got = self._insert_new_native(unique, seg, missing, clock, pos, found_rows, pre_free, distinct)
            if got is not None and (got.n_left == 0 or (got.rest is not None and got.rest.code == 0)):
                # Every new key placed, with its slot and row id in the result: nothing evicted or failed.
                no_seg = none if self.segmented else None
                return IndexResult(pos, found_rows, found, absent, none, none, none, none, no_seg, no_seg)
            if got is not None:
                # The placed keys have their slots and row ids in pos and rows (moves follow them);
                # the places left go on (a copy: the kernel's buffer is reused by later calls).
                widen = functools.partial(self._every_new_key, unique, seg, missing, batch_scores, distinct)
                occurrences = missing = got.left.clone()
                rest = got.rest
        if rest is not None:
            # The rest's passes ran in the insert's call and left keys pending: its new keys in
            # priority order, each at its first place, and their state (copies, as above).
            new_keys, missing = rest.new_keys.clone(), rest.first.clone()
            spread, new_seg = (None if distinct else rest.spread.clone()), _pick(seg, missing)
        elif distinct or missing.numel() == 0:
            new_keys, new_seg = unique.index_select(0, missing), _pick(seg, missing)
        elif self.native and seg is None:
            # As below, the compiled sort also giving each key's first place among the missing;
            # the [M'] temporaries are views of the workspace (no fresh pages to fault in).
            ws = self._workspace
            missing_keys = torch.index_select(unique, 0, missing, out=ws.get("missing.keys", missing.numel(), (), torch.int64))
            new_keys, spread, first = sort_unique_first_native(missing_keys, workspace=ws)
            new_seg = None
            missing = torch.index_select(occurrences, 0, first, out=ws.get("missing.first", first.numel(), (), torch.int64))  # [M] one place of each
        else:
            # The distinct missing keys in ascending order: the priority order of one clock value.
            new_keys, new_seg, spread, _ = self._dedup(unique.index_select(0, missing), _pick(seg, missing))
            missing = torch.empty_like(new_keys).scatter_(0, spread, occurrences)  # [M] one place of each
        # One clock value: every key of the call has the same score, so any M of them are the new keys'.
        new_scores = batch_scores[: missing.numel()] if uniform else batch_scores.index_select(0, missing)
        pending = new_pos = missing  # [M] ranks not placed yet and slots (none when every key was found)
        hopeful = None
        if rest is not None:
            new_pos, waiting, pending, hopeful = (t.clone() for t in (rest.new_pos, rest.waiting, rest.pending, rest.hopeful))
        elif widen is not None:
            # The compiled insert was the first placement pass: every key left waits.
            new_pos = torch.full_like(missing, -1)
            waiting = torch.ones_like(missing, dtype=torch.bool)
            pending = torch.arange(missing.numel())
        else:
            if self._grow_before(missing.numel(), new_seg):
                pos, _ = self._locate(unique, seg)
                pre_free = None  # read before the keys moved
            if missing.numel():
                # The first placement pass places every key in the common case (room in its buckets).
                placed, new_pos = self._place_free(new_keys, new_scores, new_seg, keep="place.first", pre_free=pre_free, pre_at=missing)
                waiting = ~placed  # [M] not placed yet
                pending = waiting.nonzero().squeeze(1)
        if pending.numel():
            resume = None if rest is None else (rest.code == 1, rest.gave_up)
            pos, new_pos, pending, widened = self._place_rest(
                unique, seg, missing, new_keys, new_scores, new_seg, pos, new_pos, waiting, pending, widen, hopeful, resume
            )
            if widened is not None:
                missing, new_keys, new_scores, new_seg, occurrences, spread = widened

        evicted = (torch.empty(0, dtype=torch.int64, device=self.device),) * 4
        if pending.numel() and self.strategy is not ScoreStrategy.NO_EVICTION:
            # The batch's keys, found or placed, are never victims.
            held = pos.index_copy(0, missing, new_pos)
            victim_pos, *evicted = self._evict_for(new_keys[pending], new_scores[pending], held[held >= 0], _pick(new_seg, pending))
            new_pos.scatter_(0, pending, victim_pos)
        *evicted, taken = evicted
        # In place: pos is this call's own tensor (the probe's, growth's or the moves').
        if found_rows is None:
            if missing.numel():
                pos.index_copy_(0, occurrences, new_pos if spread is None else new_pos.index_select(0, spread))
            rows = self._rows_at(pos)
        else:
            # Found keys keep their row ids through growth and moves: read only the new keys',
            # put into the result with their slots in one pass.
            rows = found_rows
            if missing.numel():
                rows_of_new_native(self._rows, occurrences, spread, new_pos, pos, rows)
        ok, failed_keys, failed_seg = None, unique[:0], _pick(seg, missing[:0])  # every key found or placed: no host sync
        if pending.numel():
            ok = pos >= 0
            if spread is None:
                failed_keys, failed_seg = unique[~ok], None if seg is None else seg[~ok]
            else:  # each failed key once, in key order as from distinct keys
                failed = new_pos < 0
                failed_keys, failed_seg = new_keys[failed], None if new_seg is None else new_seg[failed]
        evicted_seg = None
        if seg is not None:
            evicted_seg = self._bucket_segments(taken // self.bucket_capacity) if taken.numel() else taken
        elif self.segmented:
            # One segment, placed without segment tensors: every key is segment 0's.
            failed_seg, evicted_seg = torch.zeros_like(failed_keys), torch.zeros_like(taken)
        self._count("failed_inserts", seg=failed_seg, n=failed_keys.numel())
        inserted = ~found if ok is None else ok & ~found
        return IndexResult(pos, rows, found, inserted, *evicted, failed_keys, evicted_seg, failed_seg)

    def _place_rest(
        self,
        unique: torch.Tensor,
        seg: torch.Tensor | None,
        missing: torch.Tensor,
        new_keys: torch.Tensor,
        new_scores: torch.Tensor,
        new_seg: torch.Tensor | None,
        pos: torch.Tensor,
        new_pos: torch.Tensor,
        waiting: torch.Tensor,
        pending: torch.Tensor,
        widen=None,
        hopeful: torch.Tensor | None = None,
        resume: tuple[bool, bool] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple | None]:
        """The passes after the first: growth, cuckoo moves and displacement for the P keys the
        first pass left ``pending`` (ranks into ``missing``, P > 0; ``waiting`` [M] marks them).

        ``widen`` (after the compiled insert): the M keys here are only those it left, each
        placed key's slot being in ``pos``; growth, moves and placement see just these keys, in
        the same order as among all the new keys. Displacement weighs every new key's rank:
        before it, ``widen`` gives every new key (:meth:`_every_new_key`), and the passes go on
        with them.

        Returns pos [U] (slots of the found keys, moved where residents moved), new_pos [M], the
        ranks still pending (for eviction), and, if widened, the new keys' (missing, keys,
        scores, segments, occurrences, spread) to go on with (else None).

        ``hopeful`` ([M], default all): the keys moves may still help. ``resume`` (after the
        compiled insert ran the first native pass, :class:`dynemb.kernels.insert.Rest`): that
        pass's (whether no tried key got room, whether the moves were given up); the loop goes
        on from its state as if it had just made it."""
        widened = None
        # New keys for which moving residents may still free a slot: a key none of whose
        # buckets' keys could move is not tried again in this call.
        hopeful = torch.ones_like(missing, dtype=torch.bool) if hopeful is None else hopeful  # [M]
        gave_up = False if resume is None else resume[1]  # whether every key was ruled out of the moves at once (GIVE_UP)
        # Each pass places at least one more key, or rules keys out of displacement, or improves
        # the priority of the placed ones (_displace), or ends. The host syncs per pass (sizes of
        # masked selections) are what lets the loop stop as soon as every key is placed.
        while True:
            if self.native and not self._can_grow():
                # The passes of the branch below, in one compiled call, until every key is placed
                # or no tried key gets room (then on to displacement, as there).
                if resume is not None:
                    stalled, resume = resume[0], None
                else:
                    stalled, pending, stopped = self._place_rest_native(new_keys, new_scores, new_seg, pending, waiting, hopeful, pos, new_pos)
                    gave_up |= stopped
                if pending.numel() == 0:
                    return pos, new_pos, pending, widened
                if not stalled:
                    continue
                to_place = pending[:0]
            elif self._grow_for(_pick(new_seg, pending)):
                # Growth moved every key: find the batch's keys again.
                pos, _ = self._locate(unique, seg)
                new_pos = torch.where(waiting, -1, pos.index_select(0, missing))
                to_place = pending
            else:
                to_place = pending[:0]
                while to_place.numel() == 0:
                    self._hope_in_room(hopeful, pending, new_seg)
                    # No more than the free slots can be filled: trying a few times as many keys
                    # at once bounds the cost of displacement when the index is nearly full.
                    tried = pending[hopeful.index_select(0, pending)][: 4 * (self.current_capacity() - self._size)]
                    if tried.numel() == 0:
                        break
                    room, stuck, moves = self._make_room(new_keys.index_select(0, tried), _pick(new_seg, tried))
                    hopeful.index_fill_(0, tried[stuck], False)
                    if self.native:
                        # In place: pos and new_pos are this call's own tensors.
                        pos, new_pos = follow_all_native([pos, new_pos], moves, inplace=True)
                    else:
                        pos, new_pos = follow_torch(pos, moves), follow_torch(new_pos, moves)
                    to_place = tried[room]
                    if to_place.numel() * GIVE_UP < tried.numel():
                        # Few keys got room: the free slots left are hard to reach. Stop trying in
                        # this call, so that a nearly full index does not spend many passes per call.
                        hopeful.zero_()
                        gave_up = True
            if to_place.numel() == 0:
                if widen is not None:
                    widened, (new_pos, waiting, pending, hopeful) = widen(pos, missing, new_pos, pending, hopeful, gave_up)
                    missing, new_keys, new_scores, new_seg, _, _ = widened
                    widen = None
                # Full: keys that found no free slot take slots of lower-priority keys of the
                # batch; displaced keys go round again (their other bucket may have room).
                pending, displaced = self._displace(new_keys, new_scores, pending, new_pos, new_seg)
                if not displaced:
                    return pos, new_pos, pending, widened
                waiting.zero_().index_fill_(0, pending, True)
                to_place = pending
            placed, placed_pos = self._place_free(new_keys.index_select(0, to_place), new_scores.index_select(0, to_place), _pick(new_seg, to_place))
            done = to_place[placed]
            new_pos.scatter_(0, done, placed_pos[placed])
            waiting.index_fill_(0, done, False)
            pending = waiting.nonzero().squeeze(1)
            if pending.numel() == 0:
                return pos, new_pos, pending, widened

    def _segment_free(self) -> torch.Tensor | None:
        """Empty slots of each segment ([S] int64, a new tensor), or None for one segment."""
        if self._segment_size is None:
            return None
        return self._segments.counts * self.bucket_capacity - self._segment_size

    def _hope_in_room(self, hopeful: torch.Tensor, pending: torch.Tensor, new_seg: torch.Tensor | None) -> None:
        """Before a pass of moves: the pending keys (ranks into ``hopeful`` [M]) of a segment
        with no empty slot lose hope, in place. Every move stays within its key's segment, so
        none could make room for them; trying them would only take the places of keys of
        other segments among those tried (docs/design/0045). A segment that fills stays full
        for the rest of the call (growth, where it can, comes before the moves)."""
        free = None if new_seg is None else self._segment_free()
        if free is None or pending.numel() == 0:
            return
        full = free.index_select(0, new_seg.index_select(0, pending)) <= 0
        hopeful.index_fill_(0, pending[full], False)

    def _place_rest_native(
        self,
        new_keys: torch.Tensor,
        new_scores: torch.Tensor,
        new_seg: torch.Tensor | None,
        pending: torch.Tensor,
        waiting: torch.Tensor,
        hopeful: torch.Tensor,
        pos: torch.Tensor,
        new_pos: torch.Tensor,
    ) -> tuple[bool, torch.Tensor, bool]:
        """:meth:`_place_rest`'s moves and placements for an index that cannot grow, by the
        compiled kernel (:func:`dynemb.kernels.rest.place_rest_native`: the same kernels in the
        same order); ``waiting``, ``hopeful``, ``pos`` and ``new_pos`` are updated in place.
        Returns (whether no tried key got room, the ranks still pending, whether the moves were
        given up for the call)."""
        free = self.free_list
        per_segment = None if new_seg is None else torch.zeros(self.num_segments, dtype=torch.int64)
        code, pending, gave_up, allocations, _ = place_rest_native(
            self._keys,
            self._tags,
            self._rows,
            self._scores,
            self._segments,
            new_keys,
            new_scores,
            new_seg,
            pending,
            waiting,
            hopeful,
            pos,
            new_pos,
            self.current_capacity() - self._size,
            MOVE_DEPTH,
            GIVE_UP,
            free.reusable(),
            free.high_water,
            per_segment,
            None if new_seg is None else self._segment_free(),
        )
        # Each allocation is one placement round's keys: their sum is the keys placed.
        self._commit_rounds(allocations, per_segment)
        if code < 0:
            raise RuntimeError("rest kernel: an output bound was exceeded (a bug; the keys placed before it are counted)")
        return code == 1, pending, gave_up

    def _every_new_key(
        self,
        unique: torch.Tensor,
        seg: torch.Tensor | None,
        places: torch.Tensor,
        batch_scores: torch.Tensor,
        distinct: bool,
        pos: torch.Tensor,
        left_places: torch.Tensor,
        left_pos: torch.Tensor,
        left_pending: torch.Tensor,
        left_hopeful: torch.Tensor,
        gave_up: bool,
    ) -> tuple[tuple, tuple]:
        """Every new key of a call after the compiled insert, as the sorted path holds them, from
        ``places`` (the M' places of missing keys in ``unique``, ascending), ``pos`` (the placed
        keys' slots there) and the state of the P keys it left: one place of each
        (``left_places``, in priority order), their slots, pending ranks and hopeful flags
        (``gave_up``: every key was ruled out of the moves at once). ``distinct``: ``unique``
        holds each key once (then in priority order, segments first), else one segment's keys
        as they came.

        Returns (missing [M], keys [M], scores [M], segments [M] or None, occurrences [M'],
        spread [M'] or None) and (new_pos [M], waiting [M], pending, hopeful [M])."""
        if distinct:
            keys, spread, missing = unique.index_select(0, places), None, places
            at = torch.searchsorted(places, left_places)  # [P] the left keys' ranks among all
        else:
            keys, spread, first = sort_unique_first_native(unique.index_select(0, places))
            missing = places.index_select(0, first)
            at = torch.searchsorted(keys, unique.index_select(0, left_places))
        new_pos = pos.index_select(0, missing).index_copy_(0, at, left_pos)
        hopeful = torch.full_like(keys, not gave_up, dtype=torch.bool).index_copy_(0, at, left_hopeful)
        pending = at.index_select(0, left_pending)
        waiting = torch.zeros_like(hopeful).index_fill_(0, pending, True)
        every = (missing, keys, batch_scores[: keys.numel()], _pick(seg, missing), places, spread)
        return every, (new_pos, waiting, pending, hopeful)

    def _found_and_missing(
        self, unique: torch.Tensor, counts: torch.Tensor, batch_scores: torch.Tensor, lfu_add: bool, uniform: bool, seg: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Locate U keys, give the found ones this call's score (lfu: add their counts,
        saturating), and list the missing ones in priority order. Returns pos [U] (-1 where
        missing), found [U] and missing [M] (indices into unique). The plain-torch twin of
        :func:`dynemb.kernels.upsert.found_and_missing_native`."""
        pos, found = self._locate(unique, seg)
        found_pos = pos[found]
        if lfu_add:
            # Saturating add: a key pinned at the largest score must not wrap to the smallest.
            old = self._scores_at(found_pos)
            add = counts[found]
            found_scores = torch.where(old > _MAX_SCORE - add, _MAX_SCORE, old + add)
        else:
            found_scores = batch_scores[found]
        # Widen the stored scores before any is written, if this call's do not fit in int32
        # (batch_scores covers the new keys' scores, and the found ones' but for lfu sums).
        self._fit_scores(torch.cat([found_scores, batch_scores]) if lfu_add else batch_scores)
        self._scores.view(-1).scatter_(0, found_pos, found_scores.to(self._scores.dtype))

        missing = (~found).nonzero().squeeze(1)  # [M] into unique
        if not uniform:
            # Priority order: higher score first, then smaller key (unique is sorted).
            by_score = torch.sort(batch_scores.index_select(0, missing), descending=True, stable=True)
            missing = missing.index_select(0, by_score.indices)
        return pos, found, missing

    def _found_and_missing_native(
        self, unique: torch.Tensor, counts: torch.Tensor, batch_scores: torch.Tensor, lfu_add: bool, uniform: bool, seg: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """:meth:`_found_and_missing` by the compiled kernel (bitwise the same), the found
        keys' row ids ([U] int64, -1 for the missing keys), read in the probe, the missing
        keys' candidates' free slots as the probe saw them ([U] int64, or None), and under one
        clock value ~found ([U] bool: the result's ``inserted`` when the compiled insert places
        every new key; else None)."""
        args = (self._segments, unique, seg, batch_scores, counts, lfu_add, uniform)
        got = found_and_missing_native(self._keys, self._tags, self._scores, *args, self._rows, self._workspace, free_info=True, absent=uniform)
        if got is None:
            # A score of this call does not fit int32 (nothing was written): widen, then redo.
            self._widen_scores()
            got = found_and_missing_native(self._keys, self._tags, self._scores, *args, self._rows, self._workspace, free_info=True, absent=uniform)
        return got

    def _place_free(
        self,
        keys: torch.Tensor,
        scores: torch.Tensor,
        seg: torch.Tensor | None = None,
        keep: str | None = None,
        pre_free: torch.Tensor | None = None,
        pre_at: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Put P keys (in priority order) into free slots of their candidate buckets.

        A batch places its keys in rounds, each key going to its candidate with more free slots;
        while keys compete, a bucket takes at most half of its free slots per round, so a batch
        spreads over both candidates the way keys inserted one by one would. Then a round fills
        the preferred candidate completely, and a last one the other candidate.

        ``keep`` (native): a workspace name for ``pos``, which is then a view valid until the next
        call with that name (the upsert's first pass: no fresh [P] pages to fault in).
        ``pre_free``, ``pre_at`` (native): the free slots of key i's candidates as the upsert's
        probe read them, ``pre_free[pre_at[i]]`` (see
        :func:`dynemb.kernels.place.place_free_native`); only while the index is unchanged since.

        Returns:
            placed (Tensor[bool]): [P]
            pos (Tensor[int64]): [P] slot taken, meaningful where placed.
        """
        if self._size == self.current_capacity():
            return torch.zeros_like(keys, dtype=torch.bool), torch.full_like(keys, -1)
        if self.native:
            return self._place_free_native(keys, scores, seg, keep, pre_free, pre_at)
        placed = torch.zeros_like(keys, dtype=torch.bool)
        pos = torch.full_like(keys, -1)
        b1, b2 = self._buckets(keys, seg)
        # Ties between equally free candidates go by a bit of the buckets, not always to bucket 1.
        tie_second = ((b1 ^ b2) & 1).bool()

        def one_round(halve: bool, other: bool) -> int:
            todo = (~placed).nonzero().squeeze(1)
            t1, t2 = b1.index_select(0, todo), b2.index_select(0, todo)
            free1 = (self._tags.index_select(0, t1) == 0).sum(1)
            free2 = (self._tags.index_select(0, t2) == 0).sum(1)
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
                # A halving round places a key of every bucket a waiting key tries: none placed,
                # no waiting key has a free slot, and the filling rounds would place none.
                return placed, pos
        one_round(halve=False, other=False)
        one_round(halve=False, other=True)
        return placed, pos

    def _places_without_growth(self, m: int, new_seg: torch.Tensor | None) -> bool:
        """Whether up to ``m`` new keys (of segments ``new_seg``, [m] or None) go into this index
        as it is: room left, and no growth before placing them (so that placing fewer, once
        de-duplicated, grows nothing either)."""
        return self._size < self.current_capacity() and not self._would_grow(m, new_seg)

    def _insert_new_native(
        self,
        keys: torch.Tensor,
        seg: torch.Tensor | None,
        missing: torch.Tensor,
        score: int,
        pos: torch.Tensor,
        rows: torch.Tensor,
        pre_free: torch.Tensor | None,
        distinct: bool,
    ):
        """The first placement pass of a call under one clock value by the compiled insert, from
        the probe's missing places (repeats included unless ``distinct``;
        :func:`dynemb.kernels.insert.insert_new_native`): the new keys it places get their slots
        and row ids, in the index and in ``pos`` / ``rows``. Where the index cannot grow, the
        places it leaves go on in the same call to the passes :meth:`_place_rest` would make
        first (:meth:`_place_rest_native`'s); ``score``: the clock value, every new key's. Returns its
        :class:`dynemb.kernels.insert.Inserted` (the row ids it handed out committed), or None
        where the kernel cannot take the call (nothing was done)."""
        free = self.free_list
        # The kernel counts each segment's placed keys (no slot -> segment mapping afterwards).
        per_segment = None if seg is None else torch.zeros(self.num_segments, dtype=torch.int64)
        tables = (self._keys, self._tags, self._scores, self._rows)
        rest = None if self._can_grow() else (self.current_capacity() - self._size, MOVE_DEPTH, GIVE_UP)
        stack, reusable = free.reusable_stack()
        got = insert_new_native(
            *tables,
            self._segments,
            keys,
            seg,
            missing,
            score,
            pre_free,
            stack,
            free.high_water,
            pos,
            rows,
            self._workspace,
            per_segment,
            rest=rest,
            repeats=not distinct,
            segment_free=None if seg is None or rest is None else self._segment_free(),
            reusable=reusable,
        )
        if got is None:
            return None
        # One allocation a round, the rounds' first, then the rest's (as _place_rest_native's).
        self._commit_rounds(got.rounds + (got.rest.allocations if got.rest is not None else []), per_segment)
        if got.rest is not None and got.rest.code < 0:
            raise RuntimeError("rest kernel: an output bound was exceeded (a bug; the keys placed before it are counted)")
        return got

    def _commit_rounds(self, rounds: list[int], per_segment: torch.Tensor | None) -> None:
        """After a compiled placement that handed out row ids itself (one allocation a round, in
        turn, as :meth:`_place_free`'s): the free list takes what it handed out, and the size
        and insert counters (``per_segment``: [S], the kernel's count per segment, or None) follow."""
        # Allocations in turn take what one allocation of their sum takes (reused ids first).
        placed = sum(rounds)
        self.free_list.take(placed)
        self._size += placed
        self._count("inserts", n=placed, per_segment=per_segment)

    def _place_free_native(
        self,
        keys: torch.Tensor,
        scores: torch.Tensor,
        seg: torch.Tensor | None,
        keep: str | None = None,
        pre_free: torch.Tensor | None = None,
        pre_at: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_place_free` by the compiled kernel (same slots, same row ids)."""
        # The kernel counts each segment's placed keys (no slot -> segment mapping afterwards).
        per_segment = None if seg is None else torch.zeros(self.num_segments, dtype=torch.int64)
        ws = self._workspace
        pos, order, rounds = place_free_native(self._keys, self._tags, self._scores, self._segments, keys, scores, seg, ws, per_segment, keep, pre_free, pre_at)
        # One free-list call per round, as _fill makes: the row ids each slot gets match. They
        # are copied into the slots at once, so reused ids may stay views of the free list.
        ids = [self.free_list.allocate(n, borrow=True) for n in rounds]
        if ids:
            put_rows_native(self._rows, order, ids[0] if len(ids) == 1 else torch.cat(ids))
        self._size += order.numel()
        self._count("inserts", order, per_segment=per_segment)
        return pos >= 0, pos

    def _fill(self, keys: torch.Tensor, scores: torch.Tensor, bucket: torch.Tensor, halve: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Give the r-th key of each bucket (in priority order) the bucket's r-th free slot.

        Args:
            keys, scores, bucket (Tensor[int64]): [P] each.
            halve: take at most half (rounded up) of each bucket's free slots.
        Returns:
            fits (Tensor[bool]): [P]
            pos (Tensor[int64]): [P] slot taken, meaningful where fits.
        """
        order, bucket, rank = group_by_bucket(bucket)  # [P] each
        fits, pos = self._free_slots(bucket, rank, halve)
        fit_pos = pos[fits]
        fit_idx = order[fits]
        fit_keys = keys.index_select(0, fit_idx)
        self._keys.view(-1).scatter_(0, fit_pos, fit_keys)
        self._tags.view(-1).scatter_(0, fit_pos, tag_of(fit_keys))
        self._scores.view(-1).scatter_(0, fit_pos, scores.index_select(0, fit_idx).to(self._scores.dtype))
        self._rows.view(-1).scatter_(0, fit_pos, self.free_list.allocate(fit_pos.numel()).to(self._rows.dtype))
        self._size += fit_pos.numel()
        self._count("inserts", fit_pos)
        out_fits = torch.zeros_like(fits).scatter_(0, order, fits)
        out_pos = torch.empty_like(pos).scatter_(0, order, pos)
        return out_fits, out_pos

    def _free_slots(self, bucket: torch.Tensor, rank: torch.Tensor, halve: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The rank-th free slot of each bucket (buckets and ranks [P] from group_by_bucket).

        Returns:
            fits (Tensor[bool]): [P] the bucket has that many free slots (at most half of them,
                rounded up, with ``halve``).
            pos (Tensor[int64]): [P] flat slot, meaningful where fits.
        """
        free = self._tags.index_select(0, bucket) == 0  # [P, W]
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
                the order applied (see :func:`dynemb.kernels.move.follow_torch`).
        """
        moves: list[tuple[torch.Tensor, torch.Tensor]] = []
        free = self.current_capacity() - self._size
        if free == 0:
            nothing = torch.zeros_like(keys, dtype=torch.bool)
            return nothing, ~nothing, moves
        if self.native and MOVE_DEPTH <= MOVE_KERNEL_DEPTH:
            return make_room_native(self._keys, self._tags, self._rows, self._scores, self._segments, keys, seg, MOVE_DEPTH, free)
        b1, b2 = self._buckets(keys, seg)
        needy = torch.unique(torch.cat([b1, b2]))  # [Q]
        # Chains of two moves look at W times more keys; they are tried for at most as many
        # buckets as there are free slots, which bounds their cost when the index is nearly full.
        stuck = self._move_out(needy, MOVE_DEPTH, free, moves)
        tags = self._tags
        room = ~((tags.index_select(0, b1) != 0).all(1) & (tags.index_select(0, b2) != 0).all(1))
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
        full = buckets[(self._tags.index_select(0, buckets) != 0).all(1)]  # [F]
        F = full.numel()
        if F == 0:
            return full
        residents = self._keys.index_select(0, full).view(-1)  # [F * W]
        own = full.repeat_interleave(W)
        r1, r2 = self._buckets(residents, self._bucket_segments(own))
        alt = torch.where(r1 == own, r2, r1)  # [F * W], == own when both candidates coincide
        free_alt = (self._tags.index_select(0, alt) == 0).sum(1).masked_fill_(alt == own, 0).view(F, W)
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
        order, dst_bucket, rank = group_by_bucket(dst_bucket)
        fits, dst = self._free_slots(dst_bucket, rank)
        src, dst = src.index_select(0, order)[fits], dst[fits]
        for table in (self._keys, self._tags, self._rows, self._scores):
            flat = table.view(-1)
            flat.scatter_(0, dst, flat.index_select(0, src))
        self._tags.view(-1).index_fill_(0, src, 0)
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

    def _displace(
        self, keys: torch.Tensor, scores: torch.Tensor, pending: torch.Tensor, pos: torch.Tensor, seg: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, int]:
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
            w_keys = keys.index_select(0, w_rank)
            flat_keys.scatter_(0, w_pos, w_keys)
            self._tags.view(-1).scatter_(0, w_pos, tag_of(w_keys))
            flat_scores.scatter_(0, w_pos, scores.index_select(0, w_rank).to(flat_scores.dtype))
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
        if self.native:
            pos, taken, old_keys, old_scores = evict_for_native(
                self._keys, self._tags, self._scores, self._segments, keys, scores, seg, locked_pos, self.strategy is ScoreStrategy.LFU, self._workspace
            )
            self._count("evictions", taken)
            self._count("inserts", taken)
            return pos, old_keys, self._rows_at(taken), old_scores, taken
        W = self.bucket_capacity
        # Slots locked by the batch being placed (1 byte a slot, for this call only).
        lock = torch.zeros(self.current_capacity(), dtype=torch.bool, device=self.device)
        lock.index_fill_(0, locked_pos, True)
        flat_keys, flat_scores = self._keys.view(-1), self._scores.view(-1)
        flat_tags = self._tags.view(-1)
        candidates = self._candidate_slots(keys, seg)  # [P, 2W]
        pos = torch.full_like(keys, -1)
        active = torch.arange(keys.numel(), device=self.device)
        won = []
        while active.numel():
            cand = candidates.index_select(0, active)  # [A, 2W]
            flat = cand.view(-1)
            # An empty slot is never a victim (free slots were offered before eviction).
            blocked = (lock.index_select(0, flat) | (flat_tags.index_select(0, flat) == 0)).view(cand.shape)
            masked = self._scores_at(flat).view(cand.shape).masked_fill_(blocked, _MAX_SCORE)
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
            won.append((flat_keys.index_select(0, w_pos), self._rows_at(w_pos), self._scores_at(w_pos), w_pos))
            flat_keys.scatter_(0, w_pos, keys.index_select(0, w_keys))
            flat_tags.scatter_(0, w_pos, tag_of(keys.index_select(0, w_keys)))
            flat_scores.scatter_(0, w_pos, scores.index_select(0, w_keys).to(flat_scores.dtype))
            lock.index_fill_(0, w_pos, True)
            pos.scatter_(0, w_keys, w_pos)
            active = active[~winner]
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        *evicted, taken = [torch.cat(parts) for parts in zip(*won)] if won else [empty] * 4
        self._count("evictions", taken)
        self._count("inserts", taken)
        return (pos, *evicted, taken)
