"""Disk tier engines: batched random row reads and writes of W1's rows, rows/s against an in-memory tensor.

R rows in the table, W = D + 1 float32 columns a row (D = 128 embedding + 1 row-wise Adagrad state
column: 516 bytes), U unique ids of a W1 step (~30.6k), of which ~16k are keys never seen before.

The workload: a W1 key stream (65,536 ids per step, Zipf(1.05) over 10^8 ranks, ``keygen``) gives
every distinct key a row id, a random permutation of [0, R). The keys of the first ``--history``
steps and enough filler rows to reach R minus the timed steps' new keys are written before timing
(random rows), so the store holds ~R rows and every timed step's new keys are true inserts.
One timed step, on each contender's own store:

* read: gather the rows of the step's unique ids already in the store (ids in ``torch.unique``'s
  key order, i.e. random row order), as a [n, W] float32 tensor;
* write: scatter those rows back (+1, applied untimed) and the new keys' rows (insert).

Contenders (each its own file or directory under ``--dir``):

* ``memory`` (the reference): a [R, W] tensor, ``index_select`` / ``index_copy_``;
* ``mmap``: a row file mapped with ``torch.from_file(shared=True)``, the same two ops (row id ->
  offset id * W * 4); ``mmap-sorted`` sorts the ids first; ``mmap-random`` maps the file with
  Python's ``mmap`` and ``madvise(MADV_RANDOM)`` (no read-around on a page fault), as a tensor
  via ``torch.frombuffer``; ``np.memmap``: numpy fancy indexing on ``numpy.memmap``;
* ``rocksdb`` (``rocksdict``, raw mode, no compression, WAL off): key = row id as 8 big-endian
  bytes, value = the row's bytes; multi-get for reads, one ``WriteBatch`` a step;
* ``lmdb`` (``lmdb``; writemap, no sync): same keys and values; ``getmulti`` in a read
  transaction, ``putmulti`` in one write transaction a step.

Rates: rows read / read seconds, rows written / write seconds, and U / (read + write seconds)
("step"), each summed over the steps of a repeat; ratios against ``memory`` in the same repeat.
Each repeat times every contender on a fresh slice of the stream, alternating the order.

Cold: afterwards each store is closed, fsynced and dropped from the page cache
(``posix_fadvise(DONTNEED)`` per file; ``fincore`` reports what stayed resident), reopened, and
times ``--cold-steps`` steps of a fresh slice. At the end every store is compared with the
reference row by row (sampled rows and every row of the last step).

    python benchmarks/disk_tier.py                    # R = 2^21, ~5 minutes on 2 cores
    python benchmarks/disk_tier.py --rows 524288 --steps 2 --repeats 2 --history 4 --cold-steps 1   # smoke run, ~30 s
"""

from __future__ import annotations

import argparse
import json
import mmap
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from disk_stores import (
    LMDB,
    WIDTH,
    MappedFile,
    Memory,
    NumpyMemmap,
    RocksDB,
    drop_cache,
    files_of,
    key_bytes,
    mapped_resident,
    resident_bytes,
    rows_of,
    value_bytes,
)
from harness import OthersLoad, append_jsonl, environment, markdown_table, paired_ratio, quiet_repeats, record, settle
from keygen import zipf_keys

IDS_PER_STEP = 65536
NUM_RANKS = 10**8
EXPONENT = 1.05


