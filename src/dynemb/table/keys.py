"""Argument checks and de-duplication for the key index: keys, segments, the caller's clock.

N keys in a call, U distinct (segment, key) pairs, S segments.
"""

from __future__ import annotations

import operator

import torch

INT64_MIN = torch.iinfo(torch.int64).min
INT64_MAX = torch.iinfo(torch.int64).max


def check_keys(keys: torch.Tensor, name: str, device: torch.device) -> torch.Tensor:
    """Validate int64 (or int32) keys of any shape on ``device``; returns them flat ([N] int64)."""
    if not isinstance(keys, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int64, got {type(keys).__name__}")
    if keys.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name}.dtype={keys.dtype}: must be torch.int64 (or int32)")
    if keys.device != device:
        raise ValueError(f"{name}.device={keys.device}: the table lives on {device}")
    return keys.reshape(-1).to(torch.int64)


def check_segments(segments: torch.Tensor | None, n: int, num_segments: int, device: torch.device) -> torch.Tensor | None:
    """The segment of each of n keys ([n] int64, each in [0, S)), or None for an index of one
    segment (which takes ``segments=None`` or all zeros; several segments need them)."""
    if segments is None:
        if num_segments > 1:
            raise ValueError(f"segments=None: this index has {num_segments} segments; pass the segment of every key")
        return None
    seg = check_keys(segments, "segments", device)
    if seg.numel() != n:
        raise ValueError(f"segments has {seg.numel()} values for {n} keys")
    if seg.numel() and not bool(((seg >= 0) & (seg < num_segments)).all()):
        raise ValueError(f"segments: must lie in [0, {num_segments}), got values in [{int(seg.min())}, {int(seg.max())}]")
    return seg if num_segments > 1 else None


def check_segment(segment, num_segments: int) -> int:
    """One segment number as an int in [0, S), or ValueError naming ``segment``."""
    if not isinstance(segment, int) or isinstance(segment, bool) or not 0 <= segment < num_segments:
        raise ValueError(f"segment={segment!r}: must be an int in [0, {num_segments})")
    return segment


def check_chunk_size(chunk_size) -> int:
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size!r}: must be an int >= 1")
    return chunk_size


def check_now(now) -> int:
    """The clock as a Python int in int64 range, or ValueError naming ``now``."""
    try:
        if isinstance(now, bool):
            raise TypeError
        value = operator.index(now)
    except TypeError:
        raise ValueError(f"now={now!r}: must be an int (the step or timestamp of this call)") from None
    if not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(f"now={value}: must fit in int64")
    return value


def unique_pairs(first: torch.Tensor, second: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor, torch.Tensor]:
    """Distinct (first, second) pairs of two [N] int64 tensors, sorted by first, then second.

    Returns:
        (first, second) of the U distinct pairs ([U] each), inverse ([N], the pair of each
        input) and counts ([U]).
    """
    n = first.numel()
    if n:
        # Rank the second values, then one unique of (first - min) * ranks + rank: two uniques
        # instead of two stable sorts and their gathers, when the product fits in int64.
        second_values, rank = torch.unique(second, sorted=True, return_inverse=True)
        low, high = int(first.min()), int(first.max())
        width = second_values.numel()
        if (high - low + 1) * width < (1 << 62):
            composite = (first - low) * width + rank
            pairs, inverse, counts = torch.unique(composite, sorted=True, return_inverse=True, return_counts=True)
            return (pairs // width + low, second_values.index_select(0, pairs % width)), inverse, counts
    by_second = torch.sort(second, stable=True)
    by_first = torch.sort(first.index_select(0, by_second.indices), stable=True)
    order = by_second.indices.index_select(0, by_first.indices)  # [N] input index in pair order
    f, s = by_first.values, second.index_select(0, order)
    start = torch.ones_like(f, dtype=torch.bool)
    if f.numel() > 1:
        start[1:] = (f[1:] != f[:-1]) | (s[1:] != s[:-1])
    group = start.cumsum(0) - 1  # [N] pair id in sorted order
    inverse = torch.empty_like(group).scatter_(0, order, group)
    starts = start.nonzero().squeeze(1)
    counts = torch.diff(starts, append=starts.new_tensor([f.numel()]))
    return (f.index_select(0, starts), s.index_select(0, starts)), inverse, counts
