"""A bag collection's single-hot outputs: each (feature, sample)'s row of its group's unique rows
copied into the feature's columns of the concat.

B samples, F features of one group, U its unique rows, D its dim. ``copy_bags_torch`` is the
plain-torch twin (one ``index_select`` and one strided copy per feature); ``copy_bags_native``
runs ``pool.cpp``: one parallel pass, row by row of the concat, with no unit table and no index
arrays (docs/design/0017-pooled-units.md).
"""

from __future__ import annotations

import torch

from dynemb.kernels import library, ptr, threads


def copy_bags_torch(out: torch.Tensor, cols: list[int], rows: torch.Tensor, inverse: torch.Tensor) -> None:
    """``out[b, cols[j] : cols[j] + D] = rows[inverse[j * B + b]]`` for every feature j, sample b.

    Args:
        out (Tensor): [B, total] the concat (contiguous rows).
        cols (list[int]): [F] first column of each feature.
        rows (Tensor): [U, D] the group's unique rows (rows may be strided).
        inverse (Tensor[int64]): [F * B] the unique row of each id, feature-major.
    """
    B, D = out.shape[0], rows.shape[1]
    for j, c in enumerate(cols):
        out[:, c : c + D] = rows.index_select(0, inverse[j * B : (j + 1) * B])


def copy_bags_native(out: torch.Tensor, cols: list[int], rows: torch.Tensor, inverse: torch.Tensor) -> None:
    """:func:`copy_bags_torch` in one compiled pass (CPU tensors, ``out`` contiguous, ``rows``
    with unit column stride); bitwise the same (a copy)."""
    B, D = out.shape[0], rows.shape[1]
    if not cols or B == 0 or D == 0:
        return
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    inverse = inverse.contiguous()
    es = out.element_size()
    offsets = torch.tensor([c * es for c in cols], dtype=torch.int64)
    library().dyn_copy_bags(ptr(out), out.stride(0) * es, ptr(offsets), len(cols), B, ptr(rows), rows.stride(0) * es, ptr(inverse), D * es, threads())
