"""Test-wide settings: every fresh scratch buffer and store row is poisoned (NaN / loud ints),
so a code path that returns or trains on a value it never wrote fails; and without a GPU,
Triton runs its interpreter (the Triton parity tests run the GPU kernels on CPU tensors)."""

from __future__ import annotations

import os

import pytest
import torch

# Triton takes its mode from the environment when it is first imported (its standard library's
# jit functions are built then), and importing torchrec imports it: set here, before any test
# module imports either, so the parity tests do not depend on which tests ran first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dynemb import workspace


@pytest.fixture(autouse=True, scope="session")
def _poison_fresh_buffers():
    workspace.set_poison(True)
    yield
    workspace.set_poison(False)
