"""The compiled insert (``insert.cpp``, docs/design/0043) against the sequence it replaces: a
find_or_insert under one clock value run once through it and once through the sorted path (the
missing keys sorted and de-duplicated, ``_place_free``, one free-list allocation a round,
``rows_of_new``), on both backends. Results, slots, row ids, scores, free list and counters must
be bitwise the same, on random and adversarial keys (one bucket, 0 / -1 / int64 extremes,
repeats), with reused row ids, keys left for the cuckoo moves and eviction, and unpacked slots."""

from __future__ import annotations

import pytest
import torch
from test_kernel_parity import SPECIAL, assert_same_index, assert_same_result, random_keys, same_bucket_keys, t

from dynemb.kernels import uses_native
from dynemb.kernels.dedup import dedup_torch
from dynemb.table.index import KeyIndex
from dynemb.table.placement import BatchPlacement

pytestmark = pytest.mark.skipif(not uses_native("native", "cpu"), reason="compiled kernels could not be built")


class Counting:
    """Counts the compiled insert's calls by what they left: every key placed by its rounds,
    some left, refused; and of the calls that left some, those whose rest passes (in the same
    call, where the index cannot grow) placed them all, and those that left keys pending for
    the caller to go on from."""

    def __init__(self, monkeypatch):
        self.placed_all = self.left_some = self.refused = self.rest_placed = self.rest_pending = 0
        original = BatchPlacement._insert_new_native

        def counted(index, *args):
            got = original(index, *args)
            if got is None:
                self.refused += 1
            elif got.left is not None:
                self.left_some += 1
                if got.rest is not None:
                    self.rest_placed += got.rest.code == 0
                    self.rest_pending += got.rest.code != 0
            else:
                self.placed_all += 1
            return got

        monkeypatch.setattr(BatchPlacement, "_insert_new_native", counted)


def sorted_path(monkeypatch, index: KeyIndex) -> None:
    """``index`` never takes the compiled insert (its calls go the sorted way)."""
    monkeypatch.setattr(index, "_places_without_growth", lambda m, new_seg: False)


def drive(monkeypatch, make, batches, *, erase_every: int = 2, now0: int = 1):
    """The same find_or_insert calls on three indexes: native through the compiled insert, native
    the sorted way, torch; equal after every call. Returns the call counts of the insert."""
    counting = Counting(monkeypatch)
    fast, native_sorted, torch_index = make("native"), make("native"), make("torch")
    sorted_path(monkeypatch, native_sorted)
    for step, keys in enumerate(batches):
        results = [index.find_or_insert(keys, now=now0 + step) for index in (fast, native_sorted, torch_index)]
        for other, index in zip(results[1:], (native_sorted, torch_index)):
            assert_same_result(results[0], other)
            assert_same_index(fast, index)
        if step % erase_every == erase_every - 1:
            # Released row ids go back on the free list: the next calls reuse them.
            gone = keys[::3]
            for index in (fast, native_sorted, torch_index):
                index.erase(gone)
    return counting


@pytest.mark.parametrize("segmented", [False, True])
def test_upsert_unique_of_training_lookups(monkeypatch, segmented):
    # The training path: distinct keys (a collection's tables as segments), one clock value a
    # step; keys left to the moves, displacement and eviction once the segments fill.
    g = torch.Generator().manual_seed(15)
    if segmented:
        make = lambda b: KeyIndex(capacities=[256, 1024, 64], bucket_capacity=8, backend=b)
    else:
        make = lambda b: KeyIndex(capacity=1024, bucket_capacity=8, backend=b)
    counting = Counting(monkeypatch)
    fast, native_sorted, torch_index = make("native"), make("native"), make("torch")
    sorted_path(monkeypatch, native_sorted)
    for step in range(12):
        n = 40 if step < 2 else 700  # small first calls: every key placed; then the segments fill
        keys = torch.randint(0, 3000, (n,), generator=g) * 11 - 5000
        seg = torch.randint(0, 3, (n,), generator=g) if segmented else torch.zeros(n, dtype=torch.int64)
        unique, useg, _, _ = dedup_torch(keys, seg)  # the distinct pairs, by segment, then key
        kw = {"segments": useg} if segmented else {}
        results = [index.upsert_unique(unique, torch.ones_like(unique), now=step + 1, **kw) for index in (fast, native_sorted, torch_index)]
        for other, index in zip(results[1:], (native_sorted, torch_index)):
            assert_same_result(results[0], other)
            assert_same_index(fast, index)
        if step % 3 == 2:
            for index in (fast, native_sorted, torch_index):
                index.erase(unique[::4], **({"segments": useg[::4]} if segmented else {}))
    assert counting.placed_all > 0 and counting.left_some > 0 and counting.rest_pending > 0


