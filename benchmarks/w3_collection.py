"""W3, collection train step: 26 Criteo-like features in one dynemb collection, against a Python
loop over 26 single tables and against the FBGEMM kernel TorchRec's fused EBC runs.

F features (= tables, one feature per table), B samples per batch, D_f feature f's embedding
dim, K_f distinct keys of feature f over all pre-generated batches, T batches.

One step feeds B = 4,096 samples with one id per feature per sample (single-hot, as Criteo's 26
categorical columns), pools by sum, takes loss = (out * v).sum() over the [B, sum D_f]
concatenation for a fixed random v, and runs backward. Feature f's ids are Zipf(1.05) over
CARDINALITIES[f] ranks (Criteo Kaggle's 26 column cardinalities, 3 to 10.1 M), scrambled into
arbitrary int64 keys, each feature in its own key range. Dims by cardinality: 16 up to 2,000
ranks, 32 up to 200,000, 64 above (12 / 8 / 6 features, sum D_f = 832). Every table uses
row-wise Adagrad (lr 0.01, eps 1e-8) fused into backward:

* collection: ``dynemb.DynamicEmbeddingBagCollection`` of 26 ``TableConfig``s (capacity
  C_f = max(MIN_CAPACITY, 2 K_f), so nothing is evicted; ``check_mode='count'``) on a
  pre-built ``KeyedJaggedTensor`` of the raw keys; tables of equal dim form one group (3 here),
  looked up and updated in one pass each.
* loop: 26 ``dynemb.DynamicEmbeddingBag(D_f, C_f, mode='sum')``, one optimizer each, called in
  a Python loop on each feature's pre-split keys and offsets, outputs concatenated: what a user
  writes without the collection.
* TBE: FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen`` holding the 26 tables (K_f rows of
  D_f each, ``EmbeddingLocation.HOST`` / ``ComputeDevice.CPU``, ``EXACT_ROWWISE_ADAGRAD``, sum
  pooling), built as TorchRec's ``BatchedFusedEmbeddingBag`` builds it for a fused, CPU-placed
  ``EmbeddingBagCollection``; fed the KJT's values remapped per feature to [0, K_f) before timing
  and its offsets. It never inserts or initialises a row: the static model with a known key set.

All batches are generated first; the contenders warm up on the first ones, then each repeat
times all three on a fresh slice of the stream (so the dynemb tables keep meeting new keys),
rotating which goes first. A parity check runs first: collection and loop must give the same
pooled outputs and rows after 2 small steps, and the collection the same rows as the TBE (both
from zero rows).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import torch

import dynemb
from dynemb.nn import DynamicEmbeddingBagCollection
from harness import OthersLoad, paired_ratio, quiet_repeats, record, time_step_by_step, wait_quiet
from keygen import scramble, zipf_ranks
from phases import PhaseTimer, phase_table, profile_steps, top_ops

BATCH = 4096
# Criteo Kaggle (DAC) categorical columns C1..C26: distinct values per column.
CARDINALITIES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
EXPONENT = 1.05
# Feature f's keys are scramble(rank + f * FEATURE_STRIDE): disjoint key ranges per feature.
FEATURE_STRIDE = 1 << 40
MIN_CAPACITY = 1024
LR = 0.01
EPS = 1e-8
CASE = "rowwise_adagrad"
PARITY_BATCH = 512
PARITY_STEPS = 2
PARITY_TOLERANCE = 1e-3
QUIET_WAIT_S = 60.0
CONTENDERS = ("collection", "loop", "tbe")
NAMES = {
    "collection": "dynemb.DynamicEmbeddingBagCollection",
    "loop": "loop of 26 dynemb.DynamicEmbeddingBag",
    "tbe": "fbgemm TBE (TorchRec fused EBC kernel)",
}


def dim_of(cardinality: int) -> int:
    return 16 if cardinality <= 2000 else 32 if cardinality <= 200_000 else 64


DIMS = tuple(dim_of(k) for k in CARDINALITIES)
FEATURES = tuple(f"f{i}" for i in range(len(CARDINALITIES)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class W3Config:
    steps: int  # measured steps per repeat and contender
    repeats: int
    warmup: int  # steps each contender runs before timing
    profile_steps: int  # collection steps run with phase timers after the measurement (0: none)
    max_retries: int  # repeats that may be discarded because other processes loaded the CPUs
    seed: int = 0


def feature_keys(n: int, generator: torch.Generator) -> torch.Tensor:
    """One sample of every feature for ``n`` samples: int64 keys [F, n]."""
    return torch.stack([scramble(zipf_ranks(n, k, EXPONENT, generator) + f * FEATURE_STRIDE) for f, k in enumerate(CARDINALITIES)])


def remap(batches: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """Per feature, keys [T, F, N] -> ids in [0, K_f) (sorted-key order), and every K_f."""
    dense = torch.empty_like(batches)
    num_keys = []
    for f in range(batches.shape[1]):
        keys, inverse = torch.unique(batches[:, f], return_inverse=True)
        dense[:, f] = inverse
        num_keys.append(keys.numel())
    return dense, num_keys


def _rowwise_adagrad() -> dynemb.optim.RowWiseAdagrad:
    return dynemb.optim.RowWiseAdagrad(lr=LR, eps=EPS)


def _kjt(keys: torch.Tensor):
    """KeyedJaggedTensor of one batch [F, N], one id per feature per sample."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    return KeyedJaggedTensor(keys=list(FEATURES), values=keys.reshape(-1), lengths=torch.ones(keys.numel(), dtype=torch.int64))


