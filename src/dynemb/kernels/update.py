"""One optimizer step on a store's rows, by row id, with the gradient summed per key.

U rows, D embedding columns, S optimizer state columns. The plain-torch twin is
``update_rows_torch`` (gather, :meth:`dynemb.optim.RowOptimizer.update_rows`, screen, scatter);
``update_rows_native`` runs ``update.cpp``: one pass over the rows in the store, float32 rows
only, for the optimizers whose ``native_update`` describes their step.

``update_rows_from_bags_native`` / ``update_rows_from_bags_torch``: the same step with each
row's gradient summed from a bag collection's concat gradient (as
:func:`dynemb.kernels.pool.sum_bags_native` sums it) in the same pass, so that no [U, D]
gradient is written and read back.
"""

from __future__ import annotations

import torch

from dynemb.kernels import UPDATE_KINDS as KINDS
from dynemb.kernels import library, ptr, threads
from dynemb.kernels.pool import sum_bags_torch


def _step_args(spec: dict) -> tuple:
    """The kernels' step arguments from an optimizer's ``native_update`` spec: kind, lr,
    weight_decay, eps, a, b, c."""
    return (KINDS[spec["kind"]], spec["lr"], *(spec.get(name, 0.0) for name in ("weight_decay", "eps", "a", "b", "c")))


def update_rows_native(table: torch.Tensor, rows: torch.Tensor, grads: torch.Tensor, spec: dict, *, check: bool) -> torch.Tensor | None:
    """Update ``table``'s rows ``rows`` in place; rows whose gradient or result is not finite
    are left unchanged with ``check``.

    Args:
        table (Tensor[float32]): [R, D+S] contiguous, the store's rows.
        rows (Tensor[int64]): [U] distinct row ids.
        grads (Tensor[float32]): [U, D] the gradient summed per key (rows may be strided).
        spec: the optimizer's step, from ``RowOptimizer.native_update(step)``: ``kind`` (a key of
            :data:`KINDS`), ``lr``, ``weight_decay``, ``eps``, and ``a``, ``b``, ``c`` (Adagrad:
            a = the decayed lr; Adam: a = 1 - beta1, b = 1 - beta2, c = the step size).
        check: flag non-finite rows (nonfinite_grads="skip"); without it every row is written.
    Returns:
        Tensor[bool] [U] of the rows left unchanged, or None (none, or ``check`` off).
    """
    if table.is_cuda:
        from dynemb.kernels.gpu.update import update_rows_triton

        return update_rows_triton(table, rows, grads, spec, check=check)
    n, D = grads.shape
    rows = rows.contiguous()
    if grads.stride(1) != 1:
        grads = grads.contiguous()
    bad = torch.empty(n, dtype=torch.bool) if check else None
    n_bad = library().dyn_rows_update(
        ptr(table),
        table.shape[1],
        ptr(rows),
        ptr(grads),
        grads.stride(0),
        n,
        D,
        *_step_args(spec),
        ptr(bad),
        threads(),
    )
    return bad if n_bad else None


def update_rows_torch(optimizer, table: torch.Tensor, rows: torch.Tensor, grads: torch.Tensor, step: int, *, check: bool) -> torch.Tensor | None:
    """The plain-torch twin of :func:`update_rows_native`: gather the rows, run ``optimizer``'s
    :meth:`update_rows` (a :class:`dynemb.optim.RowOptimizer`) at ``step``, write back the rows
    that stayed finite (all of them without ``check``). Same arguments and result."""
    D = grads.shape[1]
    data = table.index_select(0, rows)
    optimizer.update_rows(data, D, grads, step)
    bad = None
    if check:
        bad = ~(torch.isfinite(grads).all(1) & torch.isfinite(data).all(1))
        keep = (~bad).nonzero().squeeze(1)
        rows, data = rows.index_select(0, keep), data.index_select(0, keep)
        bad = bad if bool(bad.any()) else None
    table.index_copy_(0, rows, data)
    return bad


def update_rows_from_bags_native(
    table: torch.Tensor,
    rows: torch.Tensor,
    grad_rows: torch.Tensor,
    first_row: torch.Tensor,
    order: torch.Tensor,
    starts: torch.Tensor,
    k: int,
    spec: dict,
    *,
    check: bool,
) -> torch.Tensor | None:
    """:func:`update_rows_native` with row u's gradient the sum of ``k`` unit rows of
    ``grad_rows`` at each of its ids (:func:`dynemb.kernels.pool.sum_bags_native`'s sum, the
    same floats in the same order), in one pass: bitwise ``update_rows_native(table, rows,
    sum_bags_native(grad_rows, first_row, order, starts, U, k), spec, check=check)``.

    Args:
        table (Tensor[float32]): [R, D+S] contiguous, the store's rows; D = k * u.
        rows (Tensor[int64]): [U] distinct row ids.
        grad_rows (Tensor[float32]): [B * K, u] the concat gradient in unit rows.
        first_row (Tensor[int64]): [N] the unit row where each id's slice begins.
        order (Tensor[int64]): [N] the ids grouped by row; starts (Tensor[int64]): [U].
        k: unit rows per id; spec, check: as :func:`update_rows_native`.
    Returns:
        Tensor[bool] [U] of the rows left unchanged, or None (none, or ``check`` off).
    """
    grad_rows, first_row, order, starts, rows = (t.contiguous() for t in (grad_rows, first_row, order, starts, rows))
    n, u = rows.numel(), grad_rows.shape[1]
    if table.is_cuda or starts.numel() != n or first_row.numel() != order.numel():
        raise ValueError(
            f"update_rows_from_bags_native: a CPU table, one start per row and one first row per id "
            f"(table on {table.device}, {n} rows, {starts.numel()} starts, {order.numel()} ids, {first_row.numel()} first rows)"
        )
    bad = torch.empty(n, dtype=torch.bool) if check else None
    n_bad = library().dyn_rows_update_bags(
        ptr(table),
        table.shape[1],
        ptr(rows),
        ptr(grad_rows),
        u,
        ptr(first_row),
        ptr(order),
        ptr(starts),
        n,
        order.numel(),
        k * u,
        *_step_args(spec),
        ptr(bad),
        threads(),
    )
    return bad if n_bad else None


def update_rows_from_bags_torch(
    optimizer,
    table: torch.Tensor,
    rows: torch.Tensor,
    grad_rows: torch.Tensor,
    first_row: torch.Tensor,
    order: torch.Tensor,
    starts: torch.Tensor,
    k: int,
    step: int,
    *,
    check: bool,
) -> torch.Tensor | None:
    """The plain-torch twin of :func:`update_rows_from_bags_native`: the per-row sums by
    :func:`dynemb.kernels.pool.sum_bags_torch`, then :func:`update_rows_torch`."""
    grads = sum_bags_torch(grad_rows, first_row, order, starts, rows.numel(), k)
    return update_rows_torch(optimizer, table, rows, grads, step, check=check)
