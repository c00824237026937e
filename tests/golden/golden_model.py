"""A tiny click model whose loss curve pins dynemb's training numerics bitwise on CPU.

B samples per step, L ids per sample, D embedding dim. Used by test_golden.py; run this file
(`python tests/golden/golden_model.py --write`) only when a change is meant to alter numerics,
and say so in the commit message.
"""

from __future__ import annotations

import json
import pathlib
import sys

import torch

import dynemb

B, L, D, STEPS = 64, 4, 8, 25
GOLDEN = pathlib.Path(__file__).with_name("golden_losses.json")
OPTIMIZERS = {
    "sgd": lambda: dynemb.optim.SGD(lr=0.3),
    "adagrad": lambda: dynemb.optim.Adagrad(lr=0.2),
    "rowwise_adagrad": lambda: dynemb.optim.RowWiseAdagrad(lr=0.2),
    "adam": lambda: dynemb.optim.Adam(lr=0.05),
}


def batches(steps: int = STEPS):
    """Fixed ids ([B, L], arbitrary int64 with repeats) and labels ([B]) per step."""
    g = torch.Generator().manual_seed(1234)
    for _ in range(steps):
        ranks = torch.randint(0, 300, (B, L), generator=g)
        ids = ranks * -7919 + (ranks % 3) * (2**61)  # spread over the int64 range, negatives included
        labels = (ranks.sum(1) % 2).to(torch.float32)
        yield ids, labels


def losses(optimizer: str, pooled: bool) -> list[float]:
    """Train the tiny model for STEPS steps; the loss of each step."""
    torch.manual_seed(0)
    opt = OPTIMIZERS[optimizer]()
    if pooled:
        emb = dynemb.DynamicEmbeddingBag(D, 1024, mode="sum", optimizer=opt, score_strategy="step")
    else:
        emb = dynemb.DynamicEmbedding(D, 1024, optimizer=opt, score_strategy="step")
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
    return out


def all_curves() -> dict[str, list[str]]:
    """Every (optimizer, pooled) curve as float hex strings (exact)."""
    return {
        f"{name}-{'pooled' if pooled else 'sequence'}": [v.hex() for v in losses(name, pooled)]
        for name in OPTIMIZERS
        for pooled in (False, True)
    }


if __name__ == "__main__":
    if "--write" in sys.argv:
        GOLDEN.write_text(json.dumps(all_curves(), indent=1) + "\n")
        print(f"wrote {GOLDEN}")
    else:
        print(json.dumps(all_curves(), indent=1))