class Collection:
    """dynemb.DynamicEmbeddingBagCollection on a KeyedJaggedTensor of raw keys."""

    def __init__(self, capacities: list[int], v: torch.Tensor, initializer: dynemb.Initializer | None = None):
        init = {} if initializer is None else {"initializer": initializer}
        tables = [
            dynemb.TableConfig(
                name=f"t{i}",
                feature_names=[f],
                embedding_dim=d,
                capacity=c,
                pooling="sum",
                check_mode="count",
                **init,
            )
            for i, (f, d, c) in enumerate(zip(FEATURES, DIMS, capacities))
        ]
        self.ebc = DynamicEmbeddingBagCollection(tables, _rowwise_adagrad())
        self.v = v

    def forward(self, kjt) -> torch.Tensor:
        return self.ebc(kjt).concat  # [B, sum D]

    def step(self, kjt) -> None:
        (self.forward(kjt) * self.v).sum().backward()

    def timed_step(self, kjt, timer: PhaseTimer) -> None:
        with timer.phase("step"):
            with timer.phase("forward"):
                out = self.forward(kjt)
            with timer.phase("loss"):
                loss = (out * self.v).sum()
            with timer.phase("backward"):
                loss.backward()

    def rows(self, f: int, keys: torch.Tensor) -> torch.Tensor:
        values, found = self.ebc.find(f"t{f}", keys)
        return values if bool(found.all()) else torch.full_like(values, float("inf"))

    def stats(self) -> dict[str, int]:
        per_table = self.ebc.stats().values()
        return {c: sum(s[c] for s in per_table) for c in ("size", "inserts", "evictions", "failed_inserts")}


