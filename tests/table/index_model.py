"""Helpers for the key index tests: key pools, bucket probes and a dict model of the index.

B buckets, W slots per bucket. A key lives in one of its two candidate buckets
(``dynemb.hashing.candidate_buckets``); when both coincide it has only one.
"""

from __future__ import annotations

import functools

import torch

from dynemb.hashing import candidate_buckets, tag_of

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1
SPECIAL_KEYS = [0, -1, INT64_MIN, INT64_MAX]

_candidates_cache: dict[tuple[int, int], tuple[int, int]] = {}


def candidates(key: int, num_buckets: int) -> tuple[int, int]:
    """(first, second) candidate bucket of ``key`` (memoised: the key pools are small)."""
    got = _candidates_cache.get((key, num_buckets))
    if got is None:
        b1, b2 = candidate_buckets(torch.tensor([key], dtype=torch.int64), num_buckets)
        got = (int(b1[0]), int(b2[0]))
        _candidates_cache[(key, num_buckets)] = got
    return got


@functools.cache
def _keys_in_bucket(num_buckets: int, n: int, target: int, start: int) -> tuple[int, ...]:
    found: list[int] = []
    lo = start
    while len(found) < n:
        cand = torch.arange(lo, lo + (1 << 16), dtype=torch.int64)
        b1, b2 = candidate_buckets(cand, num_buckets)
        found.extend(cand[(b1 == target) & (b2 == target)].tolist())
        lo += 1 << 16
    return tuple(found[:n])


def keys_in_bucket(num_buckets: int, n: int, target: int = 0, start: int = 1) -> list[int]:
    """The first ``n`` keys >= ``start`` whose candidate buckets are both ``target``."""
    return list(_keys_in_bucket(num_buckets, n, target, start))


def layout(index) -> dict[int, tuple[int, int]]:
    """key -> (bucket, slot) of every held key.

    Reads the index's private tables: the public API hides slots, and the eviction and failure
    rules are stated in terms of buckets and slots.
    """
    W = index.bucket_capacity
    used = index._tags.reshape(-1).nonzero().squeeze(1)
    keys = index._keys.reshape(-1).index_select(0, used)
    # Every used slot holds its key's tag (the probes screen slots by tag before key).
    assert torch.equal(index._tags.reshape(-1).index_select(0, used), tag_of(keys)), "a slot's tag is not its key's"
    return {k: (p // W, p % W) for k, p in zip(keys.tolist(), used.tolist())}


def export_all(index, chunk_size: int = 1 << 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(keys, rows, scores) of every held key, concatenated over export's chunks."""
    parts = list(index.export(chunk_size))
    empty = torch.empty(0, dtype=torch.int64)
    return tuple(torch.cat([p[i] for p in parts]) if parts else empty for i in range(3))


def export_sorted(index) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """export_all sorted by key."""
    keys, rows, scores = export_all(index)
    order = keys.argsort()
    return keys[order], rows[order], scores[order]


class DictModel:
    """What the index holds, as dicts, and the score a batch gives each key under a strategy.

    ``now`` is the clock the tests pass to the index (``timestamp``, ``step``, ``no_eviction``).
    """

    def __init__(self, strategy: str):
        self.strategy = strategy
        self.row: dict[int, int] = {}
        self.score: dict[int, int] = {}
        self.now = 0
        self.stats = {"inserts": 0, "evictions": 0, "failed_inserts": 0, "growths": 0}

    def batch_scores(self, keys: list[int], scores: list[int] | None) -> dict[int, int]:
        """Score each distinct key of a batch gets (new keys take it; found keys see apply_found)."""
        if scores is not None:
            batch: dict[int, int] = {}
            for k, s in zip(keys, scores):
                batch[k] = max(batch.get(k, INT64_MIN), s)
            return batch
        if self.strategy == "lfu":
            return {k: keys.count(k) for k in set(keys)}
        if self.strategy == "customized":
            raise ValueError("customized needs scores")
        return {k: self.now for k in set(keys)}

    def apply_found(self, keys: list[int], batch: dict[int, int], given: bool) -> None:
        """Update the scores of the keys of a batch that were already held."""
        for k in set(keys):
            if k in self.row:
                if self.strategy == "lfu" and not given:
                    self.score[k] = min(self.score[k] + keys.count(k), INT64_MAX)
                else:
                    self.score[k] = batch[k]


@functools.cache
def _keys_with_candidates(num_buckets: int, pair: tuple[int, int], n: int, start: int) -> tuple[int, ...]:
    found: list[int] = []
    lo = start
    while len(found) < n:
        cand = torch.arange(lo, lo + (1 << 16), dtype=torch.int64)
        b1, b2 = candidate_buckets(cand, num_buckets)
        found.extend(cand[(b1 == pair[0]) & (b2 == pair[1])].tolist())
        lo += 1 << 16
    return tuple(found[:n])


def keys_with_candidates(num_buckets: int, first: int, second: int, n: int = 1, start: int = 1) -> list[int]:
    """The first ``n`` keys >= ``start`` whose candidate buckets are (``first``, ``second``)."""
    return list(_keys_with_candidates(num_buckets, (first, second), n, start))


def state_with_layout(index, placement: dict[int, tuple[int, int]], scores: dict[int, int] | None = None) -> dict:
    """A state_dict for ``index`` (same geometry, at its current buckets) holding ``placement``:
    key -> (bucket, slot), row ids 0, 1, ... in the order given, scores 0 unless given."""
    W = index.bucket_capacity
    keys = list(placement)
    state = index.state_dict()
    n = len(keys)
    state.update(
        keys=torch.tensor(keys, dtype=torch.int64),
        rows=torch.arange(n, dtype=torch.int64),
        scores=torch.tensor([(scores or {}).get(k, 0) for k in keys], dtype=torch.int64),
        slots=torch.tensor([b * W + s for b, s in placement.values()], dtype=torch.int64),
        free_high_water=torch.tensor(n, dtype=torch.int64),
        free=torch.empty(0, dtype=torch.int64),
    )
    return state
