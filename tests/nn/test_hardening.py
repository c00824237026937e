"""Regression tests for what broke when the table was tried as a new user would (issue 7's
findings 3-10; 1-2 are in test_state_dict.py).

N ids, D embedding dim.
"""

from __future__ import annotations

import sys
import threading

import pytest
import torch

import dynemb
from dynemb import workspace

D = 8


def table(**kw):
    kw.setdefault("optimizer", dynemb.optim.SGD(lr=0.5))
    return dynemb.DynamicEmbedding(D, kw.pop("capacity", 256), **kw)


def snapshot(t: dynemb.DynamicTable) -> dict:
    return {k: v.clone() for k, v in t.table_state().items()}


def assert_unchanged(t: dynemb.DynamicTable, before: dict) -> None:
    after = t.table_state()
    assert after.keys() == before.keys()
    for name in before:
        assert torch.equal(after[name], before[name]), name


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
@pytest.mark.parametrize("bag", [False, True])
def test_lookup_under_inference_mode_never_breaks_training(mode, bag):
    kw = dict(optimizer=dynemb.optim.Adam(lr=0.01), init_capacity=16, capacity=1024)
    t = dynemb.DynamicEmbeddingBag(D, mode="sum", **kw) if bag else dynemb.DynamicEmbedding(D, **kw)
    ctx = torch.inference_mode if mode == "inference_mode" else torch.no_grad
    with ctx():
        # Enough new keys to grow the table and its buffers under inference mode.
        ids = torch.arange(500).view(100, 5)
        t(ids)
        t.find(torch.arange(10))
        t.insert(torch.tensor([10_000]), torch.ones(1, D))
    assert t.size() == 501, "a training-mode lookup inserts under no_grad / inference_mode (documented)"
    for step in range(3):
        t(torch.arange(step * 400, step * 400 + 600).view(120, 5)).sum().backward()
    t.eval()
    with ctx():
        t(torch.arange(50).view(10, 5))
    t.train()
    t(torch.arange(50).view(10, 5)).sum().backward()


def test_training_lookup_under_no_grad_inserts_but_does_not_update():
    t = table()
    with torch.no_grad():
        out = t(torch.tensor([1, 2]))
    assert not out.requires_grad and t.size() == 2 and t.stats()["step"] == 1
    before, _ = t.find(torch.tensor([1, 2]))
    torch.testing.assert_close(before, out, rtol=0, atol=0)


def test_concurrent_find_gives_correct_results():
    t = table(capacity=1 << 14, init_capacity=1 << 10)
    keys = torch.arange(8000) * 7919 - 4000
    values = (keys.to(torch.float32)[:, None] * torch.arange(1, D + 1)).contiguous()
    t.insert(keys, values)
    errors = []

    def reader(seed):
        g = torch.Generator().manual_seed(seed)
        for _ in range(60):
            idx = torch.randint(0, keys.numel(), (int(torch.randint(1, 3000, (1,), generator=g)),), generator=g)
            got, found = t.find(keys[idx])
            if not (bool(found.all()) and torch.equal(got, values[idx])):
                errors.append(seed)

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not errors


