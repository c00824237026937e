"""Frequency admission: a key enters a table only after ``threshold`` sightings in training.

n keys in a call.
"""

from __future__ import annotations

import torch

from dynemb.config import Admission
from dynemb.table.free_list import FreeList
from dynemb.table.index import KeyIndex, rounded_capacity
from dynemb.types import CheckMode, ScoreStrategy


class FrequencyAdmission:
    """Counts sightings of keys not (yet) in a table, in a bounded counter index.

    The counter is a :class:`KeyIndex` with the ``step`` strategy: when its bucket is full, the
    count of the key unseen for the most steps is dropped. A key whose count cannot be stored
    (its counter bucket is all in use by this batch) is judged on this batch's count alone.
    """

    def __init__(self, config: Admission, device: torch.device):
        self.threshold = config.threshold
        self._rows = FreeList(rounded_capacity(config.counter_capacity, None, 32), device)
        self.index = KeyIndex(
            capacity=config.counter_capacity,
            allocator=self._rows,
            score_strategy=ScoreStrategy.STEP,
            bucket_capacity=32,
            check_mode=CheckMode.COUNT,
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
        self.index.step = step
        r = self.index.upsert_unique(keys, counts)
        rows = r.rows.clamp(min=0)
        previous = torch.where(r.found, self.counts.index_select(0, rows), 0)
        total = previous + counts
        self.counts.index_copy_(0, rows[r.ok], total[r.ok])
        admitted = total >= self.threshold
        self.rejections += int((~admitted).sum())
        return admitted

    def forget(self, keys: torch.Tensor) -> None:
        """Drop the counts of keys now in the table (Tensor[int64]: [n])."""
        self.index.erase(keys)
