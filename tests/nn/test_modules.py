"""Module behaviour beyond parity: eval, admission, failures, initialisation, errors.

N ids, D embedding dim.
"""

from __future__ import annotations

import pytest
import torch

import dynemb

D = 8


def table(**kw):
    kw.setdefault("optimizer", dynemb.optim.SGD(lr=0.5))
    return dynemb.DynamicEmbedding(D, kw.pop("capacity", 256), **kw)


def test_eval_never_inserts_and_returns_default():
    t = table(eval_default=0.25)
    t(torch.tensor([1, 2]))
    t.eval()
    out = t(torch.tensor([1, 3, 3]))
    assert t.size() == 2
    torch.testing.assert_close(out[1:], torch.full((2, D), 0.25))
    found_value, _ = t.find(torch.tensor([1]))
    torch.testing.assert_close(out[0], found_value[0])
    assert not out.requires_grad


def test_train_inserts_and_initial_value_is_per_key():
    a, b = table(seed=7), table(seed=7)
    keys = torch.tensor([5, -1, 2**63 - 1, -(2**63), 0])
    with torch.no_grad():
        out_a = a(keys)
        out_b = b(keys.flip(0))
    torch.testing.assert_close(out_a, out_b.flip(0), rtol=0, atol=0)
    assert a.size() == 5
    other = table(seed=8)
    with torch.no_grad():
        assert not torch.equal(other(keys), out_a)


def test_initial_value_survives_eviction_and_reinsertion():
    t = table(capacity=32, bucket_capacity=32, score_strategy="step", check_mode="count")
    with torch.no_grad():
        first = t(torch.tensor([11]))
        t.erase(torch.tensor([11]))
        again = t(torch.tensor([11]))
    torch.testing.assert_close(first, again, rtol=0, atol=0)


def test_admission_threshold():
    t = table(admission=dynemb.Admission(threshold=3, counter_capacity=64))
    key = torch.tensor([42])
    for seen in range(1, 3):
        out = t(key)
        out.sum().backward()
        assert t.size() == 0, seen
    assert t.stats()["admission_rejections"] == 2
    # Duplicates in a batch count as sightings: the third sighting admits the key.
    out = t(key)
    assert t.size() == 1
    out.sum().backward()
    value, found = t.find(key)
    assert bool(found.all())
    torch.testing.assert_close(value, out.detach() - 0.5)


def test_admission_duplicates_count():
    t = table(admission=dynemb.Admission(threshold=3))
    t(torch.tensor([9, 9, 9, 10]))
    _, found = t.find(torch.tensor([9, 10]))
    assert found.tolist() == [True, False]


def test_not_admitted_key_gets_initial_value_and_is_not_trained():
    t = table(admission=dynemb.Admission(threshold=5))
    out1 = t(torch.tensor([3]))
    out1.sum().backward()
    out2 = t(torch.tensor([3]))
    torch.testing.assert_close(out1, out2)


def test_no_eviction_raises_in_forward_and_table_stays_consistent():
    t = table(capacity=8, bucket_capacity=8, score_strategy="no_eviction")
    t(torch.arange(8)).sum().backward()
    before = {k: v for k, v in zip(*_export(t))}
    with pytest.raises(dynemb.InsertionError, match="1 of 2 keys could not be inserted") as err:
        t(torch.tensor([0, 100]))
    assert err.value.failed_keys.tolist() == [100]
    assert t.stats()["failed_inserts"] == 1
    after = {k: v for k, v in zip(*_export(t))}
    assert before.keys() == after.keys()


def test_failed_keys_count_mode_get_initial_value_and_no_training():
    t = table(capacity=4, bucket_capacity=4, score_strategy="no_eviction", check_mode="count")
    t(torch.arange(4)).sum().backward()
    out = t(torch.tensor([50, 50]))
    out.sum().backward()
    assert t.last_failed_keys.tolist() == [50]
    assert t.size() == 4
    with torch.no_grad():
        again = t(torch.tensor([50]))
    torch.testing.assert_close(again[0], out[0].detach())


def test_warn_mode_warns():
    t = table(capacity=4, bucket_capacity=4, score_strategy="no_eviction", check_mode="warn")
    with torch.no_grad():
        t(torch.arange(4))
        with pytest.warns(RuntimeWarning, match="could not be inserted"):
            t(torch.tensor([99]))


def test_eviction_in_training_frees_rows_for_new_keys():
    t = table(capacity=16, bucket_capacity=16, score_strategy="timestamp")
    for start in range(0, 64, 8):
        t(torch.arange(start, start + 8)).sum().backward()
    s = t.stats()
    assert s["size"] == 16 and s["evictions"] == 48 and s["failed_inserts"] == 0
    _, found = t.find(torch.arange(48, 64))
    assert bool(found.all())


