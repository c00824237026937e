"""The one 64-bit mixer of dynemb and the bits each use takes from it.

N keys. All arithmetic is int64 with two's-complement wrap-around, which torch performs on CPU and
CUDA alike; right shifts are made logical by masking the sign-extended bits.

Uses and their bits (independent, so e.g. rank routing does not starve buckets):
    bucket 1    high 32 bits of mix(key)           (multiply-shift onto [0, B))
    bucket 2    high 32 bits of mix(mix(key))      (the second choice of two-choice hashing)
    rank        low 32 bits of mix(key)            (multiply-shift onto [0, R))
    tag         low 8 bits of mix(mix(key)), 0 read as 1   (the index's per-slot tag byte:
                0 marks an empty slot; a probe compares tags before keys, docs/design/0039)
    init        mix(key ^ salt) * (mix(column ^ ~salt) | 1), salt from the seed: 64 bits per
                (key, column) (init_bits); storage/initializers.py asks for ceil(D/2) columns
                and takes two uniforms from each value, one from its leading bits, one from
                bits 0..39 shifted up
"""

from __future__ import annotations

import torch

_MASK32 = (1 << 32) - 1


def _signed(x: int) -> int:
    """The int64 with the same bits as the unsigned 64-bit ``x``."""
    return x - (1 << 64) if x >= 1 << 63 else x


_M1 = _signed(0xBF58476D1CE4E5B9)
_M2 = _signed(0x94D049BB133111EB)
_GOLDEN = _signed(0x9E3779B97F4A7C15)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 ``x`` by ``s`` bits."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix64(keys: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser: a bijection on 64-bit values.

    Args:
        keys (Tensor[int64]): [*] any shape.
    Returns:
        Tensor[int64]: [*] mixed bits.
    """
    x = keys ^ _shr(keys, 30)
    x = x * _M1
    x = x ^ _shr(x, 27)
    x = x * _M2
    return x ^ _shr(x, 31)


def bucket_of(mixed: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """Bucket in [0, num_buckets) from the high 32 bits of ``mixed`` ([N] int64 -> [N] int64).

    Multiply-shift keeps the split property used by growth: doubling ``num_buckets`` sends bucket
    b to buckets 2b and 2b+1 only.
    """
    return (_shr(mixed, 32) * num_buckets) >> 32


def candidate_buckets(keys: torch.Tensor, num_buckets: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two buckets a key may live in ([N] int64 -> two [N] int64); they may coincide."""
    mixed = mix64(keys)
    return bucket_of(mixed, num_buckets), bucket_of(mix64(mixed), num_buckets)


def tag_of(keys: torch.Tensor) -> torch.Tensor:
    """The index's tag byte of each key, in [1, 255] ([*] int64 -> [*] uint8)."""
    t = mix64(mix64(keys)) & 0xFF
    return t.masked_fill_(t == 0, 1).to(torch.uint8)


def rank_of(mixed: torch.Tensor, world_size: int) -> torch.Tensor:
    """Owner rank in [0, world_size) from the low 32 bits of ``mixed`` ([N] int64 -> [N] int64)."""
    return ((mixed & _MASK32) * world_size) >> 32


def init_bits(keys: torch.Tensor, seed: int, columns: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Per (key, column) 64 pseudo-random bits that depend on (seed, key, column) only.

    The key (xor a salt derived from the seed) is mixed once, then multiplied by a distinct odd
    constant per column, itself the mixed column index (multiplicative hashing): one int64
    multiply per value, which is what makes per-key initialisation cheap. Prefer the high bits
    (as :func:`unit_uniform` does): the low k bits of a product depend only on the low k bits of
    its factors (both factors are mixed, so bits 16..39, which the initializer's second uniform
    uses, still depend on the whole key).

    Args:
        keys (Tensor[int64]): [N]
        seed: any int.
        columns: C values per key (the initializer asks for C = ceil(D/2)).
        out (Tensor[int64] | None): [N, C] to write into.
    Returns:
        Tensor[int64]: [N, C]
    """
    salt, col = init_salt_and_columns(seed, columns, keys.device)  # col: [C], odd
    base = mix64(keys ^ salt)  # [N]
    return torch.mul(base[:, None], col, out=out) if out is not None else base[:, None] * col


def init_salt_and_columns(seed: int, columns: int, device: torch.device | str = "cpu") -> tuple[int, torch.Tensor]:
    """The salt (an int64) and the C odd column multipliers ([C] int64) of :func:`init_bits`."""
    salt = _signed((seed * _GOLDEN + 0x632BE59BD9B4E019) & ((1 << 64) - 1))
    return salt, mix64(torch.arange(columns, device=device, dtype=torch.int64) ^ ~salt) | 1


def unit_uniform(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Map 64-bit values to floats uniform on [0, 1) using their top 24 bits ([*] -> [*])."""
    return (_shr(bits, 40).to(dtype)).mul_(2.0**-24)
