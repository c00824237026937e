"""Adversarial key index tests: crowded buckets, eviction order per strategy, locks, special keys,
duplicates, batch order, growth, export chunking and argument errors.

W = 4 slots per bucket throughout. "Crowded" keys all share one bucket: either the index has a
single bucket, or the keys are those whose two candidate buckets are both bucket 0 of 4 (so no
key of the bucket can move to another one). Keys inserted one call at a time take the bucket's
slots 0, 1, 2, 3 in call order, which the tie rule (lower slot first) then refers to.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from index_model import (
    INT64_MAX,
    INT64_MIN,
    SPECIAL_KEYS,
    candidates,
    export_all,
    export_sorted,
    keys_in_bucket,
    layout,
)

from dynemb.table.index import KeyIndex

W = 4
STRATEGIES = ["timestamp", "step", "lfu", "customized", "no_eviction"]


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def make_index(strategy: str = "customized", *, capacity: int = W, init_capacity: int | None = None, **kwargs):
    return KeyIndex(capacity=capacity, init_capacity=init_capacity, bucket_capacity=W, score_strategy=strategy, **kwargs)


def ins(index: KeyIndex, keys: list[int], scores: list[int] | None = None, now: int = 0):
    return index.find_or_insert(t(keys), now=now, scores=None if scores is None else t(scores))


def rows_of(index: KeyIndex, keys: list[int]) -> list[int]:
    return index.find(t(keys))[0].tolist()


def scores_of(index: KeyIndex, keys: list[int]) -> list[int]:
    return index.scores(t(keys))[0].tolist()


def held(index: KeyIndex) -> set[int]:
    return set(export_all(index)[0].tolist())


def assert_evicted(result, victims: list[int], before: dict[int, tuple[int, int]]) -> None:
    """result evicted exactly ``victims`` (in any order), reporting their rows and scores from before."""
    got = zip(result.evicted_keys.tolist(), result.evicted_rows.tolist(), result.evicted_scores.tolist())
    assert sorted(got) == sorted((v, *before[v]) for v in victims)


def snapshot(index: KeyIndex) -> dict[int, tuple[int, int]]:
    keys, rows, scores = export_all(index)
    return {k: (r, s) for k, r, s in zip(keys.tolist(), rows.tolist(), scores.tolist())}


@pytest.fixture(params=["one_bucket", "bucket_0_of_4"])
def crowd(request) -> tuple[int, list[int]]:
    """(capacity, 10 keys ascending) where the keys all share one bucket of an index of that capacity."""
    if request.param == "one_bucket":
        return W, [-50, -7, 0, 3, 9, 11, 20, 31, 42, 99]
    keys = keys_in_bucket(4, 10)
    assert all(candidates(k, 4) == (0, 0) for k in keys)
    return 4 * W, keys


def fill_one_per_call(index: KeyIndex, keys: list[int], scores: list[int] | None = None, now: int = 0) -> None:
    """Insert keys one call each (so they take slots 0, 1, ... of their shared bucket); the
    clock ticks once per call from ``now``."""
    for i, k in enumerate(keys):
        r = ins(index, [k], None if scores is None else [scores[i]], now=now + i)
        assert r.ok.all() and r.evicted_keys.numel() == 0
    where = layout(index)
    b = where[keys[0]][0]
    assert [where[k] for k in keys] == [(b, s) for s in range(len(keys))]


# Eviction order per strategy.


def test_timestamp_evicts_least_recently_used(crowd):
    capacity, (k0, k1, k2, k3, n1, n2, n3, *_) = crowd
    index = make_index("timestamp", capacity=capacity)
    # The caller's clock, here in nanoseconds: a key's score is the ``now`` of its last use.
    clock = 1_700_000_000_000_000_000
    fill_one_per_call(index, [k2, k0, k3, k1], now=clock)
    assert scores_of(index, [k2, k0, k3, k1]) == [clock, clock + 1, clock + 2, clock + 3]
    ins(index, [k0], now=clock + 10)
    # find has no side effect: k2 stays the least recently used.
    index.find(t([k2]))
    assert scores_of(index, [k2, k0]) == [clock, clock + 10]

    before = snapshot(index)
    r = ins(index, [n1], now=clock + 11)
    assert_evicted(r, [k2], before)
    assert r.rows.tolist() == [before[k2][0]] and r.ok.all() and not r.found.any() and r.inserted.all()
    before = snapshot(index)
    assert_evicted(ins(index, [n2], now=clock + 12), [k3], before)
    ins(index, [k1], now=clock + 13)
    # Use order now: k0, n1, n2, k1.
    before = snapshot(index)
    assert_evicted(ins(index, [n3], now=clock + 14), [k0], before)
    assert held(index) == {n1, n2, k1, n3}


def test_step_evicts_oldest_step_lower_slot_first(crowd):
    capacity, (k0, k1, k2, k3, *new) = crowd
    n1, n2, n3, n4 = sorted(new[:4])
    index = make_index("step", capacity=capacity)
    # Slots 0..3; k3 (slot 1) and k0 (slot 3) will tie, and the lower slot holds the larger key.
    for k in [k1, k3, k2, k0]:
        ins(index, [k], now=1)
    ins(index, [k1, k2], now=2)
    ins(index, [k1], now=3)
    assert scores_of(index, [k1, k3, k2, k0]) == [3, 1, 2, 1]

    before = snapshot(index)
    r = ins(index, [n1], now=4)
    assert_evicted(r, [k3], before)
    assert rows_of(index, [n1]) == [before[k3][0]] and scores_of(index, [n1]) == [4]
    before = snapshot(index)
    assert_evicted(ins(index, [n2], now=5), [k0], before)
    # Two new keys, two victims: the smaller key takes the lowest-scored one.
    before = snapshot(index)
    r = ins(index, [n4, n3], now=6)
    assert sorted(r.evicted_keys.tolist()) == sorted([k1, k2])
    assert rows_of(index, [n3, n4]) == [before[k2][0], before[k1][0]]
    assert held(index) == {n1, n2, n3, n4}


def test_lfu_evicts_least_frequent_even_for_a_rarer_new_key(crowd):
    capacity, (k0, k1, k2, k3, n1, n2, n3, n4, *_) = crowd
    index = make_index("lfu", capacity=capacity)
    for k, count in [(k1, 3), (k3, 1), (k2, 2), (k0, 1)]:
        ins(index, [k] * count)
    assert [where[1] for where in map(layout(index).get, [k1, k3, k2, k0])] == [0, 1, 2, 3]
    assert scores_of(index, [k1, k3, k2, k0]) == [3, 1, 2, 1]

    # n1 (count 1) ties k3 and k0 at 1: k3 is in the lower slot.
    before = snapshot(index)
    assert_evicted(ins(index, [n1]), [k3], before)
    assert scores_of(index, [n1]) == [1]
    # n2 ties k0 (slot 3) and n1 (slot 1): a key inserted by an earlier call is not protected.
    before = snapshot(index)
    assert_evicted(ins(index, [n2]), [n1], before)
    ins(index, [n2, n2, k0, k0])
    assert scores_of(index, [k1, n2, k2, k0]) == [3, 3, 2, 3]

    # Every held key is more frequent than n3 (count 1): an LFU cache still admits n3, in place
    # of the least frequent key (k2, count 2).
    stats = index.stats()
    before = snapshot(index)
    r = ins(index, [n3])
    assert_evicted(r, [k2], before)
    assert r.failed_keys.numel() == 0 and r.ok.tolist() == [True] and r.inserted.tolist() == [True]
    assert r.rows.tolist() == [before[k2][0]] and scores_of(index, [n3]) == [1]
    assert index.stats()["evictions"] == stats["evictions"] + 1 and index.stats()["failed_inserts"] == 0
    # Ties among the least frequent: the lower slot (n3 sits in k2's slot 2, k0 in slot 3).
    ins(index, [k0], scores=[1])
    before = snapshot(index)
    assert_evicted(ins(index, [n4, n4]), [n3], before)
    assert scores_of(index, [n4]) == [2]


def test_lfu_fails_only_when_every_candidate_is_used_by_the_batch(crowd):
    capacity, (k0, k1, k2, k3, n1, *_) = crowd
    index = make_index("lfu", capacity=capacity)
    ins(index, [k0, k1, k2, k3] * 5)
    r = ins(index, [k0, k1, k2, k3, n1])
    assert r.failed_keys.tolist() == [n1] and r.evicted_keys.numel() == 0
    r = ins(index, [k0, k1, k2, n1])
    assert r.failed_keys.numel() == 0 and r.evicted_keys.tolist() == [k3]


def test_customized_evicts_lowest_given_score(crowd):
    capacity, (k0, k1, k2, k3, n1, n2, n3, n4, *_) = crowd
    index = make_index("customized", capacity=capacity)
    fill_one_per_call(index, [k0, k1, k2, k3], [50, 10, 30, 20])
    before = snapshot(index)
    assert_evicted(ins(index, [n1], [15]), [k1], before)
    # Lower than every held score: fails.
    r = ins(index, [n2], [5])
    assert r.failed_keys.tolist() == [n2] and r.evicted_keys.numel() == 0 and r.ok.tolist() == [False]
    # Equal to the lowest held score: replaces it ("not higher than its own").
    before = snapshot(index)
    assert_evicted(ins(index, [n3], [15]), [n1], before)
    # A found key takes the score it is given, even a lower one.
    ins(index, [k0], [1])
    before = snapshot(index)
    assert_evicted(ins(index, [n4], [2]), [k0], before)
    assert scores_of(index, [n4, k2, k3, n3]) == [2, 30, 20, 15]


def test_customized_without_scores_is_an_error():
    index = make_index("customized", capacity=16)
    with pytest.raises(ValueError, match="scores"):
        index.find_or_insert(t([1, 2]), now=1)
    assert index.size() == 0


def test_ties_evict_lower_slot_not_smaller_key(crowd):
    capacity, (k0, k1, k2, k3, n1, n2, n3, n4, *_) = crowd
    index = make_index("customized", capacity=capacity)
    fill_one_per_call(index, [k2, k0, k3, k1], [7] * 4)
    before = snapshot(index)
    assert_evicted(ins(index, [n1], [7]), [k2], before)
    assert layout(index)[n1][1] == 0
    before = snapshot(index)
    assert_evicted(ins(index, [n2], [7]), [n1], before)
    # A free slot is taken before anything is evicted.
    assert index.erase(t([k3])).found.tolist() == [True]
    r = ins(index, [n3], [7])
    assert r.evicted_keys.numel() == 0 and layout(index)[n3][1] == 2
    before = snapshot(index)
    assert_evicted(ins(index, [n4], [7]), [n2], before)


def test_no_eviction_returns_failed_keys_of_a_full_bucket(crowd):
    capacity, (k0, k1, k2, k3, k4, *_) = crowd
    index = make_index("no_eviction", capacity=capacity)
    ins(index, [k0, k1, k2, k3])
    before = snapshot(index)
    r = ins(index, [k4, k0], now=1)
    assert torch.equal(r.failed_keys, t([k4]))
    assert r.ok.tolist() == [False, True] and r.evicted_keys.numel() == 0
    assert r.rows.tolist() == [-1, before[k0][0]] and r.positions[0].item() == -1
    assert index.stats()["failed_inserts"] == 1 and index.stats()["evictions"] == 0
    after = snapshot(index)
    assert after.keys() == before.keys()
    assert all(after[k][0] == before[k][0] for k in before)
    # The found key was still touched by the call.
    assert after[k0][1] == 1


def test_no_eviction_grows_then_fails_once_full():
    index = KeyIndex(capacity=16, init_capacity=4, bucket_capacity=W, score_strategy="no_eviction")
    rows = {}
    for key in range(1000):
        before = snapshot(index)
        r = index.find_or_insert(t([key]), now=key)
        if r.failed_keys.numel():
            assert torch.equal(r.failed_keys, t([key])) and r.rows.tolist() == [-1]
            break
        rows[key] = r.rows.item()
    else:
        pytest.fail("1000 keys fit in an index of capacity 16")
    assert index.current_capacity() == index.capacity()
    assert snapshot(index) == before
    assert rows_of(index, list(rows)) == list(rows.values())


# Keys used by the current batch are locked.


def test_batch_keys_are_never_evicted_by_their_batch(crowd):
    capacity, (k0, k1, k2, k3, n1, *_) = crowd
    index = make_index("customized", capacity=capacity)
    fill_one_per_call(index, [k0, k1, k2, k3], [1, 2, 3, 4])
    # All four held keys are used by the batch: n1 fails whatever its score.
    r = ins(index, [k0, k1, n1, k2, k3], [1, 2, 100, 3, 4])
    assert r.failed_keys.tolist() == [n1] and r.evicted_keys.numel() == 0
    assert r.ok.tolist() == [True, True, False, True, True]
    assert held(index) == {k0, k1, k2, k3}
    # Two of them used: n1 evicts the lowest-scored of the other two.
    before = snapshot(index)
    r = ins(index, [k0, k1, n1], [1, 2, 100])
    assert_evicted(r, [k2], before)


def test_more_new_keys_than_slots_extra_fail(crowd):
    capacity, keys = crowd
    new = keys[:6]
    scores = [60, 10, 50, 20, 40, 30]
    index = make_index("customized", capacity=capacity)
    r = ins(index, new, scores)
    assert set(r.failed_keys.tolist()) == {new[1], new[3]}
    assert r.evicted_keys.numel() == 0
    assert held(index) == {new[0], new[2], new[4], new[5]}
    # Equal scores (timestamp): the smaller keys win.
    index = make_index("timestamp", capacity=capacity)
    r = ins(index, new[::-1])
    assert set(r.failed_keys.tolist()) == set(new[4:])
    assert held(index) == set(new[:4])


def test_new_keys_evict_old_ones_but_not_each_other(crowd):
    capacity, (k0, k1, *new) = crowd
    new = new[:5]
    scores = [10, 20, 30, 40, 50]
    index = make_index("customized", capacity=capacity)
    fill_one_per_call(index, [k0, k1], [1, 2])
    before = snapshot(index)
    r = ins(index, new, scores)
    # 50 and 40 take the free slots, 30 evicts k0, 20 evicts k1, and 10 fails: every slot now
    # holds a key of this batch, and those are locked.
    assert r.failed_keys.tolist() == [new[0]]
    assert_evicted(r, [k0, k1], before)
    assert rows_of(index, [new[2], new[1]]) == [before[k0][0], before[k1][0]]
    assert held(index) == set(new[1:])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_given_scores_rank_new_keys_under_every_strategy(strategy):
    """Among new keys competing for one bucket the higher score wins, then the smaller key
    (ScoreStrategy docstring); scores= assigns scores under every strategy."""
    index = make_index(strategy, capacity=W)
    ins(index, [100, 200, 300], [1000] * 3)
    before = snapshot(index)
    r = ins(index, [1, 2, 3], [5, 9, 9])
    # One free slot: 2 (score 9, smaller than 3) wins it.
    assert r.inserted[1] and scores_of(index, [2]) == [9]
    if strategy == "lfu":
        # An LFU cache admits every new key, in place of the least frequent (ties: lower slot).
        assert r.ok.all()
        assert_evicted(r, [100, 200], before)
        assert rows_of(index, [3, 1]) == [before[100][0], before[200][0]]
    else:
        # Nothing can be evicted: held scores are higher.
        assert r.ok.tolist() == [False, True, False]
        assert set(r.failed_keys.tolist()) == {1, 3}


def _priority_violations(index: KeyIndex, keys: list[int], batch: dict[int, int], failed: set[int], new: set[int]):
    """(failed key, lower-priority new key holding a slot of one of its candidate buckets) pairs."""
    where = layout(index)
    B = index.num_buckets
    out = []
    for k in failed:
        for j in new - failed:
            if where[j][0] in candidates(k, B) and (-batch[j], j) > (-batch[k], k):
                out.append((k, j, where[j][0]))
    return out


def test_failed_key_does_not_lose_its_bucket_to_lower_priority_key_regression():
    # Found by the property test below: all five keys have score 0 (no_eviction, now 0), so the
    # smaller key has priority. Candidates (B = 4): 13 (3, 3), 15 (0, 2), 18 (3, 3), 23 (0, 3),
    # 24 (3, 0). Placed one at a time in priority order, 24 is the key left without a slot.
    index = KeyIndex(capacity=8, bucket_capacity=2, score_strategy="no_eviction")
    keys = [13, 15, 18, 23, 24]
    r = index.find_or_insert(t(keys), now=0)
    failed = set(r.failed_keys.tolist())
    assert _priority_violations(index, keys, {k: 0 for k in keys}, failed, set(keys)) == []


@settings(max_examples=60, deadline=None)
@given(
    strategy=st.sampled_from(["step", "customized", "no_eviction"]),
    prefill=st.lists(st.integers(0, 60), max_size=12, unique=True),
    batch=st.lists(st.tuples(st.integers(0, 60), st.integers(0, 3)), min_size=1, max_size=14),
)
def test_failed_key_does_not_lose_its_bucket_to_lower_priority_key(strategy, prefill, batch):
    """A new key fails only if no lower-priority new key of its batch (lower score, then larger
    key) took a slot in one of its candidate buckets: placed one at a time in priority order, the
    failed key would have had that slot, or the victim the other key evicted."""
    index = KeyIndex(capacity=8, bucket_capacity=2, score_strategy=strategy)
    customized = strategy == "customized"
    if prefill:
        ins(index, prefill, [1] * len(prefill) if customized else None)
    keys = [k for k, _ in batch]
    before = held(index)
    if customized:
        r = ins(index, keys, [s for _, s in batch])
        scores: dict[int, int] = {}
        for k, s in batch:
            scores[k] = max(scores.get(k, s), s)
    else:
        r = ins(index, keys, now=1)
        scores = {k: 1 for k in keys}
    failed = set(r.failed_keys.tolist())
    assert _priority_violations(index, keys, scores, failed, set(keys) - before) == []


# Special keys, duplicates, batch order.


def test_special_keys_insert_find_erase():
    index = make_index("step", capacity=4 * W)
    special = t(SPECIAL_KEYS)
    # The key table starts zeroed: key 0 must not be found in an empty index.
    rows, found = index.find(special)
    assert not found.any() and rows.tolist() == [-1] * 4
    assert index.erase(special).found.tolist() == [False] * 4
    r = ins(index, SPECIAL_KEYS + SPECIAL_KEYS[::-1])
    assert r.ok.all() and not r.found.any()
    rows = r.rows[:4]
    assert rows.unique().numel() == 4 and torch.equal(r.rows[4:], rows.flip(0))
    assert torch.equal(index.find(special)[0], rows)
    assert torch.equal(export_sorted(index)[0], special.sort().values)
    erased = index.erase(t([0, INT64_MAX, 0]))
    assert erased.found.tolist() == [True, True, True]
    assert erased.evicted_keys.tolist() == [0, INT64_MAX]
    assert erased.evicted_rows.tolist() == [rows[0].item(), rows[3].item()]
    assert index.find(special)[1].tolist() == [False, True, True, False]
    assert index.find(t([-1, INT64_MIN]))[0].tolist() == rows[1:3].tolist()
    assert index.erase(t([0, INT64_MAX])).found.tolist() == [False, False]
    assert index.size() == 2 and index.free_list.num_used() == 2
    r = ins(index, [0])
    assert r.ok.tolist() == [True] and r.found.tolist() == [False]
    assert r.rows.item() not in rows[1:3].tolist()
    # int32 keys are the same keys.
    assert torch.equal(index.find(t([0, -1, 5]).to(torch.int32))[0], index.find(t([0, -1, 5]))[0])


def test_special_keys_share_one_bucket():
    index = make_index("customized", capacity=W)
    r = ins(index, SPECIAL_KEYS, [4, 3, 2, 1])
    assert r.ok.all()
    before = snapshot(index)
    assert_evicted(ins(index, [7], [2]), [INT64_MAX], before)
    assert index.find(t(SPECIAL_KEYS))[1].tolist() == [True, True, True, False]


def test_duplicates_in_a_batch():
    index = make_index("lfu", capacity=4 * W)
    keys = [5, 5, 7, 5, -1, 7]
    r = ins(index, keys)
    assert r.ok.all() and not r.found.any() and r.inserted.all()
    by_key = {}
    for k, row in zip(keys, r.rows.tolist()):
        assert by_key.setdefault(k, row) == row
    assert len(set(by_key.values())) == 3 and index.size() == 3
    assert scores_of(index, [5, 7, -1]) == [3, 2, 1]
    r = ins(index, keys)
    assert r.found.all() and not r.inserted.any()
    assert r.rows.tolist() == [by_key[k] for k in keys]
    assert scores_of(index, [5, 7, -1]) == [6, 4, 2]
    # Given scores: a key given several times gets the largest.
    ins(index, [5, 5, 5, 7], [3, 9, -2, 0])
    assert scores_of(index, [5, 7]) == [9, 0]
    erased = index.erase(t([5, 5, 11]))
    assert erased.found.tolist() == [True, True, False] and erased.evicted_keys.tolist() == [5]
    assert index.size() == 2


def _run_batches(strategy: str, batches: list[list[int]], permutations: list[list[int]] | None):
    index = make_index(strategy, capacity=4 * W, init_capacity=W)
    outcomes = []
    for i, batch in enumerate(batches):
        keys = batch if permutations is None else [batch[j] for j in permutations[i]]
        scores = [k % 7 for k in keys] if strategy == "customized" else None
        r = ins(index, keys, scores, now=i)
        per_key = {k: (row, f, ok) for k, row, f, ok in zip(keys, r.rows.tolist(), r.found.tolist(), r.ok.tolist())}
        evicted = sorted(zip(r.evicted_keys.tolist(), r.evicted_rows.tolist()))
        outcomes.append((per_key, sorted(r.failed_keys.tolist()), evicted))
    return index, outcomes


@settings(max_examples=25, deadline=None)
@given(
    strategy=st.sampled_from(["customized", "step", "lfu"]),
    batches=st.lists(st.lists(st.sampled_from(list(range(-20, 20)) + SPECIAL_KEYS), min_size=1, max_size=24), min_size=1, max_size=3),
    data=st.data(),
)
def test_results_independent_of_batch_order(strategy, batches, data):
    permutations = [data.draw(st.permutations(range(len(b)))) for b in batches]
    a, outcomes_a = _run_batches(strategy, batches, None)
    b, outcomes_b = _run_batches(strategy, batches, permutations)
    assert outcomes_a == outcomes_b
    for x, y in zip(export_sorted(a), export_sorted(b)):
        assert torch.equal(x, y)
    assert layout(a) == layout(b)
    assert a.stats() == b.stats()


# Growth.


def test_growth_keeps_every_key_row_and_score():
    gen = torch.Generator().manual_seed(0)
    keys = torch.randint(INT64_MIN, INT64_MAX, (640,), generator=gen, dtype=torch.int64)
    keys = torch.cat([t(SPECIAL_KEYS), keys]).unique()
    index = make_index("step", capacity=1 << 12, init_capacity=16)
    assert index.current_capacity() == 16
    inserted = torch.empty(0, dtype=torch.int64)
    expected_rows = torch.empty(0, dtype=torch.int64)
    capacities = [index.current_capacity()]
    for i, batch in enumerate(keys.split(64)):
        r = index.find_or_insert(batch, now=i)
        rows = r.rows
        assert r.ok.all() and not r.found.any() and r.evicted_keys.numel() == 0
        inserted, expected_rows = torch.cat([inserted, batch]), torch.cat([expected_rows, rows])
        got_rows, got_found = index.find(inserted)
        assert got_found.all() and torch.equal(got_rows, expected_rows)
        assert torch.equal(index.scores(batch)[0], torch.full_like(batch, i))
        capacities.append(index.current_capacity())
    assert expected_rows.unique().numel() == keys.numel()
    assert index.stats()["growths"] >= 4 and index.stats()["failed_inserts"] == 0
    assert all(b % a == 0 and (b // a).bit_count() == 1 for a, b in zip(capacities, capacities[1:]))
    # Scores of earlier batches survived growth too.
    first = keys.split(64)[0]
    assert torch.equal(index.scores(first)[0], torch.zeros_like(first))


def test_growth_within_one_batch():
    index = make_index("customized", capacity=1 << 10, init_capacity=W)
    keys = torch.arange(-300, 300, 2)
    r = index.find_or_insert(keys, scores=keys)
    assert r.ok.all() and r.rows.unique().numel() == keys.numel()
    assert index.stats()["growths"] >= 6
    assert torch.equal(index.find(keys)[0], r.rows)
    assert torch.equal(index.scores(keys)[0], keys)


# Export.


def _filled_index() -> KeyIndex:
    index = make_index("customized", capacity=16 * W)
    keys = list(range(-25, 25)) + SPECIAL_KEYS[1:]
    ins(index, keys, [k % 5 for k in keys])
    assert index.size() > 40
    return index


@pytest.mark.parametrize("chunk_size", [1, 2, 3, 4, 5, 7, 8, 16, 1000, 1 << 16])
def test_export_chunks_cover_every_key_once(chunk_size):
    index = _filled_index()
    keys, rows, scores = export_all(index, chunk_size)
    assert keys.unique().numel() == keys.numel() == index.size()
    full = export_sorted(index)
    order = keys.argsort()
    for got, want in zip((keys[order], rows[order], scores[order]), full):
        assert torch.equal(got, want)


@pytest.mark.parametrize("chunk_size", [1, 2, 3, 5, 7])
def test_export_chunk_holds_at_most_chunk_size_keys(chunk_size):
    # export's docstring: "in chunks of at most chunk_size slots scanned".
    index = _filled_index()
    sizes = [keys.numel() for keys, _, _ in index.export(chunk_size)]
    assert max(sizes) <= chunk_size, sizes


@pytest.mark.parametrize("chunk_size", [0, -1, 2.5])
def test_export_rejects_bad_chunk_size(chunk_size):
    with pytest.raises(ValueError, match=f"chunk_size={chunk_size}"):
        next(make_index().export(chunk_size))


# Argument errors name the argument and the value.


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"capacity": 0}, "capacity=0"),
        ({"capacity": -3}, "capacity=-3"),
        ({"capacity": 2.5}, "capacity=2.5"),
        ({"capacity": True}, "capacity=True"),
        ({"bucket_capacity": 0}, "bucket_capacity=0"),
        ({"init_capacity": 0}, "init_capacity=0"),
        ({"init_capacity": 17}, "init_capacity=17"),
        ({"init_capacity": 4.0}, "init_capacity=4.0"),
        ({"max_load_factor": 0}, "max_load_factor=0"),
        ({"max_load_factor": 1.5}, "max_load_factor=1.5"),
        ({"max_load_factor": math.nan}, "max_load_factor=nan"),
        ({"init_capacity": True}, "init_capacity=True"),
        ({"score_strategy": "fifo"}, "score_strategy='fifo'"),
        ({"device": "nonsense"}, "device='nonsense'"),
    ],
)
def test_bad_constructor_arguments(kwargs, match):
    args = {"capacity": 16, "bucket_capacity": W, **kwargs}
    with pytest.raises(ValueError, match=match):
        KeyIndex(**args)


@pytest.mark.parametrize("method", ["find", "scores", "find_or_insert", "erase"])
def test_bad_keys(method):
    index = make_index("step", capacity=16)
    call = getattr(index, method)
    if method == "find_or_insert":
        call = functools.partial(call, now=0)
    with pytest.raises(TypeError, match=r"keys\.dtype=torch\.float32"):
        call(torch.tensor([1.0, 2.0]))
    with pytest.raises(TypeError, match=r"keys\.dtype=torch\.bool"):
        call(torch.tensor([True]))
    with pytest.raises(TypeError, match="keys must be a torch.Tensor.*list"):
        call([1, 2])
    # The index is on CPU; keys on the meta device stand in for keys on another device.
    with pytest.raises(ValueError, match=r"keys\.device=meta"):
        call(torch.empty(2, dtype=torch.int64, device="meta"))
    assert index.size() == 0


def test_bad_scores():
    index = make_index("customized", capacity=16)
    with pytest.raises(TypeError, match=r"scores\.dtype=torch\.float64"):
        index.find_or_insert(t([1, 2]), scores=torch.tensor([1.0, 2.0], dtype=torch.float64))
    with pytest.raises(ValueError, match="scores has 2 values for 3 keys"):
        index.find_or_insert(t([1, 2, 3]), scores=t([1, 2]))
    assert index.size() == 0


def test_bad_upsert_unique_arguments():
    index = make_index("lfu", capacity=16)
    with pytest.raises(ValueError, match="counts has 1 values for 2 keys"):
        index.upsert_unique(t([1, 2]), t([1]))
    with pytest.raises(ValueError, match="given has 3 values for 2 keys"):
        index.upsert_unique(t([1, 2]), t([1, 1]), given=t([1, 2, 3]))
    with pytest.raises(TypeError, match=r"counts\.dtype=torch\.float32"):
        index.upsert_unique(t([1, 2]), torch.ones(2))
    assert index.size() == 0
