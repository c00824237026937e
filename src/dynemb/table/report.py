"""What a key index reports: counters, sizes per segment, and its keys (export).

K keys held, S segments.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from dynemb.table.keys import check_chunk_size, check_segment
from dynemb.table.state import COUNTERS, SEGMENT_COUNTERS


class IndexReport:
    """Counters, per-segment figures and export of :class:`dynemb.table.index.KeyIndex` (a
    mixin, like :class:`dynemb.table.placement.BatchPlacement`)."""

    def stats(self) -> dict[str, int | float]:
        """Counters: size, capacity, current_capacity, load_factor, inserts, evictions,
        failed_inserts, growths (one per doubling of a segment); memory: ``index_bytes`` (of the
        slots allocated now) and ``index_bytes_per_key`` (bytes a key costs at the maximum load
        factor: bytes per slot / max_load_factor; docs/design/0035)."""
        return {
            "size": self._size,
            "capacity": self.capacity(),
            "current_capacity": self.current_capacity(),
            "load_factor": self.load_factor(),
            **self._stats,
            **self._memory(self.current_capacity()),
        }

    def _memory(self, slots: int) -> dict[str, int | float]:
        per_slot = self.index_bytes_per_slot()
        return {"index_bytes": per_slot * slots, "index_bytes_per_key": per_slot / self.max_load_factor}

    def counters(self, segment: int | None = None) -> list[int]:
        """The index's counters (inserts, evictions, failed_inserts, growths), or with ``segment``
        that segment's (inserts, evictions, failed_inserts, erased)."""
        if segment is None:
            return [self._stats[c] for c in COUNTERS]
        s = check_segment(segment, self.num_segments)
        if self._segment_stats is None:
            return [self._stats["inserts"], self._stats["evictions"], self._stats["failed_inserts"], self._erased]
        return self._segment_stats[:, s].tolist()

    def set_counters(self, values: Sequence[int], segment: int | None = None) -> None:
        """Set what :meth:`counters` returns (to restore them from a checkpoint): 4 ints >= 0."""
        if not isinstance(values, (list, tuple)) or len(values) != 4 or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
            raise ValueError(f"values={values!r}: must be 4 ints >= 0")
        if segment is None:
            self._stats.update(zip(COUNTERS, values))
            return
        s = check_segment(segment, self.num_segments)
        if self._segment_stats is None:
            self._stats.update(zip(COUNTERS[:3], values[:3]))
            self._erased = values[3]
        else:
            # The whole index's inserts, evictions and failed inserts stay the sums over its
            # segments (as counting keeps them); its growths are its own.
            old = self._segment_stats[:, s].tolist()
            for name, before, after in zip(COUNTERS[:3], old, values):
                self._stats[name] += after - before
            self._segment_stats[:, s] = torch.tensor(values, dtype=torch.int64, device=self.device)

    def _count(
        self, name: str, positions: torch.Tensor | None = None, seg: torch.Tensor | None = None, n: int | None = None, per_segment: torch.Tensor | None = None
    ) -> None:
        """Add to counter ``name`` the keys at flat ``positions`` (or of segments ``seg``, or ``n``);
        ``per_segment`` ([S] int64), when given, is how many of them each segment holds."""
        k = (positions if positions is not None else seg).numel() if n is None else n
        if name in self._stats:
            self._stats[name] += k
        if self._segment_stats is None:
            if name == "erased":
                self._erased += k
            return
        if name not in SEGMENT_COUNTERS:
            return
        row = SEGMENT_COUNTERS.index(name)
        if self.num_segments == 1:
            self._segment_stats[row, 0] += k
            return
        if per_segment is None:
            if positions is not None:
                seg = self._bucket_segments(positions // self.bucket_capacity)
            if seg is None or seg.numel() == 0:
                return
            per_segment = torch.bincount(seg, minlength=self.num_segments)
        if k:
            self._segment_stats[row] += per_segment
            # Inserts add keys; evictions (counted with the insert that took the slot) and erases remove them.
            if name == "inserts":
                self._segment_size += per_segment
            elif name != "failed_inserts":
                self._segment_size -= per_segment

    def export(self, chunk_size: int = 1 << 16) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Yield (keys, rows, scores), each Tensor[int64] [K'], over every held key in slot order,
        in chunks of at most ``chunk_size`` slots scanned. Do not modify the index while iterating."""
        for keys, rows, scores, _ in self.export_slots(chunk_size):
            yield keys, rows, scores

    def export_segment(self, segment: int, chunk_size: int = 1 << 16) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Yield (keys, rows, scores) of one segment's keys, as :meth:`export`."""
        for keys, rows, scores, _ in self.export_slots(chunk_size, segment=segment):
            yield keys, rows, scores

    def export_slots(self, chunk_size: int = 1 << 16, *, segment: int | None = None) -> Iterator[tuple[torch.Tensor, ...]]:
        """Yield (keys, rows, scores, slots), each Tensor[int64] [K'], of every held key (of
        ``segment`` only, if given) in slot order, scanning ``chunk_size`` slots at a time
        (slots: each key's flat slot, as :meth:`locate`). Do not modify the index while iterating."""
        check_chunk_size(chunk_size)
        if segment is None:
            lo, hi = 0, self.current_capacity()
        else:
            lo, hi = self._segments.slot_range(check_segment(segment, self.num_segments), self.bucket_capacity)
        return self._export_slots(lo, hi, chunk_size)

    def _export_slots(self, lo: int, hi: int, chunk_size: int) -> Iterator[tuple[torch.Tensor, ...]]:
        keys, rows, scores, tags = (t.view(-1) for t in (self._keys, self._rows, self._scores, self._tags))
        for start in range(lo, hi, chunk_size):
            end = min(start + chunk_size, hi)
            at = tags[start:end].nonzero().squeeze(1)
            yield (
                keys[start:end].index_select(0, at),
                rows[start:end].index_select(0, at).to(torch.int64),
                scores[start:end].index_select(0, at).to(torch.int64),
                at + start,
            )

    def segment_capacity(self, segment: int) -> int:
        """Most keys segment ``segment`` holds (its maximum buckets times W)."""
        return self._segment_max_buckets[segment] * self.bucket_capacity

    def segment_sizes(self) -> torch.Tensor:
        """Keys held per segment ([S] int64)."""
        if self._segment_size is None:
            return torch.tensor([self._size], dtype=torch.int64, device=self.device)
        return self._segment_size.clone()

    def segment_stats(self) -> list[dict[str, int | float]]:
        """Per segment: size, capacity, current_capacity, load_factor, inserts, evictions,
        failed_inserts, erased, index_bytes, index_bytes_per_key (as :meth:`stats`)."""
        sizes = self.segment_sizes().tolist()
        out = []
        for s, size in enumerate(sizes):
            current = self._segments.buckets[s] * self.bucket_capacity
            entry = {"size": size, "capacity": self.segment_capacity(s), "current_capacity": current, "load_factor": size / current}
            entry.update(zip(SEGMENT_COUNTERS, self.counters(s)))
            entry.update(self._memory(current))
            out.append(entry)
        return out
