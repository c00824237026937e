"""FreeList: the row-id allocator behind the key index."""

from __future__ import annotations

import pytest
import torch

from dynemb.table.free_list import FreeList


def ids(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def test_allocates_fresh_ids_in_order():
    fl = FreeList(10)
    a = fl.allocate(4)
    assert a.dtype == torch.int64 and torch.equal(a, ids([0, 1, 2, 3]))
    assert torch.equal(fl.allocate(3), ids([4, 5, 6]))
    assert fl.num_used() == 7 and fl.num_free() == 3
    assert fl.allocate(0).numel() == 0
    assert fl.num_used() == 7


def test_released_ids_are_reused_before_fresh_ones():
    fl = FreeList(10)
    fl.allocate(6)
    fl.release(ids([1, 4]))
    fl.release(ids([3]))
    assert fl.num_used() == 3 and fl.num_free() == 7
    # Last released, first reused.
    assert fl.allocate(1).tolist() == [3]
    got = fl.allocate(4)
    assert sorted(got.tolist()) == [1, 4, 6, 7]
    assert fl.num_used() == 8
    assert fl.state()["high_water"] == 8 and fl.state()["free"].numel() == 0


def test_returned_ids_do_not_alias_internal_state():
    fl = FreeList(8)
    fl.allocate(4)
    fl.release(ids([0, 1, 2]))
    got = fl.allocate(2)
    kept = got.clone()
    # Releasing writes where the reused ids were kept; the caller's tensor must not change.
    fl.release(ids([3]))
    assert torch.equal(got, kept)
    got.fill_(99)
    assert sorted(fl.allocate(2).tolist()) == [0, 3]


def test_borrowed_ids_are_the_same_ids_without_a_copy():
    # borrow=True: the same ids as a plain allocate, reused ones as a view of the stack (valid
    # until the next release), so a caller that copies them at once skips a fresh tensor.
    plain, lent = FreeList(8), FreeList(8)
    for fl in (plain, lent):
        fl.allocate(5)
        fl.release(ids([4, 1, 3]))
    want = plain.allocate(2)
    got = lent.allocate(2, borrow=True)
    assert torch.equal(got, want)
    # Partly reused, partly fresh: a new tensor either way, the same ids in the same order.
    assert torch.equal(lent.allocate(3, borrow=True), plain.allocate(3))
    assert lent.num_used() == plain.num_used() and lent.num_free() == plain.num_free()
    # The borrowed ids were a view of the stack (its entries 1 and 2): the next release writes
    # where they lay.
    lent.release(ids([6, 5, 4]))
    assert torch.equal(got, ids([5, 4]))


def test_reusable_ids_are_what_allocations_take_from_the_end():
    # A kernel that hands out ids as allocate would reads them here: allocations take the last
    # k reusable ids (in stack order), then fresh ids from high_water.
    fl = FreeList(10)
    fl.allocate(6)
    fl.release(ids([4, 1, 3]))
    assert torch.equal(fl.reusable(), ids([4, 1, 3])) and fl.high_water == 6
    # The same ids as the stack and their count (what the compiled insert reads: no view).
    stack, k = fl.reusable_stack()
    assert k == 3 and torch.equal(stack[:k], ids([4, 1, 3]))
    assert torch.equal(fl.allocate(2), ids([1, 3]))
    assert torch.equal(fl.reusable(), ids([4]))
    assert torch.equal(fl.allocate(3), ids([4, 6, 7]))
    assert fl.reusable().numel() == 0 and fl.high_water == 8


def test_every_id_handed_out_once_through_many_cycles():
    fl = FreeList(2000)
    held = set(fl.allocate(1500).tolist())
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        pool = torch.tensor(sorted(held))
        back = pool[torch.randperm(pool.numel(), generator=gen)[:700]]
        fl.release(back)
        held -= set(back.tolist())
        new = fl.allocate(fl.num_free() // 2).tolist()
        assert len(set(new)) == len(new) and not set(new) & held
        assert all(0 <= i < 2000 for i in new)
        held |= set(new)
        assert fl.num_used() == len(held)


def test_exhaustion_raises_and_keeps_state():
    fl = FreeList(4)
    fl.allocate(3)
    with pytest.raises(RuntimeError, match="asked for 2 rows, 1 free of 4"):
        fl.allocate(2)
    assert fl.num_used() == 3 and fl.num_free() == 1
    assert fl.allocate(1).tolist() == [3]
    with pytest.raises(RuntimeError):
        fl.allocate(1)
    fl.release(ids([2]))
    assert fl.allocate(1).tolist() == [2]


def test_negative_count_is_rejected():
    fl = FreeList(4)
    with pytest.raises((ValueError, RuntimeError), match="-1"):
        fl.allocate(-1)
    assert fl.num_free() == 4 and fl.num_used() == 0


@pytest.mark.parametrize("capacity", [0, -1, 2.5, None])
def test_bad_capacity(capacity):
    with pytest.raises(ValueError, match=f"capacity={capacity}"):
        FreeList(capacity)


def test_state_round_trip_restores_reuse_order():
    fl = FreeList(10)
    fl.allocate(6)
    fl.release(ids([4, 1]))
    fl.release(ids([5]))
    state = fl.state()
    assert state["high_water"] == 6 and state["free"].tolist() == [4, 1, 5]
    twin = FreeList(10)
    twin.load_state(state["high_water"], state["free"])
    assert twin.num_used() == fl.num_used() == 3 and twin.num_free() == fl.num_free()
    # The state is a copy: changing it changes neither list.
    state["free"].fill_(0)
    for n in (1, 3, 2):
        assert torch.equal(twin.allocate(n), fl.allocate(n))
    assert twin.state()["high_water"] == fl.state()["high_water"] == 9


@pytest.mark.parametrize(
    "high_water,free,match",
    [
        (11, [], "high_water=11"),
        (-1, [], "high_water=-1"),
        (True, [], "high_water=True"),
        (3, [0, 3], r"\[0, high_water=3\)"),
        (3, [1, 1], "distinct"),
        (2, [0, 1, 0], "3 ids released but only 2"),
        (4, torch.tensor([1.0]), "1-d int64"),
        (4, torch.tensor(1), "1-d int64"),
    ],
)
def test_bad_state_is_rejected_and_changes_nothing(high_water, free, match):
    fl = FreeList(10)
    fl.allocate(5)
    fl.release(ids([2]))
    before = fl.state()
    free = free if isinstance(free, torch.Tensor) else ids(free)
    with pytest.raises(ValueError, match=match):
        fl.load_state(high_water, free)
    after = fl.state()
    assert after["high_water"] == before["high_water"] and torch.equal(after["free"], before["free"])


def test_release_under_inference_mode_keeps_a_normal_stack():
    fl = FreeList(4096)
    fl.allocate(3000)
    with torch.inference_mode():
        # More than the stack holds: it is reallocated under inference mode.
        fl.release(torch.arange(2000))
    assert not fl._stack.is_inference()
    fl.release(torch.arange(2000, 3000))
    assert fl.allocate(1).tolist() == [2999]


def test_to_moves_released_ids():
    fl = FreeList(8)
    fl.allocate(4)
    fl.release(ids([2]))
    # The meta device stands in for another device: ids come back there.
    fl.to("meta")
    assert fl.device.type == "meta" and fl.state()["free"].device.type == "meta"
    assert fl.allocate(2).device.type == "meta"


def test_take_advances_as_allocate_does():
    # take(n): the state allocate(n) leaves, the ids made by a kernel instead (reused ones from
    # the end of reusable(), then fresh ones from high_water).
    made, taken = FreeList(12), FreeList(12)
    for fl in (made, taken):
        fl.allocate(7)
        fl.release(ids([5, 0, 3]))
    for n in (2, 0, 3, 3):
        made.allocate(n)
        taken.take(n)
        assert made.high_water == taken.high_water and torch.equal(made.reusable(), taken.reusable())
    assert made.num_free() == taken.num_free() == 0
    with pytest.raises(RuntimeError, match="asked for 1 rows, 0 free"):
        taken.take(1)
    with pytest.raises(ValueError, match="n=-1"):
        taken.take(-1)