def test_concurrent_training_never_corrupts_the_table():
    """Two threads train one table; SGD with exact arithmetic makes the outcome order-free."""
    init = dynemb.Initializer(kind="constant", value=0.0)
    shared = table(initializer=init, capacity=4096, init_capacity=64)
    serial = table(initializer=init, capacity=4096, init_capacity=64)
    batches = [torch.randint(0, 3000, (2, 257), generator=torch.Generator().manual_seed(s)) for s in range(40)]

    def work(part):
        for ids in part:
            shared(ids).sum().backward()

    threads = [threading.Thread(target=work, args=(batches[i::2],)) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    for ids in batches:
        serial(ids).sum().backward()
    keys = torch.arange(3000)
    a, fa = shared.find(keys)
    b, fb = serial.find(keys)
    assert torch.equal(fa, fb) and torch.equal(a, b)
    assert shared.size() == serial.size()


@pytest.mark.parametrize("bag", [False, True])
def test_concurrent_lookups_read_their_own_keys_rows(bag):
    """Threads train one small table that evicts on every batch, with lr 0, so a key's row is
    always its per-key initial value. Each output must hold its own ids' rows: a lookup that
    reads its rows from the store in place (docs/design/0042) copies them before another
    thread's lookup can evict and reuse them."""
    zero = dynemb.optim.SGD(lr=0.0)
    gen = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 5000, (160,), generator=gen) for _ in range(30)]
    if bag:
        config = {"embedding_dim": D, "feature_names": ["f"], "pooling": "sum"}
        shared = dynemb.DynamicEmbeddingBagCollection([dynemb.TableConfig(name="t", capacity=256, **config)], zero)
        ref = dynemb.DynamicEmbeddingBagCollection([dynemb.TableConfig(name="t", capacity=8192, **config)], zero)
        ones = torch.ones(160, dtype=torch.int64)

        def call(module, ids):
            return module({"f": (ids, ones)}).concat
    else:
        shared, ref = table(capacity=256, optimizer=zero), table(capacity=8192, optimizer=zero)

        def call(module, ids):
            return module(ids)

    want = [call(ref, ids).detach() for ids in batches]
    wrong = []

    def work(part):
        for i in part:
            out = call(shared, batches[i])
            out.sum().backward()
            if not torch.equal(out.detach(), want[i]):
                wrong.append(i)

    threads = [threading.Thread(target=work, args=(range(k, len(batches), 3),)) for k in range(3)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between nearly every two bytecodes
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=120)
    finally:
        sys.setswitchinterval(interval)
    assert not any(th.is_alive() for th in threads)
    assert shared.stats()["evictions"] if not bag else shared.stats()["t"]["evictions"]
    assert wrong == []


def _bad_calls():
    f32 = torch.float32
    return [
        ("bag", lambda b: b(torch.tensor([1, 2, 3]), torch.tensor([0, 2]), per_sample_weights=torch.ones(3, dtype=torch.float64)), ValueError),
        ("bag_last", lambda b: b(torch.tensor([1, 2, 3]), torch.tensor([], dtype=torch.int64)), ValueError),
        ("bag_last", lambda b: b(torch.tensor([1, 2, 3]), torch.tensor([0, 2])), ValueError),
        ("bag", lambda b: b(torch.tensor([1, 2, 3]), torch.tensor([1, 2])), ValueError),
        ("bag", lambda b: b(torch.tensor([1, 2, 3]), torch.tensor([0, 5])), ValueError),
        ("bag", lambda b: b(torch.tensor([1, 2, 3]), torch.tensor([0, 2]), per_sample_weights=torch.ones(2)), ValueError),
        ("seq", lambda t: t(torch.tensor([1.0, 2.0])), TypeError),
        ("seq", lambda t: t("abc"), TypeError),
        ("seq", lambda t: t([1, "a"]), TypeError),
        ("seq", lambda t: t.insert(torch.tensor([5, 5]), torch.ones(2, D)), ValueError),
        ("seq", lambda t: t.insert(torch.tensor([5, 6]), torch.ones(2, D + 1)), ValueError),
        ("seq", lambda t: t.insert(torch.tensor([5, 6]), torch.ones(2, D, dtype=torch.int64)), TypeError),
        ("seq", lambda t: t.insert(torch.tensor([5, 6]), torch.ones(2, D, dtype=f32), scores=torch.tensor([1])), ValueError),
        ("seq", lambda t: t.insert(torch.tensor([5, 6]), torch.ones(2, D), scores=torch.tensor([1.0, 2.0])), TypeError),
        ("seq", lambda t: t.erase(torch.tensor([1.5])), TypeError),
        ("seq", lambda t: t.find(torch.tensor([1.5])), TypeError),
        ("seq", lambda t: t.load_state_dict({"keys": torch.tensor([1])}), RuntimeError),
        ("custom", lambda t: t.set_score(2**70), ValueError),
        ("custom", lambda t: t.set_score(1.5), ValueError),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls())))
def test_bad_input_changes_nothing(case):
    kind, call, error = _bad_calls()[case]
    if kind.startswith("bag"):
        t = dynemb.DynamicEmbeddingBag(D, 64, mode="sum", include_last_offset=kind == "bag_last", optimizer=dynemb.optim.Adam(lr=0.1))
        t(torch.tensor([7, 8, 9]), torch.tensor([0, 1, 3]) if kind == "bag_last" else torch.tensor([0, 1])).sum().backward()
    elif kind == "custom":
        t = table(score_strategy="customized")
        t.set_score(5)
        t(torch.tensor([7, 8])).sum().backward()
    else:
        t = table(optimizer=dynemb.optim.Adam(lr=0.1))
        t(torch.tensor([7, 8, 9])).sum().backward()
    before = snapshot(t)
    with pytest.raises(error):
        call(t)
    assert_unchanged(t, before)


