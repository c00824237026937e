"""Sharded tables and collections with device + disk tiers (2 gloo ranks) equal the unsharded
tiered model: outputs, losses, every key's row and optimizer state, find(); each shard's rows
really move between its tiers."""

from __future__ import annotations

import pytest
from dist_harness import World, run_world

CASES = [
    "table-sequence-adam-fused",
    "table-pooled-rowwise_adagrad-deferred",
    "collection-pooled-adam-fused",
    "collection-sequence-adagrad-fused",
    "moved",
]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    disk = tmp_path_factory.mktemp("tier")
    return run_world(2, "dist_tiers:tiered_world", tmp_path_factory.mktemp("world"), deadline_s=150, disk=str(disk))


@pytest.mark.parametrize("case", CASES)
def test_sharded_tiered_equals_unsharded_tiered(world, case):
    world.assert_case(case)