def test_customized_scores_need_set_score():
    t = table(score_strategy="customized")
    with pytest.raises(ValueError, match="set_score"):
        t(torch.tensor([1]))
    t.set_score(10)
    t(torch.tensor([1]))
    scores, _ = t.index.scores(torch.tensor([1]))
    assert scores.tolist() == [10]
    with pytest.raises(ValueError, match="set_score needs score_strategy='customized'"):
        table().set_score(3)


def test_insert_full_rows_and_export_roundtrip():
    t = table(optimizer=dynemb.optim.Adam(lr=0.1))
    keys = torch.tensor([3, -3, 2**40])
    rows = torch.randn(3, 3 * D)
    assert t.insert(keys, rows).all()
    got = {int(k): r for k, r in zip(*_export(t))}
    for k, r in zip(keys.tolist(), rows):
        torch.testing.assert_close(got[k], r)


def test_insert_rejects_bad_values_and_duplicates():
    t = table()
    with pytest.raises(ValueError, match=r"values.shape=\(2, 3\)"):
        t.insert(torch.tensor([1, 2]), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="duplicate"):
        t.insert(torch.tensor([1, 1]), torch.zeros(2, D))
    assert t.size() == 0


def test_erase():
    t = table()
    t(torch.tensor([1, 2, 3]))
    assert t.erase(torch.tensor([2, 7])).tolist() == [True, False]
    assert t.size() == 2
    _, found = t.find(torch.tensor([1, 2, 3]))
    assert found.tolist() == [True, False, True]


def test_growth_keeps_trained_rows():
    t = table(capacity=1024, init_capacity=32, bucket_capacity=8)
    keys = torch.arange(600) * 1_000_003
    with torch.no_grad():
        first = t(keys)
    s = t.stats()
    assert s["growths"] >= 1 and s["size"] == 600 and s["current_capacity"] <= s["capacity"]
    values, found = t.find(keys)
    assert bool(found.all())
    torch.testing.assert_close(values, first)


def test_frozen_table_has_no_grad():
    t = dynemb.DynamicEmbedding(D, 64)
    out = t(torch.tensor([1]))
    assert not out.requires_grad and t.size() == 1


def test_bag_argument_errors():
    bag = dynemb.DynamicEmbeddingBag(D, 64, mode="sum")
    with pytest.raises(ValueError, match="offsets is required"):
        bag(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="offsets must be None"):
        bag(torch.tensor([[1, 2]]), torch.tensor([0]))
    with pytest.raises(ValueError, match="mode='none'"):
        dynemb.DynamicEmbeddingBag(D, 64, mode="none")
    with pytest.raises(ValueError, match="mode='max'"):
        dynemb.DynamicEmbeddingBag(D, 64, mode="max")


def test_empty_batch():
    t = table()
    out = t(torch.empty(0, 3, dtype=torch.int64))
    assert out.shape == (0, 3, D)
    out.sum().backward()
    bag = dynemb.DynamicEmbeddingBag(D, 64, mode="mean", optimizer=dynemb.optim.SGD(lr=0.1))
    pooled = bag(torch.empty(0, dtype=torch.int64), torch.tensor([0, 0]))
    assert torch.equal(pooled, torch.zeros(2, D))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(capacity=0), "capacity=0"),
        (dict(init_capacity=10_000), "init_capacity=10000"),
        (dict(score_strategy="lru"), "score_strategy='lru'"),
        (dict(check_mode="ignore"), "check_mode='ignore'"),
        (dict(max_load_factor=1.5), "max_load_factor=1.5"),
        (dict(dtype=torch.int32), "dtype=torch.int32"),
        (dict(device="gpu0"), "device='gpu0'"),
        (dict(eval_default=float("nan")), "eval_default=nan"),
    ],
)
def test_config_errors_name_field_and_value(kwargs, match):
    kwargs.setdefault("capacity", 256)
    with pytest.raises(ValueError, match=match):
        dynemb.DynamicEmbedding(D, optimizer=None, **kwargs)


def test_optimizer_errors():
    with pytest.raises(ValueError, match="lr=-1"):
        dynemb.optim.SGD(lr=-1)
    with pytest.raises(ValueError, match="betas"):
        dynemb.optim.Adam(betas=(1.5, 0.9))
    with pytest.raises(TypeError, match="optimizer="):
        dynemb.DynamicEmbedding(D, 64, optimizer=torch.optim.SGD)
    opt = dynemb.optim.Adagrad()
    with pytest.raises(ValueError, match="lr=nan"):
        opt.lr = float("nan")


