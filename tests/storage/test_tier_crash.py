"""A disk tier survives kill -9 as a cache does (issue 18): a job trains a table whose rows live
in a small device tier over a disk tier, saves a checkpoint, trains on and is killed with
SIGKILL; a new process (here) builds the same table over the same tier directory and loads the
checkpoint. The loaded table equals the checkpoint (the uninterrupted run at that step) and a
further step equals the uninterrupted run's: nothing of the dead job's half-written tier file is
read back.

    python tests/storage/test_tier_crash.py job ROOT     # the job the test starts and kills
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

import dynemb
import dynemb.checkpoint

D, DEVICE_ROWS, DISK_ROWS = 8, 64, 4096
SAVED_AT = 3  # steps trained when the checkpoint is saved


def make_table(root: Path) -> dynemb.DynamicEmbedding:
    (root / "tiers").mkdir(parents=True, exist_ok=True)
    tiers = [dynemb.Tier("device", rows=DEVICE_ROWS), dynemb.Tier("disk", rows=DISK_ROWS, path=str(root / "tiers"))]
    return dynemb.DynamicEmbedding(D, DEVICE_ROWS + DISK_ROWS, optimizer=dynemb.optim.Adagrad(lr=0.1), tiers=tiers)


def batch(step: int) -> torch.Tensor:
    """300 ids of a 2,000-key vocabulary (0, -1 and int64 extremes among them): the device tier
    cannot hold a step's keys, so rows move between the tiers every step."""
    g = torch.Generator().manual_seed(step)
    vocab = torch.randint(-(2**62), 2**62, (2000,), generator=torch.Generator().manual_seed(99))
    vocab[:3] = torch.tensor([0, -1, -(2**63)])
    return vocab[torch.randint(0, 2000, (300,), generator=g)]


def train(table: dynemb.DynamicEmbedding, steps: range) -> None:
    for step in steps:
        (table(batch(step)) ** 2).sum().backward()


def rows(table: dynemb.DynamicEmbedding) -> dict[int, torch.Tensor]:
    out = {}
    for chunk in table.export():
        for k, e, s in zip(chunk["keys"].tolist(), chunk["embeddings"], chunk["optimizer_state"]):
            out[k] = torch.cat([e, s])
    return out


def job(root: Path) -> None:
    """Train, save at SAVED_AT, train on (logging each step) until killed."""
    torch.set_num_threads(1)
    table = make_table(root)
    train(table, range(SAVED_AT))
    dynemb.checkpoint.save(table, root / "ckpt")
    log = open(root / "log", "a")
    for step in range(SAVED_AT, 10_000):
        train(table, range(step, step + 1))
        log.write(f"step {step}\n")
        log.flush()


def test_kill_9_with_a_disk_tier_then_restart_from_the_checkpoint(tmp_path):
    proc = subprocess.Popen([sys.executable, __file__, "job", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        # Killed well after the save, while it writes rows to the disk tier.
        while not ((tmp_path / "log").exists() and len((tmp_path / "log").read_text().splitlines()) >= 5):
            assert proc.poll() is None, proc.communicate()[1].decode()[-3000:]
            assert time.monotonic() < deadline, "the job did not reach 5 steps after its checkpoint"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL

    restarted = make_table(tmp_path)  # the same tier directory the dead job wrote
    dynemb.checkpoint.load(restarted, tmp_path / "ckpt")
    uninterrupted = make_table(tmp_path / "reference")
    train(uninterrupted, range(SAVED_AT))
    expected, got = rows(uninterrupted), rows(restarted)
    assert got.keys() == expected.keys()
    for key, row in expected.items():
        assert torch.equal(got[key], row), key
    train(restarted, range(SAVED_AT, SAVED_AT + 1))
    train(uninterrupted, range(SAVED_AT, SAVED_AT + 1))
    expected, got = rows(uninterrupted), rows(restarted)
    assert got.keys() == expected.keys()
    for key, row in expected.items():
        assert torch.equal(got[key], row), key


if __name__ == "__main__" and sys.argv[1:2] == ["job"]:
    job(Path(sys.argv[2]))
