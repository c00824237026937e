"""Exact placement for loads: put a known set of keys into an index, slot by slot.

K keys to place, S segments, B buckets, W slots per bucket.

A load (a checkpoint, a warm start) knows every key it must hold before it places any. A batch
insert places most of them; :func:`place_exact` finds slots for the few it left out along cuckoo
paths (it may move many keys of the index), and :func:`state_from_slots` turns the slots found,
or the slots a checkpoint saved (:func:`state_from_layout`), into a state_dict that
:meth:`dynemb.table.index.KeyIndex.load_state_dict` installs exactly, with row ids 0..K-1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from dynemb.table.index import KeyIndex

# Buckets a key that finds no free slot searches for a lower-priority key to replace.
EVICT_SEARCH = 1 << 12


def state_from_slots(
    index: KeyIndex,
    keys: torch.Tensor,
    slots: torch.Tensor,
    scores: torch.Tensor,
    geometry: tuple[int, int, int],
    counters: Sequence[int],
    segment_buckets: Sequence[int] | None = None,
) -> dict[str, torch.Tensor]:
    """An index state_dict holding ``keys`` [K] at flat ``slots`` [K] with ``scores`` [K] and
    rows 0..K-1 (a store filled in that order), no free row ids, and ``counters`` (inserts,
    evictions, failed_inserts, growths).

    Args:
        geometry: (num_buckets, bucket_capacity, max_buckets) of the layout the slots are in.
        segment_buckets: [S] buckets of each segment in that layout (an index built with
            ``capacities=``; default: the index's own now). The state's segment counters are
            the index's own.
    """
    K = keys.numel()
    state = {
        "keys": keys,
        "rows": torch.arange(K),
        "scores": scores,
        "slots": slots,
        "num_buckets": torch.tensor(geometry[0]),
        "bucket_capacity": torch.tensor(geometry[1]),
        "max_buckets": torch.tensor(geometry[2]),
        "free_high_water": torch.tensor(K),
        "free": torch.empty(0, dtype=torch.int64),
        "counters": torch.tensor(list(counters), dtype=torch.int64),
    }
    if index.segmented:
        buckets = index.segment_buckets.tolist() if segment_buckets is None else list(segment_buckets)
        state["segment_buckets"] = torch.tensor(buckets, dtype=torch.int64)
        state["segment_counters"] = torch.tensor([index.counters(s) for s in range(index.num_segments)], dtype=torch.int64).T.contiguous()
    return {k: v.to(index.device) for k, v in state.items()}


def state_from_layout(
    index: KeyIndex, parts: Sequence[tuple[int | None, Mapping[str, torch.Tensor] | None, torch.Tensor, torch.Tensor]], counters: Sequence[int]
) -> dict[str, torch.Tensor] | None:
    """An index state_dict placing every key at the slot it was saved at, or None if the saved
    layout does not apply (missing, malformed, or a geometry this index does not pass through).

    Args:
        parts: one (segment or None, layout, keys [K_i], scores [K_i]) per table of the index;
            layout holds ``slots`` [K_i] and 0-d ``num_buckets``, ``bucket_capacity``,
            ``max_buckets`` (plus ``segment_buckets`` [S] and 0-d ``segment`` for a segment).
        counters: the index counters of the state (inserts, evictions, failed_inserts, growths).
    """
    keys, slots, scores = [], [], []
    segment_buckets = None
    for seg, lay, part_keys, part_scores in parts:
        if lay is None:
            return None
        try:
            geometry = (int(lay["num_buckets"]), int(lay["bucket_capacity"]), int(lay["max_buckets"]))
            if seg is not None:
                saved = lay["segment_buckets"].tolist()
                if int(lay["segment"]) != seg or (segment_buckets is not None and saved != segment_buckets):
                    return None
                segment_buckets = saved
        except (KeyError, RuntimeError, ValueError, TypeError, AttributeError):
            return None
        if lay["slots"].shape != part_keys.shape:
            return None
        keys.append(part_keys)
        slots.append(lay["slots"])
        scores.append(part_scores)
    if index.segmented and segment_buckets is None:
        return None
    state = state_from_slots(index, torch.cat(keys), torch.cat(slots), torch.cat(scores), geometry, counters, segment_buckets)
    return state if index.same_geometry(state) else None


def place_exact(
    index: KeyIndex, keys: torch.Tensor, segs: torch.Tensor | None, scores: torch.Tensor, slots: torch.Tensor, *, evict: bool, optional: torch.Tensor
) -> torch.Tensor:
    """Slots for keys that a batch insert left out, by cuckoo paths.

    Each key left out (``slots`` [K] is -1; keys [K] with segments, scores [K]), in priority
    order (higher score, then smaller key), reaches a free slot along a shortest chain of keys
    that move to their other bucket. A key that can reach none fails, or with ``evict`` replaces
    the lowest-priority key it can reach (among the first EVICT_SEARCH buckets) if that one
    ranks below it. ``optional`` [K] keys (beyond a table's capacity, below every other key)
    only take slots left free, and are given up after a few misses. Meant for the few keys a
    batch insert cannot place: the distance of every bucket to a free slot is computed on the
    whole index (one pass per level), then each key walks its chain on the host. Returns every
    key's slot (-1: dropped).
    """
    W, NB = index.bucket_capacity, index.num_buckets
    device = slots.device
    b1, b2 = (b.cpu() for b in index.candidate_buckets(keys, segs))
    keys, scores, slots = keys.cpu(), scores.cpu(), slots.cpu()
    K = keys.numel()
    bucket = torch.where(slots >= 0, slots // W, -1)  # [K] the bucket of each key, -1 if not placed
    count = torch.bincount(bucket[bucket >= 0], minlength=NB)  # [NB] keys per bucket
    seg = segs.cpu() if segs is not None else torch.zeros_like(keys)
    S = index.num_segments if segs is not None else 1
    placed_per_seg = torch.bincount(seg[bucket >= 0], minlength=S).tolist()
    free = [(index.segment_capacity(s) if segs is not None else index.capacity()) - placed_per_seg[s] for s in range(S)]
    misses = [0] * S
    b1l, b2l, keyl, scorel, segl, optl = b1.tolist(), b2.tolist(), keys.tolist(), scores.tolist(), seg.tolist(), optional.cpu().tolist()
    NONE = 1 << 62

    def priority(i: int) -> tuple[int, int]:
        return (scorel[i], -keyl[i])

    def move(r: int, to: int) -> None:
        old = int(bucket[r])
        if old >= 0:
            count[old] -= 1
        if to >= 0:
            count[to] += 1
        bucket[r] = to

    def distances() -> tuple[list[int], list[int]]:
        """Per bucket: moves to the nearest free slot, and the key to move out first (a
        breadth-first search from the free buckets over keys grouped by their other bucket)."""
        placed = (bucket >= 0).nonzero().squeeze(1)
        src = bucket.index_select(0, placed)
        alt = b1.index_select(0, placed) + b2.index_select(0, placed) - src
        movable = alt != src
        placed, src, alt = placed[movable], src[movable], alt[movable]
        by_alt = torch.sort(alt)
        ends = torch.searchsorted(by_alt.values, torch.arange(NB), right=True)
        starts = torch.cat([ends.new_zeros(1), ends[:-1]])
        dist = torch.where(count < W, 0, NONE)
        first = torch.full((NB,), K, dtype=torch.int64)
        frontier = (count < W).nonzero().squeeze(1)
        d = 0
        while frontier.numel():
            lo, n = starts.index_select(0, frontier), (ends - starts).index_select(0, frontier)
            total = int(n.sum())
            if total == 0:
                break
            at = torch.repeat_interleave(lo - (torch.cumsum(n, 0) - n), n, output_size=total) + torch.arange(total)
            moving = by_alt.indices.index_select(0, at)  # keys whose other bucket is in the frontier
            sb = src.index_select(0, moving)
            new = dist.index_select(0, sb) == NONE
            sb, moving = sb[new], moving[new]
            dist.index_fill_(0, sb, d + 1)
            first.scatter_reduce_(0, sb, placed.index_select(0, moving), reduce="amin")
            frontier = torch.unique(sb)
            d += 1
        return dist.tolist(), first.tolist()

    def replace_lowest(i: int) -> bool:
        """Evict the lowest-priority key reachable from i's buckets (below i) and move keys
        along the chain to its bucket; False if there is none."""
        placed = (bucket >= 0).nonzero().squeeze(1)
        src = bucket.index_select(0, placed)
        alt = b1.index_select(0, placed) + b2.index_select(0, placed) - src
        visited = torch.zeros(NB, dtype=torch.bool)
        parent = torch.full((NB,), K, dtype=torch.int64)
        frontier = torch.unique(torch.tensor([b1l[i], b2l[i]]))
        visited[frontier] = True
        while frontier.numel() and int(visited.sum()) < EVICT_SEARCH:
            inside = torch.isin(src, frontier) & (alt != src)
            to, who = alt[inside], placed[inside]
            new = ~visited.index_select(0, to)
            to, who = to[new], who[new]
            parent.scatter_reduce_(0, to, who, reduce="amin")
            visited.index_fill_(0, to, True)
            frontier = torch.unique(to)
        reached = placed[visited.index_select(0, src)]
        if reached.numel() == 0:
            return False
        # Lowest priority: lowest score, then largest key.
        low = reached[scores.index_select(0, reached) == scores.index_select(0, reached).min()]
        victim = int(low[keys.index_select(0, low).argmax()])
        if priority(victim) >= priority(i):
            return False
        b = int(bucket[victim])
        move(victim, -1)
        dropped.append(victim)
        starts = {b1l[i], b2l[i]}
        while b not in starts:
            r = int(parent[b])
            prev = int(bucket[r])
            move(r, b)
            b = prev
        move(i, b)
        return True

    left_out = sorted((bucket < 0).nonzero().squeeze(1).tolist(), key=lambda i: (-scorel[i], keyl[i]))
    dropped: list[int] = []
    dist, first = [], []
    dirty: set[int] | None = None  # buckets changed since the distances were computed
    for i in left_out:
        s = segl[i]
        if optl[i]:
            if free[s] == 0 or misses[s] >= 8:
                dropped.append(i)
                continue
        placed_it = False
        while free[s]:
            if dirty is None:
                dist, first = distances()
                dirty = set()
            c = b1l[i] if dist[b1l[i]] <= dist[b2l[i]] else b2l[i]
            stale = bool(dirty)
            if dist[c] >= NONE:
                if stale:
                    dirty = None
                    continue
                break
            chain, b = [], c
            while dist[b] > 0 and b not in dirty:
                r = first[b]
                chain.append((r, b))
                b = b1l[r] + b2l[r] - b
            if b in dirty:
                dirty = None
                continue
            # Move the chain's keys from the end back to c, then i into c.
            for r, _ in reversed(chain):
                move(r, b1l[r] + b2l[r] - int(bucket[r]))
            move(i, c)
            dirty.update(b for _, b in chain)
            dirty.update((c, b))
            placed_it = True
            break
        if placed_it:
            free[s] -= 1
            misses[s] = 0
            continue
        misses[s] += 1
        if evict and not optl[i] and replace_lowest(i):
            dirty = None
            continue
        dropped.append(i)
    # Slots: each bucket's keys take its first slots, in key order.
    out = torch.full((K,), -1, dtype=torch.int64)
    placed = (bucket >= 0).nonzero().squeeze(1)
    by_bucket = torch.sort(bucket.index_select(0, placed), stable=True)
    start_of = torch.searchsorted(by_bucket.values, by_bucket.values, right=False)
    rank = torch.arange(placed.numel()) - start_of
    out[placed.index_select(0, by_bucket.indices)] = by_bucket.values * W + rank
    return out.to(device)
