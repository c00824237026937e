"""Every compiled kernel against its plain-torch twin: integers bitwise, on random and
adversarial keys (one bucket, 0 / -1 / int64 extremes, duplicates), and whole indexes driven
through the same calls on both backends, compared slot by slot."""

from __future__ import annotations

import pytest
import torch

from dynemb.hashing import candidate_buckets, tag_of
from dynemb.kernels import uses_native
from dynemb.kernels.dedup import dedup, dedup_native, dedup_torch, sort_unique_first_native, sort_unique_first_torch, sort_unique_native
from dynemb.kernels.locate import locate_native, locate_torch
from dynemb.table.index import KeyIndex
from dynemb.workspace import Workspace

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
SPECIAL = [0, -1, INT64_MIN, INT64_MAX, 1, INT64_MIN + 1, INT64_MAX - 1]
STRATEGIES = ["timestamp", "step", "lfu", "customized", "no_eviction"]


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def random_keys(n: int, seed: int, *, low: int = INT64_MIN, high: int = INT64_MAX) -> torch.Tensor:
    return torch.randint(low, high, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.int64)


def same_bucket_keys(num_buckets: int, n: int) -> list[int]:
    """n keys whose two candidate buckets are both bucket 0 (so they crowd one bucket)."""
    found, start = [], 1
    while len(found) < n:
        batch = torch.arange(start, start + (1 << 16), dtype=torch.int64)
        b1, b2 = candidate_buckets(batch, num_buckets)
        found += batch[(b1 == 0) & (b2 == 0)].tolist()
        start += 1 << 16
    return found[:n]


def key_batches() -> list[torch.Tensor]:
    zipf = (torch.distributions.Pareto(1.0, 1.05).sample((5000,)).long() * 7919) % 100_003
    return [
        t([]),
        t([42]),
        t(SPECIAL),
        t(SPECIAL * 3),
        t([5] * 100),
        random_keys(3000, 1),
        torch.cat([random_keys(2000, 2), random_keys(2000, 2)[::3]]),
        zipf,
        torch.arange(-500, 500),
    ]


