"""Key streams of the benchmarks: Zipf-distributed ranks scrambled into arbitrary int64 keys.

N keys in a batch, K distinct ranks (the key universe).

A rank r in [0, K) is drawn with probability ~ (r + 1)^-s by inverting the CDF of the continuous
power law on [1, K + 1); the key is ``scramble(r)``, a bijection of the 64-bit values, so keys
spread over the whole int64 range (negatives included) while rank frequencies are kept.
"""

from __future__ import annotations

import torch


def _signed(x: int) -> int:
    """The int64 with the same bits as the unsigned 64-bit ``x``."""
    return x - (1 << 64) if x >= 1 << 63 else x


# murmur3's fmix64 constants: deliberately not dynemb's splitmix64 ones, so that the benchmark's
# key scrambling cannot line up with the bits the index hashes on.
_F1 = _signed(0xFF51AFD7ED558CCD)
_F2 = _signed(0xC4CEB9FE1A85EC53)
_SALT = _signed(0x5851F42D4C957F2D)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 ``x`` by ``s`` bits."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def scramble(ranks: torch.Tensor) -> torch.Tensor:
    """Bijective 64-bit mixer (xor salt, then murmur3 fmix64): distinct ranks give distinct keys.

    Args:
        ranks (Tensor[int64]): [*]
    Returns:
        Tensor[int64]: [*] keys anywhere in the int64 range.
    """
    x = ranks ^ _SALT
    x = x ^ _shr(x, 33)
    x = x * _F1
    x = x ^ _shr(x, 33)
    x = x * _F2
    return x ^ _shr(x, 33)


def zipf_ranks(n: int, num_ranks: int, exponent: float, generator: torch.Generator) -> torch.Tensor:
    """``n`` ranks in [0, num_ranks) with P(r) ~ (r + 1)^-exponent (inverse-CDF approximation).

    Args:
        n: N, ranks to draw.
        num_ranks: K.
        exponent: s of the power law, != 1.
        generator: source of the uniforms.
    Returns:
        Tensor[int64]: [N]
    """
    if exponent == 1.0:
        raise ValueError("exponent=1.0: the inverse-CDF form used here needs exponent != 1")
    a = 1.0 - exponent
    u = torch.rand(n, generator=generator, dtype=torch.float64)
    # CDF(x) = (x^a - 1) / ((K+1)^a - 1) on [1, K+1); invert, floor, shift to 0-based.
    x = u.mul_((num_ranks + 1) ** a - 1.0).add_(1.0).pow_(1.0 / a)
    return x.floor_().to(torch.int64).sub_(1).clamp_(0, num_ranks - 1)


def zipf_keys(n: int, num_ranks: int, exponent: float, generator: torch.Generator) -> torch.Tensor:
    """``n`` Zipf-distributed int64 keys: ``scramble(zipf_ranks(...))`` ([N] int64)."""
    return scramble(zipf_ranks(n, num_ranks, exponent, generator))


def distinct_keys(start: int, n: int) -> torch.Tensor:
    """Keys ``scramble(start .. start + n - 1)``: distinct, and disjoint from other ranges ([n] int64)."""
    return scramble(torch.arange(start, start + n, dtype=torch.int64))
