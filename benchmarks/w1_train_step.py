"""W1 and W1-evict, train step: dynemb.DynamicEmbedding against a static torch.nn.Embedding(sparse=True).

N ids per step, D embedding dim, K distinct keys over all pre-generated batches, T batches,
C the dynemb table's capacity.

Every step looks up N ids drawn Zipf(1.05) over 1e8 ranks scrambled into arbitrary int64 keys,
takes loss = (out * v).sum() for a fixed random v [D], and runs backward:

* dynemb: ``DynamicEmbedding(D, C, optimizer=..., check_mode='count')`` on the raw keys; the
  fused optimizer update runs inside backward; new keys are inserted and initialised per key.
  W1: C = 2**22, more than K, so nothing is evicted. W1-evict: C = K / 4; before the warm-up the
  table trains (untimed) on leading batches of the stream until they have brought C distinct
  keys, so it is full and evicts (default timestamp scores) in every timed step.
* reference: ``torch.nn.Embedding(K, D, sparse=True)`` on ids remapped to [0, K) before timing
  (torch.unique over every batch), then the same optimizer maths on the sparse gradient:
  ``torch.optim.SGD``, or FBGEMM's row-wise Adagrad written in plain torch on the coalesced grad.
* floor: a static [K, D] tensor on the same remapped ids with the update fused by hand: the batch's
  unique ids (``torch.unique``), their rows gathered (``index_select``) and expanded to the N ids,
  the loss's gradient summed per unique id (``index_add_``) and the SGD or row-wise Adagrad step
  applied to the gathered rows, written back with ``index_copy_`` (state: ``index_select`` /
  ``index_copy_``), into reused buffers; no sparse tensors, no torch.optim. What any dynamic
  table is measured against.
* MCH (W1-evict only, ``w1_mch.py``): TorchRec's ``ManagedCollisionEmbeddingCollection`` with an LFU
  ``MCHManagedCollisionModule`` evicting every step, C rows, on the raw keys as a
  ``KeyedJaggedTensor``; the same optimizer maths on its embedding's sparse gradient. It trains on
  the fill batches too, so it is full when timing starts.

All contenders see the same batches; each repeat times them on a fresh slice of the stream (so
dynemb keeps meeting new keys), step by step in turn (batch i for each contender, then batch
i + 1), rotating which goes first.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import torch

import dynemb
from harness import OthersLoad, paired_ratio, quiet_repeats, record, settle, time_step_by_step, wait_quiet
from keygen import zipf_keys
from phases import PhaseTimer, instrument, phase_table, profile_steps, top_ops

IDS_PER_STEP = 65536
NUM_RANKS = 10**8
EXPONENT = 1.05
DIM = 128
CAPACITY = 1 << 22
# W1-evict: the table holds this share of the keys of the stream.
EVICT_CAPACITY_FRACTION = 0.25
LR = 0.01
EPS = 1e-8
CASES = ("sgd", "rowwise_adagrad")
PARITY_TOLERANCE = 1e-3
QUIET_WAIT_S = 60.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class W1Config:
    steps: int  # measured steps per repeat and contender
    repeats: int
    warmup: int  # steps each contender runs before timing
    profile_steps: int  # dynemb steps run with phase timers after the measurement (0: none)
    max_retries: int  # repeats that may be discarded because other processes loaded the CPUs
    seed: int = 0
    # None: W1 (capacity CAPACITY); else W1-evict: capacity = this share of the stream's keys.
    capacity_fraction: float | None = None

    def __post_init__(self):
        f = self.capacity_fraction
        if f is not None and not 0 < f < 1:
            raise ValueError(f"capacity_fraction={f!r}: must be None or in (0, 1)")

    @property
    def workload(self) -> str:
        return "W1" if self.capacity_fraction is None else "W1-evict"


def dynemb_optimizer(case: str) -> dynemb.optim.RowOptimizer:
    if case == "sgd":
        return dynemb.optim.SGD(lr=LR)
    return dynemb.optim.RowWiseAdagrad(lr=LR, eps=EPS)


def rowwise_adagrad_step(weight: torch.Tensor, state: torch.Tensor, lr: float, eps: float) -> None:
    """FBGEMM's row-wise Adagrad on a sparse-grad embedding weight [K, D] with state [K, 1]."""
    grad = weight.grad.coalesce()
    idx = grad.indices()[0]  # [U] distinct rows
    g = grad.values()  # [U, D] summed per row
    with torch.no_grad():
        s = state.index_select(0, idx).add_(g.square().mean(1, keepdim=True))  # [U, 1]
        state.index_copy_(0, idx, s)
        weight.index_add_(0, idx, g / s.sqrt_().add_(eps), alpha=-lr)
    weight.grad = None