def _rss() -> dict[str, int]:
    """This process's anonymous and file-backed resident bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("RssAnon:", "RssFile:")):
            out[line.split(":")[0]] = int(line.split()[1]) * 1024
    return out


def _io() -> dict[str, int]:
    """Bytes this process made the kernel read from / write to storage (/proc/self/io)."""
    out = {}
    for line in Path("/proc/self/io").read_text().splitlines():
        key, value = line.split(":")
        if key in ("read_bytes", "write_bytes"):
            out[key] = int(value)
    return out


def kv_conversion_s(work: Workload, steps: range) -> float:
    """Seconds per step spent turning ids and rows into byte strings and back (the KV contenders' Python side)."""
    t0 = time.perf_counter()
    for i in steps:
        old, new = work.steps[i]
        ids = torch.cat([old, new])
        key_bytes(old)
        rows_of(value_bytes(work.table.index_select(0, old)))
        key_bytes(ids)
        value_bytes(work.table.index_select(0, ids))
    return (time.perf_counter() - t0) / len(steps)


class Workload:
    """Per step: row ids already in the store (read, then written) and new rows' ids (written)."""

    def __init__(self, rows: int, history: int, timed: int, seed: int):
        gen = torch.Generator().manual_seed(seed)
        T = history + timed
        batches = torch.stack([zipf_keys(IDS_PER_STEP, NUM_RANKS, EXPONENT, gen) for _ in range(T)])
        keys, dense = torch.unique(batches.view(-1), return_inverse=True)
        dense = dense.view(T, IDS_PER_STEP)
        step_of = torch.arange(T).repeat_interleave(IDS_PER_STEP)
        first = torch.full((keys.numel(),), T).scatter_reduce_(0, dense.view(-1), step_of, reduce="amin")
        if keys.numel() > rows:
            raise ValueError(f"rows={rows}: the stream has {keys.numel()} distinct keys; pass more rows or fewer steps")
        perm = torch.randperm(rows, generator=gen)
        row_of = perm[: keys.numel()]
        new_ids = row_of[first >= history]
        # Written before timing: the history's keys and the filler rows no key of the stream takes.
        self.prefill = torch.cat([row_of[first < history], perm[keys.numel() :]])
        self.steps = []
        for t in range(history, T):
            u = torch.unique(dense[t])
            self.steps.append((row_of[u[first[u] < t]], row_of[u[first[u] == t]]))
        self.new_rows = new_ids.numel()
        gen_rows = torch.Generator().manual_seed(seed + 1)
        self.table = torch.rand(rows, WIDTH, generator=gen_rows)
        self.new_values = {}  # step -> rows of its new keys (the same for every contender)
        for i, (_, new) in enumerate(self.steps):
            self.new_values[i] = torch.rand(new.numel(), WIDTH, generator=gen_rows)


def run_steps(store, work: Workload, steps: range) -> dict:
    """Time read and write of ``steps`` on ``store``; returns seconds and row counts."""
    settle()
    rss, io, faults = _rss(), _io(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    load = OthersLoad()
    read_s = write_s = 0.0
    n_read = n_written = 0
    for i in steps:
        old, new = work.steps[i]
        t0 = time.perf_counter()
        rows = store.gather(old)
        t1 = time.perf_counter()
        rows = torch.cat([rows.add_(1.0), work.new_values[i]])
        ids = torch.cat([old, new])
        t2 = time.perf_counter()
        store.scatter(ids, rows)
        t3 = time.perf_counter()
        read_s += t1 - t0
        write_s += t3 - t2
        n_read += old.numel()
        n_written += ids.numel()
    others = load.share()
    grew = {k: v - rss[k] for k, v in _rss().items()}
    io = {k: v - io[k] for k, v in _io().items()}
    io["minor_faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    store.ran.update(steps)
    return {"read_s": read_s, "write_s": write_s, "rows_read": n_read, "rows_written": n_written, "others": others, "rss": grew, "io": io}


def rates(m: dict) -> dict:
    return {"read": m["rows_read"] / m["read_s"], "write": m["rows_written"] / m["write_s"], "step": m["rows_written"] / (m["read_s"] + m["write_s"])}


def build(names: list[str], work: Workload, root: Path, log) -> list:
    stores = [Memory(work.table.clone())]
    stores[0].ran = set()
    makers = {
        "mmap": lambda: MappedFile(root / "rows.mmap", work.table),
        "mmap-sorted": lambda: MappedFile(root / "rows.mmap-sorted", work.table, name="mmap-sorted", sort=True),
        "mmap-random": lambda: MappedFile(root / "rows.mmap-random", work.table, name="mmap-random", advice=mmap.MADV_RANDOM),
        "mmap-willneed": lambda: MappedFile(root / "rows.mmap-willneed", work.table, name="mmap-willneed", advice=mmap.MADV_RANDOM, prefetch=True),
        "np.memmap": lambda: NumpyMemmap(root / "rows.npmemmap", work.table),
        "rocksdb": lambda: RocksDB(root / "rocksdb", work.table, work.prefill),
        "lmdb": lambda: LMDB(root / "lmdb", work.table, work.prefill),
    }
    for name in names:
        before = _rss()
        t0 = time.perf_counter()
        store = makers[name]()  # built and open
        store.build_s = time.perf_counter() - t0
        store.build_rss = {k: v - before[k] for k, v in _rss().items()}
        store.ran = set()
        stores.append(store)
        log(f"built {name} in {store.build_s:.1f} s")
    return stores


def verify(stores: list, work: Workload, seed: int) -> dict[str, int]:
    """Rows that differ from the reference, per store (sampled rows and the last step's rows)."""
    ref = stores[0]
    old, new = work.steps[max(ref.ran)]
    sample = torch.cat([torch.randperm(work.table.shape[0], generator=torch.Generator().manual_seed(seed))[:20000], old, new])
    inserted = torch.cat([work.prefill, *(work.steps[i][1] for i in sorted(ref.ran))])
    sample = sample[torch.isin(sample, inserted)]
    want = ref.gather(sample)
    return {s.name: int((s.gather(sample) != want).any(1).sum()) for s in stores[1:]}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1 << 21, help="rows in the table (default 2^21: 1.08 GB of rows)")
    p.add_argument("--steps", type=int, default=8, help="timed W1 steps per repeat and contender")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--history", type=int, default=30, help="W1 steps whose keys are in the store before timing")
    p.add_argument("--cold-steps", type=int, default=3, help="steps timed after dropping each store from the page cache (0: skip)")
    p.add_argument("--max-retries", type=int, default=3)
    p.add_argument("--contenders", default="mmap,mmap-sorted,mmap-random,mmap-willneed,np.memmap,rocksdb,lmdb")
    p.add_argument("--dir", type=Path, help="where the stores go (default: a temporary directory, removed)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "results.jsonl")
    p.add_argument("--markdown", type=Path, help="also write the summary table to this file")
    args = p.parse_args(argv)
    names = [n for n in args.contenders.split(",") if n]
    env = environment()
    env["command"] = " ".join(["python", "benchmarks/disk_tier.py", *argv])
    log = print
    t_start = time.perf_counter()
    timed_steps = (args.repeats + args.max_retries) * args.steps + args.cold_steps
    work = Workload(args.rows, args.history, timed_steps, args.seed)
    u = np.mean([o.numel() + n.numel() for o, n in work.steps])
    new = np.mean([n.numel() for _, n in work.steps])
    log(
        f"{args.rows:,} rows x {WIDTH} float32 ({args.rows * WIDTH * 4 / 1e9:.2f} GB); {work.prefill.numel():,} written before timing; per step {u:.0f} unique ids, {new:.0f} new"
    )
    root = Path(args.dir or tempfile.mkdtemp(prefix="dynemb-disk-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        stores = build(names, work, root, log)
        cursor = {"next": 0}

        def one_repeat(attempt):
            steps = range(cursor["next"], cursor["next"] + args.steps)
            cursor["next"] += args.steps
            order = stores if attempt % 2 == 0 else stores[::-1]
            measured = {s.name: run_steps(s, work, steps) for s in order}
            log(f"attempt {attempt}: " + ", ".join(f"{k} {rates(m)['step'] / 1e6:.2f}M" for k, m in measured.items()) + " rows/s (step)")
            return measured, [m["others"] for m in measured.values()]

        kept, noise = quiet_repeats(one_repeat, args.repeats, args.max_retries, log)
        for s in stores[1:]:
            s.mapped = mapped_resident(s.path)
        kv_s = kv_conversion_s(work, range(args.steps))
        log(f"KV contenders' byte conversions alone: {kv_s * 1e3:.1f} ms per step")
        cold = {}
        if args.cold_steps:
            steps = range(len(work.steps) - args.cold_steps, len(work.steps))
            for s in stores[1:]:
                s.close()
                drop_cache(s.path)
                left = resident_bytes(s.path)
                s.open()
                cold[s.name] = {**run_steps(s, work, steps), "resident_after_drop": left}
                io = cold[s.name]["io"]
                log(
                    f"cold {s.name}: {rates(cold[s.name])['step'] / 1e6:.3f}M rows/s (step), {left} bytes resident after the drop, read {io['read_bytes'] / 1e6:.0f} MB from storage"
                )
            cold["memory"] = run_steps(stores[0], work, steps)
        mismatches = verify(stores, work, args.seed)
        log(f"rows differing from the reference: {mismatches}")
        records, rows_md = [], []
        for s in stores:
            per = {k: [rates(m[s.name])[k] for m in kept] for k in ("read", "write", "step")}
            ref = {k: [rates(m["memory"])[k] for m in kept] for k in ("read", "write", "step")}
            extra = {
                "rows": args.rows,
                "width": WIDTH,
                "unique_per_step": float(u),
                "new_per_step": float(new),
                "mismatched_rows": mismatches.get(s.name, 0),
                "kv_conversion_s_per_step": kv_s,
                **noise,
            }
            if s.name != "memory":
                extra["build_s"] = s.build_s
                extra["rss_growth_build"] = s.build_rss
                extra["rss_growth_runs"] = {k: sum(m[s.name]["rss"][k] for m in kept) for k in s.build_rss}
                extra["disk_bytes"] = sum(f.stat().st_blocks * 512 for f in files_of(s.path))  # allocated, not apparent
                extra["mapped_after_warm"] = s.mapped
            if s.name in cold:
                extra["cold"] = {**rates(cold[s.name]), **cold[s.name]}
            for case in ("read", "write", "step"):
                records.append(
                    record(workload="disk-tier", case=case, contender=s.name, unit="rows/s", values=per[case], env=env,
                           ratio=None if s.name == "memory" else paired_ratio(per[case], ref[case], "memory"), extra=extra)
                )  # fmt: skip
            med = {k: float(np.median(v)) for k, v in per.items()}
            ratio = {k: float(np.median([a / b for a, b in zip(per[k], ref[k])])) for k in per}
            c = rates(cold[s.name]) if s.name in cold else None
            rows_md.append(
                [s.name]
                + [f"{med[k] / 1e6:.2f}M ({ratio[k]:.2f})" for k in ("read", "write", "step")]
                + [f"{1e3 * u / med['step']:.1f}", f"{np.median([m[s.name]['io']['minor_faults'] for m in kept]) / args.steps:.0f}"]
                + ([f"{c['read'] / 1e6:.3f}M", f"{c['step'] / 1e6:.3f}M"] if c else ["", ""])
                + [f"{extra.get('disk_bytes', 0) / 1e9:.2f}" if s.name != "memory" else "", str(extra["mismatched_rows"])]
            )
        for r in records:
            r["command"] = env["command"]
        append_jsonl(args.out, records)
        header = [
            "contender",
            "read rows/s (x memory)",
            "write rows/s (x memory)",
            "step rows/s (x memory)",
            "ms / step",
            "page faults / step",
            "cold read rows/s",
            "cold step rows/s",
            "GB on disk",
            "rows != ref",
        ]
        table = markdown_table(header, rows_md)
        seconds = time.perf_counter() - t_start
        others = [x for x in noise["others_cpu_share"] if x is not None]
        tail = f"\nWall time {seconds:.0f} s; others' CPU share at most {max(others, default=0):.1%} per kept repeat; {noise['discarded']} repeat(s) redone."
        print(table + tail)
        if args.markdown:
            args.markdown.write_text(f"Command: `{env['command']}`\n\n{table}\n{tail}\n")
        keys = ("build_s", "rss_growth_build", "rss_growth_runs", "mapped_after_warm", "disk_bytes")
        print(json.dumps({r["contender"]: {k: r["extra"].get(k) for k in keys} for r in records[3::3]}))
    finally:
        for s in stores if "stores" in locals() else []:
            s.close()
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
