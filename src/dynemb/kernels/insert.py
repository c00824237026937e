"""The new keys of a find_or_insert under one clock value: placed, given row ids and put into the
call's result in one call, from the missing keys as the upsert's probe left them (repeats
included, in the call's order).

U keys in the call, m places of missing keys among them. The plain-torch twin is the sequence
``insert_new_native`` replaces in ``BatchPlacement._upsert`` (:mod:`dynemb.table.placement`): the
missing keys sorted and de-duplicated (``sort_unique_first_torch``), placed in priority order
(``BatchPlacement._place_free``, the rule of ``place.py``), one free-list allocation of row ids
per placement round, and ``rows_of_new_torch``. The kernel gives the same slots, row ids, free
list and result without sorting the keys (docs/design/0043).

Where the index cannot grow, the places the rounds leave go on, in the same call, to the passes
of ``rest.cpp`` (cuckoo moves, then free slots), as ``BatchPlacement._upsert`` would hand them to
``BatchPlacement._place_rest``: the same kernels in the same order, without the Python between.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch

from dynemb.kernels import library, ptr, slot_args, slot_step, threads
from dynemb.kernels import rest as rest_kernel
from dynemb.kernels.place import MAX_ROUNDS

# int64 scratch entries per missing place (insert.cpp's SCRATCH_PER_KEY): ROUNDS for the rounds,
# then the rest's state (REST, read back below).
ROUNDS_PER_KEY, REST_PER_KEY = 10, 8
SCRATCH_PER_KEY = ROUNDS_PER_KEY + REST_PER_KEY
# The small output, int64: the rounds' slots (MAX_ROUNDS), the rest's tail (TAIL), then its
# allocations (at most rest.MAX_PASSES placement calls of MAX_ROUNDS each, as place_rest_native's).
TAIL = 6
MAX_ALLOCATIONS = rest_kernel.MAX_PASSES * MAX_ROUNDS
SMALL = MAX_ROUNDS + TAIL + MAX_ALLOCATIONS
_Small = ctypes.c_int64 * SMALL


class Rest(NamedTuple):
    """Where the index cannot grow: the rest's passes over the places the rounds left, as
    :func:`dynemb.kernels.rest.place_rest_native` on the new keys among them would report them
    (M new keys, P pending)."""

    code: int  # 0: every key placed, its slot and row id in the result; 1 / 2 / -1: as place_rest_native's
    allocations: list[int]  # the row ids each of its placement rounds took, in turn
    gave_up: bool  # the moves were given up for the rest of the call
    # With code != 0 (else None): views of the workspace, valid until its next insert.
    new_keys: torch.Tensor | None = None  # [M] each new key once, in priority order
    first: torch.Tensor | None = None  # [M] its first place in the call's keys
    spread: torch.Tensor | None = None  # [left] the new key of each left place
    new_pos: torch.Tensor | None = None  # [M] slots (-1: none)
    pending: torch.Tensor | None = None  # [P] ranks still pending, ascending
    waiting: torch.Tensor | None = None  # [M] bool
    hopeful: torch.Tensor | None = None  # [M] bool


class Inserted(NamedTuple):
    """What :func:`insert_new_native` did."""

    rounds: list[int]  # slots each round took (the free list's allocations to commit, in turn)
    left_places: torch.Tensor  # the workspace buffer whose first n_left entries are the places left
    n_left: int  # how many places the rounds left without a slot
    rest: Rest | None  # the rest's passes over them, where asked and some were left

    @property
    def left(self) -> torch.Tensor | None:
        """[n_left] the places left without a slot by the rounds, in ``missing``'s order (a
        workspace view); None: none left. Made when asked for: a view costs tens of microseconds
        right after the kernel, and most calls never look."""
        return self.left_places[: self.n_left] if self.n_left else None


def insert_new_native(
    table_keys: torch.Tensor,
    tags: torch.Tensor,
    table_scores: torch.Tensor,
    table_rows: torch.Tensor,
    segments,
    keys: torch.Tensor,
    seg: torch.Tensor | None,
    missing: torch.Tensor,
    score: int,
    pre_free: torch.Tensor | None,
    free_ids: torch.Tensor,
    high_water: int,
    pos: torch.Tensor,
    rows: torch.Tensor,
    workspace,
    per_segment: torch.Tensor | None = None,
    rest: tuple[int, int, int] | None = None,
    repeats: bool = True,
    segment_free: torch.Tensor | None = None,
    reusable: int | None = None,
) -> Inserted | None:
    """Place the missing keys of one segment's index, in place; returns what was done
    (:class:`Inserted`: the rounds, the places they left, the rest's passes over those), or
    None where the kernel cannot take the call (nothing was written: buckets of more than
    ``PACKED_FREE_MAX_W`` slots, or 2^31 buckets or more).

    Args:
        table_keys (Tensor[int64]), tags (Tensor[uint8]), table_scores (Tensor[int32|int64]),
            table_rows (Tensor[int32|int64]): [B, W] the index's slots, written where keys are placed.
        segments: the index's :class:`dynemb.table.geometry.Segments`.
        keys (Tensor[int64]): [U] the call's keys; seg (Tensor[int64] | None): [U] their
            segments (None: one segment); missing (Tensor[int64]): [m] places in ``keys`` of the
            missing ones (a key may repeat only without ``seg``).
        score: the call's score, every new key's (fits ``table_scores``' dtype).
        pre_free (Tensor[int64] | None): [U] the first round's choice of each place's candidate
            as the probe saw them (``pack_choice``, from
            :func:`dynemb.kernels.upsert.found_and_missing_native`), or None.
        free_ids (Tensor[int64]): the free list's reusable ids (:meth:`FreeList.reusable`), or
            its stack whose first ``reusable`` entries they are (:meth:`FreeList.reusable_stack`);
            high_water: its first never-used id.
        pos, rows (Tensor[int64]): [U] the call's result, written at the places of placed keys.
        workspace: a :class:`dynemb.workspace.Workspace` for the kernel's scratch.
        per_segment (Tensor[int64] | None): [S] with ``seg``: each segment's placed keys are added.
        rest: (the index's empty slots, MOVE_DEPTH, GIVE_UP) for an index that cannot grow: the
            places left go on to the rest's passes (:class:`Rest`); None: they are only reported.
        repeats: ``missing`` may repeat keys (then the rest's new keys are sorted by key);
            False: its keys are distinct and in priority order.
        segment_free (Tensor[int64] | None): [S] with ``rest`` and ``seg``: each segment's
            empty slots as the call starts, taken in place as keys are placed (the rest's passes
            use them as :func:`dynemb.kernels.rest.place_rest_native` does).
        reusable: with ``free_ids`` the free list's stack, how many of its first entries are reusable.
    """
    keys, missing, free_ids = keys.contiguous(), missing.contiguous(), free_ids.contiguous()
    seg = None if seg is None else seg.contiguous()
    m = missing.numel()
    # The rounds, the rest's tail and its allocations, written by the kernel; read through ctypes
    # (no tensor operation: each costs tens of microseconds right after the kernel).
    small = workspace.get("insert_new.small", SMALL, (), torch.int64).data_ptr()
    left_places = workspace.get("insert_new.left", m, (), torch.int64)
    cap = SCRATCH_PER_KEY * m
    scratch = workspace.get("insert_new", cap, (), torch.int64)
    with_segments = seg is not None or segments.of_bucket is not None
    free_slots, depth, give_up = rest or (0, 0, 0)
    left = library().dyn_insert_new(
        *slot_args(table_keys, tags, table_scores),
        ptr(table_rows),
        table_rows.element_size(),
        slot_step(table_rows),
        ptr(keys),
        ptr(seg),
        ptr(segments.counts) if with_segments else None,
        ptr(segments.offsets) if with_segments else None,
        ptr(missing),
        m,
        score,
        ptr(pre_free),
        ptr(free_ids),
        free_ids.numel() if reusable is None else reusable,
        high_water,
        ptr(pos),
        ptr(rows),
        small,
        ptr(per_segment),
        ptr(left_places),
        ptr(scratch),
        cap,
        threads(),
        keys.numel(),
        int(repeats),
        int(rest is not None),
        ptr(segments.of_bucket),
        free_slots,
        depth,
        give_up,
        small + 8 * (MAX_ROUNDS + TAIL),
        MAX_ALLOCATIONS,
        ptr(segment_free if seg is not None else None),
        small + 8 * MAX_ROUNDS,
    )
    if left < 0:
        return None
    # One read of the whole output (each tensor operation after a kernel that swept the caches
    # costs tens of microseconds: perf-log, sixteenth session).
    out = _Small.from_address(small)
    rounds, (code, M, P, gave_up, n_alloc, _) = [r for r in out[:MAX_ROUNDS] if r], out[MAX_ROUNDS : MAX_ROUNDS + TAIL]
    if code == -2:
        return Inserted(rounds, left_places, left, None)
    allocations = out[MAX_ROUNDS + TAIL : MAX_ROUNDS + TAIL + n_alloc]
    if code == 0:
        return Inserted(rounds, left_places, left, Rest(0, allocations, bool(gave_up)))
    # The state the caller goes on from (insert.cpp's layout).
    state = scratch[ROUNDS_PER_KEY * m :].view(REST_PER_KEY, m)
    new_keys, first, spread, new_pos, pending = (state[i] for i in range(5))
    flags = state[7].view(torch.bool)
    return Inserted(
        rounds,
        left_places,
        left,
        Rest(code, allocations, bool(gave_up), new_keys[:M], first[:M], spread[:left], new_pos[:M], pending[:P], flags[:M], flags[m : m + M]),
    )
