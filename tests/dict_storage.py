"""The external store a user writes in twenty lines: a Python dict of key -> row.

N keys, W = D + S row width.
"""

from __future__ import annotations

import torch


class DictStorage:
    """``dynemb.storage.ExternalStorage`` over a dict {key: Tensor [W]}; counts its calls."""

    def __init__(self):
        self.rows: dict[int, torch.Tensor] = {}
        self.calls = {"get": 0, "put": 0, "delete": 0}

    def get(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls["get"] += 1
        found = torch.tensor([k in self.rows for k in keys.tolist()], dtype=torch.bool)
        held = [self.rows[k] for k in keys.tolist() if k in self.rows]
        return (torch.stack(held) if held else torch.empty(0, 0)), found

    def put(self, keys: torch.Tensor, rows: torch.Tensor) -> None:
        self.calls["put"] += 1
        for k, row in zip(keys.tolist(), rows):
            self.rows[k] = row.clone()

    def delete(self, keys: torch.Tensor) -> None:
        self.calls["delete"] += 1
        for k in keys.tolist():
            self.rows.pop(k, None)

    def items(self, chunk_size: int = 1 << 16):
        keys = list(self.rows)
        for lo in range(0, len(keys), chunk_size):
            part = keys[lo : lo + chunk_size]
            yield torch.tensor(part, dtype=torch.int64), torch.stack([self.rows[k] for k in part])
