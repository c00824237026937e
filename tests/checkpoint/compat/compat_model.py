"""The model of the compatibility fixtures: ckpt_models.Model (a DynamicEmbedding, a
DynamicEmbeddingBag and a bag collection of three tables) plus a sequence collection.

B samples, L ids per sample.
"""

from __future__ import annotations

import torch
from ckpt_models import B, L, Model, batch_ids

import dynemb

BASE_STEPS = range(0, 6)
DELTA_STEPS = range(6, 9)


class CompatModel(Model):
    def __init__(self):
        super().__init__(optimizer="adam", strategy="step")
        configs = [
            dynemb.TableConfig(
                name="query", feature_names=["query"], embedding_dim=4, capacity=40, bucket_capacity=8, check_mode="count", score_strategy="step", seed=3
            ),
            dynemb.TableConfig(
                name="doc", feature_names=["doc"], embedding_dim=4, capacity=48, bucket_capacity=8, check_mode="count", score_strategy="step", seed=3
            ),
        ]
        self.ec = dynemb.DynamicEmbeddingCollection(configs, dynemb.optim.RowWiseAdagrad(lr=0.1))

    def forward(self, step: int) -> torch.Tensor:
        ids = batch_ids(step)
        lengths = torch.full((B,), L)
        out = self.ec({"query": (ids["seq"].reshape(-1), lengths), "doc": (ids["tag"].reshape(-1), lengths)})
        pooled = [out[f][0].view(B, L, -1).sum(1) for f in ("query", "doc")]  # [B, 4] each
        return torch.cat([super().forward(step), *pooled], 1)


def flat(contents: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """``{table: {field: tensor}}`` as ``{"table/field": tensor}`` (one safetensors file)."""
    return {f"{t}/{k}": v.contiguous() for t, fields in contents.items() for k, v in fields.items()}
