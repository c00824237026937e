"""W1, train step: dynemb.DynamicEmbedding against a static torch.nn.Embedding(sparse=True).

N ids per step, D embedding dim, K distinct keys over all pre-generated batches, T batches.

Every step looks up N ids drawn Zipf(1.05) over 1e8 ranks scrambled into arbitrary int64 keys,
takes loss = (out * v).sum() for a fixed random v [D], and runs backward:

* dynemb: ``DynamicEmbedding(D, 2**22, optimizer=..., check_mode='count')`` on the raw keys; the
  fused optimizer update runs inside backward; new keys are inserted and initialised per key.
* reference: ``torch.nn.Embedding(K, D, sparse=True)`` on ids remapped to [0, K) before timing
  (torch.unique over every batch), then the same optimizer maths on the sparse gradient:
  ``torch.optim.SGD``, or FBGEMM's row-wise Adagrad written in plain torch on the coalesced grad.

Both contenders see the same batches; each repeat times them back to back on a fresh slice of
the stream (so dynemb keeps meeting new keys), alternating which goes first.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import torch

import dynemb
from harness import OthersLoad, paired_ratio, quiet_repeats, record, settle, wait_quiet
from keygen import zipf_keys
from phases import PhaseTimer, instrument, phase_table, profile_steps, top_ops

IDS_PER_STEP = 65536
NUM_RANKS = 10**8
EXPONENT = 1.05
DIM = 128
CAPACITY = 1 << 22
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


class Contender:
    """dynemb.DynamicEmbedding on raw int64 keys; the optimizer runs inside backward."""

    def __init__(self, case: str, v: torch.Tensor):
        self.v = v
        self.table = dynemb.DynamicEmbedding(DIM, CAPACITY, optimizer=dynemb_optimizer(case), check_mode="count")

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
    table = dynemb.DynamicEmbedding(
        DIM, 1 << 16, optimizer=dynemb_optimizer(case), check_mode="count", initializer=zero
    )
    for batch, ids in zip(batches, dense):
        (table(batch) * v).sum().backward()
        reference.step(ids)
    values, found = table.find(torch.unique(batches))  # [K, D], rows in the reference's id order
    if not bool(found.all()):
        return float("inf")
    return (values - reference.emb.weight.detach()).abs().max().item()


def _steps_per_second(step, batches: torch.Tensor) -> tuple[float, float | None]:
    """Steps/s of ``step`` over the batches, and other processes' CPU share meanwhile."""
    settle()
    load = OthersLoad()
    t0 = time.perf_counter()
    for batch in batches:
        step(batch)
    return batches.shape[0] / (time.perf_counter() - t0), load.share()


def _one_repeat(
    attempt: int, *, case: str, cfg: W1Config, contender: Contender, reference: Reference, batches, dense, log
) -> tuple[dict[str, float], list[float | None]]:
    """Time both contenders on slice ``attempt`` of the stream, in alternating order; returns
    their steps/s and other processes' CPU share during each."""
    part = slice(cfg.warmup + attempt * cfg.steps, cfg.warmup + (attempt + 1) * cfg.steps)
    runs = [("dynemb", contender.step, batches[part]), ("reference", reference.step, dense[part])]
    measured = {name: _steps_per_second(step, data) for name, step, data in (runs if attempt % 2 == 0 else runs[::-1])}
    rates = {name: rate for name, (rate, _) in measured.items()}
    log(
        f"W1 {case} attempt {attempt}: dynemb {rates['dynemb']:.2f} steps/s, reference {rates['reference']:.2f} steps/s"
    )
    return rates, [share for _, share in measured.values()]


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


