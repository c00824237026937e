"""The process harness of the sharding tests: results, errors, hangs (no sharding involved)."""

from __future__ import annotations

import pytest
from dist_harness import run_world


def test_world_runs_collectives_and_cases(tmp_path):
    world = run_world(2, "dist_selftest:all_reduce", tmp_path, deadline_s=90)
    world.assert_ok()
    assert [next(r["value"] for r in rank.records if r.get("event") == "sum") for rank in world.ranks] == [3.0, 3.0]
    world.assert_case("sum")
    world.assert_case("after-bad")
    with pytest.raises(AssertionError, match="bad case on rank 1"):
        world.assert_case("bad")


def test_world_reports_errors_and_kills_hangs(tmp_path):
    world = run_world(3, "dist_selftest:misbehave", tmp_path, deadline_s=15, final_barrier=False)
    r0, r1, r2 = world.ranks
    assert r0.returncode == 0 and not r0.killed
    assert r1.returncode == 1 and "ValueError: boom on rank 1" in r1.error() and "boom on rank 1" in r1.stderr
    assert r2.killed and any(r.get("event") == "hanging" for r in r2.records)
    with pytest.raises(AssertionError, match="(?s)boom on rank 1.*rank 2: killed"):
        world.assert_ok()
    assert world.seconds < 60
