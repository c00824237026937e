"""Recycled outputs: memory is reused only once nothing can read the previous output."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.utils.dlpack

from dynemb.workspace import Recycler, Workspace, poison_enabled, set_poison


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@pytest.mark.parametrize(
    "hold",
    ["tensor", "view", "detach", "numpy", "split", "autograd", "dlpack", "untyped_storage", "typed_storage", "shared"],
)
def test_a_held_output_is_not_reused(hold):
    r = Recycler()
    out = r.get("x", (64, 8), torch.float32, torch.device("cpu"))
    out.fill_(1.0)
    w = torch.ones(8, requires_grad=True)
    held = {
        "tensor": lambda: out,
        "view": lambda: out[3:],
        "detach": lambda: out.detach(),
        "numpy": lambda: out.numpy(),
        "split": lambda: torch.split(out, [4, 4], dim=1),
        "autograd": lambda: (out * w).sum(),  # the graph keeps out for w's gradient
        "dlpack": lambda: torch.utils.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(out)),
        "untyped_storage": lambda: out.untyped_storage(),
        "typed_storage": lambda: out.storage(),
        # Sent to another process: its memory moved to shared memory, read over there.
        "shared": lambda: [out.share_memory_()] and None,
    }[hold]()
    ptr = out.data_ptr()
    if hold != "tensor":
        del out
    again = r.get("x", (64, 8), torch.float32, torch.device("cpu"))
    assert again.data_ptr() != ptr
    if hold == "autograd":
        held.backward()
        assert torch.equal(w.grad, torch.full((8,), 64.0))
    elif hold == "numpy":
        assert np.all(held == 1.0)
    del held


def test_freed_or_outsized_blocks_are_replaced():
    r = Recycler()
    out = r.get("x", (64, 8), torch.float32, torch.device("cpu"))
    out.untyped_storage().resize_(0)  # memory released by its user (FSDP-style)
    del out
    again = r.get("x", (64, 8), torch.float32, torch.device("cpu"))
    again.fill_(2.0)
    ptr = again.data_ptr()
    del again
    # A much smaller request does not keep the large block alive.
    assert r.get("x", (4, 8), torch.float32, torch.device("cpu")).data_ptr() != ptr


def test_a_dropped_output_is_reused_and_is_not_a_view():
    r = Recycler()
    out = r.get("x", (64, 8), torch.float32, torch.device("cpu"))
    ptr = out.data_ptr()
    assert out._base is None and out.shape == (64, 8)
    del out
    again = r.get("x", (32, 8), torch.float32, torch.device("cpu"))
    assert again.data_ptr() == ptr and again.shape == (32, 8)
    other = r.get("y", (32, 8), torch.float32, torch.device("cpu"))
    assert not _same_memory(other, again)
    # Larger than the block, or another dtype: new memory.
    del again
    assert r.get("x", (65, 8), torch.float32, torch.device("cpu")).data_ptr() != ptr


def test_collection_outputs_reuse_memory_only_when_dropped():
    import dynemb

    tables = [dynemb.TableConfig(name=n, embedding_dim=d, capacity=256) for n, d in (("a", 8), ("b", 16))]
    col = dynemb.DynamicEmbeddingBagCollection(tables, dynemb.optim.SGD(lr=0.1))
    ones = torch.ones(32, dtype=torch.int64)

    def batch(seed):
        g = torch.Generator().manual_seed(seed)
        return {n: (torch.randint(0, 100, (32,), generator=g), ones) for n in ("a", "b")}

    first = col(batch(0))
    kept = first.concat.detach().clone()
    second = col(batch(1))  # first still held: new memory, first unchanged
    assert not _same_memory(first.concat, second.concat)
    assert torch.equal(first.concat.detach(), kept)
    ptr = second.concat.data_ptr()
    second.concat.sum().backward()
    first.concat.sum().backward()
    del first, second
    third = col(batch(2))
    assert third.concat.data_ptr() == ptr
    # The same as an eval lookup of the same ids (the rows did not change in between).
    col.eval()
    torch.testing.assert_close(col(batch(2)).concat, third.concat.detach())


def test_large_buffers_are_poisoned_and_reused_like_small_ones():
    # Buffers of 4 MiB and more are asked for 2 MiB pages before first touch (the kernels'
    # scratch is read at random); they must behave as any other buffer.
    was = poison_enabled()
    set_poison(True)
    try:
        ws = Workspace(torch.device("cpu"))
        rows = (6 << 20) // 8 + 3  # 6 MiB and a bit of int64: not a whole number of 2 MiB pages
        big = ws.get("big", rows, (), torch.int64)
        assert big.shape == (rows,) and big.dtype == torch.int64
        assert bool((big == -0x5A5A5A5A5A5A5A5A).all())  # poisoned, as small buffers are
        big.fill_(7)
        again = ws.get("big", rows - 10, (), torch.int64)
        assert again.data_ptr() == big.data_ptr() and again.shape == (rows - 10,)
        assert bool((again == -0x5A5A5A5A5A5A5A5A).all())  # poisoned again on reuse
    finally:
        set_poison(was)
