"""Dtype conversions (``.half()``, ``.bfloat16()``, ``.double()``, ``.float()``, ``.to(dtype)``) of
models holding dynemb tables, against torch.nn.Embedding(Bag) + torch.optim converted the same way
(docs/design/0021-dtype-moves.md).

K keys (arbitrary int64, standing for the reference's ids 0..K-1), B samples, D embedding dim,
S optimizer state columns.
"""

from __future__ import annotations

import pytest
import torch

import dynemb

KEYS = torch.tensor([0, -1, -(2**63), 2**63 - 1, 7, 2**40 + 3, -(2**62), 12345])
K, D, B, LR = KEYS.numel(), 4, 6, 0.1
TABLES = ("a", "b")

# name -> (dtype the model is built in, the conversion, dtype after it)
CONVERSIONS = {
    "half": (torch.float32, lambda m: m.half(), torch.float16),
    "bfloat16": (torch.float32, lambda m: m.bfloat16(), torch.bfloat16),
    "double": (torch.float32, lambda m: m.double(), torch.float64),
    "float": (torch.float64, lambda m: m.float(), torch.float32),
    "to_float64": (torch.float32, lambda m: m.to(torch.float64), torch.float64),
    "to_float16": (torch.float32, lambda m: m.to(torch.float16), torch.float16),
}
KINDS = ("embedding", "bag", "collection", "bag_collection")
OPTIMIZERS = {
    "adagrad": (lambda: dynemb.optim.Adagrad(lr=LR), lambda p: torch.optim.Adagrad([p], lr=LR)),
    "adam": (lambda: dynemb.optim.Adam(lr=LR, betas=(0.8, 0.9)), lambda p: torch.optim.SparseAdam([p], lr=LR, betas=(0.8, 0.9))),
}


def table_names(kind: str) -> tuple[str, ...]:
    return TABLES if "collection" in kind else TABLES[:1]


def build(kind: str, optimizer, dtype: torch.dtype, **kw) -> torch.nn.Module:
    if kind == "embedding":
        return dynemb.DynamicEmbedding(D, 64, optimizer=optimizer, dtype=dtype, **kw)
    if kind == "bag":
        return dynemb.DynamicEmbeddingBag(D, 64, mode="sum", optimizer=optimizer, dtype=dtype, **kw)
    configs = [dynemb.TableConfig(name=t, feature_names=[f"f{t}"], embedding_dim=D, capacity=64, dtype=dtype, **kw) for t in TABLES]
    cls = dynemb.DynamicEmbeddingCollection if kind == "collection" else dynemb.DynamicEmbeddingBagCollection
    return cls(configs, optimizer)


def insert(sparse, kind: str, table: str, keys: torch.Tensor, rows: torch.Tensor) -> None:
    if "collection" in kind:
        sparse.insert(table, keys, rows)
    else:
        sparse.insert(keys, rows)


