"""The clock of ``timestamp`` tables: whole seconds since 2025-01-01 UTC, later on every call.

K scores of a table.

A module hands each training call (a lookup or an insert) one value, shared by the call's
engines: the seconds since :data:`EPOCH_S` now, or one more than the previous call's value when
that is not later (calls faster than one a second count up, running ahead of the wall clock
until calls slow down). Every rank uses the same unit and epoch, so rows of one table scored on
different ranks compare after a reshard. The values fit the index's int32 scores until 2093, or
until about 2**31 calls when calls come faster than one a second (as ``step`` scores do); past
that the index widens its scores (docs/design/0035) and nothing is lost.

Before docs/design/0036 the clock was ``time.time_ns()`` (~1.7e18). Values at or above
:data:`LEGACY_MIN` (2**50, which this clock would reach only after 2**50 calls) are such
nanosecond values: a saved clock and a ``timestamp`` table's saved scores are converted on load
(floor to seconds since the epoch), so old states load with int32 scores and later calls score
above their keys.
"""

from __future__ import annotations

import time

import torch

from dynemb.types import ScoreStrategy

# 2025-01-01T00:00:00Z in Unix seconds.
EPOCH_S = 1_735_689_600
LEGACY_MIN = 1 << 50
_NS = 10**9


def tick(last: int) -> int:
    """The next clock value after ``last``: seconds since the epoch, or ``last + 1`` if not later."""
    return max(time.time_ns() // _NS - EPOCH_S, last + 1)


def clock_from_legacy(last: int) -> int:
    """A saved clock value in this clock's unit: a nanosecond one (>= LEGACY_MIN) becomes whole
    seconds since the epoch, never below 0 (the smallest value a saved clock may hold)."""
    return max(last // _NS - EPOCH_S, 0) if last >= LEGACY_MIN else last


def loaded_scores(scores: torch.Tensor, strategy: ScoreStrategy) -> torch.Tensor:
    """A table's saved scores [K] int64 as it keeps them: a ``timestamp`` table's nanosecond ones
    (>= LEGACY_MIN) become whole seconds since the epoch (order kept, to the second); the
    scores of other strategies are not times and stay as they are."""
    if strategy is not ScoreStrategy.TIMESTAMP:
        return scores
    return torch.where(scores >= LEGACY_MIN, torch.div(scores, _NS, rounding_mode="floor") - EPOCH_S, scores)


class TimestampClock:
    """A module's timestamp clock: ``last``, the last value handed out, and the current call's."""

    def __init__(self):
        self.last = 0
        self._call: int | None = None

    def start_call(self) -> None:
        """A training call starts: its first :meth:`now` takes a new value."""
        self._call = None

    def now(self) -> int:
        """The current call's value (taken by its first use, the same for the rest of the call)."""
        if self._call is None:
            self.last = self._call = tick(self.last)
        return self._call

    def restore(self, last: int) -> None:
        """Restore a saved value (a load); nanosecond values of before 0036 are converted."""
        self.last, self._call = clock_from_legacy(last), None
