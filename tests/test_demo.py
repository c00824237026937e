"""The demo trains and clearly beats chance on a short run."""

from __future__ import annotations

import torch

from dynemb.demo import auc, main


def test_auc_matches_pairwise_definition():
    gen = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 5, (200,), generator=gen).double()  # many ties
    labels = torch.randint(0, 2, (200,), generator=gen).double()
    pos, neg = scores[labels.bool()], scores[~labels.bool()]
    diff = pos[:, None] - neg[None, :]
    expected = ((diff > 0).double() + 0.5 * (diff == 0).double()).mean().item()
    assert abs(auc(scores, labels) - expected) < 1e-12


def test_short_demo_run_beats_chance(capsys):
    value = main(["--steps", "120", "--batch-size", "512", "--eval-samples", "10000"])
    assert value > 0.58
    out = capsys.readouterr().out
    assert "held-out AUC" in out and "evictions" in out


def test_tiered_demo_trains_like_the_in_memory_demo_and_prints_its_tiers(tmp_path, capsys):
    """--tiers: the users' rows in a 2^13-row device tier over a disk tier. Nothing is evicted in
    a short run, so the model, and its AUC, are those of the in-memory demo."""
    args = ["--steps", "60", "--batch-size", "512", "--eval-samples", "4000"]
    plain = main(args)
    capsys.readouterr()
    tiered = main([*args, "--tiers", "--tier-dir", str(tmp_path / "tiers"), "--plot", str(tmp_path / "tiers.png")])
    assert tiered == plain
    out = capsys.readouterr().out
    assert "users' tiers:" in out and "hit rate" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split() and line.split()[0] in ("device", "disk")}
    assert set(rows) == {"device", "disk"}
    assert int(rows["device"][1]) == 1 << 13  # the device tier is full, the rest went to disk
    assert int(rows["disk"][1]) > 0


def test_distributed_demo_under_torchrun():
    """README's distributed command, shortened: 2 gloo processes, tables sharded, per-rank stats."""
    import os
    import signal
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    cmd += ["-m", "dynemb.demo"]
    cmd += ["--distributed", "--steps", "60", "--batch-size", "256", "--eval-samples", "4000"]
    # A session of its own: on a timeout the launcher and both workers are killed together.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError("the distributed demo did not finish within 240 s") from None
    assert proc.returncode == 0, stderr[-3000:]
    lines = stdout.splitlines()
    assert any(line.startswith("held-out AUC") for line in lines), stdout
    rows = [line.split() for line in lines if line[:1].isdigit()]
    assert {(r[0], r[1]) for r in rows} == {(rank, t) for rank in "01" for t in ("users", "items", "tags")}, stdout