def rows_of(sparse, kind: str, table: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The table's embeddings [K, D] and optimizer state [K, S], in KEYS order."""
    chunks = list(sparse.export(table) if "collection" in kind else sparse.export())
    keys = torch.cat([c["keys"] for c in chunks])
    order = torch.argsort(keys)
    pos = order[torch.searchsorted(keys[order], KEYS.to(keys.device))]
    assert torch.equal(keys[pos].cpu(), KEYS)
    return torch.cat([c["embeddings"] for c in chunks])[pos], torch.cat([c["optimizer_state"] for c in chunks])[pos]


def batch(step: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Dense input [B, 3] and, per table, the reference ids [B, 2] (two ids a sample; sequence
    kinds read the first)."""
    g = torch.Generator().manual_seed(step)
    return torch.randn(B, 3, generator=g), {t: torch.randint(0, K, (B, 2), generator=g) for t in TABLES}


def sparse_out(sparse, kind: str, idx: dict[str, torch.Tensor]) -> torch.Tensor:
    """Our sparse output [B, D * tables]."""
    keys = KEYS.to(idx["a"].device)
    n = idx["a"].shape[0]
    lengths = {k: torch.full((n,), k, device=keys.device) for k in (1, 2)}
    if kind == "embedding":
        return sparse(keys[idx["a"][:, 0]])
    if kind == "bag":
        return sparse(keys[idx["a"]].reshape(-1), torch.arange(0, 2 * n, 2, device=keys.device))
    if kind == "collection":
        out = sparse({f"f{t}": (keys[idx[t][:, 0]], lengths[1]) for t in TABLES})
        return torch.cat([out[f"f{t}"][0] for t in TABLES], 1)
    return sparse({f"f{t}": (keys[idx[t]].reshape(-1), lengths[2]) for t in TABLES}).concat


def reference_out(refs: torch.nn.ModuleDict, kind: str, idx: dict[str, torch.Tensor]) -> torch.Tensor:
    if kind in ("embedding", "collection"):
        return torch.cat([refs[t](idx[t][:, 0]) for t in refs], 1)
    return torch.cat([refs[t](idx[t]) for t in refs], 1)


def coefficients(shape: torch.Size, dtype: torch.dtype, device) -> torch.Tensor:
    """The loss's weights [B, D * tables]: multiples of 1/8 in [-1, 1]. Every gradient is then
    exact in each dtype, and so is a key's gradient summed over its ids in any order (dynemb and
    torch sum in different orders): results differ only by the optimizers' arithmetic."""
    n = shape[0] * shape[1]
    return ((torch.arange(n, device=device) % 17 - 8) / 8).view(shape).to(dtype)


class Model(torch.nn.Module):
    """A Linear before the sparse part (it is converted first); loss: their sum, weighted."""

    def __init__(self, sparse: torch.nn.Module, kind: str, forward):
        super().__init__()
        self.dense = torch.nn.Linear(3, D * len(table_names(kind)))
        self.sparse, self.kind, self._forward = sparse, kind, forward

    def forward(self, x, idx):
        out = self.dense(x.to(self.dense.weight.dtype)) + self._forward(self.sparse, self.kind, idx)
        return (out * coefficients(out.shape, out.dtype, out.device)).sum()


def twins(kind: str, opt: str, dtype: torch.dtype):
    """Our model and torch's twin (one nn.Embedding(Bag)(sparse=True) per table) holding the same
    rows, the same dense weights, and our rows' optimizer state (reference order)."""
    ours = Model(build(kind, OPTIMIZERS[opt][0](), dtype), kind, sparse_out).to(dtype)
    S = {"adagrad": D, "adam": 2 * D}[opt]
    g = torch.Generator().manual_seed(0)
    refs, states = torch.nn.ModuleDict(), {}
    for t in table_names(kind):
        # Accumulators / second moments must be >= 0.
        rows = torch.cat([torch.randn(K, D, generator=g), torch.rand(K, S, generator=g)], 1).to(dtype)
        insert(ours.sparse, kind, t, KEYS, rows)
        cls = torch.nn.Embedding if kind in ("embedding", "collection") else torch.nn.EmbeddingBag
        refs[t] = cls(K, D, sparse=True, **({} if cls is torch.nn.Embedding else {"mode": "sum"})).to(dtype)
        with torch.no_grad():
            refs[t].weight.copy_(rows[:, :D])
        states[t] = rows[:, D:]
    ref = Model(refs, kind, reference_out).to(dtype)
    ref.dense.load_state_dict(ours.dense.state_dict())
    return ours, ref, states


def reference_optimizer(opt: str, weight: torch.nn.Parameter, state: torch.Tensor):
    """torch's optimizer over ``weight`` starting from dynemb's state [K, S] (step 0)."""
    ref_opt = OPTIMIZERS[opt][1](weight)
    if opt == "adagrad":
        ref_opt.state[weight]["sum"].copy_(state)
    else:
        ref_opt.state[weight] = {"step": 0, "exp_avg": state[:, :D].clone(), "exp_avg_sq": state[:, D:].clone()}
    return ref_opt


def reference_state(opt: str, ref_opt, weight) -> torch.Tensor:
    if isinstance(ref_opt, RoundedOnce):
        return ref_opt.state()
    s = ref_opt.state[weight]
    return s["sum"] if opt == "adagrad" else torch.cat([s["exp_avg"], s["exp_avg_sq"]], 1)


class RoundedOnce:
    """torch's optimizer for a 16-bit weight as dynemb updates 16-bit rows: the step in float32
    on the upcast weight, gradient and state, then weight and state rounded once."""

    def __init__(self, opt: str, weight: torch.nn.Parameter, state: torch.Tensor):
        self.name, self.weight = opt, weight
        self.shadow = torch.nn.Parameter(weight.detach().float())
        self.opt = reference_optimizer(opt, self.shadow, state.float())

    def zero_grad(self):
        self.weight.grad = None

    @torch.no_grad()
    def step(self):
        self.shadow.grad = self.weight.grad.float()
        self.opt.step()
        self.weight.copy_(self.shadow)
        self.shadow.copy_(self.weight)
        for v in self.opt.state[self.shadow].values():
            if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim():
                v.copy_(v.to(self.weight.dtype))

    def state(self) -> torch.Tensor:
        return reference_state(self.name, self.opt, self.shadow).to(self.weight.dtype)


def cases():
    for kind in KINDS:
        for conv in CONVERSIONS:
            for opt in OPTIMIZERS:
                # Adam cannot train float16 rows: test_adam_on_float16_rows_serves_but_refuses_training.
                if not (opt == "adam" and CONVERSIONS[conv][2] == torch.float16):
                    yield kind, conv, opt


@pytest.mark.parametrize("kind,conv,opt", list(cases()))
def test_conversion_matches_torch_converted_the_same_way(kind, conv, opt):
    before, convert, after = CONVERSIONS[conv]
    ours, ref, states = twins(kind, opt, before)
    assert convert(ours) is ours
    convert(ref)
    assert {p.dtype for p in ours.parameters()} == {after}
    for t in table_names(kind):
        emb, state = rows_of(ours.sparse, kind, t)
        assert emb.dtype == state.dtype == after
        # A conversion is one rounding of the same values: bitwise equal to torch's.
        torch.testing.assert_close(emb, ref.sparse[t].weight.detach(), rtol=0, atol=0)
        torch.testing.assert_close(state, states[t].to(after), rtol=0, atol=0)
    # Training continues in the new dtype, step after step, as torch's optimizers in that dtype
    # (16-bit: in float32, rounded once per step, which is what dynemb promises for them).
    sixteen = after in (torch.float16, torch.bfloat16)
    make = (lambda o, w, st: RoundedOnce(o, w, st)) if sixteen else reference_optimizer
    ref_opts = {t: make(opt, ref.sparse[t].weight, states[t].to(after)) for t in table_names(kind)}
    dense_ours, dense_ref = torch.optim.SGD(ours.dense.parameters(), lr=LR), torch.optim.SGD(ref.dense.parameters(), lr=LR)
    for step in range(3):
        x, idx = batch(step)
        loss, ref_loss = ours(x, idx), ref(x, idx)
        assert loss.dtype == after
        torch.testing.assert_close(loss, ref_loss)
        for o in (dense_ours, dense_ref, *ref_opts.values()):
            o.zero_grad()
        loss.backward()
        ref_loss.backward()
        for o in (dense_ours, dense_ref, *ref_opts.values()):
            o.step()
        torch.testing.assert_close(ours.dense.weight, ref.dense.weight)
        for t in table_names(kind):
            emb, state = rows_of(ours.sparse, kind, t)
            assert emb.dtype == state.dtype == after
            torch.testing.assert_close(emb, ref.sparse[t].weight.detach())
            torch.testing.assert_close(state, reference_state(opt, ref_opts[t], ref.sparse[t].weight))


@pytest.mark.parametrize("kind", KINDS)
def test_float16_training_updates_in_float32_rounded_once(kind):
    # What a float16 table promises: the float32 update of its float16 values (rows, state and
    # gradient, all exact in float32), rounded once. Reference: torch in float32 on those values.
    ours, ref, states = twins(kind, "adagrad", torch.float32)
    ours.half()
    with torch.no_grad():
        for t in table_names(kind):
            ref.sparse[t].weight.copy_(ref.sparse[t].weight.half().float())
    ref_opts = {t: reference_optimizer("adagrad", ref.sparse[t].weight, states[t].half().float()) for t in table_names(kind)}
    for step in range(3):
        x, idx = batch(step)
        ours(x, idx).backward()
        for o in ref_opts.values():
            o.zero_grad()
        ref(x, idx).backward()
        for o in ref_opts.values():
            o.step()
        for t in table_names(kind):
            emb, state = rows_of(ours.sparse, kind, t)
            torch.testing.assert_close(emb, ref.sparse[t].weight.detach().half())
            torch.testing.assert_close(state, reference_state("adagrad", ref_opts[t], ref.sparse[t].weight).half())
            # The next step starts from the rounded values, as the table's does.
            with torch.no_grad():
                ref.sparse[t].weight.copy_(emb.float())
                ref_opts[t].state[ref.sparse[t].weight]["sum"].copy_(state.float())


@pytest.mark.parametrize("kind", KINDS)
def test_adam_on_float16_rows_serves_but_refuses_training(kind):
    ours, ref, states = twins(kind, "adam", torch.float32)
    ours.half()
    ref.half()
    for t in table_names(kind):
        emb, state = rows_of(ours.sparse, kind, t)
        torch.testing.assert_close(emb, ref.sparse[t].weight.detach(), rtol=0, atol=0)
        torch.testing.assert_close(state, states[t].half(), rtol=0, atol=0)
    x, idx = batch(0)
    ours.eval()
    ref.eval()
    torch.testing.assert_close(ours(x, idx), ref(x, idx))
    ours.train()
    before = {t: rows_of(ours.sparse, kind, t) for t in table_names(kind)}
    size = len(ours.sparse) if "collection" not in kind else {t: s["size"] for t, s in ours.sparse.stats().items()}
    with pytest.raises(ValueError, match=r"dtype=torch.float16: Adam cannot train"):
        ours(x, {t: torch.full((B, 2), 0) for t in TABLES})
    assert ours.sparse.step == 0
    assert size == (len(ours.sparse) if "collection" not in kind else {t: s["size"] for t, s in ours.sparse.stats().items()})
    for t in table_names(kind):
        after = rows_of(ours.sparse, kind, t)
        assert torch.equal(after[0], before[t][0]) and torch.equal(after[1], before[t][1])
    # Back to float32, training resumes.
    ours.float()
    ours(x, idx).backward()
    assert not torch.equal(rows_of(ours.sparse, kind, table_names(kind)[0])[0], before[table_names(kind)[0]][0].float())


def test_adam_float16_table_can_be_built_and_loaded_for_serving():
    t = dynemb.DynamicEmbedding(D, 64, optimizer=dynemb.optim.Adam(), dtype=torch.float16)
    t.insert(KEYS, torch.ones(K, D))
    t.eval()
    assert torch.equal(t(KEYS), torch.ones(K, D, dtype=torch.float16))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.complex64])
