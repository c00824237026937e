"""Triton twin of :mod:`dynemb.kernels.init`: new keys' rows written straight into the store,
per-key uniform embeddings (the bits of :func:`dynemb.hashing.init_bits`, two uniforms from
each 64-bit value, the float32 operations of init.cpp in its order) and the optimizer's
constant initial state. n keys, D embedding columns, H = ceil(D / 2) hashed values per key.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dynemb.hashing import init_salt_and_columns
from dynemb.kernels.gpu import launch_options
from dynemb.kernels.gpu.common import mix64


@triton.jit
def _init_kernel(
    table,  # [R, width] float32
    width,
    rows,  # [n] int64 distinct row ids
    keys,  # [n] int64
    D,
    H,
    salt,
    cols,  # [H] int64, the odd per-column multipliers of init_bits
    low,
    scale,
    state_value,
    BLOCK_H: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    row = table + tl.load(rows + i) * width
    base = mix64((tl.load(keys + i) ^ salt).to(tl.uint64, bitcast=True))
    c = tl.arange(0, BLOCK_H)
    cm = c < H
    bits = base * tl.load(cols + c, mask=cm, other=1).to(tl.uint64, bitcast=True)
    # * 2^-64 + 0.5: the signed value as a uniform on [0, 1), as init.cpp.
    u1 = bits.to(tl.int64, bitcast=True).to(tl.float32) * 5.421010862427522e-20 + 0.5
    u2 = (bits << 24).to(tl.int64, bitcast=True).to(tl.float32) * 5.421010862427522e-20 + 0.5
    tiny = 5.9604644775390625e-08  # 2^-24
    u1 = tl.minimum(tl.maximum(u1, tiny), 1.0 - tiny)
    u2 = tl.minimum(tl.maximum(u2, 0.0), 1.0 - tiny)
    tl.store(row + c, u1 * scale + low, mask=cm)
    tl.store(row + H + c, u2 * scale + low, mask=cm & (H + c < D))
    s = tl.arange(0, BLOCK_S)
    tl.store(row + D + s, tl.full([BLOCK_S], 0.0, tl.float32) + state_value, mask=s < width - D)


def init_rows_triton(table: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor, D: int, seed: int, low: float, high: float, state_value: float) -> None:
    """:func:`dynemb.kernels.init.init_rows_native` on the store's device (same arguments,
    bitwise the same rows)."""
    n = keys.numel()
    if n == 0:
        return
    H = (D + 1) // 2
    salt, cols = init_salt_and_columns(seed, H, table.device)
    width = table.shape[1]
    _init_kernel[(n,)](
        table,
        width,
        rows.contiguous(),
        keys.contiguous(),
        D,
        H,
        salt,
        cols,
        float(low),
        float(high - low),
        float(state_value),
        BLOCK_H=triton.next_power_of_2(H),
        BLOCK_S=triton.next_power_of_2(max(width - D, 1)),
        **launch_options(),
    )