def test_lists_become_tensors():
    t = table()
    out = t([[1, 2], [3, 1]])
    assert out.shape == (2, 2, D)
    assert t.contains([1, 4]).tolist() == [True, False]
    bag = dynemb.DynamicEmbeddingBag(D, 64, mode="sum")
    assert bag([1, 2, 3], [0, 1]).shape == (2, D)


def test_unavailable_device_and_absurd_capacity_raise_value_error():
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device='cuda'.*not available"):
            table(device="cuda")
    with pytest.raises(ValueError, match=r"capacity=4611686018427387904: .*needs [\d,]+ bytes"):
        table(capacity=1 << 62)


def _nan_step(t):
    out = t(torch.tensor([1, 2, 3]))
    scale = torch.ones(3, 1)
    scale[1] = float("nan")
    (out * scale).sum().backward()


@pytest.mark.parametrize("optimizer", [dynemb.optim.SGD(lr=0.1), dynemb.optim.Adam(lr=0.1)])
def test_nonfinite_grads_skip_by_default(optimizer):
    t = table(optimizer=optimizer)
    t(torch.tensor([1, 2, 3]))
    before, _ = t.find(torch.tensor([1, 2, 3]))
    _nan_step(t)
    after, _ = t.find(torch.tensor([1, 2, 3]))
    assert torch.equal(after[1], before[1]) and torch.isfinite(after).all()
    assert not torch.equal(after[0], before[0])
    assert t.stats()["nonfinite_grads"] == 1


def test_nonfinite_grads_raise_and_apply():
    t = table(nonfinite_grads="raise")
    t(torch.tensor([1, 2, 3]))
    before = snapshot(t)
    with pytest.raises(FloatingPointError, match="non-finite gradient for 1 key"):
        _nan_step(t)
    # The forward advanced the step; no row changed.
    after = t.table_state()
    assert torch.equal(after["embeddings"], before["embeddings"])
    t = table(nonfinite_grads="apply")
    _nan_step(t)
    assert torch.isnan(t.find(torch.tensor([2]))[0]).all()
    with pytest.raises(ValueError, match="nonfinite_grads='sometimes'"):
        table(nonfinite_grads="sometimes")


def test_second_backward_says_what_happened():
    t = table()
    loss = t(torch.tensor([1, 2])).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice through one dynemb lookup"):
        loss.backward()


def test_to_moves_and_converts_the_whole_table():
    t = table(optimizer=dynemb.optim.Adagrad(lr=0.1))
    t(torch.tensor([1, 2])).sum().backward()
    before = t.table_state()
    assert t.double() is t
    assert t.config.dtype == torch.float64
    state = t.table_state()
    torch.testing.assert_close(state["embeddings"], before["embeddings"].double(), rtol=0, atol=0)
    t(torch.tensor([1, 3])).sum().backward()
    assert t.find(torch.tensor([3]))[0].dtype == torch.float64
    with pytest.raises(ValueError, match="dtype=torch.float8_e4m3fn"):
        t.to(torch.float8_e4m3fn)
    assert t.config.dtype == torch.float64
    model = torch.nn.Sequential(t).to(torch.float32).cpu()
    assert model[0].config.dtype == torch.float32
    if not torch.cuda.is_available():
        with pytest.raises((RuntimeError, AssertionError, ValueError)):
            t.cuda()
        assert t.device == torch.device("cpu") and t.size() == 3


def test_len_and_membership():
    t = table()
    t(torch.tensor([4, 5, 4]))
    assert len(t) == 2
    assert 4 in t and torch.tensor(5) in t and 6 not in t
    assert t.contains(torch.tensor([[4, 6], [5, 5]])).tolist() == [[True, False], [True, True]]
    with pytest.raises(TypeError, match="contains"):
        torch.tensor([4, 5]) in t  # noqa: B015


