"""Triton twin of :mod:`dynemb.kernels.update`: one optimizer step on float32 rows of the store
in place, by row id, with the gradient summed per key; rows whose gradient or result is not
finite are left unchanged and flagged (nonfinite_grads="skip").

U rows, D embedding columns, S state columns, width = D + S. A program updates one row: its
[D] embedding and state read once, written once. The arithmetic is update.cpp's (and
dynemb/optim/optimizers.py's) op by op in float32, with IEEE square roots and divisions; the
row-wise mean's sum runs as a tree, so it may differ from torch's in the last bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dynemb.kernels import UPDATE_KINDS as KINDS
from dynemb.kernels.gpu import launch_options


@triton.jit
def _finite(x):
    return tl.abs(x) < float("inf")


@triton.jit
def _update_kernel(
    table,  # [R, width] float32
    width,
    rows,  # [U] int64 distinct row ids
    grad,  # [U, D] float32, rows of grad_stride
    grad_stride,
    D,
    Df,  # D as a float
    lr,
    wd,
    eps,
    a,
    b,
    c,
    bad,  # [U] bool out (CHECK)
    KIND: tl.constexpr,
    CHECK: tl.constexpr,
    HAS_WD: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    u = tl.program_id(0).to(tl.int64)
    row = table + tl.load(rows + u) * width
    j = tl.arange(0, BLOCK_D)
    jm = j < D
    w = tl.load(row + j, mask=jm, other=0.0)
    g0 = tl.load(grad + u * grad_stride + j, mask=jm, other=0.0)
    if HAS_WD:
        g = g0 + wd * w
    else:
        g = g0
    ok = tl.sum(tl.where(jm & ~_finite(g0), 1, 0), axis=0) == 0
    if KIND == 0:  # SGD
        out = w + (-lr) * g
        ok = ok & (tl.sum(tl.where(jm & ~_finite(out), 1, 0), axis=0) == 0)
        keep = ok if CHECK else tl.full([], 1, tl.int1)
        tl.store(row + j, out, mask=jm & keep)
    elif KIND == 1:  # Adagrad: element-wise accumulators in columns D..2D
        s = tl.load(row + D + j, mask=jm, other=0.0) + g * g
        out = w + (-a) * tl.div_rn(g, tl.sqrt_rn(s) + eps)
        ok = ok & (tl.sum(tl.where(jm & ~(_finite(out) & _finite(s)), 1, 0), axis=0) == 0)
        keep = ok if CHECK else tl.full([], 1, tl.int1)
        tl.store(row + D + j, s, mask=jm & keep)
        tl.store(row + j, out, mask=jm & keep)
    elif KIND == 2:  # row-wise Adagrad: one accumulator in column D
        s = tl.load(row + D) + tl.div_rn(tl.sum(tl.where(jm, g * g, 0.0), axis=0), Df)
        denom = tl.sqrt_rn(s) + eps
        out = w + (-lr) * tl.div_rn(g, denom)
        ok = ok & _finite(s) & (tl.sum(tl.where(jm & ~_finite(out), 1, 0), axis=0) == 0)
        keep = ok if CHECK else tl.full([], 1, tl.int1)
        tl.store(row + D, s, mask=keep)
        tl.store(row + j, out, mask=jm & keep)
    else:  # Adam: first moments in columns D..2D, second in 2D..3D
        m0 = tl.load(row + D + j, mask=jm, other=0.0)
        v0 = tl.load(row + 2 * D + j, mask=jm, other=0.0)
        m1 = m0 + a * (g - m0)
        v1 = v0 + (g * g - v0) * b
        out = w + (-c) * tl.div_rn(m1, tl.sqrt_rn(v1) + eps)
        ok = ok & (tl.sum(tl.where(jm & ~(_finite(out) & _finite(m1) & _finite(v1)), 1, 0), axis=0) == 0)
        keep = ok if CHECK else tl.full([], 1, tl.int1)
        tl.store(row + D + j, m1, mask=jm & keep)
        tl.store(row + 2 * D + j, v1, mask=jm & keep)
        tl.store(row + j, out, mask=jm & keep)
    if CHECK:
        tl.store(bad + u, ok == 0)


def update_rows_triton(table: torch.Tensor, rows: torch.Tensor, grads: torch.Tensor, spec: dict, *, check: bool) -> torch.Tensor | None:
    """:func:`dynemb.kernels.update.update_rows_native` on the store's device: same arguments,
    same result ([U] bool of the rows left unchanged, or None)."""
    n, D = grads.shape
    rows = rows.contiguous()
    if grads.stride(1) != 1:
        grads = grads.contiguous()
    bad = torch.empty(n, dtype=torch.bool, device=table.device) if check else None
    if n:
        wd = float(spec.get("weight_decay", 0.0))
        _update_kernel[(n,)](
            table,
            table.shape[1],
            rows,
            grads,
            grads.stride(0),
            D,
            float(D),
            float(spec["lr"]),
            wd,
            float(spec.get("eps", 0.0)),
            float(spec.get("a", 0.0)),
            float(spec.get("b", 0.0)),
            float(spec.get("c", 0.0)),
            bad if check else rows,
            KIND=KINDS[spec["kind"]],
            CHECK=check,
            HAS_WD=wd != 0.0,
            BLOCK_D=triton.next_power_of_2(D),
            **launch_options(),
        )
    if bad is None or not bool(bad.any()):
        return None
    return bad