class Reference:
    """torch.nn.Embedding(K, D, sparse=True) on dense ids with the case's optimizer."""

    def __init__(self, case: str, num_rows: int, v: torch.Tensor):
        self.case, self.v = case, v
        self.emb = torch.nn.Embedding(num_rows, DIM, sparse=True)
        if case == "sgd":
            self.opt = torch.optim.SGD(self.emb.parameters(), lr=LR)
        else:
            self.state = torch.zeros(num_rows, 1)

    def step(self, ids: torch.Tensor) -> None:
        out = self.emb(ids)  # [N, D]
        (out * self.v).sum().backward()
        if self.case == "sgd":
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        else:
            rowwise_adagrad_step(self.emb.weight, self.state, LR, EPS)


class Floor:
    """A static [K, D] tensor on dense ids with the update fused by hand (see the module doc).
    Buffers sized for N ids are allocated once: fresh 32 MiB tensors page-fault every step."""

    def __init__(self, case: str, num_rows: int, v: torch.Tensor, ids_per_step: int = IDS_PER_STEP, device: str = "cpu"):
        self.case, self.v = case, v
        self.weight = torch.randn(num_rows, DIM, device=device)
        self.state = torch.zeros(num_rows, 1, device=device) if case != "sgd" else None
        self.rows = torch.empty(ids_per_step, DIM, device=device)  # [<=N, D] the unique ids' rows
        self.out = torch.empty(ids_per_step, DIM, device=device)  # [N, D] forward output
        self.grad = torch.empty(ids_per_step, DIM, device=device)  # [<=N, D] gradient per unique id
        self.square = torch.empty(ids_per_step, DIM, device=device)  # [<=N, D] row-wise Adagrad scratch

    def step(self, ids: torch.Tensor) -> None:
        uniq, inverse = torch.unique(ids, return_inverse=True)  # [U], [N]
        U = uniq.numel()
        rows = torch.index_select(self.weight, 0, uniq, out=self.rows[:U])  # [U, D]
        out = torch.index_select(rows, 0, inverse, out=self.out[: ids.numel()])  # [N, D]
        out = out.detach().requires_grad_()
        (out * self.v).sum().backward()
        g = self.grad[:U].zero_().index_add_(0, inverse, out.grad)  # [U, D] summed per unique id
        # The step on the gathered rows, written back with index_copy_ (the ids are unique):
        # 3x faster than index_add_ into the [K, D] table, which runs on one core.
        if self.case == "sgd":
            rows.add_(g, alpha=-LR)
        else:
            sq = torch.mul(g, g, out=self.square[:U]).mean(1, keepdim=True)  # [U, 1]
            s = self.state.index_select(0, uniq).add_(sq)  # [U, 1]
            self.state.index_copy_(0, uniq, s)
            rows.addcdiv_(g, s.sqrt_().add_(EPS), value=-LR)
        self.weight.index_copy_(0, uniq, rows)


