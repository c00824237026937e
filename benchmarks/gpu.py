"""GPU figures of issue 19 (item 5): dynemb's Triton kernels against plain torch on the same GPU.

    python benchmarks/gpu.py --out results/gpu.jsonl         # needs CUDA and Triton; ~3 min on an H100

N keys per call, C index capacity.

W2-GPU  a ``dynemb.KeyIndex`` of C = 2**22 slots on the GPU, filled with random int64 keys to load
        0.5 and 0.9; per call N keys: ``find`` of present keys (uniform, with repeats),
        ``find_or_insert`` with 10% never-seen keys, ``insert`` of N never-seen keys (the new keys
        erased untimed after each call, so every call runs at the target load). Backend
        ``native`` (the Triton kernels: candidates, probe, row ids) against ``torch`` (the
        plain-torch index on the GPU), keys/s, for N = 65,536 and 1,048,576.
W1-GPU  W1's train step (``w1_train_step``: 65,536 Zipf ids, D = 128) on the GPU: dynemb with the
        Triton kernels (locate, fused optimizer update, per-key init), dynemb on plain torch, and
        the floor (a static GPU table on pre-remapped ids with the hand-fused update), steps/s,
        SGD and row-wise Adagrad.

Each figure is the median over repeats; every repeat times all contenders back to back (order
rotated), and the ratios are taken within a repeat. Timing brackets the calls with
``torch.cuda.synchronize()``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import dynemb
import w1_train_step as w1
from keygen import distinct_keys

CAPACITY = 1 << 22
LOADS = (0.5, 0.9)
BATCHES = (1 << 16, 1 << 20)
NEW_FRACTION = 0.1
NEW_BASE = 1 << 40
# Where the run measures: cuda (the point), or cpu for a smoke run of the script (--device cpu).
DEVICE = torch.device("cuda")


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, calls: int) -> float:
    _sync()
    t0 = time.perf_counter()
    for i in range(calls):
        fn(i)
    _sync()
    return time.perf_counter() - t0


def _w2_seconds(index: dynemb.KeyIndex, op: str, batches: list[torch.Tensor]) -> float:
    """Seconds of ``op`` over the batches; the new keys of an insert are erased untimed."""
    if op == "find":
        return _timed(lambda i: index.find(batches[i]), len(batches))
    untimed = []

    def call(i: int) -> None:
        r = index.find_or_insert(batches[i], now=1)
        new = batches[i][r.inserted]
        _sync()
        t = time.perf_counter()
        index.erase(new)
        _sync()
        untimed.append(time.perf_counter() - t)

    return _timed(call, len(batches)) - sum(untimed)


def w2(repeats: int, calls: int, log) -> list[dict]:
    records = []
    for load in LOADS:
        present = distinct_keys(0, int(load * CAPACITY)).to(DEVICE)
        indexes = {}
        for backend in ("native", "torch"):
            index = dynemb.KeyIndex(capacity=CAPACITY, backend=backend, device=DEVICE)
            for part in present.split(1 << 20):
                index.find_or_insert(part, now=0)
            indexes[backend] = index
        assert indexes["native"].compiled and not indexes["torch"].compiled
        for n in BATCHES:
            g = torch.Generator().manual_seed(n)
            queries = [present[torch.randint(0, present.numel(), (n,), generator=g).to(DEVICE)] for _ in range(calls)]
            fresh = [distinct_keys(NEW_BASE + i * (1 << 24), n).to(DEVICE) for i in range(calls)]
            mixed = [torch.where(torch.rand(n, generator=g).to(DEVICE) < NEW_FRACTION, f, q) for q, f in zip(queries, fresh)]

            # Inserts only where the new keys fit under the index's load limit (no eviction).
            ops = ("find", "find_or_insert", "insert") if load * CAPACITY + n <= 0.85 * CAPACITY else ("find",)
            for op in ops:
                rates = {b: [] for b in indexes}
                for rep in range(repeats + 1):  # the first is a warm-up (Triton compiles)
                    order = list(indexes) if rep % 2 else list(indexes)[::-1]
                    for b in order:
                        seconds = _w2_seconds(indexes[b], op, queries if op == "find" else fresh if op == "insert" else mixed)
                        if rep:
                            rates[b].append(n * calls / seconds)
                ratio = statistics.median(a / b for a, b in zip(rates["native"], rates["torch"]))
                rec = {
                    "workload": "W2-GPU",
                    "case": f"{op}@{load} N={n}",
                    "native_keys_per_s": statistics.median(rates["native"]),
                    "torch_keys_per_s": statistics.median(rates["torch"]),
                    "ratio": ratio,
                }
                log(
                    f"W2-GPU {rec['case']}: native {rec['native_keys_per_s'] / 1e6:.1f} M keys/s, torch {rec['torch_keys_per_s'] / 1e6:.1f} M/s, ratio {ratio:.2f}"
                )
                records.append(rec)
        del indexes
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()
    return records


def _stepper(step, batches: torch.Tensor):
    return lambda i: step(batches[i])


def w1_gpu(repeats: int, steps: int, log) -> list[dict]:
    cfg = w1.W1Config(steps=steps, repeats=repeats, warmup=3, profile_steps=0, max_retries=0)
    st = w1.make_stream(cfg)
    batches, dense, v = st.batches.to(DEVICE), st.dense.to(DEVICE), st.v.to(DEVICE)
    log(f"W1-GPU: {batches.shape[0]} batches of {batches.shape[1]} ids, {st.num_keys} distinct keys")
    records = []
    for case in w1.CASES:
        contenders = {
            "dynemb-native": (w1.Contender(case, v, st.capacity, device=DEVICE, backend="native").step, batches),
            "dynemb-torch": (w1.Contender(case, v, st.capacity, device=DEVICE, backend="torch").step, batches),
            "floor": (w1.Floor(case, st.num_keys, v, device=DEVICE).step, dense),
        }
        for step, data in contenders.values():
            for i in range(cfg.warmup):
                step(data[i])
        rates = {name: [] for name in contenders}
        for rep in range(repeats):
            part = slice(cfg.warmup + rep * steps, cfg.warmup + (rep + 1) * steps)
            names = list(contenders)
            names = names[rep % 3 :] + names[: rep % 3]
            for name in names:
                step, data = contenders[name]
                rates[name].append(steps / _timed(_stepper(step, data[part]), steps))
        rec = {"workload": "W1-GPU", "case": case}
        for name in contenders:
            rec[f"{name}_steps_per_s"] = statistics.median(rates[name])
        for name in ("dynemb-native", "dynemb-torch"):
            rec[f"{name}_vs_floor"] = statistics.median(a / b for a, b in zip(rates[name], rates["floor"]))
        rec["native_vs_torch"] = statistics.median(a / b for a, b in zip(rates["dynemb-native"], rates["dynemb-torch"]))
        log(
            f"W1-GPU {case}: native {rec['dynemb-native_steps_per_s']:.1f}, torch {rec['dynemb-torch_steps_per_s']:.1f}, "
            f"floor {rec['floor_steps_per_s']:.1f} steps/s; native/floor {rec['dynemb-native_vs_floor']:.2f}, "
            f"torch/floor {rec['dynemb-torch_vs_floor']:.2f}, native/torch {rec['native_vs_torch']:.2f}"
        )
        records.append(rec)
    return records


def main() -> None:
    global DEVICE, BATCHES
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=("W1", "W2", "all"), default="all")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=10, help="W1 steps / W2 calls per repeat and contender")
    p.add_argument("--out", type=Path)
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run of the script (the C++ kernels stand in)")
    p.add_argument("--batches", type=int, nargs="+", default=[1 << 16, 1 << 20], help="W2 keys per call")
    args = p.parse_args()
    DEVICE, BATCHES = torch.device(args.device), tuple(args.batches)
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu.py needs a CUDA device (or --device cpu for a smoke run)")
    env = {"device": torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu", "torch": torch.__version__}
    print(json.dumps(env), flush=True)
    records = []
    if args.workload in ("W2", "all"):
        records += w2(args.repeats, args.steps, lambda s: print(s, flush=True))
    if args.workload in ("W1", "all"):
        records += w1_gpu(args.repeats, args.steps, lambda s: print(s, flush=True))
    if args.out:
        with args.out.open("a") as f:
            for r in records:
                f.write(json.dumps({**env, **r}) + "\n")


if __name__ == "__main__":
    main()