def assert_same(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if x is None or y is None:
            assert x is None and y is None
        else:
            assert x.dtype == y.dtype and torch.equal(x, y), (x, y)


def native_available() -> bool:
    return uses_native("native", "cpu")


pytestmark = pytest.mark.skipif(not native_available(), reason="compiled kernels could not be built")


@pytest.mark.parametrize("case", range(len(key_batches())))
def test_dedup_matches_torch_unique(case):
    keys = key_batches()[case]
    unique, useg, inverse, counts, order = dedup_native(keys, grouping=True, workspace=Workspace("cpu"))
    assert_same((unique, useg, inverse, counts), dedup_torch(keys))
    # The grouping is the stable sort of the inputs by key.
    assert torch.equal(order, torch.sort(inverse, stable=True).indices)
    starts = counts.cumsum(0) - counts
    assert_same(dedup(keys, native=True, grouping=True)[4], (order, starts))


@pytest.mark.parametrize("case", range(len(key_batches())))
def test_dedup_with_segments_matches_unique_pairs(case):
    keys = key_batches()[case]
    seg = torch.randint(0, 4, (keys.numel(),), generator=torch.Generator().manual_seed(case))
    got = dedup_native(keys, seg, grouping=True)
    assert_same(got[:4], dedup_torch(keys, seg))
    assert torch.equal(got[4], torch.sort(got[2], stable=True).indices)


def test_dedup_takes_non_contiguous_keys():
    keys = random_keys(1000, 3)[::2]
    assert_same(dedup_native(keys)[:4], dedup_torch(keys))


def filled_index(backend: str, keys: torch.Tensor, **kwargs) -> KeyIndex:
    index = KeyIndex(backend=backend, **kwargs)
    index.find_or_insert(keys, now=1)
    return index


@pytest.mark.parametrize("case", ["random", "special", "one_bucket"])
def test_locate_matches_torch(case):
    if case == "one_bucket":
        held = t(same_bucket_keys(8, 4))
        probe = torch.cat([held, t(same_bucket_keys(8, 12)), t(SPECIAL)])
        kwargs = {"capacity": 32, "bucket_capacity": 4}
    else:
        held = random_keys(3000, 4) if case == "random" else t(SPECIAL)
        probe = torch.cat([held, random_keys(1000, 5), t(SPECIAL), held[:10]])
        kwargs = {"capacity": 1 << 13}
    index = filled_index("torch", held, **kwargs)
    b1, b2 = index.candidate_buckets(probe)
    want = locate_torch(index._keys, index._tags, b1, b2, probe, Workspace("cpu"))
    pos, found, rows = locate_native(index._keys, index._tags, index._segments, probe, None, index._rows)
    assert_same((pos, found), want)
    assert torch.equal(rows, index.find(probe)[0])
    assert int(found.sum()) == torch.isin(probe, held).sum()


def same_tag_keys(n: int, start: int = 1) -> list[int]:
    """The first n keys >= start whose tag equals key start's."""
    ks = torch.arange(start, start + 400 * n)
    return ks[tag_of(ks) == tag_of(ks[:1])][:n].tolist()


@pytest.mark.parametrize("W", [1, 5, 20, 80])
def test_locate_screens_tag_collisions_like_torch(W):
    """Buckets of W slots (below, between and above the 16-slot screen), keys sharing one tag,
    held and absent, the held ones placed after erasing some of them: the probe's first guess is
    often another key's slot and the full screen decides. Same slots as the plain-torch twin."""
    shared = same_tag_keys(40)
    held = t(shared[::2] + list(range(10_000, 10_000 + 3 * W)))
    probe = torch.cat([t(shared), held, t(SPECIAL)])
    for backend in ("torch", "native"):
        index = KeyIndex(capacity=8 * W, bucket_capacity=W, backend=backend)
        index.find_or_insert(held, now=1)
        index.erase(held[::3])
        index.find_or_insert(held[::3], now=2)
        b1, b2 = index.candidate_buckets(probe)
        want = locate_torch(index._keys, index._tags, b1, b2, probe, Workspace("cpu"))
        pos, found, rows = locate_native(index._keys, index._tags, index._segments, probe, None, index._rows)
        assert_same((pos, found), want)
        assert torch.equal(rows, index.find(probe)[0])


def test_locate_with_segments_matches_torch():
    index = KeyIndex(capacities=[64, 200, 1000], init_capacities=[16, None, 64], bucket_capacity=8, backend="torch")
    keys = torch.cat([t(SPECIAL), random_keys(500, 6)])
    seg = torch.randint(0, 3, (keys.numel(),), generator=torch.Generator().manual_seed(6))
    index.find_or_insert(keys, now=3, segments=seg)
    probe_seg = torch.cat([seg, (seg + 1) % 3])
    probe = torch.cat([keys, keys])
    b1, b2 = index.candidate_buckets(probe, probe_seg)
    want = locate_torch(index._keys, index._tags, b1, b2, probe, Workspace("cpu"))
    assert_same(locate_native(index._keys, index._tags, index._segments, probe, probe_seg)[:2], want)


def index_state(index: KeyIndex) -> list[torch.Tensor]:
    return [index._keys, index._tags, index._rows, index._scores, index.free_list.state()["free"]]


def assert_same_index(a: KeyIndex, b: KeyIndex) -> None:
    assert a.size() == b.size() and a.num_buckets == b.num_buckets and a.counters() == b.counters()
    # Each segment's counters and sizes (the native placement counts its segments itself).
    assert all(a.counters(s) == b.counters(s) for s in range(a.num_segments))
    assert torch.equal(a.segment_sizes(), b.segment_sizes())
    for x, y in zip(index_state(a), index_state(b)):
        assert x.dtype == y.dtype and torch.equal(x, y)
    assert a.free_list.high_water == b.free_list.high_water and a.free_list.num_free() == b.free_list.num_free()
    # Every used slot holds its key's tag (0 marks an empty slot): what the native probes rely on.
    used = a._tags.view(-1) != 0
    assert torch.equal(a._tags.view(-1)[used], tag_of(a._keys.view(-1)[used]))


def assert_same_result(x, y) -> None:
    for name in (
        "positions",
        "rows",
        "found",
        "inserted",
        "evicted_keys",
        "evicted_rows",
        "evicted_scores",
        "failed_keys",
        "evicted_segments",
        "failed_segments",
    ):
        u, v = getattr(x, name), getattr(y, name)
        assert (u is None) == (v is None), name
        if u is not None:
            assert torch.equal(u, v), name


def drive(strategy: str, make, batches, *, segments: int = 0) -> None:
    """The same calls on a torch and a native index; after each, results and slots equal."""
    pair = [make("torch"), make("native")]
    assert pair[1].native and not pair[0].native
    g = torch.Generator().manual_seed(7)
    for step, keys in enumerate(batches):
        kw = {}
        if segments:
            kw["segments"] = torch.randint(0, segments, (keys.numel(),), generator=g)
        if strategy == "customized":
            kw["scores"] = torch.randint(-5, 5, (keys.numel(),), generator=g)
        elif strategy != "lfu":
            kw["now"] = step + 1
        results = [index.find_or_insert(keys, **kw) for index in pair]
        assert_same_result(*results)
        assert_same_index(*pair)
        if step % 3 == 2:
            gone = keys[::4]
            seg_kw = {"segments": kw["segments"][::4]} if segments else {}
            assert_same_result(*[index.erase(gone, **seg_kw) for index in pair])
            assert_same_index(*pair)
        found = [index.find(keys, **({"segments": kw["segments"]} if segments else {})) for index in pair]
        assert_same(found[0], found[1])


def stream(seed: int, n_batches: int, size: int, key_range: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = [torch.randint(0, key_range, (size,), generator=g) * 1_000_003 - key_range for _ in range(n_batches)]
    out[1] = torch.cat([out[1], t(SPECIAL)])
    return out


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_index_on_both_backends_same_slots_while_growing_and_evicting(strategy):
    # Grows from 64 slots to 512, then evicts (or fails under no_eviction) for the rest.
    batches = stream(1, 14, 150, 2000)
    drive(strategy, lambda backend: KeyIndex(capacity=512, init_capacity=64, bucket_capacity=8, score_strategy=strategy, backend=backend), batches)


@pytest.mark.parametrize("strategy", ["timestamp", "lfu", "customized"])
def test_segmented_index_on_both_backends_same_slots(strategy):
    batches = stream(2, 10, 200, 700)
    drive(
        strategy,
        lambda backend: KeyIndex(capacities=[100, 300, 64], init_capacities=[32, None, 16], bucket_capacity=4, score_strategy=strategy, backend=backend),
        batches,
        segments=3,
    )


@pytest.mark.parametrize("W", [5, 20, 64, 80])
def test_placement_on_both_backends_same_slots_for_bucket_widths(W):
    """Buckets of W slots: below 16, 16 and a tail, 64 (the widest the placement kernel reads as
    one bit mask of free slots) and 80 (its per-slot scan); growing, then evicting."""
    batches = stream(3, 8, 12 * W, 60 * W)
    drive("timestamp", lambda backend: KeyIndex(capacity=32 * W, init_capacity=4 * W, bucket_capacity=W, backend=backend), batches)


def test_crowded_bucket_on_both_backends_same_slots():
    keys = t(same_bucket_keys(16, 40))
    batches = [keys[:5], keys[3:20], keys[10:40], keys[::2], t(SPECIAL), keys]
    drive("step", lambda backend: KeyIndex(capacity=64, bucket_capacity=4, backend=backend), batches)


def test_large_batch_on_both_backends_same_slots():
    batches = [random_keys(20_000, 8, low=-(10**6), high=10**6) for _ in range(3)]
    drive("timestamp", lambda backend: KeyIndex(capacity=1 << 15, init_capacity=1 << 12, backend=backend), batches)


def test_scores_widen_and_saturate_alike_on_both_backends():
    # customized scores past int32 widen the stored scores; lfu counts saturate at int64 max.
    pair = [KeyIndex(capacity=256, bucket_capacity=8, score_strategy="lfu", backend=b) for b in ("torch", "native")]
    keys = torch.arange(40) * 7 - 100
    for index in pair:
        index.find_or_insert(keys[:20], scores=torch.full((20,), 5))
    assert_same_index(*pair)
    big = torch.tensor([INT64_MAX - 1] * 10 + [2**40] * 10)
    results = [index.find_or_insert(keys[10:30], scores=big) for index in pair]
    assert_same_result(*results)
    assert_same_index(*pair)
    assert pair[1]._scores.dtype == torch.int64
    # Found keys add their counts (3 each) under lfu: the keys at INT64_MAX - 1 saturate.
    batch = torch.cat([keys, keys[5:25], keys[:15]])
    results = [index.find_or_insert(batch) for index in pair]
    assert_same_result(*results)
    assert_same_index(*pair)
    assert int(pair[1].scores(keys[10:11])[0]) == INT64_MAX


def test_candidates_match_segments_candidates():
    from dynemb.kernels.locate import candidates_native

    index = KeyIndex(capacities=[64, 200, 1000], bucket_capacity=8, backend="torch")
    keys = torch.cat([t(SPECIAL), random_keys(3000, 9)])
    seg = torch.randint(0, 3, (keys.numel(),), generator=torch.Generator().manual_seed(9))
    for s in (None, seg):
        got = candidates_native(index._segments, keys, s)
        want = index._segments.candidates(keys, s)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("passes", [None, 1])
def test_cuckoo_moves_on_both_backends_same_slots(monkeypatch, passes):
    # A full-size index filled near capacity in small calls: new keys whose buckets are full
    # get room by moving residents (chains of two); the move kernel must run and agree. An
    # index that cannot grow runs the moves and placements after the first pass in one call of
    # the rest kernel; with passes=1 it hands back after every placement and is called again.
    import dynemb.kernels.rest as rest
    import dynemb.table.placement as placement

    calls = {"make_room": 0, "rest": 0}

    def counted(name, real):
        def call(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(placement, "make_room_native", counted("make_room", placement.make_room_native))
    monkeypatch.setattr(placement, "place_rest_native", counted("rest", placement.place_rest_native))
    real_insert = placement.insert_new_native

    def insert(*args, **kwargs):
        # The compiled insert runs the rest's passes itself over the keys it leaves.
        got = real_insert(*args, **kwargs)
        calls["rest"] += got is not None and got.rest is not None
        return got

    monkeypatch.setattr(placement, "insert_new_native", insert)
    if passes is not None:
        monkeypatch.setattr(rest, "MAX_PASSES", passes)
    g = torch.Generator().manual_seed(11)
    batches = [torch.randint(-(10**9), 10**9, (40,), generator=g) for _ in range(30)]
    drive("step", lambda backend: KeyIndex(capacity=1024, bucket_capacity=8, backend=backend), batches)
    assert calls["rest"]
    drive(
        "lfu",
        lambda backend: KeyIndex(capacities=[300, 700], bucket_capacity=4, score_strategy="lfu", backend=backend),
        [torch.randint(-(10**9), 10**9, (60,), generator=g) for _ in range(25)],
        segments=2,
    )
    # While some segment can grow, the Python loop runs, with the move kernel alone: segment 0
    # is at its largest from the start, segment 1 grows.
    calls["make_room"] = 0
    drive(
        "step",
        lambda backend: KeyIndex(capacities=[64, 4096], init_capacities=[64, 256], bucket_capacity=4, backend=backend),
        [torch.randint(-(10**9), 10**9, (80,), generator=g) for _ in range(12)],
        segments=2,
    )
    assert calls["make_room"]


@pytest.mark.parametrize("m", [1, 7, 300, 40_000])
def test_follow_matches_torch(m):
    # Positions through steps of moves: -1, slot 0, huge slots, positions equal to moved slots,
    # a chain (a slot moved in one step moved again in the next) and an empty step.
    from dynemb.kernels.move import follow_all_native, follow_native, follow_torch

    g = torch.Generator().manual_seed(m)
    src = torch.randperm(1 << 20, generator=g)[: 2 * m] * 4096  # distinct, up to ~2^32
    src[0] = 0
    step1, step2 = src[:m], src[m:]
    dst1 = step2[torch.randperm(m, generator=g)]  # every destination of step 1 moves again
    dst2 = torch.randint(0, 1 << 40, (m,), generator=g)
    positions = torch.randint(0, 1 << 32, (70_000,), generator=g)
    positions[::3] = step1[torch.randint(0, m, (positions[::3].numel(),), generator=g)]
    positions[1::5] = step2[torch.randint(0, m, (positions[1::5].numel(),), generator=g)]
    positions[::11] = -1
    positions[7] = 0
    moves = [(step1, dst1), (step1[:0], dst1[:0]), (step2, dst2)]
    want = follow_torch(positions, moves)
    assert torch.equal(follow_native(positions, moves), want)
    assert torch.equal(follow_native(positions[:5], moves), want[:5])  # one thread
    assert (want != positions).sum() > positions.numel() // 3  # the moves reached the positions
    # Two tensors through one hashing of each step, in place (the upsert's found and new slots).
    a, b = positions.clone(), positions[100:].clone()
    got = follow_all_native([a, b], moves, inplace=True)
    assert got[0] is a and got[1] is b
    assert torch.equal(a, want) and torch.equal(b, want[100:])
    strided = positions[::2]  # not contiguous: followed in a copy, the input left as it was
    assert torch.equal(follow_all_native([strided], moves, inplace=True)[0], want[::2])
    assert torch.equal(strided, positions[::2])


@pytest.mark.parametrize("case", ["random", "skewed", "narrow", "extremes"])
def test_sort_dedup_matches_torch_unique_on_large_batches(case):
    # Large enough for both threads, many most-significant-digit buckets and the recursive
    # sort of crowded buckets (a hot key's copies, keys close together).
    n = 200_000
    keys = {
        "random": torch.cat([random_keys(n, 11), random_keys(n, 11)[::7]]),
        "skewed": (torch.distributions.Pareto(1.0, 0.8).sample((n,)).long() * 7919),
        "narrow": random_keys(n, 12, low=-300, high=300),
        "extremes": torch.cat([t([INT64_MIN, INT64_MAX] * 1000), random_keys(n, 13, low=0, high=1 << 20)]),
    }[case]
    unique, _, inverse, counts, order = dedup_native(keys, grouping=True, workspace=Workspace("cpu"))
    assert_same((unique, inverse, counts), torch.unique(keys, sorted=True, return_inverse=True, return_counts=True))
    assert torch.equal(order, torch.sort(inverse, stable=True).indices)
    # Segments label the keys: each distinct key's first input's segment, or None as soon as one
    # key is read through two segments (one mixed run among many, at the start, middle or end).
    starts = counts.cumsum(0) - counts
    label = keys.remainder(3)
    got = sort_unique_native(keys, grouping=True, segments=label)
    assert_same((got[0], got[2], got[3], got[4]), (unique, inverse, counts, order))
    assert torch.equal(got[1], label.index_select(0, order.index_select(0, starts)))
    repeated = order.index_select(0, starts.index_select(0, (counts > 1).nonzero().squeeze(1)))
    for at in (repeated[0], repeated[repeated.numel() // 2], repeated[-1]):
        mixed = label.clone()
        mixed[order[(inverse[at] == inverse[order]).nonzero().squeeze(1)[-1]]] += 1  # the run's last input
        assert sort_unique_native(keys, grouping=True, segments=mixed)[1] is None
    # Each distinct key's first place (an upsert's missing keys, 0040).
    assert_same(sort_unique_first_native(keys, workspace=Workspace("cpu")), sort_unique_first_torch(keys))


@pytest.mark.parametrize("case", range(len(key_batches())))
def test_sort_unique_first_places_match_torch(case):
    keys = key_batches()[case]
    assert_same(sort_unique_first_native(keys), sort_unique_first_torch(keys))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_row_id_gather_and_scatter_match_torch(dtype):
    from dynemb.kernels.rows import put_rows_native, put_rows_torch, rows_at_native, rows_at_torch

    gen = torch.Generator().manual_seed(5)
    table = torch.randint(0, 1 << 30, (4096, 16), generator=gen).to(dtype)
    for n in (0, 7, 50_000):
        pos = torch.randint(-1, table.numel(), (n,), generator=gen)
        assert_same((rows_at_native(table, pos),), (rows_at_torch(table, pos),))
        slots = torch.randperm(table.numel(), generator=gen)[: min(n, table.numel())]
        ids = torch.randint(0, 1 << 30, (slots.numel(),), generator=gen)
        a, b = table.clone(), table.clone()
        put_rows_native(a, slots, ids)
        put_rows_torch(b, slots, ids)
        assert torch.equal(a, b)


def test_new_keys_into_the_result_match_torch():
    """An upsert's new keys' slots and row ids put at their places, from int64 and int32 row-id
    tables and the packed slots' strided row ids: with and without repeated places (spread),
    new keys without a slot (-1), none at all, and enough for both threads."""
    from dynemb.kernels.rows import rows_of_new_native, rows_of_new_torch

    gen = torch.Generator().manual_seed(9)
    packed = KeyIndex(capacity=1 << 16, backend="torch")
    packed.find_or_insert(random_keys(40_000, 3), now=1)
    assert packed._rows.stride(-1) > 1  # the packed slots' view
    tables = [torch.randint(0, 1 << 30, (4096, 16), generator=gen).to(dtype) for dtype in (torch.int64, torch.int32)] + [packed._rows]
    for table in tables:
        for m_new, m in ((0, 0), (5, 5), (300, 900), (30_000, 50_000)):
            new_pos = torch.randint(0, table.numel(), (m_new,), generator=gen)
            new_pos[::7] = -1
            places = torch.randperm(60_000, generator=gen)[:m]
            spread = None if m == m_new else torch.randint(0, m_new, (m,), generator=gen)
            start = torch.randint(-1, 1 << 20, (60_000,), generator=gen)
            want_pos, want_rows = start.clone(), start.clone() + 1
            rows_of_new_torch(table, places, spread, new_pos, want_pos, want_rows)
            got_pos, got_rows = start.clone(), start.clone() + 1
            rows_of_new_native(table, places, spread, new_pos, got_pos, got_rows)
            assert_same((got_pos, got_rows), (want_pos, want_rows))
    with pytest.raises(ValueError, match="contiguous"):
        rows_of_new_native(tables[0], places, spread, new_pos, start[::2], start.clone())


@pytest.mark.parametrize("case", range(len(key_batches())))
@pytest.mark.parametrize("tables", [1, 3])
def test_collection_dedup_on_the_compiled_sort_matches_torch_sort(case, tables):
    """The collection's dedup of a group (one or three tables, features split unevenly, keys
    shared between tables in the last batches) gives the same pairs, inverse, counts and
    grouping on the compiled sort as on torch.sort."""
    if not native_available():
        pytest.skip("the compiled kernels do not build here")
    from dynemb.nn.collection import dedup as collection_dedup
    from dynemb.nn.tables import TableGroup

    values = key_batches()[case]
    group = TableGroup(0, list(range(tables)))
    cuts = sorted({0, values.numel(), values.numel() // 3, values.numel() // 2})
    vals = [values[a:b] for a, b in zip(cuts, cuts[1:])] or [values]
    group.features = list(range(len(vals)))
    group.feature_segments = [f % tables for f in range(len(vals))]
    by_torch = collection_dedup(group, vals, torch.device("cpu"), native=False)
    by_native = collection_dedup(group, vals, torch.device("cpu"), native=True, workspace=Workspace(torch.device("cpu")))
    for a, b in zip(by_torch[:4], by_native[:4]):
        assert_same(a, b)
    assert (by_torch[4] is None) == (by_native[4] is None)
    if by_torch[4] is not None:
        for a, b in zip(by_torch[4], by_native[4]):
            assert_same(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("features", [1, 5])
def test_bag_copy_matches_torch(dtype, features):
    """The single-hot bag copy writes, bitwise, what the per-feature index_select writes: rows of
    two groups (dims 8 and 4), strided (a store's [U, D + S] view), repeated and extreme ids,
    features given out of column order, every other column left as it was."""
    from dynemb.kernels.pool import copy_bags_native, copy_bags_torch

    g = torch.Generator().manual_seed(3)
    B, U = 1000, 37
    groups = [torch.randn(U, 8 + 3, generator=g).to(dtype)[:, :8], torch.randn(U + 5, 4 + 1, generator=g).to(dtype)[:, :4]]
    rows = [groups[f % 2] for f in range(features)]
    inverses = [torch.randint(0, r.shape[0], (B,), generator=g) for r in rows]
    inverses[0][:3] = torch.tensor([0, rows[0].shape[0] - 1, rows[0].shape[0] - 1])
    cols = [2 + 11 * f for f in range(features)][::-1]
    total = max(cols) + 8 + 4
    outs = [torch.full((B, total), -7.0, dtype=dtype) for _ in range(2)]
    copy_bags_torch(outs[0], cols, rows, inverses)
    copy_bags_native(outs[1], cols, rows, inverses)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[1][:, cols[0] : cols[0] + 8], rows[0].index_select(0, inverses[0]))


@pytest.mark.parametrize("k", [1, 4])
def test_bag_gradient_sum_matches_torch(k):
    """The backward's per-row sums of concat-gradient slices: the compiled pass against the
    sub-unit embedding_bag, with a hot row of many ids, rows of one id and an empty batch."""
    from dynemb.kernels.pool import sum_bags_native, sum_bags_torch

    g = torch.Generator().manual_seed(5)
    B, K, u = 300, 9, 4
    grad_rows = torch.randn(B * K, u, generator=g)
    n = 700
    first_row = torch.randint(0, B, (n,), generator=g) * K + torch.randint(0, K - k + 1, (n,), generator=g)
    inverse = torch.cat([torch.zeros(200, dtype=torch.int64), torch.randint(1, 150, (n - 200,), generator=g)])
    order = torch.argsort(inverse, stable=True)
    counts = torch.bincount(inverse, minlength=150)
    starts = counts.cumsum(0) - counts
    want = sum_bags_torch(grad_rows, first_row, order, starts, 150, k)
    got = sum_bags_native(grad_rows, first_row, order, starts, 150, k)
    assert got.shape == (150, k * u)
    # Each row's ids are added in embedding_bag's order: the same floats.
    assert torch.equal(got, want)
    empty = torch.empty(0, dtype=torch.int64)
    assert torch.equal(sum_bags_torch(grad_rows, first_row, empty, torch.zeros(0, dtype=torch.int64), 0, k), torch.zeros(0, k * u))