def test_id_errors():
    t = table()
    with pytest.raises(TypeError, match="ids.dtype=torch.float32"):
        t(torch.tensor([1.0]))
    with pytest.raises(TypeError, match="ids must be a torch.Tensor"):
        t({1, 2})
    with pytest.raises(TypeError, match="ids must be a tensor of int64 or a list of ints"):
        t([1.5, "a"])
    assert t.size() == 0


def test_int32_ids_accepted():
    t = table()
    with torch.no_grad():
        a = t(torch.tensor([3, 4], dtype=torch.int32))
        b = t(torch.tensor([3, 4]))
    torch.testing.assert_close(a, b)


def _export(t):
    chunks = list(t.export(chunk_size=16))
    keys = torch.cat([c["keys"] for c in chunks]).tolist()
    rows = torch.cat([torch.cat([c["embeddings"], c["optimizer_state"]], 1) for c in chunks])
    return keys, rows


def test_insert_detaches_values():
    t = table()
    t.insert(torch.tensor([1, 2]), torch.randn(2, D, requires_grad=True))
    assert not t.store.data.requires_grad and t.store.data.grad_fn is None


def test_insert_raise_keeps_given_values_for_keys_that_fit():
    t = dynemb.DynamicEmbedding(2, 4, bucket_capacity=2, score_strategy="no_eviction")
    with pytest.raises(dynemb.InsertionError) as err:
        t.insert(torch.arange(10), torch.full((10, 2), 7.0))
    values, found = t.find(torch.arange(10))
    assert int(found.sum()) == 10 - err.value.failed_keys.numel() > 0
    assert bool((values[found] == 7.0).all())


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.int32])
def test_dtypes_without_arithmetic_rejected(dtype):
    with pytest.raises(ValueError, match=f"dtype={dtype}"):
        dynemb.DynamicEmbedding(D, 64, dtype=dtype)


def test_float16_table_trains_without_nan():
    # A zero gradient on zero Adagrad state: float16 arithmetic would give 0 / (0 + eps) with eps
    # rounded to 0, i.e. NaN; the update runs in float32.
    t = dynemb.DynamicEmbedding(D, 64, optimizer=dynemb.optim.Adagrad(), dtype=torch.float16)
    (t(torch.tensor([1, 2])) * 0).sum().backward()
    values, _ = t.find(torch.tensor([1, 2]))
    assert values.dtype == torch.float16 and bool(torch.isfinite(values).all())


def test_bfloat16_table_trains_without_nan():
    t = dynemb.DynamicEmbedding(D, 64, optimizer=dynemb.optim.Adam(), dtype=torch.bfloat16)
    (t(torch.tensor([1, 2])) * 0).sum().backward()
    values, _ = t.find(torch.tensor([1, 2]))
    assert bool(torch.isfinite(values).all())


def test_bag_rejects_bad_input_before_touching_the_table():
    bag = dynemb.DynamicEmbeddingBag(D, 64, mode="mean", optimizer=dynemb.optim.SGD(lr=0.1))
    with pytest.raises(ValueError, match="per_sample_weights needs mode='sum'"):
        bag(torch.tensor([1, 2, 3]), torch.tensor([0, 2]), per_sample_weights=torch.ones(3))
    with pytest.raises(ValueError, match="offsets=.*len\\(ids\\)=4"):
        bag(torch.tensor([1, 2, 3, 4]), torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="offsets=.*must start at 0"):
        bag(torch.tensor([1, 2, 3, 4]), torch.tensor([1, 2]))
    assert bag.size() == 0 and bag.step == 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_table_accepts_cuda_ids():
    t = dynemb.DynamicEmbedding(D, 64, optimizer=dynemb.optim.SGD(lr=0.1), device="cuda")
    t(torch.tensor([1, 2], device="cuda")).sum().backward()
    assert t.size() == 2


def test_admitted_key_that_fails_keeps_its_count():
    t = table(capacity=4, bucket_capacity=4, score_strategy="no_eviction", check_mode="count", admission=dynemb.Admission(threshold=2))
    with torch.no_grad():
        t(torch.tensor([1, 2, 3, 4] * 2))
        assert t.size() == 4
        t(torch.tensor([9, 9]))  # admitted, but the table is full: fails
        assert t.last_failed_keys.tolist() == [9]
        t.erase(torch.tensor([1]))
        t(torch.tensor([9]))  # one more sighting is enough: its count was kept
    _, found = t.find(torch.tensor([9]))
    assert bool(found.all())
