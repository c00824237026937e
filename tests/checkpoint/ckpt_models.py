"""A small model holding every kind of dynemb table, its training loop, and exact comparisons of
tables, for the checkpoint tests.

B samples per step, L ids per bag, D embedding dims 4 and 8.

The model holds a DynamicEmbedding, a DynamicEmbeddingBag and a DynamicEmbeddingBagCollection of
three tables in two groups (``user`` and ``item`` of dim 4, ``tag`` of dim 8), ``item`` read by two
features. Batches are a function of the step only and draw from far more keys than the tables
hold, so training evicts (or, with ``no_eviction``, fails inserts).
"""

from __future__ import annotations

import hashlib

import pytest
import torch

import dynemb
from dynemb.checkpoint.tables import entries

B, L = 8, 3
OPTIMIZERS = {
    "sgd": lambda: dynemb.optim.SGD(lr=0.1),
    "adagrad": lambda: dynemb.optim.Adagrad(lr=0.1),
    "rowwise_adagrad": lambda: dynemb.optim.RowWiseAdagrad(lr=0.1),
    "adam": lambda: dynemb.optim.Adam(lr=0.05),
}
# Strategies a collection accepts; "customized" is tested on single tables (CustomModel).
STRATEGIES = ("timestamp", "step", "lfu", "no_eviction")
# Geometry of every table: (capacity, init_capacity, bucket_capacity).
GEOMETRY = {"seq": (48, 16, 8), "bag": (64, None, 8), "user": (40, None, 8), "item": (64, None, 8), "tag": (32, None, 8)}
TABLES = ("seq", "bag", "ebc.user", "ebc.item", "ebc.tag")


@pytest.fixture(autouse=True)
def one_thread():
    """These tables are tiny: one intra-op thread is faster than two fighting over small ops."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _admission(admission: bool):
    return dynemb.Admission(threshold=2, counter_capacity=256) if admission else None


class Model(torch.nn.Module):
    """seq, bag and ebc (user, item read by item and prev_item, tag); ``geometry`` overrides
    GEOMETRY per table name, ``strategy`` may differ per module via ``strategies``."""

    def __init__(self, optimizer: str | None = "adam", strategy: str = "step", admission: bool = False, *, geometry=None, strategies=None, seed: int = 3):
        super().__init__()
        geo = dict(GEOMETRY, **(geometry or {}))
        strat = {name: strategy for name in ("seq", "bag", "ebc")} | (strategies or {})
        opt = (lambda: None) if optimizer is None else OPTIMIZERS[optimizer]

        def kw(name):
            capacity, init_capacity, bucket_capacity = geo[name]
            return dict(
                capacity=capacity, init_capacity=init_capacity, bucket_capacity=bucket_capacity, check_mode="count", admission=_admission(admission), seed=seed
            )

        self.seq = dynemb.DynamicEmbedding(4, optimizer=opt(), score_strategy=strat["seq"], **kw("seq"))
        self.bag = dynemb.DynamicEmbeddingBag(4, optimizer=opt(), mode="sum", score_strategy=strat["bag"], **kw("bag"))
        configs = []
        for name, dim, features in (("user", 4, ["user"]), ("item", 4, ["item", "prev_item"]), ("tag", 8, ["tag"])):
            configs.append(dynemb.TableConfig(name=name, feature_names=features, embedding_dim=dim, score_strategy=strat["ebc"], **kw(name)))
        self.ebc = dynemb.DynamicEmbeddingBagCollection(configs, opt())

    def forward(self, step: int) -> torch.Tensor:
        ids = batch_ids(step)
        parts = [self.seq(ids["seq"]).sum(1), self.bag(ids["bag"])]
        lengths = torch.full((B,), L)
        pooled = self.ebc({f: (ids[f].reshape(-1), lengths) for f in ("user", "item", "prev_item", "tag")})
        return torch.cat([*parts, pooled.concat], 1)  # [B, 4 + 4 + 4 * 3 + 8]


class CustomModel(torch.nn.Module):
    """A DynamicEmbedding and a DynamicEmbeddingBag with caller-given scores (``customized``)."""

    def __init__(self, optimizer: str = "adam", admission: bool = False, *, seed: int = 3):
        super().__init__()
        kw = dict(capacity=24, bucket_capacity=8, check_mode="count", score_strategy="customized", admission=_admission(admission), seed=seed)
        self.seq = dynemb.DynamicEmbedding(4, optimizer=OPTIMIZERS[optimizer](), **kw)
        self.bag = dynemb.DynamicEmbeddingBag(4, optimizer=OPTIMIZERS[optimizer](), mode="sum", **kw)

    def forward(self, step: int) -> torch.Tensor:
        # The score is the caller's: here a function of the step that is not monotone.
        for table in (self.seq, self.bag):
            table.set_score((step * 7919) % 23 + 100)
        ids = batch_ids(step)
        return torch.cat([self.seq(ids["seq"]).sum(1), self.bag(ids["bag"])], 1)  # [B, 8]


def batch_ids(step: int) -> dict[str, torch.Tensor]:
    """Ids of one step, [B, L] per input; a function of the step only. Keys are spread over the
    int64 range and skewed (small values are frequent), so some are seen often enough to pass
    admission and the rest are evicted."""
    g = torch.Generator().manual_seed(1000 + step)
    out = {}
    for name in ("seq", "bag", "user", "item", "prev_item", "tag"):
        raw = torch.randint(0, 200, (B, L), generator=g)
        skewed = raw * raw // 200  # [B, L], most ids small
        out[name] = (skewed - 60) * 1_000_000_007
    return out


def train(model: torch.nn.Module, steps) -> list[torch.Tensor]:
    """One fused update per step; returns each step's output and loss (detached)."""
    outs = []
    model.train()
    for step in steps:
        out = model(step)
        w = torch.linspace(-1, 1, out.shape[1])
        loss = ((out * w).sum(1) - 0.5).square().sum()
        if loss.requires_grad:
            loss.backward()
        outs.append(out.detach().clone())
        outs.append(loss.detach().clone())
    return outs


