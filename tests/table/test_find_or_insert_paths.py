"""find_or_insert under a clock (timestamp / step / no_eviction) probes the keys as they come and
de-duplicates only the missing ones (docs/design/0040). Its definition is the general path:
de-duplicate every key, upsert_unique, spread the result back over the keys. Both are driven
through the same calls here (growing, moving, evicting, failing, repeated keys, segments) and
must give the same results and the same slots, row ids, scores and counters, bitwise."""

from __future__ import annotations

import pytest
import torch

from dynemb.kernels import uses_native
from dynemb.table.base import IndexResult
from dynemb.table.index import KeyIndex

BACKENDS = ["torch"] + (["native"] if uses_native("auto", torch.device("cpu")) else [])
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def reference(index: KeyIndex, keys: torch.Tensor, now: int, segments: torch.Tensor | None) -> IndexResult:
    """find_or_insert as defined: every key de-duplicated, then upsert_unique."""
    seg = index._check_segments(segments, keys.numel())
    unique, useg, inverse, counts = index._dedup(keys, seg)
    r = index.upsert_unique(unique, counts, now=now, segments=useg)
    pick = lambda x: x.index_select(0, inverse)
    return IndexResult(pick(r.positions), pick(r.rows), pick(r.found), pick(r.inserted), *(getattr(r, f) for f in FIELDS[4:]))


FIELDS = ["positions", "rows", "found", "inserted", "evicted_keys", "evicted_rows", "evicted_scores", "failed_keys", "evicted_segments", "failed_segments"]


def assert_same(a: KeyIndex, b: KeyIndex, x: IndexResult, y: IndexResult) -> None:
    for name in FIELDS:
        u, v = getattr(x, name), getattr(y, name)
        assert (u is None) == (v is None), name
        if u is not None:
            assert u.dtype == v.dtype and torch.equal(u, v), name
    for name in ("_keys", "_tags", "_rows", "_scores"):
        u, v = getattr(a, name), getattr(b, name)
        assert u.dtype == v.dtype and torch.equal(u, v), name
    assert a.size() == b.size() and a.counters() == b.counters()
    assert all(a.counters(s) == b.counters(s) for s in range(a.num_segments))
    assert a.free_list.high_water == b.free_list.high_water and torch.equal(a.free_list.state()["free"], b.free_list.state()["free"])


def drive(make, batches, segments: int = 0) -> None:
    fast, slow = make(), make()
    g = torch.Generator().manual_seed(3)
    for step, keys in enumerate(batches):
        seg = torch.randint(0, segments, (keys.numel(),), generator=g) if segments else None
        kw = {"segments": seg} if segments else {}
        x = fast.find_or_insert(keys, now=step + 1, **kw)
        y = reference(slow, keys, step + 1, seg)
        assert_same(fast, slow, x, y)
        if step % 3 == 2:
            gone = keys[::5]
            ekw = {"segments": seg[::5]} if segments else {}
            fast.erase(gone, **ekw)
            slow.erase(gone, **ekw)


def stream(seed: int, n: int, size: int, key_range: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = [torch.randint(0, key_range, (size,), generator=g) * 7919 - key_range for _ in range(n)]
    # Repeated keys, extremes, and a batch of only repeats of one missing key.
    out[1] = torch.cat([out[1], out[1][:50], torch.tensor([0, -1, INT64_MIN, INT64_MAX] * 3)])
    out[2] = torch.full((40,), 123456789)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("strategy", ["timestamp", "step", "no_eviction"])
def test_probe_first_equals_the_general_path_growing_and_evicting(backend, strategy):
    # Grows from 64 slots to 512, then moves residents and evicts (or fails under no_eviction).
    batches = stream(1, 16, 180, 2500)
    drive(lambda: KeyIndex(capacity=512, init_capacity=64, bucket_capacity=8, score_strategy=strategy, backend=backend), batches)


@pytest.mark.parametrize("backend", BACKENDS)
def test_probe_first_equals_the_general_path_with_segments(backend):
    batches = stream(2, 12, 220, 900)
    drive(lambda: KeyIndex(capacities=[100, 300, 64], init_capacities=[32, None, 16], bucket_capacity=4, backend=backend), batches, segments=3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_probe_first_equals_the_general_path_in_a_crowded_index(backend):
    # Few buckets, many repeats of each key: displacement and eviction within one call.
    batches = [torch.randint(0, 300, (400,), generator=torch.Generator().manual_seed(s)) for s in range(8)]
    drive(lambda: KeyIndex(capacity=64, bucket_capacity=4, score_strategy="step", backend=backend), batches)
