"""Frozen keyword-only configuration of a dynamic table; every field is validated on creation."""

from __future__ import annotations

import dataclasses
import math
import os

import torch

from dynemb.types import Backend, CheckMode, InitKind, NonFiniteGrads, PoolingMode, ScoreStrategy


def _require(ok: bool, field: str, value, why: str) -> None:
    if not ok:
        raise ValueError(f"{field}={value!r}: {why}")


def resolve_device(device: torch.device | str, field: str = "device") -> torch.device:
    """A torch.device with its index filled in for CUDA (tensors report ``cuda:0``, not ``cuda``)."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"{field}={device!r}: not a torch device") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{field}={str(device)!r}: CUDA is not available here (torch {torch.__version__}); use device='cpu'")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        elif device.index >= torch.cuda.device_count():
            raise ValueError(f"{field}={str(device)!r}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    elif device.type != "cpu":
        raise ValueError(f"{field}={str(device)!r}: dynemb tables live on 'cpu' or 'cuda'")
    return device


# The dtypes a table's rows may have.
ROW_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _require_int(field: str, value, minimum: int) -> None:
    _require(
        isinstance(value, int) and not isinstance(value, bool) and value >= minimum,
        field,
        value,
        f"must be an int >= {minimum}",
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Initializer:
    """Initial value of a new key's embedding row.

    Args:
        kind: ``uniform`` on [low, high), ``normal`` (mean, std), ``truncated_normal`` (mean, std,
            cut at mean + a*std and mean + b*std) or ``constant`` (value).
        low, high: uniform bounds; ``None`` means -/+ 1/sqrt(D).
        mean, std: normal parameters; ``std=None`` means 1/sqrt(D).
        a, b: truncation points of ``truncated_normal`` in units of std.
        value: the constant of ``constant``.
        per_key: ``True`` (default) makes a key's row a function of (seed, key) only, so it does
            not depend on batch order, world size or re-insertion after eviction. ``False`` draws
            from the table's torch.Generator instead (cheaper, not reproducible per key).
    """

    kind: InitKind | str = InitKind.UNIFORM
    low: float | None = None
    high: float | None = None
    mean: float = 0.0
    std: float | None = None
    a: float = -2.0
    b: float = 2.0
    value: float = 0.0
    per_key: bool = True

    def __post_init__(self):
        object.__setattr__(self, "kind", InitKind.parse(self.kind, "initializer.kind"))
        for name in ("low", "high", "std"):
            v = getattr(self, name)
            if v is not None:
                _require(isinstance(v, (int, float)) and math.isfinite(v), f"initializer.{name}", v, "must be a finite number")
        if self.low is not None and self.high is not None:
            _require(self.low < self.high, "initializer.low", self.low, f"must be < high={self.high}")
        if self.std is not None:
            _require(self.std > 0, "initializer.std", self.std, "must be > 0")
        _require(self.a < self.b, "initializer.a", self.a, f"must be < b={self.b}")
        for name in ("mean", "value", "a", "b"):
            v = getattr(self, name)
            _require(isinstance(v, (int, float)) and math.isfinite(v), f"initializer.{name}", v, "must be a finite number")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Admission:
    """Frequency admission: a new key enters the table once seen ``threshold`` times in training.

    Counts of keys not yet admitted live in a bounded counter index of ``counter_capacity`` keys
    that evicts the counts of keys unseen for the longest (step strategy).
    """

    threshold: int
    counter_capacity: int = 1 << 20

    def __post_init__(self):
        _require_int("admission.threshold", self.threshold, 1)
        _require_int("admission.counter_capacity", self.counter_capacity, 1)


# Tier kinds, fastest first: a table's tiers are listed in this order.
TIER_KINDS = ("device", "host", "disk")


@dataclasses.dataclass(frozen=True)
class Tier:
    """One memory tier of a table's rows (docs/design/0032-tiers.md).

    Args:
        kind: ``"device"`` (the table's device), ``"host"`` (CPU memory, pinned when the table
            is on CUDA; the same medium as ``device`` on a CPU table) or ``"disk"`` (a scratch
            file under ``path``).
        rows: rows this tier holds.
        path: the directory of a disk tier's scratch file (required for ``disk``, else None).
    """

    kind: str
    rows: int
    path: str | None = None

    def __post_init__(self):
        _require(self.kind in TIER_KINDS, "Tier.kind", self.kind, f"must be one of {', '.join(TIER_KINDS)}")
        _require_int("Tier.rows", self.rows, 1)
        if self.kind == "disk":
            _require(isinstance(self.path, (str, os.PathLike)) and str(self.path) != "", "Tier.path", self.path, "a disk tier needs the directory of its file")
            object.__setattr__(self, "path", os.fspath(self.path))
        else:
            _require(self.path is None, "Tier.path", self.path, f"only a disk tier takes a path, not a {self.kind} tier")


def _check_tiers(tiers) -> tuple[Tier, ...]:
    _require(
        isinstance(tiers, (list, tuple)) and len(tiers) > 0 and all(isinstance(t, Tier) for t in tiers),
        "tiers",
        tiers,
        "must be a non-empty list of dynemb.Tier",
    )
    kinds = [TIER_KINDS.index(t.kind) for t in tiers]
    _require(
        kinds == sorted(kinds) and len(set(kinds)) == len(kinds),
        "tiers",
        [t.kind for t in tiers],
        "one tier per kind, fastest first (device, host, disk)",
    )
    return tuple(tiers)


def tier_layout(tiers: tuple[Tier, ...] | None) -> tuple | None:
    """What tables must share to pool their tiers in one store: kinds and paths (rows add up)."""
    return None if tiers is None else tuple((t.kind, t.path) for t in tiers)


def local_share(config: TableConfig, world_size: int) -> TableConfig:
    """One rank's share of a table sharded over ``world_size`` ranks: capacity (and each tier's
    rows) divided by the world size, at least one row each."""
    if config.tiers is None:
        capacity, tiers = max(1, config.capacity // world_size), None
    else:
        tiers = tuple(dataclasses.replace(t, rows=max(1, t.rows // world_size)) for t in config.tiers)
        capacity = sum(t.rows for t in tiers)
    init = None if config.init_capacity is None else min(config.init_capacity, capacity)
    return dataclasses.replace(config, capacity=capacity, init_capacity=init, tiers=tiers)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TableConfig:
    """Everything that defines one dynamic table (one rank's shard of it).

    Args:
        embedding_dim: D, columns of an embedding.
        capacity: most rows the table holds (may be omitted with ``tiers``: their rows summed); rounded up to whole buckets so that the table can
            double from its initial size, never to more than twice the value given
            (``stats()["capacity"]`` is the real figure).
        init_capacity: rows at creation (default: ``capacity``); the table doubles when its load
            factor passes ``max_load_factor`` or a bucket overflows, up to ``capacity``. It may be
            raised so that the rounding above stays within 2x.
        bucket_capacity: W, slots per hash bucket; a key may use either of two buckets, and
            eviction picks among their 2W keys.
        max_load_factor: load factor that triggers growth, in (0, 1].
        score_strategy: see :class:`dynemb.ScoreStrategy`.
        check_mode: what a failed insert does, see :class:`dynemb.CheckMode`.
        initializer: initial rows of new keys.
        admission: optional frequency admission.
        eval_default: value of every column returned for a key missing in eval mode.
        seed: seed of per-key initialisation and of the table's generator.
        dtype: embedding and optimizer state dtype (float32, float64, bfloat16 or float16; 16-bit
            rows are updated in float32 and rounded once, docs/design/0021-dtype-moves.md).
        device: where index and rows live ("cpu", "cuda", "cuda:1", ...).
        nonfinite_grads: what an update does with a key whose summed gradient holds NaN or inf,
            or whose updated row or optimizer state would (overflow: SGD lr 10 on a gradient of
            3e38, a squared gradient beyond float max): ``skip`` (default: its row and state are
            not updated, ``stats()["nonfinite_grads"]`` counts it), ``raise``
            (``FloatingPointError`` before any row of the batch changes) or ``apply``
            (docs/design/0020-nonfinite-rows.md).
        name: the table's name (collections and checkpoints refer to it).
        feature_names: the features looked up in this table (collections; default: the
            table's name).
        pooling: how a bag collection pools this table's features, ``sum`` (default, as
            TorchRec) or ``mean`` (the single-table modules take ``mode=`` instead).
        caching: the table's rows live in ``external_storage`` (every row, by key) behind a
            write-back cache of ``cache_rows`` rows on ``device``; ``capacity`` bounds the keys
            the store may hold (the key index stays in memory, as for every table).
            ``flush()`` writes the dirty cached rows back, a checkpoint save flushes first,
            ``stats()["cache"]`` has the hit rate (docs/design/0034-caching-external-storage.md).
        external_storage: the :class:`dynemb.storage.ExternalStorage` of a caching table
            (``get`` / ``put`` / ``delete`` / ``items``), e.g. ``dynemb.storage.InMemoryStorage()``
            or ``dynemb.storage.DiskStorage(path)``; required with ``caching=True``, refused
            without it. A store serves one table.
        cache_rows: rows of a caching table's cache (default: ``capacity``, every row cached,
            the store then a write-back copy); only with ``caching=True``.
        tiers: where the rows live, fastest first: a list of :class:`dynemb.Tier` (device,
            host, disk) whose rows sum to ``capacity``; new rows take the fastest tier with
            room, rows move between tiers by score (docs/design/0032-tiers.md). Default: every
            row in one tensor on ``device``.
        backend: ``auto`` (default), ``native`` or ``torch``: whether dynemb's compiled CPU
            kernels run the index, de-duplication and update loops, see :class:`dynemb.Backend`.
    """

    embedding_dim: int
    capacity: int | None = None
    init_capacity: int | None = None
    bucket_capacity: int = 16
    max_load_factor: float = 0.85
    score_strategy: ScoreStrategy | str = ScoreStrategy.TIMESTAMP
    check_mode: CheckMode | str = CheckMode.RAISE
    initializer: Initializer = dataclasses.field(default_factory=Initializer)
    admission: Admission | None = None
    eval_default: float = 0.0
    seed: int = 0
    dtype: torch.dtype = torch.float32
    device: torch.device | str = "cpu"
    nonfinite_grads: NonFiniteGrads | str = NonFiniteGrads.SKIP
    name: str | None = None
    feature_names: tuple[str, ...] | list[str] | None = None
    pooling: PoolingMode | str = PoolingMode.SUM
    caching: bool = False
    # Compared by identity, left out of the hash: a store is an object, not a value.
    external_storage: object | None = dataclasses.field(default=None, hash=False)
    cache_rows: int | None = None
    tiers: tuple[Tier, ...] | list[Tier] | None = None
    backend: Backend | str = Backend.AUTO

    def __post_init__(self):
        _require_int("embedding_dim", self.embedding_dim, 1)
        if self.tiers is not None:
            object.__setattr__(self, "tiers", _check_tiers(self.tiers))
            rows = sum(t.rows for t in self.tiers)
            if self.capacity is None:
                object.__setattr__(self, "capacity", rows)
            _require(self.capacity == rows, "capacity", self.capacity, f"must equal the tiers' rows summed ({rows}) or be omitted")
        _require(self.capacity is not None, "capacity", None, "is required unless tiers are given")
        _require_int("capacity", self.capacity, 1)
        _require_int("bucket_capacity", self.bucket_capacity, 1)
        if self.init_capacity is not None:
            _require_int("init_capacity", self.init_capacity, 1)
            _require(
                self.init_capacity <= self.capacity,
                "init_capacity",
                self.init_capacity,
                f"must be <= capacity={self.capacity}",
            )
        _require(
            isinstance(self.max_load_factor, (int, float)) and 0 < self.max_load_factor <= 1,
            "max_load_factor",
            self.max_load_factor,
            "must be in (0, 1]",
        )
        object.__setattr__(self, "score_strategy", ScoreStrategy.parse(self.score_strategy, "score_strategy"))
        object.__setattr__(self, "check_mode", CheckMode.parse(self.check_mode, "check_mode"))
        _require(isinstance(self.initializer, Initializer), "initializer", self.initializer, "must be a dynemb.Initializer")
        _require(
            self.admission is None or isinstance(self.admission, Admission),
            "admission",
            self.admission,
            "must be None or a dynemb.Admission",
        )
        _require(
            isinstance(self.eval_default, (int, float)) and math.isfinite(self.eval_default),
            "eval_default",
            self.eval_default,
            "must be a finite number",
        )
        _require(isinstance(self.seed, int) and not isinstance(self.seed, bool), "seed", self.seed, "must be an int")
        # 16-bit rows are updated in float32 (RowOptimizer.update_rows), so float16's range does
        # not lose the optimizers' eps; the float8 types have no arithmetic (docs/design/0021).
        _require(self.dtype in ROW_DTYPES, "dtype", self.dtype, "must be torch.float32, torch.float64, torch.bfloat16 or torch.float16")
        object.__setattr__(self, "device", resolve_device(self.device))
        object.__setattr__(self, "nonfinite_grads", NonFiniteGrads.parse(self.nonfinite_grads, "nonfinite_grads"))
        object.__setattr__(self, "backend", Backend.parse(self.backend, "backend"))
        _require(self.name is None or (isinstance(self.name, str) and self.name != ""), "name", self.name, "must be a non-empty str or None")
        if self.feature_names is not None:
            names = self.feature_names
            _require(
                isinstance(names, (list, tuple)) and all(isinstance(f, str) and f for f in names) and len(set(names)) == len(names),
                "feature_names",
                names,
                "must be a list of distinct non-empty str",
            )
            object.__setattr__(self, "feature_names", tuple(names))
        object.__setattr__(self, "pooling", PoolingMode.parse(self.pooling, "pooling"))
        _require(self.pooling is not PoolingMode.NONE, "pooling", str(self.pooling), "must be 'sum' or 'mean'")
        _require(isinstance(self.caching, bool), "caching", self.caching, "must be a bool")
        store = self.external_storage
        if self.caching:
            # (The config layer cannot import dynemb.storage's Protocol: checked by its methods.)
            methods = ("get", "put", "delete", "items")
            _require(
                store is not None and all(callable(getattr(store, m, None)) for m in methods),
                "external_storage",
                store,
                "caching=True needs an external store with get, put, delete and items (dynemb.storage.ExternalStorage)",
            )
            if self.cache_rows is not None:
                _require_int("cache_rows", self.cache_rows, 1)
            _require(
                self.tiers is None,
                "tiers",
                self.tiers,
                "caching=True keeps its cache in one device tier of cache_rows rows; tiers under a cache are not supported yet",
            )
        else:
            _require(store is None, "external_storage", store, "needs caching=True (the table's rows are a cache over the store)")
            _require(self.cache_rows is None, "cache_rows", self.cache_rows, "needs caching=True (the rows cached in front of external_storage)")