def test_random_keys_with_repeats_and_reused_row_ids(monkeypatch):
    g = torch.Generator().manual_seed(11)
    batches = [torch.randint(-(10**6), 10**6, (6000,), generator=g) * 7 for _ in range(8)]
    counting = drive(monkeypatch, lambda b: KeyIndex(capacity=1 << 14, backend=b), batches)
    assert counting.placed_all > 0


def test_nearly_full_index_leaves_keys_to_moves_and_eviction(monkeypatch):
    # 4,096 slots offered ~20k distinct keys: the later calls leave keys to the cuckoo moves,
    # displacement and eviction after the compiled insert's rounds.
    g = torch.Generator().manual_seed(12)
    batches = [torch.randint(0, 40_000, (n,), generator=g) for n in [600, 600] + [3000] * 8]
    counting = drive(monkeypatch, lambda b: KeyIndex(capacity=4096, bucket_capacity=8, backend=b), batches, erase_every=4)
    assert counting.placed_all > 0 and counting.left_some > 0
    # The rest passes in the insert's call: every left key placed there, and keys left pending
    # for the caller's displacement and eviction to go on from.
    assert counting.rest_placed > 0 and counting.rest_pending > 0


@pytest.mark.parametrize("strategy", ["step", "no_eviction"])
def test_one_crowded_bucket(monkeypatch, strategy):
    # Every key's two candidates are bucket 0: halving rounds, then failures or eviction.
    keys = t(same_bucket_keys(16, 40))
    batches = [keys[:3], torch.cat([keys[3:9], keys[3:9]]), keys[5:30], keys.flip(0), keys]
    make = lambda b: KeyIndex(capacity=64, bucket_capacity=4, score_strategy=strategy, backend=b)
    counting = drive(monkeypatch, make, batches, erase_every=3)
    assert counting.placed_all > 0 and counting.left_some > 0


def test_many_keys_crowding_one_bucket(monkeypatch):
    # Hundreds of new keys (and repeats) choosing one bucket in a round: the kernel orders such
    # a bucket's keys through a sorted permutation rather than by insertion.
    keys = t(same_bucket_keys(4, 600))
    batches = [keys[:300], torch.cat([keys[200:600], keys[250:400]]).flip(0), keys]
    make = lambda b: KeyIndex(capacity=64, bucket_capacity=16, score_strategy="step", backend=b)
    counting = drive(monkeypatch, make, batches, erase_every=2)
    assert counting.left_some > 0


def test_extreme_keys_and_repeats(monkeypatch):
    batches = [t(SPECIAL), t(SPECIAL * 4 + [5] * 50), torch.cat([t(SPECIAL), random_keys(500, 3)]), random_keys(500, 3).repeat(3)]
    drive(monkeypatch, lambda b: KeyIndex(capacity=4096, bucket_capacity=16, backend=b), batches)


@pytest.mark.parametrize("W", [5, 20, 64, 80])
def test_bucket_widths(monkeypatch, W):
    """Below 16 slots, 16 and a tail, 64 (one bit mask of free slots) and 80 (slot by slot)."""
    g = torch.Generator().manual_seed(W)
    batches = [torch.randint(0, 40 * W, (10 * W,), generator=g) for _ in range(6)]
    drive(monkeypatch, lambda b: KeyIndex(capacity=32 * W, bucket_capacity=W, backend=b), batches)


def test_unpacked_slots_after_scores_widen(monkeypatch):
    # A clock past int32 widens the stored scores: the slots are unpacked from then on.
    g = torch.Generator().manual_seed(13)
    batches = [torch.randint(0, 20_000, (4000,), generator=g) for _ in range(4)]
    counting = drive(monkeypatch, lambda b: KeyIndex(capacity=1 << 13, backend=b), batches, now0=2**40)
    assert counting.placed_all > 0


def test_growing_index_takes_the_sorted_path_until_it_cannot_grow(monkeypatch):
    # Growth would follow the de-duplicated count: calls that may grow go the sorted way.
    g = torch.Generator().manual_seed(14)
    batches = [torch.randint(0, 3000, (800,), generator=g) for _ in range(8)]
    counting = drive(monkeypatch, lambda b: KeyIndex(capacity=2048, init_capacity=128, bucket_capacity=8, backend=b), batches)
    assert counting.placed_all + counting.left_some > 0


def test_large_batch_uses_both_threads(monkeypatch):
    batches = [random_keys(60_000, 21, low=-(10**9), high=10**9), random_keys(60_000, 22, low=-(10**9), high=10**9)]
    counting = drive(monkeypatch, lambda b: KeyIndex(capacity=1 << 18, backend=b), batches, erase_every=1)
    assert counting.placed_all == 2
