"""Index memory (issue 19 item 2, docs/design/0035): at most 20 bytes a key at the default
maximum load factor; int32 row ids below 2**31 slots; int32 scores, widened to int64 exactly
when a score does not fit; the int64 API, state and checkpoints unchanged."""

from __future__ import annotations

import pytest
import torch

from dynemb import DynamicEmbedding, TableConfig
from dynemb.table.geometry import bytes_per_slot, index_bytes, row_dtype
from dynemb.table.index import KeyIndex

INT32_MAX = (1 << 31) - 1
INT64_MAX = (1 << 63) - 1
INT64_MIN = -(1 << 63)


def t(values):
    return torch.tensor(values, dtype=torch.int64)


def _kept_bytes(index: KeyIndex) -> int:
    # Every tensor of the index's size in slots (the workspace and free list aside).
    kept = [index._keys, index._tags, index._rows, index._scores]
    return sum(x.numel() * x.element_size() for x in kept)


def test_at_most_20_bytes_a_key_at_the_default_maximum_load_factor():
    # 1280 slots (80 buckets of 16): 0.85 of them is a whole number of keys, 1088.
    index = KeyIndex(capacity=1280)
    assert index.max_load_factor == TableConfig(embedding_dim=4, capacity=8).max_load_factor == 0.85
    assert index.index_bytes_per_slot() == 17 == bytes_per_slot(1280)
    # Filled to the maximum load factor, the tensors cost at most 20 bytes per key held.
    n = 1088
    index.find_or_insert(torch.arange(n) * 7919, now=1)
    assert index.size() == n and index.current_capacity() == 1280 and index.load_factor() == pytest.approx(0.85)
    assert _kept_bytes(index) == index.stats()["index_bytes"] == 17 * 1280
    assert _kept_bytes(index) <= 20 * n
    assert index.stats()["index_bytes_per_key"] == pytest.approx(17 / 0.85) and 17 / 0.85 <= 20 + 1e-9


def test_row_ids_int32_below_2_31_slots_and_int64_beyond():
    assert row_dtype(1 << 31) is torch.int32 and row_dtype((1 << 31) + 1) is torch.int64
    assert index_bytes(1 << 20) == 17 << 20 and index_bytes(16, capacity=1 << 32) == 21 * 16
    index = KeyIndex(capacity=1 << 10)
    assert index._rows.dtype is torch.int32
    # A huge capacity allocated small: row ids may reach 2**40, so they are int64 from the start.
    big = KeyIndex(capacity=1 << 40, init_capacity=1 << 8)
    assert big._rows.dtype is torch.int64 and big.index_bytes_per_slot() == 21
    assert big.stats()["index_bytes"] == _kept_bytes(big) == 21 * big.current_capacity()
    r = big.find_or_insert(t([5, 6, 7]), now=0)
    assert r.rows.dtype is torch.int64 and sorted(r.rows.tolist()) == [0, 1, 2]


def test_api_stays_int64():
    index = KeyIndex(capacity=64, score_strategy="customized")
    r = index.find_or_insert(t([1, 2, 3]), scores=t([10, 20, 30]))
    assert r.rows.dtype is torch.int64 and r.evicted_scores.dtype is torch.int64
    rows, found = index.find(t([1, 2, 4]))
    assert rows.dtype is torch.int64 and rows.tolist()[2] == -1 and found.tolist() == [True, True, False]
    scores, _ = index.scores(t([1, 2, 3]))
    assert scores.dtype is torch.int64 and scores.tolist() == [10, 20, 30]
    assert all(v.dtype is torch.int64 for v in index.state_dict().values())
    for keys, rows, scores in index.export():
        assert keys.dtype is rows.dtype is scores.dtype is torch.int64
    erased = index.erase(t([2]))
    assert erased.evicted_rows.dtype is erased.evicted_scores.dtype is torch.int64 and erased.evicted_scores.tolist() == [20]


@pytest.mark.parametrize("score", [INT32_MAX + 1, -(1 << 31) - 1, INT64_MAX, INT64_MIN, 1_700_000_000_000_000_000])
def test_scores_beyond_int32_widen_exactly(score):
    index = KeyIndex(capacity=64, score_strategy="customized")
    index.find_or_insert(t([1, 2]), scores=t([5, -5]))
    assert index._scores.dtype is torch.int32 and index.stats()["index_bytes"] == 17 * 64
    index.find_or_insert(t([3]), scores=t([score]))
    # Widened for good, every score kept exactly; the memory figure says so.
    assert index._scores.dtype is torch.int64 and index.stats()["index_bytes"] == 21 * 64
    assert index.scores(t([1, 2, 3]))[0].tolist() == [5, -5, score]
    assert index.state_dict()["scores"].dtype is torch.int64
    # The state loads into a fresh index, widened as needed; without the large score it is int32 again.
    twin = KeyIndex(capacity=64, score_strategy="customized")
    twin.load_state_dict(index.state_dict())
    assert twin._scores.dtype is torch.int64 and twin.scores(t([3]))[0].tolist() == [score]
    index.erase(t([3]))
    narrow = KeyIndex(capacity=64, score_strategy="customized")
    narrow.load_state_dict(index.state_dict())
    assert narrow._scores.dtype is torch.int32 and narrow.scores(t([1, 2]))[0].tolist() == [5, -5]


