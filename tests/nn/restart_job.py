"""A training job that can stop and resume in another process, for the restart tests.

B bags per step, L ids per bag, D embedding dim. ``python restart_job.py save DIR STEPS`` trains
every (optimizer, mode) table STEPS steps and saves its state_dict; ``resume DIR MORE`` loads
them in a fresh process, trains MORE steps and saves the final state_dicts and the outputs.
``run(..)`` does the same without stopping, in process.
"""

from __future__ import annotations

import pathlib
import sys

import torch

import dynemb

B, L, D = 16, 3, 4
OPTIMIZERS = {
    "sgd": lambda: dynemb.optim.SGD(lr=0.1),
    "adagrad": lambda: dynemb.optim.Adagrad(lr=0.1),
    "rowwise_adagrad": lambda: dynemb.optim.RowWiseAdagrad(lr=0.1),
    "adam": lambda: dynemb.optim.Adam(lr=0.01),
}
CASES = [(opt, pooled) for opt in OPTIMIZERS for pooled in (False, True)]


def make(optimizer: str, pooled: bool) -> dynemb.DynamicTable:
    # Small capacity and a step clock: the job evicts, so the restore must keep scores and layout.
    kw = dict(optimizer=OPTIMIZERS[optimizer](), score_strategy="step", check_mode="count", init_capacity=32, seed=3)
    if pooled:
        return dynemb.DynamicEmbeddingBag(D, 96, mode="sum", **kw)
    return dynemb.DynamicEmbedding(D, 96, **kw)


def batch(step: int) -> torch.Tensor:
    """Ids of a step ([B, L]), a function of the step only, over more keys than the capacity."""
    g = torch.Generator().manual_seed(step)
    return torch.randint(-200, 200, (B, L), generator=g) * 1_000_003


def train(table: dynemb.DynamicTable, pooled: bool, steps: range) -> list[torch.Tensor]:
    outs = []
    for step in steps:
        ids = batch(step)
        out = table(ids) if pooled else table(ids).sum(1)
        w = torch.linspace(-1, 1, D)
        (out * w).square().sum().backward()
        outs.append(out.detach().clone())
    return outs


def run(optimizer: str, pooled: bool, steps: int) -> tuple[dynemb.DynamicTable, list[torch.Tensor]]:
    table = make(optimizer, pooled)
    return table, train(table, pooled, range(steps))


def main(argv: list[str]) -> None:
    what, folder, n = argv[0], pathlib.Path(argv[1]), int(argv[2])
    for optimizer, pooled in CASES:
        name = f"{optimizer}-{int(pooled)}"
        if what == "save":
            table, _ = run(optimizer, pooled, n)
            torch.save(table.state_dict(), folder / f"{name}.pt")
        else:
            table = make(optimizer, pooled)
            table.load_state_dict(torch.load(folder / f"{name}.pt", weights_only=True))
            start = int(table.step)
            outs = train(table, pooled, range(start, start + n))
            torch.save({"state": table.state_dict(), "outs": outs}, folder / f"{name}-resumed.pt")


if __name__ == "__main__":
    main(sys.argv[1:])
