"""Checkpoints see one table whatever its tiers: full and delta saves of a tiered table (rows on
disk, moving) load into tiered and single-tier tables alike, and a process killed with a disk
tier restarts from its last checkpoint.

N ids per batch, D embedding dim.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import torch

import dynemb
from dynemb import TableConfig, Tier

D, CAPACITY = 8, 512


def table(path=None, seed: int = 5) -> dynemb.DynamicEmbedding:
    kw = {"capacity": CAPACITY} if path is None else {"tiers": [Tier("device", 24), Tier("disk", CAPACITY - 24, path=str(path))]}
    return dynemb.DynamicEmbedding(D, optimizer=dynemb.optim.Adam(lr=0.05), score_strategy="step", seed=seed, **kw)


def train(module, steps, n: int = 64) -> list[torch.Tensor]:
    outs = []
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        ids = (torch.randint(0, 300, (n,), generator=gen) ** 2) % 301 - 150
        out = module(ids)
        (out * torch.linspace(-1, 1, D)).sum().backward()
        outs.append(out.detach())
    return outs


class Table:
    """One table of a collection, seen as a table (its ``export()``)."""

    def __init__(self, collection, name: str):
        self.collection, self.name = collection, name

    def export(self):
        return self.collection.export(self.name)


def contents(module) -> dict:
    """key -> (embedding, optimizer state, score): export order is the index's, not compared."""
    out = {}
    for chunk in module.export():
        for k, e, s, sc in zip(chunk["keys"].tolist(), chunk["embeddings"], chunk["optimizer_state"], chunk["scores"].tolist()):
            out[k] = (e, s, sc)
    return out


def assert_same(a, b) -> None:
    ca, cb = contents(a), contents(b)
    assert ca.keys() == cb.keys()
    for k, (e, s, sc) in ca.items():
        assert torch.equal(e, cb[k][0]) and torch.equal(s, cb[k][1]) and sc == cb[k][2], k


def test_full_and_delta_saves_of_a_tiered_table(tmp_path):
    disk = tmp_path / "tier"
    disk.mkdir()
    live = table(disk)
    train(live, range(5))
    dynemb.checkpoint.save(live, tmp_path / "full")
    train(live, range(5, 9))
    live.erase(torch.arange(-150, -100))
    dynemb.checkpoint.save_delta(live, tmp_path / "delta", base=tmp_path / "full")
    assert live.stats()["tiers"][0]["promotions"] > 0 and live.stats()["evictions"] == 0

    tiered, single = table(disk), table()
    dynemb.checkpoint.load(tiered, tmp_path / "delta")
    dynemb.checkpoint.load(single, tmp_path / "delta")
    assert_same(tiered, live)
    assert_same(single, live)
    # The loaded tables train on exactly like the live one.
    for a, b, c in zip(train(live, range(9, 13)), train(tiered, range(9, 13)), train(single, range(9, 13))):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert_same(tiered, live)
    # A single-tier table's checkpoint loads into a tiered table too.
    dynemb.checkpoint.save(single, tmp_path / "single")
    again = table(disk)
    dynemb.checkpoint.load(again, tmp_path / "single")
    assert_same(again, single)
    assert os.listdir(disk) == []


def test_tiered_collection_checkpoint_round_trip(tmp_path):
    def collection(tiered: bool):
        configs = []
        for name, seed in [("a", 1), ("b", 2)]:
            kw = {"tiers": [Tier("device", 16), Tier("disk", 240, path=str(tmp_path))]} if tiered else {"capacity": 256}
            configs.append(TableConfig(name=name, embedding_dim=D, seed=seed, score_strategy="step", **kw))
        return dynemb.DynamicEmbeddingBagCollection(configs, dynemb.optim.RowWiseAdagrad(lr=0.1))

    def step(col, k):
        gen = torch.Generator().manual_seed(k)
        feats = {f: (torch.randint(0, 200, (24,), generator=gen), torch.full((4,), 6)) for f in ["a", "b"]}
        out = col(feats)
        (out["a"] * 2 + out["b"]).square().sum().backward()
        return torch.cat([out["a"], out["b"]]).detach()

    live = collection(True)
    for k in range(6):
        step(live, k)
    dynemb.checkpoint.save(live, tmp_path / "ckpt" / "full")
    for k in range(6, 9):
        step(live, k)
    dynemb.checkpoint.save_delta(live, tmp_path / "ckpt" / "delta", base=tmp_path / "ckpt" / "full")
    for tiered in (True, False):
        loaded = collection(tiered)
        dynemb.checkpoint.load(loaded, tmp_path / "ckpt" / "delta")
        for name in ["a", "b"]:
            assert_same(Table(live, name), Table(loaded, name))
    assert torch.equal(step(live, 9), step(loaded, 9))


CHILD = """
import os, signal, sys, torch
sys.path.insert(0, {tests!r})
from test_tiered_checkpoints import table, train
import dynemb
t = table({disk!r})
train(t, range(4))
dynemb.checkpoint.save(t, {ckpt!r})
train(t, range(4, 7))
print("saved", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_kill_9_with_a_disk_tier_restarts_from_the_last_checkpoint(tmp_path):
    disk = tmp_path / "tier"
    disk.mkdir()
    code = textwrap.dedent(CHILD.format(tests=os.path.dirname(__file__), disk=str(disk), ckpt=str(tmp_path / "ckpt")))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == -signal.SIGKILL and "saved" in out.stdout, out.stderr
    # No tier file outlives the process (it was unlinked once mapped).
    assert os.listdir(disk) == []
    uninterrupted = table(disk)
    train(uninterrupted, range(4))
    restarted = table(disk)
    dynemb.checkpoint.load(restarted, tmp_path / "ckpt")
    assert_same(restarted, uninterrupted)
    for a, b in zip(train(uninterrupted, range(4, 6)), train(restarted, range(4, 6))):
        assert torch.equal(a, b)
    assert_same(restarted, uninterrupted)
