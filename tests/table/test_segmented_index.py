"""KeyIndex with several segments (the tables of a collection group): each segment against a
dict model of its own, growth of segments from their initial capacities, state round trips and
bad ``segments=`` arguments."""

from __future__ import annotations

import pytest
import torch

from dynemb.table.index import KeyIndex, unique_pairs
from dynemb.table.segmented import SegmentedKeyIndex

W = 8


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def segment_of_slot(index: KeyIndex, slots: torch.Tensor) -> torch.Tensor:
    """Segment owning each flat slot ([n] -> [n]), from the public bucket counts."""
    ends = torch.cumsum(index.segment_buckets, 0) * index.bucket_capacity
    return torch.searchsorted(ends, slots, right=True)


def check_against(index: KeyIndex, model: list[dict[int, int]]) -> None:
    """Every segment holds exactly its model's keys, with its rows, inside its own slot range."""
    sizes = index.segment_sizes().tolist()
    for s, held in enumerate(model):
        assert sizes[s] == len(held) <= index.segment_capacity(s)
        parts = list(index.export_slots(64, segment=s))
        keys = torch.cat([p[0] for p in parts]) if parts else t([])
        rows = torch.cat([p[1] for p in parts]) if parts else t([])
        slots = torch.cat([p[3] for p in parts]) if parts else t([])
        assert dict(zip(keys.tolist(), rows.tolist())) == held
        assert bool((segment_of_slot(index, slots) == s).all())
        if held:
            probe = t(sorted(held))
            got, found = index.find(probe, segments=torch.full_like(probe, s))
            assert bool(found.all()) and got.tolist() == [held[k] for k in probe.tolist()]
            pos, found = index.locate(probe, segments=torch.full_like(probe, s))
            assert bool(found.all()) and torch.equal(pos.sort().values, slots.sort().values)
    assert index.size() == sum(sizes)
    used_rows = [r for held in model for r in held.values()]
    assert len(set(used_rows)) == len(used_rows)


def drive(index: KeyIndex, steps: int, seed: int, n_segments: int, key_range: int = 300) -> list[dict[int, int]]:
    """Random (segment, key) upserts and erases, applied to a dict model per segment from each
    result; conservation per call: keys before + inserted = keys after + evicted (+ erased)."""
    gen = torch.Generator().manual_seed(seed)
    model: list[dict[int, int]] = [dict() for _ in range(n_segments)]
    for step in range(1, steps + 1):
        segs = torch.randint(0, n_segments, (120,), generator=gen)
        keys = torch.randint(-key_range, key_range, (120,), generator=gen)
        (us, uk), _, counts = unique_pairs(segs, keys)
        before = sum(len(m) for m in model)
        r = index.upsert_unique(uk, counts, now=step, segments=us)
        for s, k in zip(r.evicted_segments.tolist(), r.evicted_keys.tolist()):
            del model[s][k]
        for s, k, ok, row in zip(us.tolist(), uk.tolist(), r.ok.tolist(), r.rows.tolist()):
            if ok:
                model[s][k] = row
        failed = {(s, k) for s, k, ok in zip(us.tolist(), uk.tolist(), r.ok.tolist()) if not ok}
        assert set(zip(r.failed_segments.tolist(), r.failed_keys.tolist())) == failed
        # Eviction stays inside a segment: a key evicted for a new key of segment s is of s.
        assert set(r.evicted_segments.tolist()) <= set(us[r.inserted].tolist())
        assert before + int(r.inserted.sum()) == sum(len(m) for m in model) + r.evicted_keys.numel()
        if step % 5 == 0:
            es, ek = torch.randint(0, n_segments, (30,), generator=gen), torch.randint(-key_range, key_range, (30,), generator=gen)
            e = index.erase(ek, segments=es)
            (ues, uek), _, _ = unique_pairs(es, ek)
            held = {(s, k) for s, k in zip(ues.tolist(), uek.tolist()) if k in model[s]}
            assert (
                set(zip(e.evicted_segments.tolist(), e.evicted_keys.tolist()))
                == held
                == {(s, k) for s, k, f in zip(es.tolist(), ek.tolist(), e.found.tolist()) if f}
            )
            for s, k in zip(e.evicted_segments.tolist(), e.evicted_keys.tolist()):
                del model[s][k]
        check_against(index, model)
    return model


