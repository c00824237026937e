"""Exact placement for loads (dynemb.table.exact) on segmented indexes, grown or full size:
a saved layout or a set of keys placed along cuckoo paths restores every key of every segment."""

from __future__ import annotations

import pytest
import torch

from dynemb.table.exact import place_exact, state_from_layout, state_from_slots
from dynemb.table.index import KeyIndex

ARGS = dict(capacities=[64, 128], bucket_capacity=4, score_strategy="step")


def filled(init) -> tuple[KeyIndex, torch.Tensor, torch.Tensor]:
    index = KeyIndex(**ARGS, init_capacities=init)
    keys = torch.arange(-60, 60)
    segs = (keys.abs() % 3 != 0).long()
    index.find_or_insert(keys, now=1, segments=segs)
    return index, keys, segs


@pytest.mark.parametrize("init", [None, [12, 24]])
def test_saved_layout_restores_every_key_at_its_slot(init):
    index, keys, segs = filled(init)
    pos, found = index.locate(keys, segs)
    assert bool(found.all())
    geometry = (index.num_buckets, index.bucket_capacity, index.max_buckets)
    parts = []
    for s in range(2):
        m = segs == s
        layout = {
            "slots": pos[m],
            "num_buckets": torch.tensor(geometry[0]),
            "bucket_capacity": torch.tensor(geometry[1]),
            "max_buckets": torch.tensor(geometry[2]),
            "segment_buckets": index.segment_buckets.clone(),
            "segment": torch.tensor(s),
        }
        parts.append((s, layout, keys[m], torch.full((int(m.sum()),), 1)))
    fresh = KeyIndex(**ARGS, init_capacities=init)
    # A grown layout applies to a fresh index that has not grown yet.
    assert (fresh.segment_buckets.tolist() != index.segment_buckets.tolist()) == (init is not None)
    state = state_from_layout(fresh, parts, [0, 0, 0, 0])
    assert state is not None
    fresh.load_state_dict(state)
    assert fresh.segment_buckets.tolist() == index.segment_buckets.tolist()
    got, ok = fresh.locate(torch.cat([p[2] for p in parts]), torch.cat([torch.full_like(p[2], p[0]) for p in parts]))
    assert bool(ok.all()) and torch.equal(got, torch.cat([p[1]["slots"] for p in parts]))
    # A layout of another geometry does not apply: the keys must be re-inserted.
    other = KeyIndex(**{**ARGS, "capacities": [64, 200]})
    assert state_from_layout(other, parts, [0, 0, 0, 0]) is None


def test_keys_left_out_are_placed_along_cuckoo_paths():
    """Keys placed by nobody (slots -1) get slots of their own segment; the state built from
    the slots loads, and finds every key in its segment."""
    index, keys, segs = filled(None)
    pos, _ = index.locate(keys, segs)
    # Forget a third of the keys' slots and let place_exact find slots for them again.
    slots = torch.where(torch.arange(keys.numel()) % 3 == 0, -1, pos)
    scores = torch.ones_like(keys)
    placed = place_exact(index, keys, segs, scores, slots, evict=False, optional=torch.zeros_like(keys, dtype=torch.bool))
    assert bool((placed >= 0).all()) and placed.unique().numel() == keys.numel()
    fresh = KeyIndex(**ARGS)
    fresh.load_state_dict(state_from_slots(fresh, keys, placed, scores, (index.num_buckets, 4, index.max_buckets), [0, 0, 0, 0]))
    rows, found = fresh.find(keys, segments=segs)
    assert bool(found.all()) and sorted(rows.tolist()) == list(range(keys.numel()))
    assert fresh.segment_sizes().tolist() == [int((segs == 0).sum()), int((segs == 1).sum())]
