"""The compiled eviction (``evict.cpp``: one pass in priority order, docs/design/0044) against
its plain-torch twin ``BatchPlacement._evict_for`` (rounds): the same slots, victims, report
order and table, bitwise, on full indexes where the keys contend for few buckets over many
rounds, fail on scores or locks, crowd one bucket, or come few to a large table."""

from __future__ import annotations

import pytest
import torch
from test_kernel_parity import INT64_MAX, SPECIAL, assert_same_index, native_available, random_keys, same_bucket_keys

from dynemb.table.index import KeyIndex

pytestmark = pytest.mark.skipif(not native_available(), reason="compiled kernels could not be built")


def full_pair(seed: int, **options) -> list[KeyIndex]:
    """A torch and a native index with the same slots, every slot used (so new keys must evict);
    scores from 1 to 40 (clock values, or customized scores)."""
    pair = [KeyIndex(backend=b, **options) for b in ("torch", "native")]
    g = torch.Generator().manual_seed(seed)
    segs = len(options.get("capacities", [0]))
    step = 0
    while any(index.size() < index.capacity() for index in pair) and step < 400:
        step += 1
        keys = random_keys(max(64, pair[0].capacity() // 8), seed * 1000 + step)
        kw = {"segments": torch.randint(0, segs, (keys.numel(),), generator=g)} if segs > 1 else {}
        if pair[0].strategy.value == "customized":
            kw["scores"] = torch.randint(1, 40, (keys.numel(),), generator=g)
        elif pair[0].strategy.value != "lfu":
            kw["now"] = 1 + step % 40
        for index in pair:
            index.find_or_insert(keys, **kw)
    assert_same_index(*pair)
    assert pair[0].size() == pair[0].capacity()
    return pair


def evict_both(pair, keys, scores, locked, seg=None) -> tuple:
    """``_evict_for`` on both indexes: every output and the whole index alike; the native one's outputs."""
    results = [index._evict_for(keys, scores, locked, seg) for index in pair]
    for x, y in zip(*results):
        assert x.dtype == y.dtype and torch.equal(x, y), (x, y)
    assert_same_index(*pair)
    return results[1]


@pytest.mark.parametrize("strategy", ["timestamp", "customized", "lfu"])
@pytest.mark.parametrize("n", [3, 300, 2000])
def test_contending_keys_evict_alike(strategy, n):
    # 64 buckets of 8: n = 300 or 2000 keys contend over many rounds (n = 3 takes the kernel's
    # hash map of buckets: 64 buckets is more than 16 n).
    pair = full_pair(n, capacity=512, bucket_capacity=8, score_strategy=strategy)
    g = torch.Generator().manual_seed(n)
    keys = random_keys(n, 77 + n)
    # Scores around the table's (1..40): under timestamp / customized, keys under their victims'
    # scores fail, some only after earlier keys took the slots they could evict.
    scores = torch.randint(0, 45, (n,), generator=g)
    locked = torch.randperm(512, generator=g)[: 512 // 5]
    pos, _, _, _, taken = evict_both(pair, keys, scores, locked)
    assert taken.numel() == int((pos >= 0).sum())
    if n > 3 and strategy != "lfu":
        assert 0 < taken.numel() < n


def test_few_keys_on_a_large_table_evict_alike():
    # 4096 buckets for 40 keys: the kernel's hash map of local buckets.
    pair = full_pair(5, capacity=1 << 15, bucket_capacity=8)
    keys = torch.cat([random_keys(30, 9), torch.tensor(SPECIAL)])
    scores = torch.full((keys.numel(),), 41)
    pos, *_ = evict_both(pair, keys, scores, torch.tensor([0, 7, 100, 1 << 14]))
    assert bool((pos >= 0).all())


def test_keys_crowding_one_bucket_evict_alike():
    # Both candidates are bucket 0: the keys take its slots lowest score first, one a round,
    # until none is left that they may evict.
    pair = full_pair(6, capacity=64, bucket_capacity=4, score_strategy="customized")
    present = set(pair[0]._keys.view(-1).tolist())
    keys = torch.tensor([k for k in same_bucket_keys(16, 40) if k not in present][:12])
    scores = torch.arange(12) * 4
    pos, *_ = evict_both(pair, keys, scores, torch.tensor([1]))
    assert int((pos >= 0).sum()) <= 3  # bucket 0's four slots, one locked


def test_locked_buckets_fail_and_segments_evict_alike():
    pair = full_pair(7, capacities=[96, 400], bucket_capacity=4, score_strategy="lfu")
    keys = random_keys(500, 11)
    seg = torch.randint(0, 2, (500,), generator=torch.Generator().manual_seed(3))
    # Every slot of the first segment locked: its keys all fail.
    locked = torch.arange(96)
    pos, _, _, scores, taken = evict_both(pair, keys, torch.zeros(500, dtype=torch.int64), locked, seg)
    assert bool((pos[seg == 0] == -1).all()) and bool((pos[seg == 1] >= 0).any())
    assert scores.numel() == taken.numel()


def test_extreme_scores_evict_alike():
    pair = full_pair(8, capacity=256, bucket_capacity=8, score_strategy="customized")
    keys = random_keys(200, 12)
    scores = torch.tensor([INT64_MAX, 0, -(2**63)] * 66 + [5, 39])
    evict_both(pair, keys, scores, torch.empty(0, dtype=torch.int64))


def test_empty_candidate_slots_are_never_victims():
    # Slots emptied under both indexes (tag 0): the keys pass over them, as the twin's mask does.
    pair = full_pair(9, capacity=512, bucket_capacity=8, score_strategy="customized")
    emptied = torch.randperm(512, generator=torch.Generator().manual_seed(4))[:60]
    for index in pair:
        index._tags.view(-1)[emptied] = 0
    pos, *_ = evict_both(pair, random_keys(400, 13), torch.full((400,), 50), torch.empty(0, dtype=torch.int64))
    assert not bool(torch.isin(pos, emptied).any())


def test_widened_scores_evict_alike():
    # int64 scores (one key per slot, unpacked): keys and victims scored past int32.
    pair = full_pair(10, capacity=512, bucket_capacity=8, score_strategy="customized")
    g = torch.Generator().manual_seed(5)
    for index in pair:
        index._widen_scores()
    assert pair[1]._scores.dtype == torch.int64
    # Residents scored past int32 too (they evicted their way in on both backends alike).
    big = torch.randint(2**33, 2**34, (200,), generator=g)
    for index in pair:
        index.find_or_insert(random_keys(200, 16), scores=big)
    assert_same_index(*pair)
    scores = torch.randint(2**33 - 2**20, 2**34, (300,), generator=g)
    scores[::3] = 2**40 + 7
    evict_both(pair, random_keys(300, 14), scores, torch.arange(0, 512, 9))


def test_many_keys_on_both_threads_evict_alike():
    # 6,000 keys over 4,096 buckets: the kernel's parallel candidate pass and bucket sort.
    pair = full_pair(11, capacity=1 << 15, bucket_capacity=8)
    g = torch.Generator().manual_seed(6)
    pos, *_ = evict_both(pair, random_keys(6000, 15), torch.randint(0, 45, (6000,), generator=g), torch.randperm(1 << 15, generator=g)[:3000])
    assert 0 < int((pos >= 0).sum()) < 6000
