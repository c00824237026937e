"""Device functions shared by the Triton kernels: the bits of :mod:`dynemb.hashing`."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def mix64(x):
    """splitmix64's finaliser on uint64 values (dynemb.hashing.mix64)."""
    x = x ^ (x >> 30)
    x = x * 0xBF58476D1CE4E5B9
    x = x ^ (x >> 27)
    x = x * 0x94D049BB133111EB
    return x ^ (x >> 31)


@triton.jit
def bucket_of(mixed, num_buckets):
    """Bucket in [0, num_buckets) from the high 32 bits of uint64 ``mixed`` (int64 result)."""
    return (((mixed >> 32) * num_buckets.to(tl.uint64)) >> 32).to(tl.int64)
