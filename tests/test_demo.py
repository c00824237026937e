"""The demo trains and clearly beats chance on a short run."""

from __future__ import annotations

import torch

from dynemb.demo import auc, main


def test_auc_matches_pairwise_definition():
    gen = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 5, (200,), generator=gen).double()  # many ties
    labels = torch.randint(0, 2, (200,), generator=gen).double()
    pos, neg = scores[labels.bool()], scores[~labels.bool()]
    diff = pos[:, None] - neg[None, :]
    expected = ((diff > 0).double() + 0.5 * (diff == 0).double()).mean().item()
    assert abs(auc(scores, labels) - expected) < 1e-12


def test_short_demo_run_beats_chance(capsys):
    value = main(["--steps", "120", "--batch-size", "512", "--eval-samples", "10000"])
    assert value > 0.58
    out = capsys.readouterr().out
    assert "held-out AUC" in out and "evictions" in out
