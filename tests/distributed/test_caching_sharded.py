"""Caching tables sharded row-wise (dynemb.distributed.shard) over 2 gloo ranks, each rank's
cache over its own external store, against the unsharded in-memory model (dist_caching.py)."""

from __future__ import annotations

import pytest
from dist_caching import CASES
from dist_harness import run_world


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return run_world(2, "dist_caching:caching_world", tmp_path_factory.mktemp("caching"), deadline_s=150)


@pytest.mark.parametrize("case", list(CASES))
def test_sharded_caching_equals_unsharded(world, case):
    world.assert_case(case)
