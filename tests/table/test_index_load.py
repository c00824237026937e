"""How full the index gets before it evicts: displacement of resident keys, growth before
eviction, and LFU admitting every new key.

Random keys are distinct int64 from a seeded generator; every call is checked for conservation
(keys before + new keys = keys after + evicted + failed) against a set of the keys inserted.
"""

from __future__ import annotations

import pytest
import torch
from index_model import INT64_MAX, INT64_MIN, keys_with_candidates, layout, state_with_layout

from dynemb.table.index import KeyIndex

FIRST_EVICTION_LOAD = 0.95


def random_keys(n: int, seed: int) -> torch.Tensor:
    """``n`` distinct random int64 keys ([n]) in random order."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randint(INT64_MIN, INT64_MAX, (n,), generator=gen, dtype=torch.int64)
    assert keys.unique().numel() == n
    return keys


class Tracker:
    """Checks that nothing leaves an index unreported: per call, keys before + new keys = keys
    after + evicted + failed; at the end, the held keys are exactly those inserted minus those
    reported as evicted or failed. Keys are never inserted again once they left."""

    def __init__(self, index: KeyIndex):
        self.index = index
        self.new: list[torch.Tensor] = []
        self.left: list[torch.Tensor] = []

    def insert(self, keys: torch.Tensor, **kwargs):
        index = self.index
        size = index.size()
        r = index.find_or_insert(keys, **kwargs)
        new = torch.unique(keys[~r.found])
        E, F = r.evicted_keys.numel(), r.failed_keys.numel()
        assert size + new.numel() == index.size() + E + F
        assert not torch.isin(r.evicted_keys, keys).any() and torch.isin(r.failed_keys, new).all()
        self.new.append(new)
        self.left += [r.evicted_keys, r.failed_keys]
        return r

    def check(self) -> None:
        inserted, left = torch.cat(self.new), torch.cat(self.left)
        assert inserted.unique().numel() == inserted.numel() and left.unique().numel() == left.numel()
        assert torch.isin(left, inserted).all()
        held = torch.cat([keys for keys, _, _ in self.index.export()])
        assert torch.equal(held.sort().values, inserted[~torch.isin(inserted, left)].sort().values)


def first_eviction_load(tracker: Tracker, keys: torch.Tensor, batch: int, start: int = 0, stop: float = 1.0) -> float:
    """Insert keys[start:] in batches until a call evicts or fails a key, or the load reaches
    ``stop``; returns the load factor then (keys held when the first key left, which is after
    the free slots its call could reach were filled)."""
    index = tracker.index
    for step in range(start, keys.numel(), batch):
        r = tracker.insert(keys[step : step + batch], now=step)
        if r.evicted_keys.numel() or r.failed_keys.numel() or index.load_factor() >= stop:
            break
    tracker.check()
    return index.load_factor()


@pytest.mark.parametrize("batch", [1, 64, 4096])
def test_first_eviction_comes_late_at_maximum_size(batch):
    index = KeyIndex(capacity=1 << 16)
    assert index.current_capacity() == index.capacity() == 1 << 16
    tracker = Tracker(index)
    keys = random_keys(1 << 16, seed=batch)
    start = 0
    if batch == 1:
        # Single-key calls cost ~1 ms: fill to 0.93 in batches of 4096, then one key at a time.
        start = int(0.93 * index.capacity())
        assert first_eviction_load(tracker, keys[:start], 4096) == start / index.capacity()
    assert first_eviction_load(tracker, keys, batch, start, stop=FIRST_EVICTION_LOAD) >= FIRST_EVICTION_LOAD


def test_first_eviction_comes_late_in_a_large_index():
    index = KeyIndex(capacity=1 << 22)
    keys = random_keys(int(FIRST_EVICTION_LOAD * index.capacity()) + (1 << 16), seed=1)
    load = first_eviction_load(Tracker(index), keys, 1 << 16, stop=FIRST_EVICTION_LOAD)
    assert load >= FIRST_EVICTION_LOAD


@pytest.mark.parametrize("batch", [1, 7, 300])
def test_grows_instead_of_evicting_below_capacity(batch):
    # max_load_factor=1: only keys that find no room trigger growth.
    index = KeyIndex(capacity=1 << 8, init_capacity=16, bucket_capacity=4, max_load_factor=1.0, score_strategy="lfu")
    tracker = Tracker(index)
    keys = random_keys(1 << 9, seed=batch)
    for part in keys.split(batch):
        r = tracker.insert(part)
        if r.evicted_keys.numel() or r.failed_keys.numel():
            # (A batch of 300 keys is larger than the capacity: its first call grows all the way.)
            assert index.current_capacity() == index.capacity(), "evicted before the index reached its capacity"
    tracker.check()
    assert index.current_capacity() == index.capacity() and index.stats()["growths"] == 4
    assert index.stats()["evictions"] > 0


def test_crowded_keys_grow_the_index_before_any_eviction():
    # Keys whose two candidates are one bucket of the initial 4: at most 4 fit at 4 buckets of 4.
    index = KeyIndex(capacity=64, init_capacity=16, bucket_capacity=4, score_strategy="step")
    keys = keys_with_candidates(4, 0, 0, n=12)
    r = index.find_or_insert(torch.tensor(keys), now=1)
    assert r.ok.all() and r.evicted_keys.numel() == 0
    assert index.current_capacity() > 16


@pytest.mark.parametrize("seed", [0, 1])
def test_lfu_never_fails_once_full(seed):
    index = KeyIndex(capacity=1 << 12, score_strategy="lfu")
    tracker = Tracker(index)
    gen = torch.Generator().manual_seed(seed)
    # A stream of 4x the capacity in distinct keys, each batch with repeats (counts up to 4).
    stream = random_keys(1 << 14, seed=seed + 10)
    evictions = 0
    for part in stream.split(256):
        batch = part.repeat_interleave(torch.randint(1, 5, (part.numel(),), generator=gen))
        r = tracker.insert(batch)
        assert r.failed_keys.numel() == 0 and r.ok.all()
        evictions += r.evicted_keys.numel()
    tracker.check()
    assert index.size() >= FIRST_EVICTION_LOAD * index.capacity()
    assert evictions == stream.numel() - index.size()


def test_a_resident_moves_to_its_other_bucket_instead_of_being_evicted():
    index = KeyIndex(capacity=8, bucket_capacity=2, score_strategy="customized")
    assert index.num_buckets == 4
    (a,) = keys_with_candidates(4, 0, 1)
    c, n = keys_with_candidates(4, 0, 0, n=2)
    (d,) = keys_with_candidates(4, 1, 1)
    # Bucket 0 is full ([a, c]); a may also live in bucket 1, which has a free slot.
    index.load_state_dict(state_with_layout(index, {a: (0, 0), c: (0, 1), d: (1, 0)}, {a: 5, c: 5, d: 5}))
    r = index.find_or_insert(torch.tensor([n]), scores=torch.tensor([9]))
    assert r.inserted.tolist() == [True] and r.evicted_keys.numel() == 0
    where = layout(index)
    assert where[n] == (0, 0) and where[a] == (1, 1) and where[c] == (0, 1)
    assert r.positions.tolist() == [0]
    # a kept its row id and score.
    assert index.find(torch.tensor([a]))[0].tolist() == [0]
    assert index.scores(torch.tensor([a]))[0].tolist() == [5]


def test_two_moves_in_a_chain_before_eviction():
    index = KeyIndex(capacity=8, bucket_capacity=2, score_strategy="customized")
    (a,) = keys_with_candidates(4, 0, 1)
    c, n = keys_with_candidates(4, 0, 0, n=2)
    (d,) = keys_with_candidates(4, 1, 2)
    (e,) = keys_with_candidates(4, 1, 1)
    (f,) = keys_with_candidates(4, 2, 2)
    # Buckets 0 and 1 are full; d can move on from bucket 1 to bucket 2, then a into bucket 1.
    placement = {a: (0, 0), c: (0, 1), d: (1, 0), e: (1, 1), f: (2, 0)}
    index.load_state_dict(state_with_layout(index, placement))
    r = index.find_or_insert(torch.tensor([n, a]), scores=torch.tensor([9, 1]))
    assert r.inserted.tolist() == [True, False] and r.found.tolist() == [False, True]
    assert r.evicted_keys.numel() == 0
    where = layout(index)
    assert where[d] == (2, 1) and where[a] == (1, 0) and where[n] == (0, 0)
    # The found key's position is where it sits after the moves.
    assert r.positions.tolist() == [0, 2]
    # Nothing else can move now: the next new key of bucket 0 evicts (c, the lowest scored).
    (m,) = keys_with_candidates(4, 0, 0, n=1, start=n + 1)
    r = index.find_or_insert(torch.tensor([m]), scores=torch.tensor([9]))
    assert r.evicted_keys.tolist() == [c]
