"""KeyIndex beyond placement: capacity rounding, memory, the caller's clock, state_dict, devices
and inference mode."""

from __future__ import annotations

import io
import time

import pytest
import torch
from index_model import INT64_MAX, INT64_MIN, export_all, layout

from dynemb.table.base import Index
from dynemb.table.index import KeyIndex, bucket_width, index_bytes, plan_buckets, rounded_capacity

STRATEGIES = ["timestamp", "step", "lfu", "customized", "no_eviction"]
CLOCKED = ["timestamp", "step", "no_eviction"]


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def random_keys(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(INT64_MIN, INT64_MAX, (n,), generator=gen, dtype=torch.int64)


def test_key_index_implements_the_contract():
    assert isinstance(KeyIndex(capacity=16), Index)


# Capacity rounding.


def _expected_plan(C: int, init: int | None, W: int) -> tuple[int, int, int]:
    """(width, initial buckets, max buckets) by the rule of plan_buckets, by brute force."""
    if C < W:
        return C, 1, 1
    implied = 0
    while (init or C) << (implied + 1) <= C:
        implied += 1
    best = None
    for k in range(implied + 1):
        needed = (C + W - 1) // W
        max_buckets = (needed + (1 << k) - 1) // (1 << k) * (1 << k)
        if max_buckets * W <= 2 * C:
            best = (W, max_buckets >> k, max_buckets)
    return best


CAPACITIES = [1, 2, 3, 5, 15, 16, 17, 31, 33, 100, 1000, 4095, 4096, 4097, 100_003, (1 << 20) + 1]


@pytest.mark.parametrize("W", [1, 4, 16, 32])
@pytest.mark.parametrize("C", CAPACITIES)
def test_capacity_is_at_least_the_request_and_at_most_twice(C, W):
    for init in sorted({None, 1, 2, 7, max(1, C // 3), max(1, C // 64), C} - {x for x in (2, 7) if x > C}, key=str):
        width, init_buckets, max_buckets = _expected_plan(C, init, W)
        assert plan_buckets(C, init, W) == (init_buckets, max_buckets)
        assert bucket_width(C, W) == width
        real = rounded_capacity(C, init, W)
        assert real == max_buckets * width
        assert C <= real <= 2 * C, (C, init, W, real)
        # The index doubles from its initial buckets to the maximum; it starts with at least init.
        doublings = (max_buckets // init_buckets).bit_length() - 1
        assert max_buckets == init_buckets << doublings
        assert init_buckets * width >= (init or C)
        if C <= 5000:
            index = KeyIndex(capacity=C, init_capacity=init, bucket_capacity=W)
            assert index.capacity() == real and index.bucket_capacity == width
            assert index.current_capacity() == init_buckets * width
            assert index.free_list.capacity == real


def test_small_init_capacity_no_longer_inflates_capacity():
    # Before: init_capacity=1 rounded capacity 1000 up to 8192 slots (W=16).
    index = KeyIndex(capacity=1000, init_capacity=1)
    assert index.capacity() == 1024 and index.current_capacity() == 16
    # A capacity below W: one bucket of exactly that many slots.
    index = KeyIndex(capacity=5, init_capacity=2)
    assert index.capacity() == index.current_capacity() == 5 and index.num_buckets == 1
    r = index.find_or_insert(t([1, 2, 3, 4, 5, 6]), now=0)
    assert r.ok.sum() == 5 and r.failed_keys.numel() == 1


def test_index_bytes():
    assert index_bytes(0) == 0
    # key 8, row id 4 (int32 below 2**31 slots, else 8), score 4, used flag 1 (docs/design/0035).
    assert index_bytes(1 << 20) == 17 << 20
    assert index_bytes(1 << 32) == 21 << 32
    index = KeyIndex(capacity=1 << 10)
    kept = [index._keys, index._tags, index._rows, index._scores]
    assert sum(x.numel() * x.element_size() for x in kept) == index_bytes(index.current_capacity())


@pytest.mark.parametrize("init_capacity", [None, 1 << 50])
def test_allocation_failure_names_the_argument_and_the_bytes(init_capacity):
    name = "capacity" if init_capacity is None else "init_capacity"
    with pytest.raises(ValueError, match=rf"{name}={1 << 50}: the index needs {index_bytes(1 << 50):,} bytes"):
        KeyIndex(capacity=1 << 50, init_capacity=init_capacity)
    # A small initial allocation of a huge capacity succeeds.
    index = KeyIndex(capacity=1 << 50, init_capacity=1 << 10)
    assert index.capacity() == 1 << 50 and index.current_capacity() == 1 << 10


# The clock is the caller's.


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_index_never_reads_wall_time(strategy, monkeypatch):
    def no_clock(*args):
        raise AssertionError("the index read the wall clock")

    for name in ("time", "time_ns", "monotonic", "monotonic_ns", "perf_counter", "perf_counter_ns"):
        monkeypatch.setattr(time, name, no_clock)
    index = KeyIndex(capacity=64, init_capacity=16, bucket_capacity=4, score_strategy=strategy)
    keys = random_keys(200, seed=3)
    scores = keys % 1000 if strategy == "customized" else None
    for i, part in enumerate(keys.split(50)):
        index.find_or_insert(part, now=10 * i, scores=None if scores is None else scores[50 * i : 50 * i + 50])
    index.erase(keys[:10])
    export_all(index)
    KeyIndex(capacity=64, init_capacity=16, bucket_capacity=4, score_strategy=strategy).load_state_dict(index.state_dict())


@pytest.mark.parametrize("strategy", CLOCKED)
def test_every_touched_key_gets_now(strategy):
    index = KeyIndex(capacity=64, bucket_capacity=4, score_strategy=strategy)
    index.find_or_insert(t([1, 2, 3]), now=50)
    # The clock may go backwards (a restarted step counter): the key's score is still `now`.
    r = index.find_or_insert(t([2, 3, 3, 4]), now=7)
    assert r.found.tolist() == [True, True, True, False]
    assert index.scores(t([1, 2, 3, 4]))[0].tolist() == [50, 7, 7, 7]
    r = index.upsert_unique(t([1, 5]), t([1, 1]), now=INT64_MIN)
    assert index.scores(t([1, 5]))[0].tolist() == [INT64_MIN, INT64_MIN]
    # Given scores need no clock.
    index.find_or_insert(t([1, 6]), scores=t([3, 4]))
    assert index.scores(t([1, 6]))[0].tolist() == [3, 4]


def test_lfu_counts_and_saturates():
    index = KeyIndex(capacity=64, score_strategy="lfu")
    index.find_or_insert(t([1, 1, 2]))
    index.find_or_insert(t([1, 3]), now=99)
    assert index.scores(t([1, 2, 3]))[0].tolist() == [3, 1, 1]
    index.find_or_insert(t([2]), scores=t([INT64_MAX - 1]))
    index.find_or_insert(t([2, 2, 2]))
    assert index.scores(t([2]))[0].tolist() == [INT64_MAX]


@pytest.mark.parametrize("strategy", CLOCKED)
@pytest.mark.parametrize(
    "now,match",
    [
        (None, "now=None"),
        (True, "now=True"),
        (1.5, "now=1.5"),
        ("3", "now='3'"),
        (1 << 63, "now=9223372036854775808"),
        (INT64_MIN - 1, "now=-9223372036854775809"),
    ],
)
def test_clocked_strategies_need_an_int64_now(strategy, now, match):
    index = KeyIndex(capacity=64, score_strategy=strategy)
    with pytest.raises(ValueError, match=match):
        index.find_or_insert(t([1, 2]), now=now)
    with pytest.raises(ValueError, match=match):
        index.upsert_unique(t([1, 2]), t([1, 1]), now=now)
    assert index.size() == 0


@pytest.mark.parametrize("strategy", ["lfu", "customized"])
def test_a_bad_now_is_rejected_even_where_unused(strategy):
    index = KeyIndex(capacity=64, score_strategy=strategy)
    with pytest.raises(ValueError, match="now=1.5"):
        index.find_or_insert(t([1]), now=1.5, scores=t([1]))
    assert index.size() == 0


# state_dict / load_state_dict.


def _churned_index(seed: int = 0, **kwargs) -> tuple[KeyIndex, dict]:
    """An index that grew, evicted, failed and erased, and the arguments it was made with."""
    args = dict(capacity=256, init_capacity=32, bucket_capacity=4, score_strategy="step", **kwargs)
    index = KeyIndex(**args)
    keys = random_keys(600, seed)
    for i, part in enumerate(keys.split(60)):
        index.find_or_insert(torch.cat([part, part[:5]]), now=i)
        index.erase(part[10:14])
    stats = index.stats()
    assert stats["growths"] == 3 and stats["evictions"] > 0
    return index, args


def _same_result(got, want) -> None:
    for field in want.__dataclass_fields__:
        a, b = getattr(got, field), getattr(want, field)
        assert (a is None and b is None) or torch.equal(a, b), field


def _same(a: KeyIndex, b: KeyIndex) -> None:
    for name, value in a.state_dict().items():
        assert torch.equal(value, b.state_dict()[name]), name
    assert a.stats() == b.stats() and layout(a) == layout(b)


def test_state_dict_is_plain_int64_tensors_in_slot_order():
    index, _ = _churned_index()
    state = index.state_dict()
    assert set(state) == {
        "keys", "rows", "scores", "slots", "num_buckets", "bucket_capacity", "max_buckets",
        "free_high_water", "free", "counters",
    }  # fmt: skip
    assert all(isinstance(v, torch.Tensor) and v.dtype == torch.int64 for v in state.values())
    K = index.size()
    assert all(state[n].shape == (K,) for n in ("keys", "rows", "scores", "slots"))
    assert torch.equal(state["slots"], state["slots"].sort().values)
    assert state["num_buckets"].item() == index.num_buckets and state["counters"].shape == (4,)
    assert state["free"].numel() + K == state["free_high_water"].item()
    keys, rows, scores = export_all(index)
    assert torch.equal(keys, state["keys"]) and torch.equal(rows, state["rows"]) and torch.equal(scores, state["scores"])


def test_round_trip_then_identical_behaviour():
    index, args = _churned_index()
    buffer = io.BytesIO()
    torch.save(index.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    # A fresh index, and one of the same arguments that already holds other keys and grew more.
    fresh = KeyIndex(**args)
    busy = KeyIndex(**args)
    busy.find_or_insert(random_keys(300, seed=9), now=0)
    for twin in (fresh, busy):
        twin.load_state_dict(state)
        _same(index, twin)
    more = random_keys(400, seed=5)
    for i, part in enumerate(more.split(40)):
        batch = torch.cat([part, more[:7]])
        results = [ix.find_or_insert(batch, now=100 + i) for ix in (index, fresh, busy)]
        erased = [ix.erase(part[:3]) for ix in (index, fresh, busy)]
        for calls in (results, erased):
            for got in calls[1:]:
                _same_result(got, calls[0])
    for twin in (fresh, busy):
        _same(index, twin)
        for a, b in zip(export_all(index), export_all(twin)):
            assert torch.equal(a, b)


def _corrupt(state: dict, name: str, how) -> dict:
    state = dict(state)
    state[name] = how(state[name]) if callable(how) else how
    return state


def _bad_states(state: dict, index: KeyIndex):
    W = index.bucket_capacity
    K = state["keys"].numel()
    slots = state["slots"]
    # A free slot in a bucket no held key may use, to build out-of-place keys.
    yield "not_a_mapping", [("keys", state["keys"])], "mapping"
    yield "missing", {k: v for k, v in state.items() if k != "rows"}, "'rows'"
    yield "float", _corrupt(state, "scores", lambda x: x.double()), "'scores'"
    yield "2d", _corrupt(state, "keys", lambda x: x.view(1, -1)), "'keys'"
    yield "scalar_vector", _corrupt(state, "num_buckets", lambda x: x.view(1)), "'num_buckets'"
    yield "short_rows", _corrupt(state, "rows", lambda x: x[1:]), "'rows' has"
    yield "width", _corrupt(state, "bucket_capacity", t(W * 2)), "bucket_capacity=8"
    yield "max_buckets", _corrupt(state, "max_buckets", lambda x: x * 2), "max_buckets="
    yield "num_buckets", _corrupt(state, "num_buckets", t(3)), "num_buckets=3"
    yield "slot_range", _corrupt(state, "slots", lambda x: x.clone().index_fill_(0, t([0]), 1 << 20)), "'slots'"
    yield "slot_negative", _corrupt(state, "slots", lambda x: x.clone().index_fill_(0, t([0]), -1)), "'slots'"
    yield "slot_twice", _corrupt(state, "slots", lambda x: x.clone().index_copy_(0, t([0]), x[1:2])), "'slots'"
    yield "key_twice", _corrupt(state, "keys", lambda x: x.clone().index_copy_(0, t([0]), x[1:2])), "'keys'"
    # Swap two keys' slots in different buckets: each sits outside its candidates (most likely).
    other = int((slots // W != slots[0] // W).nonzero()[0])
    swapped = slots.clone().index_copy_(0, t([0, other]), slots[[other, 0]])
    yield "wrong_bucket", _corrupt(state, "slots", swapped), "candidate buckets"
    yield "row_range", _corrupt(state, "rows", lambda x: x.clone().index_fill_(0, t([0]), index.capacity())), "'rows'"
    yield "row_twice", _corrupt(state, "rows", lambda x: x.clone().index_copy_(0, t([0]), x[1:2])), "'rows'"
    yield "row_high_water", _corrupt(state, "free_high_water", lambda x: x - state["free"].numel() - 1), "free_high_water"
    yield "free_in_use", _corrupt(state, "free", lambda x: torch.cat([x[1:], state["rows"][:1]])), "'free'"
    yield "free_missing", _corrupt(state, "free", lambda x: x[1:]), "'free'"
    yield "free_twice", _corrupt(state, "free", lambda x: torch.cat([x[:-1], x[:1]])), "'free'"
    yield "counters_shape", _corrupt(state, "counters", lambda x: x[:3]), "'counters'"
    yield "counters_negative", _corrupt(state, "counters", lambda x: -x), "'counters'"
    assert K > 2 and state["free"].numel() > 2


def test_bad_state_dicts_raise_and_leave_the_index_unchanged():
    source, _ = _churned_index(seed=1)
    state = source.state_dict()
    target, _ = _churned_index(seed=2)
    before = target.state_dict()
    names = []
    for name, bad, match in _bad_states(state, target):
        names.append(name)
        with pytest.raises(ValueError, match=match):
            target.load_state_dict(bad)
        _same_state(target.state_dict(), before)
        assert not target.same_geometry(bad) or name not in ("width", "max_buckets", "num_buckets")
    assert len(names) == 22
    # Still usable, and the good state loads.
    target.find_or_insert(random_keys(10, seed=4), now=1000)
    target.load_state_dict(state)
    _same(source, target)


def _same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_same_geometry():
    args = dict(capacity=256, init_capacity=32, bucket_capacity=4)
    index = KeyIndex(**args)
    index.find_or_insert(t([1, 2, 3]), now=0)
    state = index.state_dict()
    assert state["num_buckets"].item() == 8 and state["max_buckets"].item() == 64
    assert KeyIndex(**args).same_geometry(state)
    # Same width and maximum; 8 buckets lie on the way from 4 (init_capacity=16) to 64.
    assert KeyIndex(**{**args, "init_capacity": 16}).same_geometry(state)
    assert not KeyIndex(**{**args, "init_capacity": 64}).same_geometry(state)
    assert not KeyIndex(**{**args, "capacity": 512}).same_geometry(state)
    assert not KeyIndex(**{**args, "bucket_capacity": 8}).same_geometry(state)
    assert not index.same_geometry({})
    with pytest.raises(ValueError, match="geometry"):
        KeyIndex(**{**args, "init_capacity": 64}).load_state_dict(state)
    # A state from before growth restores the smaller index exactly.
    grown = KeyIndex(**{**args, "init_capacity": 16})
    grown.find_or_insert(torch.arange(100), now=0)
    assert grown.num_buckets == 64
    grown.load_state_dict(state)
    assert grown.num_buckets == 8 and grown.size() == 3


# Devices and inference mode.


def _assert_kept_tensors_normal(index: KeyIndex) -> None:
    kept = [index._keys, index._tags, index._rows, index._scores, index._slot_ids, index.free_list._stack]
    assert not any(x.is_inference() for x in kept)


def _exercise(index: KeyIndex) -> list:
    out = []
    keys = random_keys(400, seed=8)
    for i, part in enumerate(keys.split(50)):
        r = index.find_or_insert(part, now=i)
        out += [r.rows.clone(), r.evicted_keys.clone(), index.erase(part[:5]).evicted_rows.clone()]
    return out


def test_mutations_under_inference_mode_keep_normal_tensors():
    reference = KeyIndex(capacity=256, init_capacity=16, bucket_capacity=4, score_strategy="step")
    index = KeyIndex(capacity=256, init_capacity=16, bucket_capacity=4, score_strategy="step")
    expected = _exercise(reference)
    with torch.inference_mode():
        got = _exercise(index)
        assert index.stats()["growths"] == 4 and index.stats()["evictions"] > 0
        index.load_state_dict(reference.state_dict())
        index.to("cpu")
    _assert_kept_tensors_normal(index)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    # Normal mode mutations (in-place writes into the tensors) work afterwards.
    more = random_keys(100, seed=11)
    r1, r2 = index.find_or_insert(more, now=99), reference.find_or_insert(more, now=99)
    assert torch.equal(r1.rows, r2.rows) and torch.equal(r1.evicted_keys, r2.evicted_keys)
    _same(index, reference)


def test_created_under_inference_mode():
    with torch.inference_mode():
        index = KeyIndex(capacity=64, init_capacity=16)
        index.find_or_insert(t([1, 2, 3]), now=0)
    _assert_kept_tensors_normal(index)
    index.find_or_insert(random_keys(60, seed=1), now=1)
    assert index.size() == 63


def test_to_cpu_keeps_everything():
    index, _ = _churned_index()
    before = index.state_dict()
    assert index.to("cpu") is index
    _same_state(index.state_dict(), before)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_and_moves_back():
    cpu, args = _churned_index()
    cuda = KeyIndex(**{**args, "device": "cuda"})
    cuda.load_state_dict(cpu.state_dict())
    keys = random_keys(2000, seed=12)
    for i, part in enumerate(keys.split(100)):
        a, b = cpu.find_or_insert(part, now=500 + i), cuda.find_or_insert(part.cuda(), now=500 + i)
        assert b.rows.device.type == "cuda"
        _same_result(type(b)(**{f: None if getattr(b, f) is None else getattr(b, f).cpu() for f in b.__dataclass_fields__}), a)
        cpu.erase(part[:9])
        cuda.erase(part[:9].cuda())
    _same_state(cpu.state_dict(), {k: v.cpu() for k, v in cuda.state_dict().items()})
    cuda.to("cpu")
    assert cuda.device.type == "cpu" and cuda.free_list.device.type == "cpu"
    _same(cpu, cuda)
    moved = cpu.to("cuda")
    r = moved.find_or_insert(keys[:10].cuda(), now=10_000)
    assert r.rows.device.type == "cuda" and moved.free_list.allocate(0).device.type == "cuda"