@pytest.mark.parametrize("grow", [False, True])
def test_segments_match_a_dict_model_each(grow):
    """Segments of 64, 200 and 1000 keys, at full size or growing from small: each holds what
    its dict model says; the small one evicts, the large one never does."""
    caps = [64, 200, 1000]
    init = [16, 16, 64] if grow else None
    index = KeyIndex(capacities=caps, init_capacities=init, bucket_capacity=W, score_strategy="step")
    drive(index, 40, seed=4, n_segments=3)
    stats = index.segment_stats()
    assert stats[0]["evictions"] > 0 and stats[2]["evictions"] == 0
    assert [s["capacity"] for s in stats] == [index.segment_capacity(s) for s in range(3)]
    if grow:
        assert index.stats()["growths"] > 0
        assert [s["current_capacity"] for s in stats][:2] == [s["capacity"] for s in stats][:2]
    else:
        assert index.stats()["growths"] == 0


def test_equal_keys_in_two_segments_are_two_entries():
    index = KeyIndex(capacities=[32, 32], bucket_capacity=W, score_strategy="step")
    keys = t([5, 5, -1, 0])
    r = index.find_or_insert(keys, now=1, segments=t([0, 1, 0, 1]))
    assert r.inserted.all() and len(set(r.rows.tolist())) == 4
    e = index.erase(t([5]), segments=t([1]))
    assert e.evicted_keys.tolist() == [5] and e.evicted_segments.tolist() == [1]
    assert index.find(t([5, 5]), segments=t([0, 1]))[1].tolist() == [True, False]
    assert index.counters(0) == [2, 0, 0, 0] and index.counters(1) == [2, 0, 0, 1]


def test_segments_grow_on_their_own_and_keep_their_keys():
    """Segment 0 grows from 2 buckets to 16 as keys arrive; segment 1 stays at its initial size
    (no keys), segment 2 is full size from the start; no key is lost in the rehashes."""
    index = KeyIndex(capacities=[128, 64, 64], init_capacities=[16, 8, None], bucket_capacity=W, score_strategy="step")
    assert index.segment_buckets.tolist() == [2, 1, 8]
    held = {}
    for step in range(8):
        keys = torch.arange(step * 12, step * 12 + 12)
        r = index.find_or_insert(keys, now=step, segments=torch.zeros_like(keys))
        assert r.failed_keys.numel() == 0 and r.evicted_keys.numel() == 0
        held.update(zip(keys.tolist(), r.rows.tolist()))
        if step == 3:
            side = index.find_or_insert(t([1, 2]), now=step, segments=t([2, 2]))
    assert index.segment_buckets.tolist() == [16, 1, 8]
    assert index.stats()["growths"] == 3 and index.counters()[3] == 3
    probe = t(sorted(held))
    rows, found = index.find(probe, segments=torch.zeros_like(probe))
    assert bool(found.all()) and rows.tolist() == [held[k] for k in probe.tolist()]
    assert index.find(t([1, 2]), segments=t([2, 2]))[0].tolist() == side.rows.tolist()
    # Past its maximum a segment evicts within itself (step: older keys go first).
    r = index.find_or_insert(torch.arange(1000, 1100), now=100, segments=torch.zeros(100, dtype=torch.int64))
    assert index.segment_buckets.tolist() == [16, 1, 8] and r.evicted_keys.numel() > 0
    assert set(r.evicted_segments.tolist()) == {0} and index.find(t([1, 2]), segments=t([2, 2]))[1].all()


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_a_full_segment_does_not_crowd_out_the_moves_of_another(backend):
    # Segment 0 full, segment 1 nearly full; one call brings 120 new keys of segment 0 (ahead
    # in priority order) and 8 of segment 1 whose buckets are full. No move can make room in
    # a full segment (moves stay in their segment), so its keys are not tried: the moves that
    # are tried serve segment 1, whose keys take its empty slots instead of evicting its keys.
    # When segment 0's keys took the places tried (a few times the empty slots) and the call
    # gave up the moves, segment 1's 8 keys all evicted (the rule before, docs/design/0045).
    from dynemb.kernels import uses_native

    if backend == "native" and not uses_native("native", "cpu"):
        pytest.skip("compiled kernels could not be built")
    g = torch.Generator().manual_seed(1)
    index = KeyIndex(capacities=[256, 256], bucket_capacity=4, score_strategy="step", backend=backend)

    def upsert(keys: torch.Tensor, seg: torch.Tensor, now: int):
        order = torch.argsort(seg * (1 << 40) + keys)  # distinct pairs by segment, then key
        keys, seg = keys[order], seg[order]
        return index.upsert_unique(keys, torch.ones_like(keys), now=now, segments=seg)

    zeros, ones = (lambda n: torch.zeros(n, dtype=torch.int64)), (lambda n: torch.ones(n, dtype=torch.int64))
    upsert(torch.randperm(10**6, generator=g)[:400], zeros(400), 1)
    upsert(torch.randperm(10**6, generator=g)[:246] + 10**7, ones(246), 1)
    before = index.segment_sizes().tolist()
    assert before[0] == 256 and before[1] < 256
    new0 = torch.randperm(10**6, generator=g)[:120] + 2 * 10**7
    new1 = torch.randperm(10**6, generator=g)[:8] + 3 * 10**7
    r = upsert(torch.cat([new0, new1]), torch.cat([zeros(120), ones(8)]), 2)
    after = index.segment_sizes().tolist()
    assert r.failed_keys.numel() == 0 and int((r.evicted_segments == 0).sum()) == 120
    # Segment 1 took new keys into empty slots (it grew), evicting fewer than all 8.
    assert after[0] == 256 and after[1] > before[1]
    assert int((r.evicted_segments == 1).sum()) == 8 - (after[1] - before[1]) < 8


