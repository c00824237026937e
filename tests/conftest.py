"""Test-wide settings: every fresh scratch buffer and store row is poisoned (NaN / loud ints),
so a code path that returns or trains on a value it never wrote fails."""

from __future__ import annotations

import pytest

from dynemb import workspace


@pytest.fixture(autouse=True, scope="session")
def _poison_fresh_buffers():
    workspace.set_poison(True)
    yield
    workspace.set_poison(False)
