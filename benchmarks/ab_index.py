"""In-process A/B of two dynemb trees' KeyIndex: find (present keys), find_or_insert (10% new
keys) and insert (all new) of 65,536 keys at one load factor, the two indexes' calls alternating,
their results compared.

Separate processes on this machine differ by 10-25% in speed (perf-log); two trees in one process
share its state. The other tree's ``src/dynemb`` is copied as a package named ``dynemb_other``
(its imports renamed); its compiled kernels build under their own source hash.

    python benchmarks/ab_index.py /path/to/other/checkout --load 0.9 [--calls 16] [--rules-differ] [--probe]

``--probe`` times only the upsert's probe (``found_and_missing_native`` with the first round's
choices, nothing placed) on the find_or_insert and insert queries.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from keygen import distinct_keys, scramble

N = 65536
NEW_FRACTION = 0.1
FRESH_BASE = 1 << 40


def import_other(checkout: Path):
    """The other tree's dynemb, imported as ``dynemb_other``."""
    folder = Path(tempfile.mkdtemp(prefix="dynemb-ab-"))
    target = folder / "dynemb_other"
    shutil.copytree(checkout / "src" / "dynemb", target)
    for path in target.rglob("*.py"):
        text = path.read_text()
        path.write_text(re.sub(r"\b(from|import) dynemb(\.|\b)", r"\1 dynemb_other\2", text))
    sys.path.insert(0, str(folder))
    import dynemb_other

    return dynemb_other


def filled(module, load: float):
    index = module.KeyIndex(capacity=1 << 22)
    next_key = now = 0
    goal = int(load * index.capacity())
    while index.size() < goal:
        n = min(N, max(goal - index.size(), 4096))
        now += 1
        index.find_or_insert(distinct_keys(next_key, n), now=now)
        next_key += n
    return index, next_key, now


def probe(index, keys: torch.Tensor, now: int) -> torch.Tensor:
    """The upsert's probe of ``keys`` under one clock value, as the index runs it (the found
    keys' scores written, the first round's choices packed, nothing placed): the slot of each
    key, -1 where missing. A private method: this measures a step inside the upsert."""
    scores, counts = torch.full_like(keys, now), torch.ones_like(keys)
    return index._found_and_missing_native(keys, counts, scores, False, True, None)[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("other", type=Path, help="the other checkout (its src/dynemb is measured as 'other')")
    p.add_argument("--load", type=float, default=0.5)
    p.add_argument("--calls", type=int, default=16)
    p.add_argument(
        "--rules-differ", action="store_true", help="the trees place keys differently: compare only which keys each call holds, not slots or row ids"
    )
    p.add_argument("--probe", action="store_true", help="time only the upsert's probe of the find_or_insert and insert queries")
    args = p.parse_args()
    import dynemb

    trees = {"this": dynemb, "other": import_other(args.other)}
    built = {name: filled(module, args.load) for name, module in trees.items()}
    present, now = built["this"][1], built["this"][2]
    times = {(op, name): [] for op in ("find", "find_or_insert", "insert") for name in trees}
    g = torch.Generator().manual_seed(0)
    for call in range(args.calls):
        fresh = distinct_keys(FRESH_BASE + call * N, int(NEW_FRACTION * N))
        mixed = torch.cat([scramble(torch.randint(0, present, (N - fresh.numel(),), generator=g)), fresh])
        queries = {"find": (scramble(torch.randint(0, present, (N,), generator=g)), None)}
        queries["find_or_insert"] = (mixed[torch.randperm(N, generator=g)], fresh)
        new = distinct_keys(FRESH_BASE + (1 << 30) + call * N, N)
        queries["insert"] = (new, new)
        now += 1
        names = list(trees) if call % 2 else list(trees)[::-1]
        for op, (keys, leaving) in queries.items():
            results = {}
            for name in names:
                index = built[name][0]
                t0 = time.perf_counter()
                if args.probe and leaving is not None:
                    results[name] = probe(index, keys, now)
                    times[(op, name)].append(time.perf_counter() - t0)
                    continue
                results[name] = index.find(keys)[0] if leaving is None else index.find_or_insert(keys, now=now).rows
                times[(op, name)].append(time.perf_counter() - t0)
                if leaving is not None:
                    index.erase(leaving)
            if args.rules_differ:
                results = {name: r >= 0 for name, r in results.items()}
            assert torch.equal(results["this"], results["other"]), "the trees disagree"
    for (op, name), t in sorted(times.items()):
        t.sort()
        median = t[len(t) // 2]
        print(f"load {args.load} {op:15s} {name:5s}: median {median * 1e3:.2f} ms, {N / median / 1e6:.2f} M keys/s")


if __name__ == "__main__":
    main()
