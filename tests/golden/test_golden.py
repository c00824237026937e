"""Golden loss curves: refactors that should not change training numerics must reproduce them bitwise."""

from __future__ import annotations

import json

import pytest
from golden_model import GOLDEN, OPTIMIZERS, losses


@pytest.mark.parametrize("pooled", [False, True], ids=["sequence", "pooled"])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_loss_curve_is_bitwise_golden(optimizer, pooled):
    golden = json.loads(GOLDEN.read_text())[f"{optimizer}-{'pooled' if pooled else 'sequence'}"]
    got = [v.hex() for v in losses(optimizer, pooled)]
    assert got == golden
