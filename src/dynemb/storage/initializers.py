"""Initial embedding rows of new keys.

n keys, D embedding dim.
"""

from __future__ import annotations

import math

import torch

from dynemb.config import Initializer
from dynemb.hashing import init_bits
from dynemb.types import InitKind
from dynemb.workspace import Workspace

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
        if not self.low < self.high:
            raise ValueError(f"initializer.low={self.low!r}, high={self.high!r}: need low < high (an unset bound is -/+ 1/sqrt(D) = {bound:.4g})")
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self._workspace = Workspace(device)

    def __call__(self, keys: torch.Tensor) -> torch.Tensor:
        """Initial embeddings of keys (Tensor[int64]: [n]) -> [n, D].

        The result may be a view of a buffer that the next call overwrites: consume it first.
        """
        n, D, c = keys.numel(), self.dim, self.config
        if c.kind is InitKind.CONSTANT:
            return torch.full((n, D), c.value, dtype=self.dtype, device=self.device)
        # Sample in float32 at least: 24 random bits do not fit a half mantissa.
        work = torch.float64 if self.dtype == torch.float64 else torch.float32
        half = (D + 1) // 2
        out = self._workspace.get("out", n, (2 * half,), work)
        u1, u2 = out[:, :half], out[:, half:]  # [n, D/2] each
        if c.per_key:
            # Two uniforms from each 64-bit value halve the hashing work: one from its high bits,
            # one from bits 0..39 shifted up; float conversion keeps the leading bits.
            bits = init_bits(keys, self.seed, half, out=self._workspace.get("bits", n, (half,), torch.int64))
            u1.copy_(bits).mul_(2.0**-64).add_(0.5)
            u2.copy_(bits.bitwise_left_shift_(24)).mul_(2.0**-64).add_(0.5)
        else:
            u1.uniform_(generator=self.generator)
            u2.uniform_(generator=self.generator)
        u1.clamp_(min=_TINY, max=1 - _TINY)
        u2.clamp_(min=0.0, max=1 - _TINY)
        if c.kind is InitKind.NORMAL:
            # Box-Muller: a pair of uniforms gives a pair of normals (r sin t, r cos t).
            radius = u1.log_().mul_(-2.0).sqrt_()
            angle = u2.mul_(2 * math.pi)
            sin = torch.sin(angle)
            angle.cos_().mul_(radius)
            radius.mul_(sin)
            out.mul_(self.std).add_(c.mean)
        elif c.kind is InitKind.UNIFORM:
            out.mul_(self.high - self.low).add_(self.low)
        else:
            # Inverse CDF on [Phi(a), Phi(b)]: exact truncation, no rejection loop.
            pa = 0.5 * (1 + math.erf(c.a / math.sqrt(2)))
            pb = 0.5 * (1 + math.erf(c.b / math.sqrt(2)))
            out.mul_(pb - pa).add_(pa).clamp_(min=1e-7, max=1 - 1e-7)
            out.mul_(2).sub_(1).erfinv_().mul_(math.sqrt(2)).clamp_(c.a, c.b)
            out.mul_(self.std).add_(c.mean)
        result = out[:, :D]
        return result.to(self.dtype) if self.dtype != work else result
