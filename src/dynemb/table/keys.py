"""Argument checks and de-duplication for the key index: keys, segments, the caller's clock.

N keys in a call, U distinct (segment, key) pairs, S segments.
"""

from __future__ import annotations

import operator

import torch

# The de-duplication of (segment, key) pairs is a kernel's plain-torch twin (dynemb.kernels.dedup).
from dynemb.kernels.dedup import unique_pairs

__all__ = ["INT64_MAX", "INT64_MIN", "check_chunk_size", "check_keys", "check_now", "check_segment", "check_segments", "unique_pairs"]

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
    if keys.dim() == 1 and keys.dtype == torch.int64:
        return keys  # already flat int64: no view to make (a call's first tensor operations cost most)
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
    if seg.numel():
        low, high = torch.stack(torch.aminmax(seg)).tolist()  # one pass, one host sync
        if low < 0 or high >= num_segments:
            raise ValueError(f"segments: must lie in [0, {num_segments}), got values in [{low}, {high}]")
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
