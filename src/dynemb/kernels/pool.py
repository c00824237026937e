"""A bag collection's single-hot outputs: each (feature, sample)'s row of its group's unique rows
copied into the feature's columns of the concat.

B samples, F features (of every group), U_g the unique rows of feature f's group, D_f its dim.
``copy_bags_torch`` is the plain-torch twin (one ``index_select`` and one strided copy per
feature); ``copy_bags_native`` runs ``pool.cpp``: one parallel pass over the concat, row by row,
with no unit table and no index arrays (docs/design/0017-pooled-units.md).
"""

from __future__ import annotations

import torch

from dynemb.kernels import library, ptr, threads


def copy_bags_torch(out: torch.Tensor, cols: list[int], rows: list[torch.Tensor], inverses: list[torch.Tensor]) -> None:
    """``out[b, cols[f] : cols[f] + D_f] = rows[f][inverses[f][b]]`` for every feature f, sample b.

    Args:
        out (Tensor): [B, total] the concat (contiguous rows).
        cols (list[int]): [F] first column of each feature.
        rows (list[Tensor]): [F] feature f's group rows [U_g, D_f] (rows may be strided).
        inverses (list[Tensor[int64]]): [F] each [B], the unique row of each sample's id.
    """
    for c, r, inv in zip(cols, rows, inverses):
        out[:, c : c + r.shape[1]] = r.index_select(0, inv)


def copy_bags_native(out: torch.Tensor, cols: list[int], rows: list[torch.Tensor], inverses: list[torch.Tensor]) -> None:
    """:func:`copy_bags_torch` in one compiled pass (CPU tensors, ``out`` contiguous); bitwise
    the same (a copy). Features are copied in column order, whatever the order given."""
    B = out.shape[0]
    if not cols or B == 0:
        return
    es = out.element_size()
    # Unit column stride for every source, inverses contiguous int64: kept alive for the call.
    rows = [r if r.stride(1) == 1 else r.contiguous() for r in rows]
    inverses = [inv.contiguous() for inv in inverses]
    by_col = sorted(range(len(cols)), key=cols.__getitem__)
    table = (
        torch.tensor(
            [[cols[f] * es, rows[f].data_ptr(), rows[f].stride(0) * es, inverses[f].data_ptr(), rows[f].shape[1] * es] for f in by_col],
            dtype=torch.int64,
        )
        .t()
        .contiguous()
    )  # [5, F]
    library().dyn_copy_bags(ptr(out), out.stride(0) * es, len(cols), B, ptr(table[0]), ptr(table[1]), ptr(table[2]), ptr(table[3]), ptr(table[4]), threads())
