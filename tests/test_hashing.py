"""The 64-bit mixer and the bits each use takes from it: mix64, bucket_of, candidate_buckets, rank_of."""

from __future__ import annotations

import pytest
import torch

from dynemb.hashing import bucket_of, candidate_buckets, mix64, rank_of

_U64 = (1 << 64) - 1
INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1
SPECIAL_KEYS = [0, -1, INT64_MIN, INT64_MAX]


def _splitmix64_finaliser(x: int) -> int:
    """Reference on Python ints (unsigned 64-bit)."""
    x &= _U64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _U64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _U64
    return x ^ (x >> 31)


def _unshift(x: int, s: int) -> int:
    """Inverse of x ^= x >> s on 64 bits."""
    y = x
    for _ in range(64 // s + 1):
        y = x ^ (y >> s)
    return y


def _inverse(x: int) -> int:
    """Inverse of the finaliser (Python ints)."""
    x = _unshift(x, 31)
    x = (x * pow(0x94D049BB133111EB, -1, 1 << 64)) & _U64
    x = _unshift(x, 27)
    x = (x * pow(0xBF58476D1CE4E5B9, -1, 1 << 64)) & _U64
    return _unshift(x, 30)


def _signed(x: int) -> int:
    return x - (1 << 64) if x >> 63 else x


def _sample_keys(n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    random = torch.randint(INT64_MIN, INT64_MAX, (n,), generator=gen, dtype=torch.int64)
    return torch.cat([torch.tensor(SPECIAL_KEYS + [1, -2, INT64_MIN + 1, INT64_MAX - 1]), random])


def test_mix64_matches_reference_and_inverts():
    keys = _sample_keys(2000)
    mixed = mix64(keys)
    expected = [_signed(_splitmix64_finaliser(k)) for k in keys.tolist()]
    assert torch.equal(mixed, torch.tensor(expected, dtype=torch.int64))
    assert [_signed(_inverse(m & _U64)) for m in mixed.tolist()] == keys.tolist()


def test_mix64_no_collisions_on_a_million_keys():
    # Consecutive keys (the usual id layout) and random ones, 1e6 distinct keys in all.
    consecutive = torch.arange(-250_000, 250_000, dtype=torch.int64)
    random = _sample_keys(600_000, seed=1).unique()
    keys = torch.cat([consecutive, random]).unique()[:1_000_000]
    assert keys.numel() == 1_000_000
    assert mix64(keys).unique().numel() == 1_000_000


def test_mix64_keeps_shape():
    keys = torch.arange(12, dtype=torch.int64).view(3, 4)
    assert torch.equal(mix64(keys), mix64(keys.reshape(-1)).view(3, 4))


NUM_BUCKETS = [1, 2, 3, 7, 64, 1000, (1 << 20) + 3, (1 << 31) - 1]


@pytest.mark.parametrize("num_buckets", NUM_BUCKETS)
def test_bucket_of_range(num_buckets):
    mixed = mix64(_sample_keys(20_000))
    buckets = bucket_of(mixed, num_buckets)
    assert buckets.dtype == torch.int64
    assert int(buckets.min()) >= 0 and int(buckets.max()) < num_buckets
    if num_buckets <= 1000:
        assert buckets.unique().numel() == num_buckets
    b1, b2 = candidate_buckets(_sample_keys(20_000), num_buckets)
    assert torch.equal(b1, buckets)
    assert int(b2.min()) >= 0 and int(b2.max()) < num_buckets


@pytest.mark.parametrize("world_size", [1, 2, 3, 8, 1000, (1 << 31) - 1])
def test_rank_of_range(world_size):
    ranks = rank_of(mix64(_sample_keys(20_000)), world_size)
    assert ranks.dtype == torch.int64
    assert int(ranks.min()) >= 0 and int(ranks.max()) < world_size
    if world_size <= 1000:
        assert ranks.unique().numel() == world_size


@pytest.mark.parametrize("num_buckets", [1, 3, 7, 64, 1000, (1 << 20) + 3, 1 << 30])
def test_doubling_splits_each_bucket_in_two(num_buckets):
    keys = _sample_keys(20_000)
    old, new = bucket_of(mix64(keys), num_buckets), bucket_of(mix64(keys), 2 * num_buckets)
    assert torch.equal(torch.div(new, 2, rounding_mode="floor"), old)
    for old_b, new_b in zip(candidate_buckets(keys, num_buckets), candidate_buckets(keys, 2 * num_buckets)):
        assert torch.equal(torch.div(new_b, 2, rounding_mode="floor"), old_b)


def test_rank_and_buckets_use_independent_bits():
    # With R ranks and B buckets sharing bits, a rank would see only some buckets. Every
    # (rank, bucket 1, bucket 2) cell must get its share: 200k keys over 64 cells, ~3125 each.
    keys = _sample_keys(200_000, seed=2)
    mixed = mix64(keys)
    R, B = 4, 4
    b1, b2 = candidate_buckets(keys, B)
    cell = (rank_of(mixed, R) * B + b1) * B + b2
    counts = torch.bincount(cell, minlength=R * B * B).double()
    expected = keys.numel() / (R * B * B)
    # 6 standard deviations of a binomial count.
    assert float((counts - expected).abs().max()) < 6 * expected**0.5