def test_lr_scheduler_drives_the_fused_optimizer():
    t = table(optimizer=dynemb.optim.SGD(lr=1.0), initializer=dynemb.Initializer(kind="constant", value=0.0))
    sched = torch.optim.lr_scheduler.StepLR(t.optimizer, step_size=1, gamma=0.5)
    for _ in range(3):
        t(torch.tensor([1])).sum().backward()
        t.optimizer.step()
        sched.step()
    # 1 + 0.5 + 0.25 of lr applied to a gradient of ones
    torch.testing.assert_close(t.find(torch.tensor([1]))[0], torch.full((1, D), -1.75))


def test_real_capacity_at_most_twice_the_request_and_in_stats():
    for capacity, init in [(1000, 1), (1000, None), (5, None), (3000, 17), (1 << 16, 1 << 10)]:
        t = table(capacity=capacity, init_capacity=init)
        s = t.stats()
        assert capacity <= s["capacity"] <= 2 * capacity, (capacity, init, s["capacity"])
        assert s["requested_capacity"] == capacity


def test_scratch_memory_shrinks_after_an_outsized_batch():
    t = table(capacity=1 << 18)
    t(torch.arange(200_000)).sum().backward()
    big = t.stats()["scratch_bytes"]
    for i in range(workspace.SHRINK_WINDOW * 2 + 1):
        t(torch.tensor([i, i + 1])).sum().backward()
    small = t.stats()["scratch_bytes"]
    assert small < big / 50, (big, small)


def test_lfu_with_raise_keeps_training_once_full():
    t = table(capacity=64, score_strategy="lfu")
    for step in range(30):
        ids = torch.arange(step * 20, step * 20 + 20)
        t(torch.cat([ids, ids[:5]])).sum().backward()
    assert t.size() <= t.capacity() and t.stats()["evictions"] > 0


def test_full_size_table_takes_95_percent_before_any_eviction():
    t = table(capacity=1 << 14, check_mode="count")
    n = int(0.95 * t.capacity())
    keys = torch.randint(-(2**63), 2**63 - 1, (n,), generator=torch.Generator().manual_seed(0)).unique()
    for part in keys.split(1024):
        t.insert(part, torch.zeros(part.numel(), D))
        assert t.last_evicted_keys.numel() == 0 and t.last_failed_keys.numel() == 0
    assert t.size() == keys.numel() and t.stats()["evictions"] == 0


def _contents(t):
    out = {}
    for c in t.export():
        for k, e, s in zip(c["keys"].tolist(), c["embeddings"], c["optimizer_state"]):
            out[k] = (e.clone(), s.clone())
    return out


def test_every_key_that_leaves_is_reported_with_its_row():
    t = table(capacity=128, check_mode="count", score_strategy="step", optimizer=dynemb.optim.Adagrad(lr=0.1))
    left = []
    handle = t.register_evict_hook(lambda keys, rows: left.append((keys.clone(), {k: v.clone() for k, v in rows.items()})))
    for step in range(20):
        ids = torch.arange(step * 40, step * 40 + 60)
        before = _contents(t)
        s0 = t.stats()
        t(ids).sum().backward()
        s1 = t.stats()
        evicted, failed = t.last_evicted_keys, t.last_failed_keys
        # Conservation: size before + inserted = size after + evicted + failed keys... that left.
        assert s0["size"] + (s1["inserts"] - s0["inserts"]) == s1["size"] + evicted.numel()
        assert s1["failed_inserts"] - s0["failed_inserts"] == failed.numel()
        if evicted.numel():
            keys, rows = left[-1]
            assert torch.equal(keys, evicted)
            for i, k in enumerate(keys.tolist()):
                assert torch.equal(rows["embeddings"][i], before[k][0]) and torch.equal(rows["optimizer_state"][i], before[k][1])
            assert rows["scores"].dtype == torch.int64
    assert t.stats()["evictions"] == sum(k.numel() for k, _ in left) > 0
    first = next(t.export())["keys"][:1]
    t.erase(first)
    assert torch.equal(left[-1][0], first) and torch.equal(t.last_evicted_keys, first) and t.stats()["erased"] == 1
    handle.remove()
    n = len(left)
    t(torch.arange(10_000, 10_200)).sum().backward()
    assert len(left) == n and t.last_evicted_keys.numel() > 0