@pytest.mark.parametrize("kind", KINDS)
def test_dtype_no_table_holds_leaves_the_table_unchanged(kind, dtype):
    ours, _, _ = twins(kind, "adagrad", torch.float32)
    before = {t: rows_of(ours.sparse, kind, t) for t in table_names(kind)}
    with pytest.raises(ValueError, match=f"dtype={dtype}"):
        ours.to(dtype)
    # torch converted the Linear before the table reached its _apply (nothing can undo that); the
    # table itself is whole and still trains in its dtype.
    assert ours.dense.weight.dtype == dtype
    for t in table_names(kind):
        emb, state = rows_of(ours.sparse, kind, t)
        assert torch.equal(emb, before[t][0]) and torch.equal(state, before[t][1])
    ours.dense = torch.nn.Linear(3, D * len(table_names(kind)))
    ours(*batch(0)).backward()


def test_checkpoint_state_dict_find_export_after_half(tmp_path):
    cfgs = [dynemb.TableConfig(name=t, embedding_dim=D, capacity=64, eval_default=0.5) for t in TABLES]
    model = torch.nn.ModuleDict({"lin": torch.nn.Linear(2, 2), "ebc": dynemb.DynamicEmbeddingBagCollection(cfgs, dynemb.optim.Adagrad(lr=LR))})
    values = torch.randn(K, D)
    model["ebc"].insert("a", KEYS, values)
    model.half()
    found_values, found = model["ebc"].find("a", KEYS)
    assert bool(found.all())
    assert torch.equal(found_values, values.half())
    # A training step in float16, then the state leaves in float16 and loads back.
    model["ebc"]({"a": (KEYS, torch.ones(K, dtype=torch.int64)), "b": (KEYS[:2], torch.tensor([1, 1] + [0] * (K - 2)))}).concat.sum().backward()
    state = model.state_dict()
    assert state["ebc.a.embeddings"].dtype == state["ebc.a.optimizer_state"].dtype == torch.float16
    fresh = torch.nn.ModuleDict({"lin": torch.nn.Linear(2, 2), "ebc": dynemb.DynamicEmbeddingBagCollection(cfgs, dynemb.optim.Adagrad(lr=LR))}).half()
    fresh.load_state_dict(state)
    for name, value in fresh.state_dict().items():
        torch.testing.assert_close(value, state[name], rtol=0, atol=0)
    dynemb.checkpoint.save(model, tmp_path / "ck")
    # Into a float16 model: bitwise; into a float32 one: the exact upcast.
    for dtype in (torch.float16, torch.float32):
        target = torch.nn.ModuleDict({"lin": torch.nn.Linear(2, 2), "ebc": dynemb.DynamicEmbeddingBagCollection(cfgs, dynemb.optim.Adagrad(lr=LR))}).to(dtype)
        dynemb.checkpoint.load(target, tmp_path / "ck")
        emb, opt = rows_of(target["ebc"], "collection", "a")
        ref_emb, ref_opt = rows_of(model["ebc"], "collection", "a")
        assert emb.dtype == dtype
        torch.testing.assert_close(emb, ref_emb.to(dtype), rtol=0, atol=0)
        torch.testing.assert_close(opt, ref_opt.to(dtype), rtol=0, atol=0)
    # Eval: a missing key gets the eval default in the new dtype.
    model.eval()
    out = model["ebc"]({"a": (torch.tensor([999]), torch.ones(1, dtype=torch.int64)), "b": (torch.tensor([998]), torch.ones(1, dtype=torch.int64))})
    assert torch.equal(out["a"], torch.full((1, D), 0.5, dtype=torch.float16))


