"""A bag collection's single-hot outputs: each (feature, sample)'s row of its group's unique rows
copied into the feature's columns of the concat; and backward, each unique row's gradient summed
from the concat gradient's slices its ids point at.

B samples, F features (of every group), U_g the unique rows of feature f's group, D_f its dim.
``copy_bags_torch`` is the plain-torch twin (one ``index_select`` and one strided copy per
feature); ``copy_bags_native`` runs ``pool.cpp``: one parallel pass over the concat, row by row,
with no unit table and no index arrays (docs/design/0017-pooled-units.md). ``sum_bags_torch`` /
``sum_bags_native``: the backward's per-row sums, one ``embedding_bag`` over sub-units (the units
path's own) or one compiled pass over each row's ids.
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


def sum_bags_torch(
    grad_rows: torch.Tensor,
    first_row: torch.Tensor,
    order: torch.Tensor,
    starts: torch.Tensor,
    num_unique: int,
    k: int,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gradient [U, k * u] of unique rows: row i sums ``grad_rows[first_row[n] : first_row[n] + k]``
    (k unit rows, i.e. k * u floats) over its ids n = ``order[starts[i] : starts[i + 1]]``, each
    times ``scale[n]`` if given.

    Args:
        grad_rows (Tensor): [B * K, u] the concat gradient in unit rows.
        first_row (Tensor[int64]): [N] the unit row where each id's slice begins.
        order (Tensor[int64]): [N] the ids grouped by unique row; starts (Tensor[int64]): [U].
        scale (Tensor | None): [N] per-id factor (bag weights, mean divisors), or None.
    """
    n, u = order.numel(), grad_rows.shape[1]
    if n == 0:
        return grad_rows.new_zeros(num_unique, k * u)
    src = first_row.index_select(0, order)
    psw = None if scale is None else scale.index_select(0, order)
    if k == 1:
        return torch.nn.functional.embedding_bag(src, grad_rows, starts, mode="sum", per_sample_weights=psw)
    ar = torch.arange(k, device=grad_rows.device)
    # Sub-unit-major: bag (t, i) sums the unit rows of unique row i's ids shifted by t.
    idx = (src[None, :] + ar[:, None]).reshape(-1)
    offsets = (ar[:, None] * n + starts[None, :]).reshape(-1)
    psw = None if psw is None else psw.repeat(k)
    summed = torch.nn.functional.embedding_bag(idx, grad_rows, offsets, mode="sum", per_sample_weights=psw)  # [k * U, u]
    return summed.view(k, num_unique, u).transpose(0, 1).reshape(num_unique, k * u)


def sum_bags_native(grad_rows: torch.Tensor, first_row: torch.Tensor, order: torch.Tensor, starts: torch.Tensor, num_unique: int, k: int) -> torch.Tensor:
    """:func:`sum_bags_torch` in one compiled pass (float32 CPU tensors): each row's ids added in
    order, as ``embedding_bag``'s sum adds them."""
    grad_rows, first_row, order, starts = (t.contiguous() for t in (grad_rows, first_row, order, starts))
    u = grad_rows.shape[1]
    out = torch.empty(num_unique, k * u, dtype=grad_rows.dtype)
    library().dyn_sum_bags(ptr(grad_rows), u, ptr(first_row), ptr(order), ptr(starts), num_unique, order.numel(), k * u, ptr(out), threads())
    return out