@pytest.mark.parametrize("init", [None, [16, 8, 64]])
def test_state_round_trip(init):
    """A grown (or full-size) segmented index restores exactly, and then behaves bitwise as the
    original; a full-size one writes the entries segmented indexes always wrote."""
    args = dict(capacities=[64, 120, 500], init_capacities=init, bucket_capacity=W, score_strategy="step")
    index = KeyIndex(**args)
    drive(index, 25, seed=7, n_segments=3)
    state = index.state_dict()
    assert set(state) == {
        "keys", "rows", "scores", "slots", "num_buckets", "bucket_capacity", "max_buckets",
        "free_high_water", "free", "counters", "segment_buckets", "segment_counters",
    }  # fmt: skip
    assert state["segment_counters"].shape == (4, 3) and int(state["num_buckets"]) == int(state["segment_buckets"].sum())
    twin = KeyIndex(**args)
    assert twin.same_geometry(state)
    twin.load_state_dict(state)
    assert all(torch.equal(state[k], v) for k, v in twin.state_dict().items())
    assert twin.segment_stats() == index.segment_stats()
    gen = torch.Generator().manual_seed(9)
    for step in range(30, 40):
        segs, keys = torch.randint(0, 3, (200,), generator=gen), torch.randint(-600, 600, (200,), generator=gen)
        a, b = index.find_or_insert(keys, now=step, segments=segs), twin.find_or_insert(keys, now=step, segments=segs)
        for f in a.__dataclass_fields__:
            assert torch.equal(getattr(a, f), getattr(b, f)), f
    assert all(torch.equal(v, twin.state_dict()[k]) for k, v in index.state_dict().items())
    # Another geometry is refused, naming it, and leaves the index as it was.
    other = KeyIndex(**{**args, "capacities": [64, 120, 1000]})
    assert not other.same_geometry(state)
    with pytest.raises(ValueError, match="geometry"):
        other.load_state_dict(state)
    assert other.size() == 0


