"""W4, checkpoint: dynemb.checkpoint.save / load of one table against torch.save / torch.load
of the same tensors.

K keys, D embedding dim, S optimizer state columns (Adam: 2D).

A ``DynamicEmbedding(D, K, optimizer=Adam)`` is filled with K random keys and rows (insert, in
chunks). Its content is exported once into four tensors (keys [K], embeddings [K, D],
optimizer_state [K, S], scores [K]): the reference saves exactly these with ``torch.save`` (one
file, not fsynced, as torch does by default) and ``torch.save`` + ``os.fsync`` (the durability a
checkpoint needs), and loads them with ``torch.load``. dynemb saves the table with
``dynemb.checkpoint.save`` (chunked safetensors files, SHA-256 of each, fsync, atomic rename) and
loads it with ``dynemb.checkpoint.load`` (verify every file, rebuild the index exactly, swap).
Throughput is the table's bytes (keys, rows, scores) per second; each repeat times every
contender once, alternating the order, and the figures are paired ratios. During each dynemb
save of its own (untimed) a thread samples the process's resident memory every 2 ms: the peak
above the level before the save is the save's extra memory, reported as a share of the table's
bytes. The loads run after the saves, once the reference tensors are freed.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import torch

import dynemb
import dynemb.checkpoint
from harness import paired_ratio, record, settle

DIM = 128


@dataclasses.dataclass(frozen=True, kw_only=True)
class W4Config:
    keys: int = 4_000_000
    repeats: int = 3
    seed: int = 0
    directory: str | None = None  # where files go (default: a temporary directory)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Resident memory peak while active, sampled every 2 ms by a thread."""

    def __enter__(self):
        self.base = _rss()
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.002)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())

    @property
    def extra(self) -> int:
        return self.peak - self.base


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def build_table(cfg: W4Config) -> torch.nn.Module:
    """A table of cfg.keys keys with random rows (Adam state included)."""
    gen = torch.Generator().manual_seed(cfg.seed)
    table = dynemb.DynamicEmbedding(DIM, cfg.keys, optimizer=dynemb.optim.Adam(lr=1e-3), check_mode="count", score_strategy="step")
    width = DIM + table.state_dim
    chunk = 1 << 20
    keys = torch.randint(-(2**63), 2**63 - 1, (cfg.keys + cfg.keys // 8,), generator=gen).unique()[: cfg.keys]
    keys = keys[torch.randperm(keys.numel(), generator=gen)]
    for start in range(0, keys.numel(), chunk):
        part = keys[start : start + chunk]
        table.insert(part, torch.rand(part.numel(), width, generator=gen))
    return table


def run(cfg: W4Config, env: dict, log=print) -> list[dict]:
    log(f"W4: building a {cfg.keys:,}-key D={DIM} Adam table")
    table = build_table(cfg)
    size = len(table)
    chunks = list(table.export(1 << 20))
    tensors = {k: torch.cat([c[k] for c in chunks]) for k in ("keys", "embeddings", "optimizer_state", "scores")}
    del chunks
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    log(f"W4: {size:,} keys held (of {cfg.keys:,} inserted), {nbytes / 1e9:.2f} GB of keys, rows and scores")
    root = Path(cfg.directory or tempfile.mkdtemp(prefix="dynemb-w4-"))
    root.mkdir(parents=True, exist_ok=True)
    rates = {name: [] for name in ("save", "torch.save", "torch.save+fsync", "load", "torch.load")}
    extra_mem = []
    try:
        for repeat in range(cfg.repeats):
            order = ["save", "torch.save", "torch.save+fsync"]
            if repeat % 2:
                order.reverse()
            for name in order:
                if name == "save":
                    shutil.rmtree(root / "ckpt", ignore_errors=True)
                else:
                    (root / "ref.pt").unlink(missing_ok=True)
                # Write back what earlier contenders left in the page cache (plain torch.save
                # leaves gigabytes dirty): otherwise the next contender pays for that writeback.
                os.sync()
                settle()
                t0 = time.perf_counter()
                if name == "save":
                    dynemb.checkpoint.save(table, root / "ckpt")
                else:
                    torch.save(tensors, root / "ref.pt")
                    if name == "torch.save+fsync":
                        _fsync(root / "ref.pt")
                rates[name].append(nbytes / (time.perf_counter() - t0) / 1e9)
                log(f"W4 repeat {repeat} {name}: {rates[name][-1]:.3f} GB/s")
        # Memory, in saves of their own (the sampling thread would slow a timed save).
        for _ in range(cfg.repeats):
            settle()
            with PeakRSS() as mem:
                dynemb.checkpoint.save(table, root / "ckpt-memory")
            extra_mem.append(mem.extra)
            shutil.rmtree(root / "ckpt-memory", ignore_errors=True)
        # Loads, once every save was timed: the reference tensors are freed first (a load holds
        # the checkpoint's rows and a fresh table beside the live one).
        del tensors
        settle()
        for repeat in range(cfg.repeats):
            for name in ["load", "torch.load"] if repeat % 2 == 0 else ["torch.load", "load"]:
                settle()
                t0 = time.perf_counter()
                if name == "load":
                    dynemb.checkpoint.load(table, root / "ckpt")
                else:
                    loaded = torch.load(root / "ref.pt", weights_only=True)
                    del loaded
                rates[name].append(nbytes / (time.perf_counter() - t0) / 1e9)
                log(f"W4 repeat {repeat} {name}: {rates[name][-1]:.3f} GB/s")
    finally:
        if cfg.directory is None:
            shutil.rmtree(root, ignore_errors=True)
    extra = {"keys": size, "table_bytes": nbytes, "embedding_dim": DIM, "optimizer": "Adam", "save_extra_rss_bytes": extra_mem}
    share = [m / nbytes for m in extra_mem]
    records = [
        record(workload="W4", case="save", contender="dynemb.checkpoint.save", unit="GB/s", values=rates["save"], env=env,
               ratio=paired_ratio(rates["save"], rates["torch.save"], "torch.save"),
               extra={**extra, "ratio_vs_torch_save_fsync": paired_ratio(rates["save"], rates["torch.save+fsync"], "torch.save+fsync"),
                      "save_extra_rss_share": share}),
        record(workload="W4", case="save", contender="torch.save", unit="GB/s", values=rates["torch.save"], env=env, extra=extra),
        record(workload="W4", case="save", contender="torch.save+fsync", unit="GB/s", values=rates["torch.save+fsync"], env=env, extra=extra),
        record(workload="W4", case="load", contender="dynemb.checkpoint.load", unit="GB/s", values=rates["load"], env=env,
               ratio=paired_ratio(rates["load"], rates["torch.load"], "torch.load"), extra=extra),
        record(workload="W4", case="load", contender="torch.load", unit="GB/s", values=rates["torch.load"], env=env, extra=extra),
        record(workload="W4", case="save-memory", contender="dynemb.checkpoint.save", unit="share of table bytes", values=share, env=env, extra=extra),
    ]  # fmt: skip
    return records


if __name__ == "__main__":
    import argparse
    import sys

    from harness import append_jsonl, environment

    p = argparse.ArgumentParser(description="W4 alone (python benchmarks/run.py --workload W4 runs it with the others)")
    p.add_argument("--keys", type=int, default=W4Config.keys)
    p.add_argument("--repeats", type=int, default=W4Config.repeats)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "results.jsonl"))
    args = p.parse_args()
    env = environment()
    env["command"] = " ".join(["python", *sys.argv])
    recs = run(W4Config(keys=args.keys, repeats=args.repeats), env)
    for r in recs:
        r["command"] = env["command"]
        ratio = r.get("ratio")
        print(
            f"{r['workload']} {r['case']:<12} {r['contender']:<24} median {r['median']:.3f} {r['unit']}"
            + (f"  ratio {ratio['median']:.2f} [{ratio['min']:.2f}, {ratio['max']:.2f}] vs {ratio['vs']}" if ratio else "")
        )
    append_jsonl(Path(args.out), recs)
