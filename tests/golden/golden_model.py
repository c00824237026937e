"""A tiny click model whose training pins dynemb's numerics on any x86-64 CPU.

B samples per step, L ids per sample, D embedding dim, K keys in the table after training.

Each (optimizer, pooled) case records two things in ``golden_losses.json``:
- ``losses``: the loss of every step;
- ``trained_l1``: sum over the table's keys of |trained row - initial row| (float64), the total
  movement the update rule caused. The loss is a weak witness of the rule (a 0.1% change of the
  SGD step moves it by 1e-6); the trained movement moves by the full 1e-3.

Both are compared with ``RTOL``: another CPU's kernels (AVX2 / AVX-512 / none, any thread count)
reorder fp32 sums and move these values by at most ~2e-7 relative (measured, docs/design/0023-golden-runs.md),
while a changed update rule moves them by 1e-3 or more (tests/golden/test_golden.py shows
both). Two runs in one process must agree bitwise.

Run this file (`python tests/golden/golden_model.py --write`) only when a change is meant to
alter numerics, and say so in the commit message.
"""

from __future__ import annotations

import json
import pathlib
import sys

import torch

import dynemb

B, L, D, STEPS = 64, 4, 8, 25
# Relative tolerance of the cross-machine check: 50x what kernel reordering reached, 100x below
# what a 0.1% change of the update rule moves.
RTOL = 1e-5
GOLDEN = pathlib.Path(__file__).with_name("golden_losses.json")
OPTIMIZERS = {
    "sgd": lambda: dynemb.optim.SGD(lr=0.3),
    "adagrad": lambda: dynemb.optim.Adagrad(lr=0.2),
    "rowwise_adagrad": lambda: dynemb.optim.RowWiseAdagrad(lr=0.2),
    "adam": lambda: dynemb.optim.Adam(lr=0.05),
}
CASES = [f"{name}-{kind}" for name in OPTIMIZERS for kind in ("sequence", "pooled")]


def batches(steps: int = STEPS):
    """Fixed ids ([B, L], arbitrary int64 with repeats) and labels ([B]) per step."""
    g = torch.Generator().manual_seed(1234)
    for _ in range(steps):
        ranks = torch.randint(0, 300, (B, L), generator=g)
        ids = ranks * -7919 + (ranks % 3) * (2**61)  # spread over the int64 range, negatives included
        labels = (ranks.sum(1) % 2).to(torch.float32)
        yield ids, labels


def _table(optimizer: str, pooled: bool):
    opt = OPTIMIZERS[optimizer]()
    if pooled:
        return dynemb.DynamicEmbeddingBag(D, 1024, mode="sum", optimizer=opt, score_strategy="step")
    return dynemb.DynamicEmbedding(D, 1024, optimizer=opt, score_strategy="step")


def _trained_l1(table, pooled: bool) -> float:
    """sum |row - initial row| over the table's keys, in float64; initial rows come from a fresh
    table of the same seed (per-key initialisation makes a key's first row a function of the key)."""
    chunks = list(table.export())
    keys = torch.cat([c["keys"] for c in chunks])  # [K]
    rows = torch.cat([c["embeddings"] for c in chunks])  # [K, D]
    fresh = _table("sgd", pooled)
    with torch.no_grad():
        fresh(keys, torch.arange(keys.numel())) if pooled else fresh(keys)
    initial, found = fresh.find(keys)
    assert bool(found.all())
    return (rows.double() - initial.double()).abs().sum().item()


def run(optimizer: str, pooled: bool) -> dict[str, list[float] | float]:
    """Train the tiny model for STEPS steps: ``{"losses": [STEPS], "trained_l1": float}``."""
    torch.manual_seed(0)
    emb = _table(optimizer, pooled)
    head = torch.nn.Linear(D, 1)
    dense = torch.optim.SGD(head.parameters(), lr=0.1)
    out = []
    for ids, labels in batches():
        x = emb(ids) if pooled else emb(ids).sum(1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(head(x).squeeze(1), labels)
        dense.zero_grad()
        loss.backward()
        dense.step()
        out.append(loss.item())
    return {"losses": out, "trained_l1": _trained_l1(emb, pooled)}


def losses(optimizer: str, pooled: bool) -> list[float]:
    """The loss of each step of :func:`run`."""
    return run(optimizer, pooled)["losses"]


def all_runs() -> dict[str, dict]:
    """Every case, floats as hex strings (exact)."""
    out = {}
    for case in CASES:
        name, kind = case.split("-")
        r = run(name, kind == "pooled")
        out[case] = {"losses": [v.hex() for v in r["losses"]], "trained_l1": r["trained_l1"].hex()}
    return out


def read_golden() -> dict[str, dict]:
    """The committed runs, floats decoded."""
    raw = json.loads(GOLDEN.read_text())
    return {c: {"losses": [float.fromhex(v) for v in r["losses"]], "trained_l1": float.fromhex(r["trained_l1"])} for c, r in raw.items()}


def deviation(got: dict, want: dict) -> float:
    """Largest relative difference between two runs of one case (losses and trained_l1)."""
    pairs = [*zip(got["losses"], want["losses"], strict=True), (got["trained_l1"], want["trained_l1"])]
    return max(abs(a - b) / abs(b) for a, b in pairs)


if __name__ == "__main__":
    if "--write" in sys.argv:
        GOLDEN.write_text(json.dumps(all_runs(), indent=1) + "\n")
        print(f"wrote {GOLDEN}")
    else:
        print(json.dumps(all_runs(), indent=1))