class Loop:
    """26 dynemb.DynamicEmbeddingBag in a Python loop, each on its feature's keys [N] and offsets."""

    def __init__(self, capacities: list[int], v: torch.Tensor, initializer: dynemb.Initializer | None = None):
        init = {} if initializer is None else {"initializer": initializer}
        self.tables = [dynemb.DynamicEmbeddingBag(d, c, mode="sum", optimizer=_rowwise_adagrad(), check_mode="count", **init) for d, c in zip(DIMS, capacities)]
        self.v = v
        self.offsets: torch.Tensor | None = None

    def forward(self, keys: torch.Tensor) -> torch.Tensor:
        """keys [F, N] -> [N, sum D]."""
        N = keys.shape[1]
        if self.offsets is None or self.offsets.numel() != N:
            self.offsets = torch.arange(N)
        return torch.cat([table(keys[f], self.offsets) for f, table in enumerate(self.tables)], dim=1)

    def step(self, keys: torch.Tensor) -> None:
        (self.forward(keys) * self.v).sum().backward()

    def rows(self, f: int, keys: torch.Tensor) -> torch.Tensor:
        values, found = self.tables[f].find(keys)
        return values if bool(found.all()) else torch.full_like(values, float("inf"))

    def stats(self) -> dict[str, int]:
        per_table = [t.stats() for t in self.tables]
        return {c: sum(s[c] for s in per_table) for c in ("size", "inserts", "evictions", "failed_inserts")}


class TBE:
    """FBGEMM's SplitTableBatchedEmbeddingBagsCodegen with fused row-wise Adagrad, on CPU, as
    TorchRec's BatchedFusedEmbeddingBag builds it; input: remapped ids [F * N] and offsets."""

    def __init__(self, num_keys: list[int], v: torch.Tensor):
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        specs = [(k, d, EmbeddingLocation.HOST, ComputeDevice.CPU) for k, d in zip(num_keys, DIMS)]
        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
            specs,
            optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            learning_rate=LR,
            eps=EPS,
            pooling_mode=PoolingMode.SUM,
            device=torch.device("cpu"),
        )
        self.v = v
        self.offsets: torch.Tensor | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [F, N] in [0, K_f) -> [N, sum D]."""
        n = ids.numel()
        if self.offsets is None or self.offsets.numel() != n + 1:
            # One id per bag: bag b of the flattened [F * N] starts at b.
            self.offsets = torch.arange(n + 1)
        return self.tbe(ids.reshape(-1), self.offsets)

    def step(self, ids: torch.Tensor) -> None:
        (self.forward(ids) * self.v).sum().backward()

    def rows(self, f: int) -> torch.Tensor:
        return self.tbe.split_embedding_weights()[f]


def parity_errors(seed: int = 0) -> dict[str, float]:
    """Max abs differences after PARITY_STEPS small steps: collection vs loop (default per-key
    initialisation; pooled outputs of every step and the rows after), and collection vs TBE
    (both from zero rows; rows after). Collection and loop run the same code per key and must
    agree to rounding; the TBE does FBGEMM's own maths with its own summation order."""
    gen = torch.Generator().manual_seed(seed + 1)
    batches = torch.stack([feature_keys(PARITY_BATCH, gen) for _ in range(PARITY_STEPS)])  # [T, F, N]
    dense, num_keys = remap(batches)
    capacities = [max(MIN_CAPACITY, 2 * k) for k in num_keys]
    v = torch.randn(sum(DIMS), generator=gen)
    collection, loop = Collection(capacities, v), Loop(capacities, v)
    zero = dynemb.Initializer(kind="constant", value=0.0)
    collection0, tbe = Collection(capacities, v, initializer=zero), TBE(num_keys, v)
    with torch.no_grad():
        for w in tbe.tbe.split_embedding_weights():
            w.zero_()
    outputs = 0.0
    for keys, ids in zip(batches, dense):
        a, b = collection.forward(_kjt(keys)), loop.forward(keys)
        outputs = max(outputs, (a - b).abs().max().item())
        (a * v).sum().backward()
        (b * v).sum().backward()
        collection0.step(_kjt(keys))
        tbe.step(ids)
    rows_loop = rows_tbe = 0.0
    for f in range(len(FEATURES)):
        keys = torch.unique(batches[:, f])  # [K_f], the TBE's row order
        rows_loop = max(rows_loop, (collection.rows(f, keys) - loop.rows(f, keys)).abs().max().item())
        rows_tbe = max(rows_tbe, (collection0.rows(f, keys) - tbe.rows(f)).abs().max().item())
    return {"loop_outputs": outputs, "loop_rows": rows_loop, "tbe_rows": rows_tbe}


