"""Sharding on CUDA with NCCL: a single-process NCCL world of 1 (and 2 GPUs where present).

Skipped without CUDA; run on a lent GPU machine."""

from __future__ import annotations

import datetime
import os
import socket

import pytest
import torch
import torch.distributed as dist

import dynemb
import dynemb.distributed

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture
def nccl_world_of_one():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    try:
        yield
    finally:
        dist.destroy_process_group()


def _batches(steps: int, n: int):
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ids = torch.randint(-50, 50, (n,), generator=gen)
        ids[:2] = torch.tensor([-(2**63), 2**63 - 1])
        yield ids.cuda()


@pytest.mark.parametrize("update", ["fused", "deferred"])
def test_sharded_bag_matches_unsharded_on_cuda(nccl_world_of_one, update):
    def make():
        opt = dynemb.optim.Adam(lr=0.05)
        return dynemb.DynamicEmbeddingBag(8, 1024, mode="sum", optimizer=opt, update=update, device="cuda"), opt

    (sharded, o1), (ref, o2) = make(), make()
    dynemb.distributed.shard(sharded, timeout=datetime.timedelta(seconds=60))
    for ids in _batches(6, 48):
        offsets = torch.arange(0, ids.numel(), 3, device="cuda")
        a, b = sharded(ids, offsets), ref(ids, offsets)
        torch.testing.assert_close(a, b)
        (a * a).sum().backward()
        (b * b).sum().backward()
        if update == "deferred":
            o1.step(), o2.step(), o1.zero_grad(), o2.zero_grad()
    got = {k: v for c in sharded.export() for k, v in zip(c["keys"].tolist(), c["embeddings"])}
    want = {k: v for c in ref.export() for k, v in zip(c["keys"].tolist(), c["embeddings"])}
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k])


def test_sharded_collection_on_cuda(nccl_world_of_one):
    tables = [
        dynemb.TableConfig(name="a", feature_names=["f1", "f2"], embedding_dim=8, capacity=1024, device="cuda"),
        dynemb.TableConfig(name="b", feature_names=["f3"], embedding_dim=4, capacity=1024, device="cuda"),
    ]
    sharded = dynemb.DynamicEmbeddingBagCollection(tables, dynemb.optim.RowWiseAdagrad(lr=0.05))
    ref = dynemb.DynamicEmbeddingBagCollection(tables, dynemb.optim.RowWiseAdagrad(lr=0.05))
    dynemb.distributed.shard(sharded)
    for ids in _batches(5, 12):
        one = torch.ones(4, dtype=torch.int64, device="cuda")
        batch = {"f1": (ids[:4], one), "f2": (ids[4:8], one), "f3": (ids[8:12], one)}
        a, b = sharded(batch).concat, ref(batch).concat
        torch.testing.assert_close(a, b)
        (a * a).sum().backward()
        (b * b).sum().backward()
    for t in ("a", "b"):
        values, found = sharded.find(t, torch.tensor([1, 2, 3], device="cuda"))
        want, want_found = ref.find(t, torch.tensor([1, 2, 3], device="cuda"))
        assert torch.equal(found, want_found)
        torch.testing.assert_close(values, want)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_nccl():
    """Two processes, one GPU each, through the demo (tables sharded over NCCL)."""
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    cmd += ["-m", "dynemb.demo", "--distributed", "--device", "cuda", "--steps", "30", "--batch-size", "256", "--eval-samples", "2000"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "held-out AUC" in done.stdout
