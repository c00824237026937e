"""W1-tiers: the W1 train step with the rows in a device tier holding 1/8 of the stream's keys
over a disk tier, against the same table with every row in memory, in the same run.

    python benchmarks/w6_tiers.py                  # ~5 min on 2 CPU cores
    python benchmarks/w6_tiers.py --quick          # smoke run

N ids per step (W1's 65,536 Zipf(1.05) ids over 1e8 ranks scrambled into int64 keys), D = 128,
K distinct keys over the pre-generated stream, C = 2^22 the table's capacity.

* reference: ``DynamicEmbedding(D, C, optimizer=RowWiseAdagrad)``, every row in memory.
* tiered: the same table with ``tiers=[Tier("device", K // 8), Tier("disk", C - K // 8, path=...)]``:
  a new key's row goes to the device tier while it has room, then the coldest rows move to disk,
  and a disk hit hotter than the device tier's coldest row moves up at the step.

Both see the same batches, back to back in each repeat, alternating which goes first; the figure
is the median over repeats of tiered / reference steps per second (issue 18 asks >= 0.5), with
the device tier's hit rate over the timed steps. Records go to benchmarks/results/results.jsonl.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import torch

import dynemb
from harness import REPO, append_jsonl, environment, paired_ratio, record, settle
from keygen import zipf_keys
from w1_train_step import DIM, EPS, EXPONENT, IDS_PER_STEP, LR, NUM_RANKS

CAPACITY = 1 << 22
DEVICE_SHARE = 8  # the device tier holds K / 8 rows


def table(tiers: list[dynemb.Tier] | None) -> dynemb.DynamicEmbedding:
    extra = {"tiers": tiers} if tiers else {}
    return dynemb.DynamicEmbedding(DIM, CAPACITY, optimizer=dynemb.optim.RowWiseAdagrad(lr=LR, eps=EPS), check_mode="count", **extra)


def run_steps(module: dynemb.DynamicEmbedding, batches: torch.Tensor, v: torch.Tensor) -> float:
    """Steps per second over ``batches`` [T, N]."""
    settle()
    start = time.perf_counter()
    for keys in batches:
        (module(keys) * v).sum().backward()
    return batches.shape[0] / (time.perf_counter() - start)


def device_tier(module: dynemb.DynamicEmbedding) -> dict:
    return module.stats()["tiers"][0]


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10, help="timed steps per repeat and contender")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=20, help="steps each contender runs before timing")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--tier-dir", default=None, help="directory of the disk tier (default: a temporary directory)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "results.jsonl"))
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.repeats, args.warmup = 2, 2, 4
    env = environment()
    gen = torch.Generator().manual_seed(args.seed)
    total = args.warmup + args.steps * args.repeats
    batches = torch.stack([zipf_keys(IDS_PER_STEP, NUM_RANKS, EXPONENT, gen) for _ in range(total)])  # [T, N]
    num_keys = int(torch.unique(batches).numel())
    v = torch.randn(DIM, generator=gen)
    device_rows = num_keys // DEVICE_SHARE
    tier_dir = args.tier_dir or tempfile.mkdtemp(prefix="dynemb-w6-")
    tiers = [dynemb.Tier("device", rows=device_rows), dynemb.Tier("disk", rows=CAPACITY - device_rows, path=tier_dir)]
    contenders = {"in-memory": table(None), "tiered": table(tiers)}
    print(f"W1-tiers: K = {num_keys} keys, device tier {device_rows} rows, disk tier {CAPACITY - device_rows} rows in {tier_dir}", file=sys.stderr)
    for module in contenders.values():
        run_steps(module, batches[: args.warmup], v)
    before = device_tier(contenders["tiered"])
    rates: dict[str, list[float]] = {name: [] for name in contenders}
    for r in range(args.repeats):
        part = batches[args.warmup + r * args.steps : args.warmup + (r + 1) * args.steps]
        order = list(contenders) if r % 2 == 0 else list(contenders)[::-1]
        for name in order:
            rates[name].append(run_steps(contenders[name], part, v))
        print(f"repeat {r}: " + ", ".join(f"{n} {rates[n][-1]:.2f} steps/s" for n in contenders), file=sys.stderr)
    after = device_tier(contenders["tiered"])
    hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
    hit_rate = hits / (hits + misses) if hits + misses else float("nan")
    ratio = paired_ratio(rates["tiered"], rates["in-memory"], vs="in-memory")
    tier_figures = contenders["tiered"].stats()["tiers"]
    records = [
        record(workload="W1-tiers", case="rowwise_adagrad", contender="in-memory", unit="steps/s", values=rates["in-memory"], env=env),
        record(
            workload="W1-tiers",
            case="rowwise_adagrad",
            contender="tiered",
            unit="steps/s",
            values=rates["tiered"],
            env=env,
            ratio=ratio,
            extra={"device_tier_rows": device_rows, "num_keys": num_keys, "device_hit_rate": hit_rate, "tiers": tier_figures},
        ),
    ]
    append_jsonl(__import__("pathlib").Path(args.out), records)
    print(
        f"W1-tiers rowwise_adagrad: tiered / in-memory = {ratio['median']:.3f} (min {ratio['min']:.3f}, max {ratio['max']:.3f}); "
        f"device tier hit rate {hit_rate:.3f} over the timed steps; in-memory {sorted(rates['in-memory'])[len(rates['in-memory']) // 2]:.2f} steps/s"
    )
    return records


if __name__ == "__main__":
    main()