# Reading tables through the public API.


def tables_of(model: torch.nn.Module) -> dict:
    """Checkpoint name -> (module, table name or None) of every table in ``model``."""
    out = {}
    for path, module in model.named_modules():
        if isinstance(module, dynemb.DynamicTable):
            out[path or "table"] = (module, None)
        elif isinstance(module, (dynemb.DynamicEmbeddingBagCollection, dynemb.DynamicEmbeddingCollection)):
            for t in module.table_names:
                out[f"{path}.{t}" if path else t] = (module, t)
    return out


def export(module, table: str | None) -> dict[str, torch.Tensor]:
    """Every key of one table with its row, sorted by key: keys [K], embeddings [K, D],
    optimizer_state [K, S], scores [K]."""
    chunks = list(module.export() if table is None else module.export(table))
    out = {k: torch.cat([c[k] for c in chunks]) for k in ("keys", "embeddings", "optimizer_state", "scores")}
    order = torch.argsort(out["keys"])
    return {k: v[order] for k, v in out.items()}


def contents(model: torch.nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    return {name: export(m, t) for name, (m, t) in tables_of(model).items()}


def stats(model: torch.nn.Module) -> dict[str, dict]:
    out = {}
    for name, (m, t) in tables_of(model).items():
        s = dict(m.stats() if t is None else m.stats()[t])
        # Scratch buffers are a cache, not state.
        s.pop("scratch_bytes", None)
        out[name] = s
    return out


def admission_state(model: torch.nn.Module) -> dict[str, dict[str, torch.Tensor] | None]:
    out = {}
    for name, (m, t) in tables_of(model).items():
        adm = m.admission if t is None else m.admissions[m.table_names.index(t)]
        out[name] = None if adm is None else adm.state_dict()
    return out


def placement(model: torch.nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """Where each key sits in its index (slots, keys and scores per slot, geometry); row ids and
    the free list are left out (a load numbers rows afresh, which changes no result)."""
    out = {}
    for name, (m, t) in tables_of(model).items():
        index = m.index if t is None else m.location(t)[0].index
        state = index.state_dict()
        out[name] = {k: v for k, v in state.items() if k not in ("rows", "free", "free_high_water")}
    return out


def dense_rank(scores: torch.Tensor) -> torch.Tensor:
    """Scores replaced by their rank among the distinct values ([K] int64)."""
    return torch.unique(scores, return_inverse=True)[1]


def assert_equal(a, b, path: str = "") -> None:
    """Bitwise equality of nested dicts / lists of tensors and numbers."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{path}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            assert_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{path}: lengths {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_equal(x, y, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{tuple(a.shape)} vs {b!r}"
        # Bitwise, NaN included.
        assert torch.equal(_bits(a), _bits(b)), path
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def contents_modulo_clock(c: dict) -> dict:
    """Contents with wall-clock scores replaced by their rank (timestamp tables)."""
    return {name: {**t, "scores": dense_rank(t["scores"])} for name, t in c.items()}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8) if t.is_floating_point() else t


def digest(model: torch.nn.Module) -> str:
    """SHA-256 of every table's contents, statistics (counters), admission and RNG state."""
    h = hashlib.sha256()

    def feed(x, path: str) -> None:
        if isinstance(x, dict):
            for k in sorted(x):
                feed(x[k], f"{path}.{k}")
        elif isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous()
            h.update(f"{path}:{t.dtype}:{tuple(t.shape)}".encode())
            h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(f"{path}={x!r}".encode())

    generators = {e.name: e.generator.get_state() for e in entries(model)}
    feed({"contents": contents(model), "stats": stats(model), "admission": admission_state(model), "generators": generators}, "")
    return h.hexdigest()