@pytest.mark.parametrize("kind", ["embedding", "bag_collection"])
def test_pendingdeferred_gradient_follows_the_conversion(kind):
    if kind == "embedding":
        sparse = dynemb.DynamicEmbedding(D, 64, optimizer=dynemb.optim.SGD(lr=1.0), update="deferred")
        sparse.insert(KEYS, torch.randn(K, D))
        sparse(KEYS).mul(torch.linspace(-1, 1, K)[:, None]).sum().backward()
    else:
        cfgs = [dynemb.TableConfig(name=t, feature_names=[f"f{t}"], embedding_dim=D, capacity=64) for t in TABLES]
        sparse = dynemb.DynamicEmbeddingBagCollection(cfgs, dynemb.optim.SGD(lr=1.0), update="deferred")
        for t in TABLES:
            sparse.insert(t, KEYS, torch.randn(K, D))
        ones = torch.ones(K, dtype=torch.int64)
        sparse({f"f{t}": (KEYS, ones) for t in TABLES}).concat.mul(torch.linspace(-1, 1, K)[:, None]).sum().backward()
    names = table_names(kind)
    rows = {t: rows_of(sparse, kind, t)[0] for t in names}
    sparse.half()
    grads = sparse.deferred_grad()
    for g in grads if isinstance(grads, list) else [grads]:
        assert g.dtype == torch.float16
    sparse.optimizer.step()
    # Each key's gradient is its weight in linspace(-1, 1): the row moves by minus that, rounded once.
    expected_grad = torch.linspace(-1, 1, K)[:, None].expand(K, D)
    for t in names:
        expected = (rows[t].half().float() - expected_grad.half().float()).half()
        torch.testing.assert_close(rows_of(sparse, kind, t)[0], expected, rtol=0, atol=0)