@dataclasses.dataclass(frozen=True)
class Stream:
    """The pre-generated batches of a run and what it derives from them."""

    keys: torch.Tensor  # [T, F, B] int64 keys
    kjts: list  # T KeyedJaggedTensors of the same keys, feature-major
    dense: torch.Tensor  # [T, F, B] ids in [0, K_f) per feature, for the TBE
    num_keys: list[int]  # K_f
    capacities: list[int]  # C_f
    unique: torch.Tensor  # [T] distinct (feature, key) pairs per batch
    v: torch.Tensor  # [sum D] weights of the loss


def make_stream(cfg: W3Config) -> Stream:
    """Batches for the warm-up, every attempt (repeats and spare slices for noisy ones), the
    profiled steps and 2 steps for torch.profiler, in that order."""
    gen = torch.Generator().manual_seed(cfg.seed)
    T = cfg.warmup + (cfg.repeats + cfg.max_retries) * cfg.steps + (cfg.profile_steps + 2 if cfg.profile_steps else 0)
    keys = feature_keys(T * BATCH, gen).view(len(FEATURES), T, BATCH).transpose(0, 1).contiguous()  # [T, F, B]
    dense, num_keys = remap(keys)
    unique = torch.tensor([sum(torch.unique(keys[t, f]).numel() for f in range(len(FEATURES))) for t in range(T)])
    v = torch.randn(sum(DIMS), generator=gen)
    capacities = [max(MIN_CAPACITY, 2 * k) for k in num_keys]
    return Stream(keys, [_kjt(k) for k in keys], dense, num_keys, capacities, unique, v)


def _one_repeat(attempt: int, *, cfg: W3Config, start: int, runs: list, st: Stream, log) -> tuple[dict[str, float], list[float | None]]:
    """Time the contenders on slice ``attempt`` of the stream after batch ``start``, step by
    step in turn (:func:`harness.time_step_by_step`; blocks of 20 steps per contender, 1-2 s
    each, turned the machine's 10-20% drift between seconds into most of the paired ratios'
    spread), the first of them rotating with the attempt; returns steps/s and others' CPU
    share during the attempt."""
    inputs = {"collection": st.kjts, "loop": st.keys, "tbe": st.dense}
    k = attempt % len(runs)
    order = runs[k:] + runs[:k]
    lo = start + attempt * cfg.steps
    elapsed, share = time_step_by_step([(name, step, inputs[name]) for name, step in order], lo, lo + cfg.steps)
    measured = {name: (cfg.steps / elapsed[name], share) for name, _ in order}
    rates = {name: rate for name, (rate, _) in measured.items()}
    log(
        f"W3 attempt {attempt}: "
        + ", ".join(f"{name} {rates[name]:.2f}" for name in CONTENDERS)
        + f" steps/s; collection / loop {rates['collection'] / rates['loop']:.2f}, collection / TBE {rates['collection'] / rates['tbe']:.2f}"
    )
    return rates, [share for _, share in measured.values()]


