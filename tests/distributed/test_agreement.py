"""Ranks that raise before a collective call, make different calls, or leave a call half-way
(dist_agreement.py): every rank ends with a Python exception that names the rank and the call
and says what to do, never a signal, within the timeout; the ranks stay in step (or, after a
call left half-way, refuse every collective until restored from a checkpoint)."""

from __future__ import annotations

import re

import pytest
from dist_agreement import BROKEN_TIMEOUT, CASES
from dist_harness import World, run_world

DEADLINE_S = {2: 150, 4: 240}


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    cache: dict[int, World] = {}

    def get(size: int) -> World:
        if size not in cache:
            out = tmp_path_factory.mktemp(f"agreement{size}")
            cache[size] = run_world(size, "dist_agreement:agreement_world", out, deadline_s=DEADLINE_S[size], checkpoints=str(out / "checkpoints"))
        return cache[size]

    return get


def expected(case: str, phase: str, r: int, W: int) -> tuple[str | None, list[str]]:
    """The exception type rank r of W raises in ``phase`` of ``case`` (None: none) and patterns
    its message must match."""
    last = W - 1
    bag = "DynamicEmbeddingBag"
    col = "DynamicEmbeddingBagCollection"
    if phase in ("next step",):
        return None, []
    if case == "bad-input-table":
        if r == 0:
            return "TypeError", [r"ids\.dtype=torch\.float32"]
        return "ValueError", [
            rf"forward of {bag} \(call #\d+: training lookup\) refused on rank {r}",
            "bad input on another rank",
            rf"rank 0 raised TypeError: ids\.dtype=torch\.float32.* in forward of {bag}",
            "still in step",
            "make the call again",
        ]
    if case == "calls-differ-table":
        return "ShardingError", [
            rf"refused on rank {r}: the ranks make different collective calls",
            rf"rank {last}: find\(\) / contains\(\) of {bag}",
            rf"ranks? \[?0[],:].*forward of {bag} \(call #\d+: training lookup\)",
            "still in step",
            "same collective calls",
        ]
    if case == "backward-skipped":
        return "ShardingError", [rf"rank {last}: forward of {bag}", rf"ranks? \[?0[],:].*backward of {bag} \(call #\d+: gradient step\)", "still in step"]
    if case == "collection-agreement" and phase == "bad input":
        if r == last:
            return "ValueError", [r"features \['fc'\]: missing from the input"]
        return "ValueError", ["bad input on another rank", rf"rank {last} raised ValueError: features \['fc'\].* in forward of {col}"]
    if case == "collection-agreement" and phase == "differ":
        return "ShardingError", [
            rf"rank 0: find\(\) / contains\(\) of {col} tables \['a', 'b'\]",
            rf"ranks? \[?1[],:].*insert\(\) of {col} tables \['a', 'b'\]",
        ]
    if case == "out-of-step-backward" and phase in ("half-way", "after") and r != last:
        # The others' part of the backward ended before the owner's update failed: they learn it
        # at their next call, which the failed rank does not join.
        if phase == "half-way":
            return None, []
        return "ShardingError", [
            "did not take part",
            rf"rank {last} raised RuntimeError in the middle of backward of {bag}",
            "restore every rank from a checkpoint",
        ]
    if case == "out-of-step-backward" and phase == "after":
        return "ShardingError", [rf"refused on rank {r}: the sharded tables of this process group are out of step since", rf"rank {last}"]
    if case.startswith("out-of-step") and phase == "half-way":
        if r == last:
            return "RuntimeError", ["injected failure"]
        return "ShardingError", [
            "did not take part",
            rf"rank {last} raised RuntimeError in the middle of {'forward' if case == 'out-of-step' else 'backward'} of {bag}",
            "restore every rank from a checkpoint",
        ]
    if case.startswith("out-of-step"):
        return "ShardingError", [
            rf"refused on rank {r}: the sharded tables of this process group are out of step since",
            rf"rank {last}",
            "restore every rank from a checkpoint",
        ]
    raise AssertionError(f"no expectation for {case} / {phase}")


PHASES = {
    "bad-input-table": ["bad input", "next step"],
    "calls-differ-table": ["differ", "next step"],
    "backward-skipped": ["skipped", "next step"],
    "collection-agreement": ["bad input", "differ", "next step"],
    "out-of-step": ["half-way", "after", "save after"],
    "out-of-step-backward": ["half-way", "after", "save after"],
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("world_size", [2, 4])
def test_every_rank_raises(worlds, world_size, case):
    world = worlds(world_size)
    context = world.describe()
    # Exit codes: negative would be a signal (gloo's SIGABRT); None a rank still running at the deadline.
    for rank in world.ranks:
        assert not rank.killed and rank.returncode is not None and rank.returncode >= 0, f"rank {rank.rank} did not exit by itself:\n{context}"
    world.assert_ok()
    world.assert_case(case)
    for rank in world.ranks:
        records = {rec["phase"]: rec for rec in rank.records if rec.get("of_case") == case}
        assert list(records) == PHASES[case], f"rank {rank.rank} recorded phases {list(records)}:\n{context}"
        for phase, rec in records.items():
            want_type, patterns = expected(case, phase, rank.rank, world_size)
            where = f"rank {rank.rank}, {case} / {phase}: raised {rec['type']}: {rec['message']}"
            assert rec["type"] == want_type, f"{where}\n(expected {want_type})"
            for pattern in patterns:
                assert re.search(pattern, rec["message"]), f"{where}\n(does not match {pattern!r})"
            assert "may have died" not in rec["message"], where


def test_half_way_failure_is_reported_within_the_timeout(worlds):
    world = worlds(2)
    left = next(rec for rec in world.ranks[1].records if rec.get("of_case") == "out-of-step" and rec.get("phase") == "half-way")
    waited = next(rec for rec in world.ranks[0].records if rec.get("of_case") == "out-of-step" and rec.get("phase") == "half-way")
    # The timeout (the others wait for the rank that left), the grace period, slack for a busy machine.
    assert waited["t"] - left["t"] < 2 * BROKEN_TIMEOUT.total_seconds() + 10, world.describe()


def test_unreachable_store_is_not_blamed_on_rank_0_by_itself(tmp_path):
    # Rank 2 exits; ranks 0 and 1 cannot reach the store to name it. Rank 0 must not suspect
    # itself; rank 1 may suspect the store's host.
    world = run_world(3, "dist_agreement:store_unreachable", tmp_path, deadline_s=60, final_barrier=False)
    context = world.describe()
    for rank in world.ranks:
        assert not rank.killed and rank.returncode == 0, context
    raised = [next((rec for rec in rank.records if rec.get("event") == "raised"), None) for rank in world.ranks[:2]]
    assert all(raised), context
    for rec in raised:
        assert rec["type"] == "ShardingError" and "the failing rank could not be told (the store is unreachable" in rec["message"], rec
    assert "may have died" not in raised[0]["message"], raised[0]["message"]
    assert "its host, rank 0 unless torchrun hosts it, may have died" in raised[1]["message"], raised[1]["message"]
