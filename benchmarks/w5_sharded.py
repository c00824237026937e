"""W5, sharded training: W1 and W3 steps on 1, 2 and 4 gloo processes, and the bytes the
all-to-alls send per step with and without de-duplication.

P processes (world size), N global ids per step (W1: 65,536 Zipf keys into one
``DynamicEmbedding(128, 2**22, RowWiseAdagrad)``; W3: 4,096 samples x 26 features into the W3
collection), each rank takes its N / P slice of every global batch (strong scaling), D embedding
dim.

Contenders, each in its own spawned processes on localhost, one after another:
* ``unsharded``: one process, the model unsharded (the reference of every ratio);
* ``sharded xP`` for P in 1, 2, 4: ``dynemb.distributed.shard(model)``, P processes, each with
  ``max(1, cores // P)`` torch threads.
Each contender warms up, then times ``repeats`` blocks of ``steps`` steps (barrier before each
block; a block's time is the slowest rank's); steps/s is the median block. Bytes sent: every
rank's ``Comm.bytes_sent`` over the timed steps, summed over ranks, per step (keys, counts and
placed flags out, embeddings back, gradients and keys in backward). "Without dedup" is what the
same exchanges would carry if every id were sent instead of every unique key per rank: computed
from the same batches (ids whose owner is another rank x the bytes per key of each exchange).

    python benchmarks/w5_sharded.py                    # ~4 minutes on 2 cores
    python benchmarks/w5_sharded.py --quick            # a smoke run
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))

import dynemb
import dynemb.distributed
from dynemb.distributed.comm import owner_of

W1_IDS, W1_DIM, W1_CAPACITY = 65536, 128, 1 << 22
W3_BATCH = 4096


def _w1_batches(steps: int, seed: int) -> torch.Tensor:
    from keygen import zipf_keys

    gen = torch.Generator().manual_seed(seed)
    return torch.stack([zipf_keys(W1_IDS, 10**8, 1.05, gen) for _ in range(steps)])  # [T, N]


def _w3_batches(steps: int, seed: int) -> torch.Tensor:
    import w3_collection

    gen = torch.Generator().manual_seed(seed)
    return torch.stack([w3_collection.feature_keys(W3_BATCH, gen) for _ in range(steps)])  # [T, F, B]


class W1Model:
    dims = (W1_DIM,)

    def __init__(self):
        self.module = dynemb.DynamicEmbedding(W1_DIM, W1_CAPACITY, optimizer=dynemb.optim.RowWiseAdagrad(lr=0.01), check_mode="count")
        self.v = torch.randn(W1_DIM, generator=torch.Generator().manual_seed(1))

    def step(self, ids: torch.Tensor) -> None:
        (self.module(ids) * self.v).sum().backward()

    @staticmethod
    def local(batch: torch.Tensor, rank: int, world: int) -> torch.Tensor:
        n = batch.shape[0] // world
        return batch[rank * n : (rank + 1) * n]


class W3Model:
    def __init__(self):
        import w3_collection

        self.w3 = w3_collection
        # Capacity above any feature's distinct keys over a run: nothing is evicted.
        stream_caps = [1 << 20 for _ in w3_collection.CARDINALITIES]
        v = torch.randn(sum(w3_collection.DIMS), generator=torch.Generator().manual_seed(1))
        self.collection = w3_collection.Collection(stream_caps, v)
        self.module = self.collection.ebc
        self.dims = w3_collection.DIMS

    def step(self, keys: torch.Tensor) -> None:
        self.collection.step(self.w3._kjt(keys))

    @staticmethod
    def local(batch: torch.Tensor, rank: int, world: int) -> torch.Tensor:
        n = batch.shape[1] // world
        return batch[:, rank * n : (rank + 1) * n]


def _bytes_without_dedup(batches: torch.Tensor, model_cls, world: int, dims) -> float:
    """Bytes per step if every id (not every unique key per rank and table) were exchanged."""
    if world == 1:
        return 0.0
    total = 0
    for batch in batches:
        for rank in range(world):
            local = model_cls.local(batch, rank, world)
            per_table = [local] if local.dim() == 1 else list(local)  # W1: one table; W3: a table per feature
            for ids, dim in zip(per_table, dims):
                remote = int((owner_of(ids, world) != rank).sum())
                # out: key, count, segment (collections); back: flags, embedding; backward: key, segment, gradient
                seg = 8 if len(dims) > 1 else 0
                total += remote * (8 + 8 + seg + 3 + 4 * dim + 8 + seg + 4 * dim)
    return total / len(batches)


def _worker(rank: int, world: int, port: int, workload: str, sharded: bool, steps: int, warmup: int, repeats: int, seed: int, out) -> None:
    try:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
        if sharded:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
        model = W1Model() if workload == "W1" else W3Model()
        if sharded:
            dynemb.distributed.shard(model.module, timeout=datetime.timedelta(seconds=120))
        total = warmup + repeats * steps
        batches = _w1_batches(total, seed) if workload == "W1" else _w3_batches(total, seed)
        for i in range(warmup):
            model.step(model.local(batches[i], rank, world))
        comm = getattr(getattr(model.module, "engine", None), "comm", None) or getattr((getattr(model.module, "engines", None) or [None])[0], "comm", None)
        sent0 = comm.bytes_sent if comm is not None else 0
        times = []
        for r in range(repeats):
            if sharded:
                dist.barrier()
            t0 = time.perf_counter()
            for i in range(warmup + r * steps, warmup + (r + 1) * steps):
                model.step(model.local(batches[i], rank, world))
            elapsed = time.perf_counter() - t0
            if sharded:
                t = torch.tensor([elapsed])
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                elapsed = float(t)
            times.append(elapsed)
        sent = torch.tensor([(comm.bytes_sent - sent0) if comm is not None else 0], dtype=torch.float64)
        if sharded:
            dist.all_reduce(sent)
        if rank == 0:
            no_dedup = _bytes_without_dedup(batches[warmup:], type(model), world if sharded else 1, model.dims)
            out.put(("ok", [steps / t for t in times], float(sent) / (repeats * steps), no_dedup))
        if sharded:
            dist.destroy_process_group()
    except BaseException:
        out.put(("error", f"rank {rank}: {traceback.format_exc()}", 0, 0))
        raise


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_contender(workload: str, world: int, sharded: bool, steps: int, warmup: int, repeats: int, seed: int) -> tuple[list[float], float, float]:
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    procs = mp.start_processes(
        _worker, args=(world, _free_port(), workload, sharded, steps, warmup, repeats, seed, out), nprocs=world, join=False, start_method="spawn"
    )
    t0 = time.monotonic()
    while not procs.join(timeout=1.0):
        if time.monotonic() - t0 > 900:
            for p in procs.processes:
                p.kill()
            raise RuntimeError(f"W5 {workload} x{world}: still running after 900 s")
    status, rates, sent, no_dedup = out.get()
    if status != "ok":
        raise RuntimeError(rates)
    return rates, sent, no_dedup


def main() -> None:
    from harness import append_jsonl, environment, record

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=("W1", "W3", "all"), default="all")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "results.jsonl"))
    args = p.parse_args()
    if args.quick:
        args.steps, args.repeats, args.warmup = 2, 1, 1
    env = environment()
    env["command"] = " ".join(["python", *sys.argv])
    records = []
    for workload in ("W1", "W3") if args.workload == "all" else (args.workload,):
        ref, _, _ = run_contender(workload, 1, False, args.steps, args.warmup, args.repeats, args.seed)
        ref_rate = statistics.median(ref)
        print(f"W5 {workload} unsharded, 1 process: {ref_rate:.2f} steps/s (blocks {', '.join(f'{r:.2f}' for r in ref)})", flush=True)
        records.append(record(workload="W5", case=workload, contender="unsharded x1", unit="steps/s", values=ref, env=env))
        for world in (1, 2, 4):
            rates, sent, no_dedup = run_contender(workload, world, True, args.steps, args.warmup, args.repeats, args.seed)
            rate = statistics.median(rates)
            ratio = {"vs": "unsharded x1", "median": rate / ref_rate, "min": min(rates) / ref_rate, "max": max(rates) / ref_rate}
            print(
                f"W5 {workload} sharded x{world}: {rate:.2f} steps/s ({rate / ref_rate:.2f}x unsharded); "
                f"all-to-all bytes per step {sent / 1e6:.2f} MB (without dedup {no_dedup / 1e6:.2f} MB)",
                flush=True,
            )
            records.append(
                record(
                    workload="W5", case=workload, contender=f"sharded x{world}", unit="steps/s", values=rates, env=env, ratio=ratio,
                    extra={"world_size": world, "bytes_sent_per_step": sent, "bytes_without_dedup_per_step": no_dedup},
                )
            )  # fmt: skip
    for r in records:
        r["command"] = env["command"]
    append_jsonl(Path(args.out), records)


if __name__ == "__main__":
    main()
