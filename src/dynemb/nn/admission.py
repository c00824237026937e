"""Frequency admission: a key enters a table only after ``threshold`` sightings in training.

n keys in a call, K keys counted.
"""

from __future__ import annotations

import torch

from dynemb.config import Admission
from dynemb.table.index import KeyIndex
from dynemb.types import ScoreStrategy
from dynemb.workspace import writable


class FrequencyAdmission:
    """Counts sightings of keys not (yet) in a table, in a bounded counter index.

    The counter is a :class:`KeyIndex` with the ``step`` strategy: when its bucket is full, the
    count of the key unseen for the most steps is dropped. A key whose count cannot be stored
    (its counter bucket is all in use by this batch) is judged on this batch's count alone.
    """

    def __init__(self, config: Admission, device: torch.device):
        self.threshold = config.threshold
        self.index = KeyIndex(
            capacity=config.counter_capacity,
            score_strategy=ScoreStrategy.STEP,
            bucket_capacity=32,
            device=device,
        )
        self.counts = torch.zeros(self.index.capacity(), dtype=torch.int64, device=device)
        self.rejections = 0

    def admit(self, keys: torch.Tensor, counts: torch.Tensor, step: int) -> torch.Tensor:
        """Record sightings and say which keys are admitted (they stay counted until
        :meth:`forget`, so a key whose insert fails keeps its count).

        Args:
            keys (Tensor[int64]): [n] distinct, sorted keys missing from the table.
            counts (Tensor[int64]): [n] sightings in this batch.
            step: the table's step (the counter's clock).
        Returns:
            Tensor[bool]: [n] admitted.
        """
        with writable():
            r = self.index.upsert_unique(keys, counts, now=step)
            rows = r.rows.clamp(min=0)
            previous = torch.where(r.found, self.counts.index_select(0, rows), 0)
            total = previous + counts
            self.counts.index_copy_(0, rows[r.ok], total[r.ok])
        admitted = total >= self.threshold
        self.rejections += int((~admitted).sum())
        return admitted

    def forget(self, keys: torch.Tensor) -> None:
        """Drop the counts of keys now in the table (Tensor[int64]: [n])."""
        with writable():
            self.index.erase(keys)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The counter index's state plus ``counts`` [K] aligned with its ``keys``."""
        state = self.index.state_dict()
        state["counts"] = self.counts.index_select(0, state["rows"])
        state["rejections"] = torch.tensor(self.rejections, dtype=torch.int64)
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore from :meth:`state_dict`; a counter of another geometry re-counts the keys."""
        counts = state["counts"]
        if counts.shape != state["keys"].shape or counts.dtype != torch.int64:
            raise ValueError(f"admission.counts: shape {tuple(counts.shape)} / dtype {counts.dtype} does not match admission.keys")
        with writable():
            device = self.counts.device
            index_state = {k: v for k, v in state.items() if k not in ("counts", "rejections")}
            try:
                self.index.load_state_dict(index_state)
            except ValueError:
                # Another counter geometry: re-insert the counted keys with their scores.
                fresh = KeyIndex(capacity=self.index.capacity(), score_strategy=ScoreStrategy.STEP, bucket_capacity=32, device=device)
                keys = state["keys"].to(device)
                order = torch.argsort(keys)
                r = fresh.upsert_unique(keys[order], torch.ones_like(keys), given=state["scores"].to(device)[order])
                self.index = fresh
                self.counts.zero_()
                ok = r.ok
                self.counts.index_copy_(0, r.rows[ok], counts.to(device)[order][ok])
            else:
                self.counts.zero_()
                self.counts.index_copy_(0, state["rows"].to(device), counts.to(device))
        self.rejections = int(state["rejections"])

    def to(self, device: torch.device) -> None:
        with writable():
            self.index.to(device)
            self.counts = self.counts.to(device)
