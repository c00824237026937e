"""A state_dict and a checkpoint (base + delta) written by an earlier dynemb (compat/, made at
6ca4fdc by compat/make_fixtures.py) load into today's tables bit for bit, and train on alike."""

from __future__ import annotations

import pathlib
import sys

import torch
from ckpt_models import assert_equal, contents, one_thread, train  # noqa: F401  (one_thread: autouse fixture)
from safetensors.torch import load_file

import dynemb

COMPAT = pathlib.Path(__file__).with_name("compat")
sys.path.insert(0, str(COMPAT))

from compat_model import DELTA_STEPS, CompatModel, flat  # noqa: E402


def _from_state_dict() -> CompatModel:
    model = CompatModel()
    model.load_state_dict(torch.load(COMPAT / "state_dict.pt", weights_only=True))
    return model


def _from_checkpoint(name: str) -> CompatModel:
    model = CompatModel()
    dynemb.checkpoint.load(model, COMPAT / "ckpt" / name)
    return model


def test_old_state_dict_loads_bitwise():
    assert_equal(flat(contents(_from_state_dict())), load_file(COMPAT / "contents_base.safetensors"))


def test_old_checkpoint_and_delta_load_bitwise():
    assert_equal(flat(contents(_from_checkpoint("base"))), load_file(COMPAT / "contents_base.safetensors"))
    assert_equal(flat(contents(_from_checkpoint("delta"))), load_file(COMPAT / "contents_delta.safetensors"))


def test_old_state_dict_and_checkpoint_train_on_alike():
    a, b = _from_state_dict(), _from_checkpoint("base")
    assert_equal(train(a, DELTA_STEPS), train(b, DELTA_STEPS))
    assert_equal(contents(a), contents(b))
