"""W1-scale: the W1 train step on a table of capacity 2^24 against one of 2^22, in the same
run, and a 2^26-capacity table of dim 64 training on this machine.

    python benchmarks/w7_scale.py                  # ~3 min on 2 CPU cores
    python benchmarks/w7_scale.py --quick          # smoke run

N ids per step (W1's 65,536 Zipf(1.05) ids over 1e8 ranks scrambled into int64 keys), D = 128,
row-wise Adagrad, default options (backend "auto": the compiled kernels where they build).

* small: ``DynamicEmbedding(D, 2**22)``; large: ``DynamicEmbedding(D, 2**24)``. Both see the
  same batches back to back in each repeat, alternating which goes first; the figure is the
  median over repeats of large / small steps per second (issue 19 asks >= 0.95: a 4x larger
  table costs at most 5% a step).
* huge: ``DynamicEmbedding(64, 2**26)`` trains ``--huge-steps`` steps of the same stream; its
  steps per second, index bytes and the process's peak resident memory are recorded.

Records go to benchmarks/results/results.jsonl.
"""

from __future__ import annotations

import argparse
import pathlib
import resource
import sys
import time

import torch

import dynemb
from harness import REPO, append_jsonl, environment, paired_ratio, record, settle
from keygen import zipf_keys

IDS_PER_STEP = 65536
NUM_RANKS = 10**8
EXPONENT = 1.05
DIM = 128
LR = 0.01


def table(dim: int, capacity: int) -> dynemb.DynamicEmbedding:
    return dynemb.DynamicEmbedding(dim, capacity, optimizer=dynemb.optim.RowWiseAdagrad(lr=LR), check_mode="count")


def run_steps(module: dynemb.DynamicEmbedding, batches: torch.Tensor, v: torch.Tensor) -> float:
    """Steps per second of module over batches ([T, N] keys)."""
    settle()
    t0 = time.perf_counter()
    for keys in batches:
        (module(keys) * v).sum().backward()
    return batches.shape[0] / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8, help="timed steps per repeat and contender")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=10, help="steps each contender runs before timing")
    p.add_argument("--huge-steps", type=int, default=10, help="steps the 2^26 x 64 table trains")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "results.jsonl"))
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.repeats, args.warmup, args.huge_steps = 2, 2, 3, 3
    env = environment()
    gen = torch.Generator().manual_seed(args.seed)
    total = args.warmup + args.steps * args.repeats
    batches = torch.stack([zipf_keys(IDS_PER_STEP, NUM_RANKS, EXPONENT, gen) for _ in range(total)])  # [T, N]
    v = torch.randn(DIM, generator=gen)
    contenders = {"2^22": table(DIM, 1 << 22), "2^24": table(DIM, 1 << 24)}
    for module in contenders.values():
        run_steps(module, batches[: args.warmup], v)
    rates: dict[str, list[float]] = {name: [] for name in contenders}
    for r in range(args.repeats):
        part = batches[args.warmup + r * args.steps : args.warmup + (r + 1) * args.steps]
        for name in list(contenders) if r % 2 == 0 else list(contenders)[::-1]:
            rates[name].append(run_steps(contenders[name], part, v))
        print(f"repeat {r}: " + ", ".join(f"{n} {rates[n][-1]:.2f} steps/s" for n in contenders), file=sys.stderr)
    ratio = paired_ratio(rates["2^24"], rates["2^22"], vs="capacity 2^22")
    backend = "native" if contenders["2^22"].engines[0].index.native else "torch"
    del contenders
    huge = table(64, 1 << 26)
    huge_rate = run_steps(huge, batches[: args.huge_steps, :], torch.randn(64, generator=gen))
    huge_stats = huge.stats()
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    records = [
        record(workload="W1-scale", case="rowwise_adagrad", contender="capacity 2^22", unit="steps/s", values=rates["2^22"], env=env),
        record(
            workload="W1-scale",
            case="rowwise_adagrad",
            contender="capacity 2^24",
            unit="steps/s",
            values=rates["2^24"],
            env=env,
            ratio=ratio,
            extra={"backend": backend},
        ),
        record(
            workload="W1-scale",
            case="rowwise_adagrad_dim64",
            contender="capacity 2^26",
            unit="steps/s",
            values=[huge_rate],
            env=env,
            extra={"index_bytes": huge_stats["index_bytes"], "size": huge.size(), "peak_rss_gib": peak_gib, "backend": backend},
        ),
    ]
    append_jsonl(pathlib.Path(args.out), records)
    print(
        f"W1-scale ({backend}): 2^24 / 2^22 steps/s = {ratio['median']:.3f} (min {ratio['min']:.3f}, max {ratio['max']:.3f}); "
        f"2^26 x 64: {huge_rate:.2f} steps/s over {args.huge_steps} steps, {huge.size()} keys, index {huge_stats['index_bytes'] / 2**30:.2f} GiB, "
        f"peak RSS {peak_gib:.2f} GiB"
    )
    return records


if __name__ == "__main__":
    main()
