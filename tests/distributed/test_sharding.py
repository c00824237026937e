"""Row-wise sharding (dynemb.distributed.shard) against the unsharded model, in gloo worlds of 2
and 4 processes: every case of dist_cases.CASES runs in one world per size (started once, on
first use); each test checks one case's result on every rank."""

from __future__ import annotations

import pytest
from dist_cases import CASES
from dist_harness import World, run_world

# Generous: a healthy world of 4 ranks takes well under a minute on 2 cores; a broken one is
# killed here and its unfinished cases fail with how each rank ended.
DEADLINE_S = {2: 150, 4: 240}


@pytest.fixture(scope="session")
def worlds(tmp_path_factory):
    cache: dict[int, World] = {}

    def get(size: int) -> World:
        if size not in cache:
            cache[size] = run_world(size, "dist_cases:sharding_world", tmp_path_factory.mktemp(f"world{size}"), deadline_s=DEADLINE_S[size])
        return cache[size]

    return get


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("world_size", [2, 4])
def test_sharded_equals_unsharded(worlds, world_size, case):
    worlds(world_size).assert_case(case)