def test_collection_of_mixed_dtypes_converts_every_group():
    cfgs = [
        dynemb.TableConfig(name="a", embedding_dim=D, capacity=64, dtype=torch.float32),
        dynemb.TableConfig(name="b", embedding_dim=D, capacity=64, dtype=torch.bfloat16),
    ]
    ebc = dynemb.DynamicEmbeddingBagCollection(cfgs, dynemb.optim.SGD(lr=LR))
    values = torch.randn(K, D)
    for t in TABLES:
        ebc.insert(t, KEYS, values)
    ebc.double()
    assert [c.dtype for c in ebc.table_configs] == [torch.float64, torch.float64]
    torch.testing.assert_close(ebc.find("a", KEYS)[0], values.double(), rtol=0, atol=0)
    torch.testing.assert_close(ebc.find("b", KEYS)[0], values.bfloat16().double(), rtol=0, atol=0)
    ones = torch.ones(K, dtype=torch.int64)
    out = ebc({"a": (KEYS, ones), "b": (KEYS, ones)})
    assert out.concat.dtype == torch.float64
    torch.testing.assert_close(out.concat, torch.cat([values.double(), values.bfloat16().double()], 1), rtol=0, atol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_device_moves_keep_working(kind):
    ours, _, _ = twins(kind, "adagrad", torch.float32)
    before = {t: rows_of(ours.sparse, kind, t) for t in table_names(kind)}
    assert ours.to("cpu") is ours and ours.cpu() is ours
    ours.to("cpu", torch.float64)
    for t in table_names(kind):
        emb, state = rows_of(ours.sparse, kind, t)
        torch.testing.assert_close(emb, before[t][0].double(), rtol=0, atol=0)
        torch.testing.assert_close(state, before[t][1].double(), rtol=0, atol=0)
    if not torch.cuda.is_available():
        with pytest.raises((RuntimeError, AssertionError, ValueError)):
            ours.sparse.cuda()
        assert rows_of(ours.sparse, kind, table_names(kind)[0])[0].device == torch.device("cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_move_and_half_train_and_come_back(kind):
    ours, ref, states = twins(kind, "adagrad", torch.float32)
    ours.cuda().half()
    ref.cuda().half()
    ref_opts = {t: reference_optimizer("adagrad", ref.sparse[t].weight, states[t].half().cuda()) for t in table_names(kind)}
    x, idx = batch(0)
    idx = {t: i.cuda() for t, i in idx.items()}
    loss, ref_loss = ours(x.cuda(), idx), ref(x.cuda(), idx)
    torch.testing.assert_close(loss, ref_loss)
    loss.backward()
    ref_loss.backward()
    for o in ref_opts.values():
        o.step()
    for t in table_names(kind):
        emb, _ = rows_of(ours.sparse, kind, t)
        assert emb.device.type == "cuda" and emb.dtype == torch.float16
        # The reference steps in float16; ours in float32, rounded once: a few float16 ulps apart.
        torch.testing.assert_close(emb, ref.sparse[t].weight.detach(), rtol=4e-3, atol=1e-4)
    ours.cpu().float()
    assert rows_of(ours.sparse, kind, table_names(kind)[0])[0].device == torch.device("cpu")