def test_timestamp_clock_in_nanoseconds_widens_and_evicts_by_it():
    index = KeyIndex(capacity=16, bucket_capacity=16)
    base = 1_700_000_000_000_000_000
    index.find_or_insert(torch.arange(16), now=base)
    assert index._scores.dtype is torch.int64
    index.find_or_insert(torch.arange(8), now=base + 1)
    r = index.find_or_insert(t([100]), now=base + 2)
    # The least recently used key (one of 8..15, at `base`) is evicted, its int64 score reported.
    assert r.evicted_keys.numel() == 1 and 8 <= r.evicted_keys.item() < 16 and r.evicted_scores.tolist() == [base]


def test_lfu_saturates_at_the_int64_maximum_after_widening():
    index = KeyIndex(capacity=64, score_strategy="lfu")
    index.find_or_insert(t([1, 1, 2]))
    assert index._scores.dtype is torch.int32 and index.scores(t([1, 2]))[0].tolist() == [2, 1]
    index.find_or_insert(t([2]), scores=t([INT32_MAX]))
    assert index._scores.dtype is torch.int32
    # Counting past the int32 maximum widens first: no wrap.
    index.find_or_insert(t([2, 2]))
    assert index._scores.dtype is torch.int64 and index.scores(t([2]))[0].tolist() == [INT32_MAX + 2]
    index.find_or_insert(t([2]), scores=t([INT64_MAX - 1]))
    index.find_or_insert(t([2, 2, 2]))
    assert index.scores(t([2]))[0].tolist() == [INT64_MAX]


def test_growth_and_eviction_keep_compact_dtypes():
    index = KeyIndex(capacity=1 << 10, init_capacity=64, score_strategy="step")
    for step in range(6):
        index.find_or_insert(torch.arange(300) + 250 * step, now=step)
    assert index.stats()["growths"] > 0 and index.stats()["evictions"] > 0
    assert index._rows.dtype is index._scores.dtype is torch.int32
    assert index.stats()["index_bytes"] == _kept_bytes(index) == 17 * index.current_capacity()


def test_module_stats_report_the_figure():
    table = DynamicEmbedding(4, 256, score_strategy="step")
    table(torch.arange(100))
    stats = table.stats()
    figures = stats if "index_bytes" in stats else next(iter(stats.values()))
    assert figures["index_bytes"] == 17 * figures["current_capacity"]
    assert figures["index_bytes_per_key"] == pytest.approx(20.0)


# Packed slots (docs/design/0041): key, row id and score of a narrow slot in one 16-byte record.


def _shares_storage(*tensors: torch.Tensor) -> bool:
    return len({x.untyped_storage().data_ptr() for x in tensors}) == 1


def test_narrow_slots_are_packed_and_widening_unpacks_them():
    index = KeyIndex(capacity=64, bucket_capacity=16, score_strategy="customized")
    W = index.bucket_capacity
    # One [B, W, 2] int64 tensor: the keys every second word, row id and score in the other.
    assert _shares_storage(index._keys, index._rows, index._scores)
    assert index._keys.stride() == (2 * W, 2) and index._rows.stride() == index._scores.stride() == (4 * W, 4)
    assert index._keys.untyped_storage().nbytes() == 16 * index.current_capacity()
    r = index.find_or_insert(t([1, 2, 3]), scores=t([7, 8, 9]))
    # Each key's record: its key, then its row id and score as two int32 words.
    words = index._keys.untyped_storage()
    record = torch.tensor([], dtype=torch.int32).set_(words).view(-1, 4)
    at = r.positions.tolist()
    assert record[at, 2].tolist() == r.rows.tolist() and record[at, 3].tolist() == [7, 8, 9]
    assert torch.tensor([], dtype=torch.int64).set_(words).view(-1, 2)[at, 0].tolist() == [1, 2, 3]
    before = index.find(t([1, 2, 3]))[0]
    # A score beyond int32: four tensors of their own, nothing lost.
    index.find_or_insert(t([4]), scores=t([INT64_MAX]))
    assert not _shares_storage(index._keys, index._scores) and all(x.is_contiguous() for x in (index._keys, index._rows, index._scores))
    assert torch.equal(index.find(t([1, 2, 3]))[0], before) and index.scores(t([1, 2, 3, 4]))[0].tolist() == [7, 8, 9, INT64_MAX]


def test_int64_row_ids_are_never_packed():
    index = KeyIndex(capacity=1 << 32, init_capacity=64)
    assert index._rows.dtype is torch.int64 and index._keys.is_contiguous() and not _shares_storage(index._keys, index._rows)
    r = index.find_or_insert(t([5, 6]), now=1)
    assert index.find(t([6, 5]))[0].tolist() == r.rows.flip(0).tolist()


def test_kernels_reject_unevenly_spaced_tables():
    from dynemb.kernels import slot_step

    assert slot_step(torch.zeros(4, 16, 2, dtype=torch.int64)[..., 0]) == 2
    with pytest.raises(ValueError, match=r"shape \(4, 8\) and strides \(16, 1\)"):
        slot_step(torch.zeros(4, 16)[:, :8])


def test_huge_pages_zeros_is_zeros_on_any_size():
    from dynemb.workspace import huge_pages_zeros

    for shape in [(3,), (1 << 20, 5)]:  # below and above the 4 MiB from which pages are advised
        z = huge_pages_zeros(shape, dtype=torch.int32, device=torch.device("cpu"))
        assert z.shape == shape and z.dtype is torch.int32 and not z.any()
