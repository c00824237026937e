"""Initial embedding rows of new keys.

n keys, D embedding dim.
"""

from __future__ import annotations

import math

import torch

from dynemb.config import Initializer
from dynemb.table.hashing import init_bits, unit_uniform_pair
from dynemb.types import InitKind

# Keeps log() finite and uniforms below 1: float rounding can give exactly 0 or 1.
_TINY = 2.0**-24


class RowInitializer:
    """Makes the initial [n, D] embeddings of keys as configured.

    Args:
        config: the table's :class:`dynemb.Initializer`.
        embedding_dim: D.
        seed: table seed; per-key values depend on (seed, key) only.
        dtype, device: of the values.
    """

    def __init__(self, config: Initializer, embedding_dim: int, seed: int, dtype: torch.dtype, device: torch.device):
        self.config = config
        self.dim = embedding_dim
        self.seed = seed
        self.dtype = dtype
        self.device = device
        bound = 1.0 / math.sqrt(embedding_dim)
        self.low = -bound if config.low is None else config.low
        self.high = bound if config.high is None else config.high
        self.std = bound if config.std is None else config.std
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, keys: torch.Tensor) -> torch.Tensor:
        """Initial embeddings of keys (Tensor[int64]: [n]) -> [n, D]."""
        n, D, c = keys.numel(), self.dim, self.config
        if c.kind is InitKind.CONSTANT:
            return torch.full((n, D), c.value, dtype=self.dtype, device=self.device)
        # Sample in float32 at least: 24 random bits do not fit a half mantissa.
        work = torch.float64 if self.dtype == torch.float64 else torch.float32
        half = (D + 1) // 2
        if c.per_key:
            # Two uniforms from each 64-bit value halve the hashing work.
            u1, u2 = unit_uniform_pair(init_bits(keys, self.seed, half), work)  # [n, D/2] each
            u1.clamp_(min=_TINY)
            u2.clamp_(max=1 - _TINY)
        else:
            u1 = 1.0 - torch.rand((n, half), generator=self.generator, dtype=work, device=self.device)
            u2 = torch.rand((n, half), generator=self.generator, dtype=work, device=self.device)
        if c.kind is InitKind.NORMAL:
            # Box-Muller: a pair of uniforms gives a pair of normals.
            radius = u1.log_().mul_(-2.0).sqrt_()
            angle = u2.mul_(2 * math.pi)
            out = torch.cat([radius * torch.cos(angle), radius * torch.sin(angle)], 1)[:, :D]
            out = out.mul_(self.std).add_(c.mean)
        else:
            u = torch.cat([u1.clamp_(max=1 - _TINY), u2], 1)[:, :D]  # uniform on [0, 1)
            if c.kind is InitKind.UNIFORM:
                out = u.mul_(self.high - self.low).add_(self.low)
            else:
                # Inverse CDF on [Phi(a), Phi(b)]: exact truncation, no rejection loop.
                pa = 0.5 * (1 + math.erf(c.a / math.sqrt(2)))
                pb = 0.5 * (1 + math.erf(c.b / math.sqrt(2)))
                p = u.mul_(pb - pa).add_(pa).clamp_(min=1e-7, max=1 - 1e-7)
                z = torch.erfinv(p.mul_(2).sub_(1)).mul_(math.sqrt(2)).clamp_(c.a, c.b)
                out = z.mul_(self.std).add_(c.mean)
        return out.to(self.dtype).contiguous() if out.dtype != self.dtype else out
