"""The compiled insert (docs/design/0043) against the sorted path it replaces, in one process:
two indexes of this tree take the same upsert_unique calls (distinct (segment, key) pairs, one
clock value, as a training step's lookup), calls alternating, one of them held to the sorted
path. Both must end with the same slots and row ids. No other tree is needed: both paths are
this code's.

N keys a call, a fraction NEW of them never seen, S segments (a collection's tables).

    python benchmarks/insert_paths.py [--segments 26] [--keys 40000] [--new 0.15] [--calls 60]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dynemb.kernels.dedup import dedup_torch
from dynemb.table.index import KeyIndex

WARMUP = 5


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--segments", type=int, default=26)
    p.add_argument("--keys", type=int, default=40_000)
    p.add_argument("--new", type=float, default=0.15)
    p.add_argument("--calls", type=int, default=60)
    a = p.parse_args()

    def make() -> KeyIndex:
        if a.segments > 1:
            return KeyIndex(capacities=[(1 << 22) // a.segments] * a.segments, backend="native")
        return KeyIndex(capacity=1 << 22, backend="native")

    fast, slow = make(), make()
    slow._places_without_growth = lambda m, new_seg: False  # never the compiled insert
    g = torch.Generator().manual_seed(0)
    seen = torch.empty(0, dtype=torch.int64)
    times: dict[str, list[float]] = {"compiled insert": [], "sorted path": []}
    n_new = int(a.new * a.keys)
    for call in range(a.calls + WARMUP):
        old = seen[torch.randint(0, max(seen.numel(), 1), (a.keys - n_new,), generator=g)] if seen.numel() else seen
        fresh = torch.randint(-(2**62), 2**62, (a.keys - old.numel(),), generator=g)
        keys = torch.cat([old, fresh])
        # The distinct (segment, key) pairs, by segment, then key: upsert_unique's input.
        unique, useg, _, _ = dedup_torch(keys, torch.randint(0, a.segments, (keys.numel(),), generator=g))
        kw = {"segments": useg} if a.segments > 1 else {}
        runs = [("compiled insert", fast), ("sorted path", slow)]
        for name, index in runs if call % 2 == 0 else runs[::-1]:
            t0 = time.perf_counter()
            index.upsert_unique(unique, torch.ones_like(unique), now=call + 1, **kw)
            if call >= WARMUP:
                times[name].append(time.perf_counter() - t0)
        seen = torch.cat([seen, fresh])
    assert torch.equal(fast._keys, slow._keys) and torch.equal(fast._rows, slow._rows), "the two paths disagree"
    for name, values in times.items():
        print(f"upsert_unique, {a.segments} segment(s), {a.keys} keys a call, ~{a.new:.0%} new: {name} median {statistics.median(values) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