def test_one_segment_is_the_plain_index():
    """capacities=[c] places keys as capacity=c does (bucket width W <= c); segments= is
    optional with one segment (None or zeros), and results carry segment 0."""
    plain = KeyIndex(capacity=256, init_capacity=32, bucket_capacity=W, score_strategy="step")
    group = KeyIndex(capacities=[256], init_capacities=[32], bucket_capacity=W, score_strategy="step")
    gen = torch.Generator().manual_seed(3)
    for step in range(20):
        keys = torch.randint(0, 400, (50,), generator=gen)
        a = plain.find_or_insert(keys, now=step)
        b = group.find_or_insert(keys, now=step, segments=torch.zeros_like(keys) if step % 2 else None)
        assert torch.equal(a.rows, b.rows) and torch.equal(a.evicted_keys, b.evicted_keys)
        assert a.evicted_segments is None and b.evicted_segments.tolist() == [0] * b.evicted_keys.numel()
    ps, gs = plain.state_dict(), group.state_dict()
    assert "segment_buckets" not in ps and set(gs) - set(ps) == {"segment_buckets", "segment_counters"}
    assert all(torch.equal(ps[k], gs[k]) for k in ps)
    assert plain.counters() == group.counters() and plain.counters(0)[:3] == group.counters(0)[:3]
    assert plain.segment_sizes().tolist() == group.segment_sizes().tolist() == [plain.size()]


def test_alias_and_public_helpers():
    index = SegmentedKeyIndex(capacities=[20, 40], bucket_capacity=4, score_strategy="lfu")
    assert type(index) is KeyIndex and index.num_segments == 2 and index.segment_buckets.tolist() == [5, 10]
    keys, segs = t([3, 3, 4]), t([0, 1, 1])
    index.find_or_insert(keys, segments=segs)
    b1, b2 = index.candidate_buckets(keys, segs)
    pos, found = index.locate(keys, segs)
    assert found.all() and bool(((pos // 4 == b1) | (pos // 4 == b2)).all())
    assert b1.tolist()[0] < 5 <= min(b1.tolist()[1:] + b2.tolist()[1:])
    index.set_counters([7, 6, 5, 4], segment=1)
    # The whole index's first three counters stay the sums over its segments.
    assert index.counters()[:3] == [a + b for a, b in zip(index.counters(0)[:3], [7, 6, 5])]
    index.set_counters([1, 2, 3, 4])
    assert index.counters(1) == [7, 6, 5, 4] and index.counters() == [1, 2, 3, 4] and index.segment_stats()[1]["erased"] == 4
    with pytest.raises(ValueError, match="values"):
        index.set_counters([1, 2, -3, 4], segment=0)


@pytest.mark.parametrize(
    "call",
    [
        lambda i: i.find(t([1, 2])),
        lambda i: i.find(t([1, 2]), segments=t([0])),
        lambda i: i.find(t([1, 2]), segments=t([0, 2])),
        lambda i: i.erase(t([1]), segments=t([-1])),
        lambda i: i.upsert_unique(t([1]), t([1]), now=0),
        lambda i: i.find_or_insert(t([1, 2]), now=0, segments=t([0, 0, 1])),
        lambda i: i.locate(t([1])),
        lambda i: i.candidate_buckets(t([1]), t([5])),
        lambda i: list(i.export_slots(16, segment=2)),
        lambda i: i.counters(segment=-1),
    ],
)
def test_bad_segments_raise_naming_the_argument(call):
    index = KeyIndex(capacities=[16, 16], bucket_capacity=4, score_strategy="step")
    index.find_or_insert(t([1]), now=0, segments=t([1]))
    before = index.state_dict()
    with pytest.raises(ValueError, match="segment"):
        call(index)
    assert all(torch.equal(v, index.state_dict()[k]) for k, v in before.items())


@pytest.mark.parametrize(
    "args, name",
    [
        (dict(capacity=16, capacities=[16]), "capacities"),
        (dict(), "capacity"),
        (dict(capacities=[]), "capacities"),
        (dict(capacities=[16, 0]), r"capacities\[1\]"),
        (dict(capacities=[16, 16], init_capacities=[4]), "init_capacities"),
        (dict(capacities=[16, 16], init_capacities=[4, 32]), r"init_capacities\[1\]"),
        (dict(capacities=[16], init_capacity=4), "init_capacity"),
        (dict(capacity=16, init_capacities=[4]), "init_capacities"),
    ],
)
def test_bad_constructor_arguments(args, name):
    with pytest.raises(ValueError, match=name):
        KeyIndex(**args)