class Contender:
    """dynemb.DynamicEmbedding on raw int64 keys; the optimizer runs inside backward."""

    def __init__(self, case: str, v: torch.Tensor, capacity: int, device: str = "cpu", backend: str = "auto"):
        self.v = v
        self.table = dynemb.DynamicEmbedding(DIM, capacity, optimizer=dynemb_optimizer(case), check_mode="count", device=device, backend=backend)

    def step(self, keys: torch.Tensor) -> None:
        out = self.table(keys)  # [N, D]
        (out * self.v).sum().backward()

    def timed_step(self, keys: torch.Tensor, timer: PhaseTimer) -> None:
        with timer.phase("step"):
            with timer.phase("forward"):
                out = self.table(keys)
            with timer.phase("loss"):
                loss = (out * self.v).sum()
            with timer.phase("backward"):
                loss.backward()


def parity_error(case: str, seed: int = 0) -> float:
    """Max |dynemb - reference| over the rows after 4 small steps from zero rows: both contenders
    must do the same maths for the ratio to mean anything. Not zero: the per-key gradient sums
    run in different orders (relative differences ~1e-5 on the hottest keys)."""
    gen = torch.Generator().manual_seed(seed)
    batches = torch.stack([zipf_keys(4096, 10**6, EXPONENT, gen) for _ in range(4)])
    dense, _, _, K = key_counts(batches)
    v = torch.randn(DIM, generator=gen)
    reference = Reference(case, K, v)
    with torch.no_grad():
        reference.emb.weight.zero_()
    zero = dynemb.Initializer(kind="constant", value=0.0)
    table = dynemb.DynamicEmbedding(DIM, 1 << 16, optimizer=dynemb_optimizer(case), check_mode="count", initializer=zero)
    for batch, ids in zip(batches, dense):
        (table(batch) * v).sum().backward()
        reference.step(ids)
    values, found = table.find(torch.unique(batches))  # [K, D], rows in the reference's id order
    if not bool(found.all()):
        return float("inf")
    return (values - reference.emb.weight.detach()).abs().max().item()


def floor_parity_error(case: str, seed: int = 0) -> float:
    """Max |floor - reference| over the rows after 4 small steps from zero rows (the floor must do
    the reference's maths); not zero for the same reason as :func:`parity_error`."""
    gen = torch.Generator().manual_seed(seed)
    batches = torch.stack([zipf_keys(4096, 10**6, EXPONENT, gen) for _ in range(4)])
    dense, _, _, K = key_counts(batches)
    v = torch.randn(DIM, generator=gen)
    reference, floor = Reference(case, K, v), Floor(case, K, v, ids_per_step=batches.shape[1])
    with torch.no_grad():
        reference.emb.weight.zero_()
    floor.weight.zero_()
    for ids in dense:
        reference.step(ids)
        floor.step(ids)
    return (floor.weight - reference.emb.weight.detach()).abs().max().item()


def _one_repeat(
    attempt: int,
    *,
    case: str,
    cfg: W1Config,
    start: int,
    contender: Contender,
    reference: Reference,
    floor: Floor,
    mch,
    batches,
    dense,
    log,
) -> tuple[dict[str, float], list[float | None]]:
    """Time the contenders on slice ``attempt`` of the stream after batch ``start``, step by
    step in turn (:func:`harness.time_step_by_step`; until 2026-11-27 in blocks of ``steps``
    per contender, whose 0.4-1 s each let the machine's drift and the contenders' order decide
    much of the paired ratio), the first of them rotating with the attempt; returns their
    steps/s and other processes' CPU share during the attempt."""
    runs = [("dynemb", contender.step, batches), ("reference", reference.step, dense), ("floor", floor.step, dense)]
    runs += [("mch", mch.step, batches)] if mch is not None else []
    k = attempt % len(runs)
    lo = start + attempt * cfg.steps
    elapsed, share = time_step_by_step(runs[k:] + runs[:k], lo, lo + cfg.steps)
    rates = {name: cfg.steps / elapsed[name] for name, _, _ in runs}
    log(f"{cfg.workload} {case} attempt {attempt}: " + ", ".join(f"{name} {rates[name]:.2f} steps/s" for name, _, _ in runs))
    return rates, [share] * len(runs)