def run(cfg: W3Config, env: dict, log=print) -> list[dict]:
    """Parity check, then the three contenders; returns their records (and the profile's)."""
    t0 = time.perf_counter()
    st = make_stream(cfg)
    T = st.keys.shape[0]
    log(
        f"W3: {T} batches of {BATCH} samples x {len(FEATURES)} features (dims {sum(DIMS)} in all), "
        f"{sum(st.num_keys)} distinct keys (largest feature {max(st.num_keys)}), generated in {time.perf_counter() - t0:.1f} s"
    )
    parity = parity_errors(cfg.seed)
    log(
        "W3 parity after 2 small steps, max abs diff: collection vs loop outputs "
        f"{parity['loop_outputs']:.2e}, rows {parity['loop_rows']:.2e}; collection vs TBE rows {parity['tbe_rows']:.2e}"
    )
    worst = max(parity.values())
    if not worst <= PARITY_TOLERANCE:
        raise RuntimeError(f"W3: the contenders disagree by {worst:.2e} > {PARITY_TOLERANCE} ({parity})")

    t0 = time.perf_counter()
    contenders = {"collection": Collection(st.capacities, st.v), "loop": Loop(st.capacities, st.v), "tbe": TBE(st.num_keys, st.v)}
    log(f"W3: contenders built in {time.perf_counter() - t0:.1f} s")
    for i in range(cfg.warmup):
        contenders["collection"].step(st.kjts[i])
        contenders["loop"].step(st.keys[i])
        contenders["tbe"].step(st.dense[i])
    runs = [(name, contenders[name].step) for name in CONTENDERS]
    one_repeat = functools.partial(_one_repeat, cfg=cfg, start=cfg.warmup, runs=runs, st=st, log=log)
    results, noise = quiet_repeats(one_repeat, cfg.repeats, cfg.max_retries, log)
    rates = {name: [r[name] for r in results] for name in CONTENDERS}
    consumed = cfg.warmup + (cfg.repeats + noise["discarded"]) * cfg.steps
    window = slice(cfg.warmup, consumed)
    table_stats = {name: contenders[name].stats() for name in ("collection", "loop")}
    extra = {
        "batch": BATCH,
        "features": len(FEATURES),
        "ids_per_step": BATCH * len(FEATURES),
        "unique_keys_per_step": st.unique[window].double().mean().item(),
        "cardinalities": list(CARDINALITIES),
        "dims": list(DIMS),
        "num_keys": st.num_keys,
        "capacities": st.capacities,
        "exponent": EXPONENT,
        "warmup": cfg.warmup,
        "steps": cfg.steps,
        "repeats": cfg.repeats,
        **noise,
    }
    ratios = {NAMES[ref]: paired_ratio(rates["collection"], rates[ref], NAMES[ref]) for ref in ("loop", "tbe")}
    log(
        "W3 tables after the timed steps (sums over the 26): "
        + "; ".join(f"{name} " + ", ".join(f"{c} {n}" for c, n in s.items()) for name, s in table_stats.items())
    )
    records = [
        record(
            workload="W3",
            case=CASE,
            contender=NAMES["collection"],
            unit="steps/s",
            values=rates["collection"],
            env=env,
            ratio=ratios[NAMES["loop"]],
            extra={**extra, "ratios": ratios, "parity_max_abs_diff": parity, "stats": table_stats["collection"]},
        ),
        record(
            workload="W3",
            case=CASE,
            contender=NAMES["loop"],
            unit="steps/s",
            values=rates["loop"],
            env=env,
            extra={**extra, "stats": table_stats["loop"]},
        ),
        record(workload="W3", case=CASE, contender=NAMES["tbe"], unit="steps/s", values=rates["tbe"], env=env, extra=extra),
    ]
    if cfg.profile_steps:
        del contenders["tbe"]
        at = consumed
        records += _profile(contenders, st, at, cfg.profile_steps, env, log)
    return records


# (owner, attribute, phase name) timed in a collection step; every group's engine, index, free
# list and store get the same names, so a phase sums over the groups. Since the rows are updated
# inside backward, the step nests as forward > lookup_group > unique_pairs, resolve > index...,
# gather, and backward > apply_lookup_gradients > apply_gradients > optimizer.update, store.scatter.
_COLLECTION_PHASES = (
    ("collection", "_parse", "parse"),
    ("collection", "_lookup_group", "lookup_group"),
    ("engine", "resolve", "resolve"),
    ("index", "upsert_unique", "index.upsert_unique"),
    ("index", "_locate", "index._locate"),
    ("index", "_place_free", "index._place_free"),
    ("index", "_fill", "index._fill"),
    ("index", "_make_room", "index._make_room"),
    ("index", "_displace", "index._displace"),
    ("index", "_evict_for", "index._evict_for"),
    ("free_list", "allocate", "free_list.allocate"),
    ("engine", "new_rows", "new_rows"),
    ("engine", "init_embeddings", "initializer"),
    ("store", "reserve", "store.reserve"),
    ("engine", "gather", "gather"),
    ("store", "scatter", "store.scatter"),
    ("collection", "_apply_lookup_gradients", "apply_lookup_gradients"),
    ("engine", "apply_gradients", "apply_gradients"),
    ("optimizer", "update", "optimizer.update"),
)


