"""A rank that dies (os._exit), raises, or hangs while training a sharded table: the other ranks
raise a RuntimeError naming it within about the shard's timeout, and no process hangs.

The default process group's own timeout (the harness's 60 s; torch's default is 30 minutes) is
far above the shard's 10 s: a survivor must not depend on it, neither to raise nor to exit.
"""

from __future__ import annotations

import re

import pytest
from dist_harness import run_world

TIMEOUT_S = 10
# "rank 1", or rank 1 among several ("ranks [1, 2]": a survivor slow to report may be blamed too).
NAMES_RANK_1 = re.compile(r"\brank 1\b|\branks \[(\d+, )*1(, \d+)*\]")


@pytest.mark.parametrize("mode", ["exit", "raise", "hang"])
def test_survivors_name_the_failed_rank(mode, tmp_path):
    # A hung rank 1 is killed here 5 s after the first survivor ended.
    world = run_world(
        3, "dist_cases:peer_failure", tmp_path, deadline_s=60, linger_s=5 if mode == "hang" else None, final_barrier=False, mode=mode, timeout_s=TIMEOUT_S
    )
    context = world.describe()
    r0, r1, r2 = world.ranks
    dying = next((rec for rec in r1.records if rec.get("event") == "dying"), None)
    assert dying is not None, f"rank 1 never reached step 3:\n{context}"
    for survivor in (r0, r2):
        events = [rec for rec in survivor.records if rec.get("event") in ("peer failed", "finished", "error")]
        assert events and events[0]["event"] == "peer failed", f"rank {survivor.rank} did not raise:\n{context}"
        failed = events[0]
        assert failed["runtime_error"], f"rank {survivor.rank} raised {failed['type']}, not a RuntimeError:\n{failed['traceback']}"
        assert NAMES_RANK_1.search(failed["message"]), f"rank {survivor.rank}'s error does not name rank 1:\n{failed['traceback']}"
        waited = failed["t"] - dying["t"]
        # The timeout (a hung peer is only noticed then), a grace period, slack for a busy machine.
        assert waited < 2 * TIMEOUT_S + 10, f"rank {survivor.rank} raised {waited:.1f} s after rank 1 failed:\n{failed['traceback']}"
    for survivor in (r0, r2):
        assert not survivor.killed, f"rank {survivor.rank} raised in time but its process did not exit (killed at the 60 s deadline):\n{context}"
        assert survivor.returncode == 0, context
        exited = survivor.ended_at - dying["t"]
        assert exited < 2 * TIMEOUT_S + 15, f"rank {survivor.rank} raised in time but its process exited {exited:.1f} s after rank 1 failed:\n{context}"
    if mode == "hang":
        assert r1.killed, context
    else:
        assert r1.returncode == 1 and not r1.killed, f"rank 1 did not exit by itself:\n{context}"