def key_counts(batches: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Dense ids [T, N] in [0, K), unique keys per batch [T], keys never seen before per batch [T], K."""
    T, N = batches.shape
    keys, dense = torch.unique(batches.view(-1), return_inverse=True)
    batch_of = torch.arange(T).repeat_interleave(N)
    first = torch.full((keys.numel(),), T, dtype=torch.int64).scatter_reduce_(0, dense, batch_of, reduce="amin")
    new = torch.bincount(first, minlength=T)
    pairs = torch.unique(batch_of * keys.numel() + dense)
    unique = torch.bincount(pairs // keys.numel(), minlength=T)
    return dense.view(T, N), unique, new, keys.numel()


@dataclasses.dataclass(frozen=True)
class Stream:
    """The pre-generated batches of a run and what it derives from them."""

    batches: torch.Tensor  # [T, N] int64 keys
    dense: torch.Tensor  # [T, N] the same as ids in [0, K), for the reference
    unique: torch.Tensor  # [T] distinct keys per batch
    new: torch.Tensor  # [T] keys no earlier batch had
    num_keys: int  # K
    capacity: int  # C asked of the dynemb table
    fill: int  # leading batches the dynemb table trains on alone before the warm-up (W1-evict)
    v: torch.Tensor  # [D] weights of the loss


def make_stream(cfg: W1Config) -> Stream:
    """Batches for the fill (W1-evict), the warm-up, every attempt (repeats and spare slices for
    noisy ones), the profiled steps and 2 steps for torch.profiler, in that order."""
    gen = torch.Generator().manual_seed(cfg.seed)
    tail = cfg.warmup + (cfg.repeats + cfg.max_retries) * cfg.steps + cfg.profile_steps + (2 if cfg.profile_steps else 0)
    parts: list[torch.Tensor] = []
    fill = 0
    while True:
        parts += [zipf_keys(IDS_PER_STEP, NUM_RANKS, EXPONENT, gen) for _ in range(fill + tail - len(parts))]
        batches = torch.stack(parts)  # [T, N]
        dense, unique, new, K = key_counts(batches)
        if cfg.capacity_fraction is None:
            capacity = CAPACITY
            break
        capacity = int(cfg.capacity_fraction * K)
        # Batches until the stream has brought C distinct keys. Appending them makes K, hence C,
        # larger: repeat until the fill no longer grows (C grows by a fraction of what it adds).
        needed = int((new.cumsum(0) < capacity).sum()) + 1
        if needed <= fill:
            break
        fill = needed
    v = torch.randn(DIM, generator=gen)
    return Stream(batches, dense, unique, new, K, capacity, fill, v)


def run(cfg: W1Config, env: dict, log=print) -> list[dict]:
    """Measure both cases; return their records (and the phase profile's, if asked)."""
    name = cfg.workload
    t0 = time.perf_counter()
    st = make_stream(cfg)
    K = st.num_keys
    log(
        f"{name}: {st.batches.shape[0]} batches of {IDS_PER_STEP} ids, {K} distinct keys, generated in "
        f"{time.perf_counter() - t0:.1f} s; dynemb capacity {st.capacity}" + (f", filled by the first {st.fill} batches" if st.fill else "")
    )
    start = st.fill + cfg.warmup  # first timed batch
    profile_at = start + (cfg.repeats + cfg.max_retries) * cfg.steps

    records = []
    for case in CASES:
        parity = parity_error(case, cfg.seed)
        log(f"{name} {case}: max |dynemb - reference| after 4 small steps: {parity:.2e}")
        if parity > PARITY_TOLERANCE:
            raise RuntimeError(f"{name} {case}: dynemb and the reference disagree by {parity:.2e} > {PARITY_TOLERANCE}")
        floor_parity = floor_parity_error(case, cfg.seed)
        log(f"{name} {case}: max |floor - reference| after 4 small steps: {floor_parity:.2e}")
        if floor_parity > PARITY_TOLERANCE:
            raise RuntimeError(f"{name} {case}: the floor and the reference disagree by {floor_parity:.2e} > {PARITY_TOLERANCE}")
        contender, reference, floor = Contender(case, st.v, st.capacity), Reference(case, K, st.v), Floor(case, K, st.v)
        mch, mch_parity = None, None
        if cfg.capacity_fraction is not None:
            import w1_mch  # imported here: it needs torchrec, and only W1-evict runs it

            mch_parity = w1_mch.parity_error(case, cfg.seed)
            log(f"{name} {case}: max |MCH - reference| after 4 small steps: {mch_parity:.2e}")
            if mch_parity > PARITY_TOLERANCE:
                raise RuntimeError(f"{name} {case}: MCH and the reference disagree by {mch_parity:.2e} > {PARITY_TOLERANCE}")
            w1_mch.check_keys(st.batches)
            # The same capacity as the dynemb table's (which rounds C up).
            mch = w1_mch.Mch(case, st.v, contender.table.stats()["capacity"], IDS_PER_STEP)
        t0 = time.perf_counter()
        for i in range(st.fill):
            contender.step(st.batches[i])
        if st.fill:
            s = contender.table.stats()
            log(
                f"{name} {case}: fill of {st.fill} steps took {time.perf_counter() - t0:.1f} s; table size {s['size']} "
                f"of {s['capacity']}, evictions {s['evictions']}, failed inserts {s['failed_inserts']}"
            )
        if mch is not None:
            t0 = time.perf_counter()
            for i in range(st.fill):
                mch.step(st.batches[i])
            log(f"{name} {case}: MCH fill took {time.perf_counter() - t0:.1f} s; {mch.counters()}")
        for i in range(st.fill, start):
            contender.step(st.batches[i])
            reference.step(st.dense[i])
            floor.step(st.dense[i])
            if mch is not None:
                mch.step(st.batches[i])

        one_repeat = functools.partial(
            _one_repeat,
            case=case,
            cfg=cfg,
            start=start,
            contender=contender,
            reference=reference,
            floor=floor,
            mch=mch,
            batches=st.batches,
            dense=st.dense,
            log=log,
        )
        before, mch_before = contender.table.stats(), mch.counters() if mch is not None else None
        results, noise = quiet_repeats(one_repeat, cfg.repeats, cfg.max_retries, log)
        table_stats = contender.table.stats()
        rates = {who: [r[who] for r in results] for who in results[0]}
        # dynemb trained on every attempt's slice, discarded ones included.
        table_steps = (cfg.repeats + noise["discarded"]) * cfg.steps
        consumed = start + table_steps
        window = slice(start, consumed)
        extra = {
            "ids_per_step": IDS_PER_STEP,
            "unique_keys_per_step": st.unique[window].double().mean().item(),
            "new_keys_per_step": st.new[window].double().mean().item(),
            "reference_rows": K,
            "capacity": table_stats["capacity"],
            "fill_steps": st.fill,
            "warmup": cfg.warmup,
            "steps": cfg.steps,
            "repeats": cfg.repeats,
            **noise,
        }
        # Table counters over the timed steps: keys inserted (new to the table, re-inserted after
        # eviction included), evicted, and failed, per step.
        per_step = {counter: (table_stats[counter] - before[counter]) / table_steps for counter in ("inserts", "evictions", "failed_inserts")}
        log(
            f"{name} {case}: timed steps had {extra['unique_keys_per_step']:.0f} unique / "
            f"{extra['new_keys_per_step']:.0f} new keys per step on average; table per step: "
            + ", ".join(f"{counter} {value:.0f}" for counter, value in per_step.items())
            + f"; load factor {table_stats['load_factor']:.3f}"
        )
        ref_name = "torch.nn.Embedding+" + ("torch.optim.SGD" if case == "sgd" else "rowwise_adagrad(plain torch)")
        floor_name = f"floor(static tensor+fused {case})"
        versus = [(ref_name, "reference"), (floor_name, "floor")] + ([(w1_mch.contender_name(case), "mch")] if mch is not None else [])
        ratios = {name: paired_ratio(rates["dynemb"], rates[who], name) for name, who in versus}
        records.append(
            record(
                workload=name,
                case=case,
                contender="dynemb",
                unit="steps/s",
                values=rates["dynemb"],
                env=env,
                ratio=ratios[ref_name],
                extra={
                    **extra,
                    "ratios": ratios,
                    "parity_max_abs_diff": parity,
                    "floor_parity_max_abs_diff": floor_parity,
                    "stats": table_stats,
                    "table_per_step": per_step,
                    # Equals stats["inserts"] unless keys were evicted and seen again, or failed.
                    "new_keys_total": int(st.new[:consumed].sum()),
                },
            )
        )
        records.append(
            record(
                workload=name,
                case=case,
                contender=ref_name,
                unit="steps/s",
                values=rates["reference"],
                env=env,
                extra=extra,
            )
        )
        records.append(
            record(
                workload=name,
                case=case,
                contender=floor_name,
                unit="steps/s",
                values=rates["floor"],
                env=env,
                extra={**extra, "parity_max_abs_diff_vs_reference": floor_parity},
            )
        )
        if mch is not None:
            after = mch.counters()
            mch_per_step = {k: (after[k] - mch_before[k]) / table_steps for k in ("evictions", "missed_ids")}
            log(f"{name} {case}: MCH per timed step: evictions {mch_per_step['evictions']:.0f}, ids on the shared miss row {mch_per_step['missed_ids']:.0f}")
            mch_extra = {"mch_per_step": mch_per_step, "mch_counters": after, "parity_max_abs_diff_vs_reference": mch_parity}
            records.append(
                record(
                    workload=name, case=case, contender=w1_mch.contender_name(case), unit="steps/s", values=rates["mch"], env=env, extra={**extra, **mch_extra}
                )
            )
        del reference, floor, mch
        if cfg.profile_steps:
            records += _profile(name, case, contender, st.batches[profile_at:], cfg.profile_steps, env, log)
        del contender
        settle()
    return records


def _profile(workload: str, case: str, contender: Contender, batches: torch.Tensor, steps: int, env: dict, log) -> list[dict]:
    """Phase breakdown of dynemb steps that continue the stream, and the top ops of two more."""
    timer = PhaseTimer()
    untimed = instrument(contender.table, timer)
    wait_quiet(QUIET_WAIT_S)
    load = OthersLoad()
    per_step = profile_steps(contender.timed_step, batches[:steps], timer)
    top = top_ops(contender.step, batches[steps:])
    others = load.share()
    rows = phase_table(per_step)
    lines = [(f"{workload} {case}: dynemb step phases (exclusive ms per step, median of {steps} steps; others used {others or 0:.0%} of the CPUs)")]
    lines += [f"  {path:<75} {med * 1e3:8.2f} ms  {share:6.1%}" for path, med, share in rows]
    lines.append(f"  {'sum':<75} {sum(m for _, m, _ in rows) * 1e3:8.2f} ms")
    lines.append(f"  (no such method in this version, not timed apart: {', '.join(untimed) or 'none'})")
    lines.append(f"{workload} {case}: top ops by self CPU time over {batches.shape[0] - steps} more steps\n{top}")
    log("\n".join(lines))
    return [
        record(
            workload=f"{workload}-profile",
            case=case,
            contender=f"dynemb:{path}",
            unit="s/step",
            values=per_step[path],
            env=env,
            extra={"share": share, "others_cpu_share": others},
        )
        for path, _, share in rows
    ]