def run(cfg: W1Config, env: dict, log=print) -> list[dict]:
    """Measure both cases; return their records (and the phase profile's, if asked)."""
    gen = torch.Generator().manual_seed(cfg.seed)
    # Spare slices for repeats discarded as noisy, then the profiled steps.
    attempts = cfg.repeats + cfg.max_retries
    profile_at = cfg.warmup + attempts * cfg.steps
    T = profile_at + cfg.profile_steps + (2 if cfg.profile_steps else 0)
    t0 = time.perf_counter()
    batches = torch.stack([zipf_keys(IDS_PER_STEP, NUM_RANKS, EXPONENT, gen) for _ in range(T)])  # [T, N]
    dense, unique, new, K = key_counts(batches)
    v = torch.randn(DIM, generator=gen)
    log(f"W1: {T} batches of {IDS_PER_STEP} ids, {K} distinct keys, generated in {time.perf_counter() - t0:.1f} s")

    records = []
    for case in CASES:
        parity = parity_error(case, cfg.seed)
        log(f"W1 {case}: max |dynemb - reference| after 4 small steps: {parity:.2e}")
        if parity > PARITY_TOLERANCE:
            raise RuntimeError(f"W1 {case}: dynemb and the reference disagree by {parity:.2e} > {PARITY_TOLERANCE}")
        contender, reference = Contender(case, v), Reference(case, K, v)
        for i in range(cfg.warmup):
            contender.step(batches[i])
            reference.step(dense[i])

        one_repeat = functools.partial(
            _one_repeat,
            case=case,
            cfg=cfg,
            contender=contender,
            reference=reference,
            batches=batches,
            dense=dense,
            log=log,
        )
        results, noise = quiet_repeats(one_repeat, cfg.repeats, cfg.max_retries, log)
        rates = {name: [r[name] for r in results] for name in ("dynemb", "reference")}
        consumed = cfg.warmup + (cfg.repeats + noise["discarded"]) * cfg.steps
        table_stats = contender.table.stats()
        window = slice(cfg.warmup, consumed)
        extra = {
            "ids_per_step": IDS_PER_STEP,
            "unique_keys_per_step": unique[window].double().mean().item(),
            "new_keys_per_step": new[window].double().mean().item(),
            "reference_rows": K,
            "warmup": cfg.warmup,
            "steps": cfg.steps,
            "repeats": cfg.repeats,
            **noise,
        }
        log(
            f"W1 {case}: timed steps had {extra['unique_keys_per_step']:.0f} unique / "
            f"{extra['new_keys_per_step']:.0f} new keys per step on average"
        )
        ref_name = "torch.nn.Embedding+" + ("torch.optim.SGD" if case == "sgd" else "rowwise_adagrad(plain torch)")
        records.append(
            record(
                workload="W1",
                case=case,
                contender="dynemb",
                unit="steps/s",
                values=rates["dynemb"],
                env=env,
                ratio=paired_ratio(rates["dynemb"], rates["reference"], ref_name),
                extra={
                    **extra,
                    "parity_max_abs_diff": parity,
                    "stats": table_stats,
                    # Equals stats["inserts"] unless keys were evicted and seen again, or failed.
                    "new_keys_total": int(new[:consumed].sum()),
                },
            )
        )
        records.append(
            record(
                workload="W1",
                case=case,
                contender=ref_name,
                unit="steps/s",
                values=rates["reference"],
                env=env,
                extra=extra,
            )
        )
        del reference
        if cfg.profile_steps:
            records += _profile(case, contender, batches[profile_at:], cfg.profile_steps, env, log)
        del contender
        settle()
    return records


def _profile(case: str, contender: Contender, batches: torch.Tensor, steps: int, env: dict, log) -> list[dict]:
    """Phase breakdown of dynemb steps that continue the stream, and the top ops of two more."""
    timer = PhaseTimer()
    untimed = instrument(contender.table, timer)
    wait_quiet(QUIET_WAIT_S)
    load = OthersLoad()
    per_step = profile_steps(contender.timed_step, batches[:steps], timer)
    top = top_ops(contender.step, batches[steps:])
    others = load.share()
    rows = phase_table(per_step)
    lines = [
        (
            f"W1 {case}: dynemb step phases (exclusive ms per step, median of {steps} steps; "
            f"others used {others or 0:.0%} of the CPUs)"
        )
    ]
    lines += [f"  {path:<75} {med * 1e3:8.2f} ms  {share:6.1%}" for path, med, share in rows]
    lines.append(f"  {'sum':<75} {sum(m for _, m, _ in rows) * 1e3:8.2f} ms")
    lines.append(f"  (no such method in this version, not timed apart: {', '.join(untimed) or 'none'})")
    lines.append(f"W1 {case}: top ops by self CPU time over {batches.shape[0] - steps} more steps\n{top}")
    log("\n".join(lines))
    return [
        record(
            workload="W1-profile",
            case=case,
            contender=f"dynemb:{path}",
            unit="s/step",
            values=per_step[path],
            env=env,
            extra={"share": share, "others_cpu_share": others},
        )
        for path, _, share in rows
    ]