def instrument_collection(ebc: torch.nn.Module, timer: PhaseTimer) -> list[str]:
    """Install timers on one collection instance and its groups' engines, indexes, free lists,
    stores and the shared optimizer (instance attributes; dynemb's source is not touched). The
    module-level ``unique_pairs`` the collection calls is wrapped too (the caller puts it back).
    Returns the phases this version has no method for, not timed apart."""
    import dynemb.nn.collection as collection_module

    wrapped: set[tuple[int, str]] = set()
    absent: dict[str, str] = {}
    for engine in ebc.engines:
        owners = {
            "collection": ebc,
            "engine": engine,
            "index": engine.index,
            "free_list": getattr(engine.index, "free_list", None),
            "store": engine.store,
            "optimizer": engine.optimizer,
        }
        for owner, attr, name in _COLLECTION_PHASES:
            obj = owners[owner]
            if obj is None or not hasattr(obj, attr):
                absent.setdefault(name, f"{owner}.{attr}")
            elif (id(obj), attr) not in wrapped:
                timer.wrap(obj, attr, name)
                wrapped.add((id(obj), attr))
    if hasattr(collection_module, "unique_pairs"):
        timer.wrap(collection_module, "unique_pairs", "unique_pairs")
    return [f"{name} ({where})" for name, where in absent.items()]


def _profile(contenders: dict, st: Stream, at: int, steps: int, env: dict, log) -> list[dict]:
    """Phase breakdown of collection steps that continue the stream, then torch.profiler's top
    ops of two more steps of the collection and of the loop."""
    import dynemb.nn.collection as collection_module

    collection, loop = contenders["collection"], contenders["loop"]
    original = getattr(collection_module, "unique_pairs", None)
    timer = PhaseTimer()
    untimed = instrument_collection(collection.ebc, timer)
    try:
        wait_quiet(QUIET_WAIT_S)
        load = OthersLoad()
        per_step = profile_steps(collection.timed_step, st.kjts[at : at + steps], timer)
        # Loop steps run on the same batches as the collection's (its tables are a separate model).
        top = top_ops(collection.step, st.kjts[at + steps : at + steps + 2])
        top_loop = top_ops(loop.step, st.keys[at + steps : at + steps + 2])
        others = load.share()
    finally:
        if original is not None:
            collection_module.unique_pairs = original
    rows = phase_table(per_step)
    lines = [f"W3 collection step phases (exclusive ms per step, median of {steps} steps; others used {others or 0:.0%} of the CPUs)"]
    lines += [f"  {path:<75} {med * 1e3:8.2f} ms  {share:6.1%}" for path, med, share in rows]
    lines.append(f"  {'sum':<75} {sum(m for _, m, _ in rows) * 1e3:8.2f} ms")
    lines.append(f"  (no such method in this version, not timed apart: {', '.join(untimed) or 'none'})")
    lines.append(f"W3 collection: top ops by self CPU time over 2 more steps\n{top}")
    lines.append(f"W3 loop: top ops by self CPU time over the same 2 steps\n{top_loop}")
    log("\n".join(lines))
    return [
        record(
            workload="W3-profile",
            case=CASE,
            contender=f"collection:{path}",
            unit="s/step",
            values=per_step[path],
            env=env,
            extra={"share": share, "others_cpu_share": others},
        )
        for path, _, share in rows
    ]
