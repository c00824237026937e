"""Row helpers of the functional layer: non-finite screening, leaving rows, initial state.

U unique keys in a call, E keys that leave the table, D embedding dim, S optimizer state columns.

The engine itself is :class:`dynemb.nn.engine.Engine` .
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

from dynemb.kernels.init import init_rows_native
from dynemb.kernels.update import update_rows_native
from dynemb.optim.base import RowOptimizer
from dynemb.storage.base import RowStore
from dynemb.storage.device_store import DeviceRowStore
from dynemb.table.base import IndexResult
from dynemb.types import InitKind, NonFiniteGrads
from dynemb.workspace import Workspace


def nonfinite_rows(values: torch.Tensor) -> torch.Tensor | None:
    """Rows [K] of ``values`` [K, W] holding NaN or inf, or None if there are none.

    The sum is finite whenever every value is (a sum of finite values only overflows near
    float max, and then the exact check finds nothing): one reduction, no [K, W] temporary, and
    one host sync because the caller must know.
    """
    if bool(torch.isfinite(values.sum())):
        return None
    bad = ~torch.isfinite(values).all(1)
    return bad if bool(bad.any()) else None


def warn_nonfinite(keys: torch.Tensor, values: torch.Tensor, what: str) -> None:
    """Warn when rows ``values`` [K, W] of ``keys`` [K] hold NaN or inf; ``what`` names them
    (a table being saved or loaded). Such rows are kept as they are: whatever a save wrote, a
    load reads (docs/design/0020-nonfinite-rows.md)."""
    bad = nonfinite_rows(values)
    if bad is not None:
        warn_nonfinite_keys(keys[bad], what)


def warn_nonfinite_keys(bad: torch.Tensor, what: str) -> None:
    """The warning of :func:`warn_nonfinite` for the keys ``bad`` [n] whose rows are non-finite."""
    shown = bad[:8].tolist()
    warnings.warn(
        f"{what}: the rows of {bad.numel()} key(s) {shown}{' ...' if bad.numel() > 8 else ''} hold NaN or inf; "
        "they are kept as they are (erase or insert them to replace them)",
        RuntimeWarning,
        stacklevel=3,
    )


def _shown(keys: torch.Tensor) -> str:
    return f"{keys.numel()} key(s) {keys[:8].tolist()}{' ...' if keys.numel() > 8 else ''}"


def update_rows(optimizer: RowOptimizer, data: torch.Tensor, D: int, grads: torch.Tensor, step: int, native: bool) -> None:
    """One optimizer step at ``step`` on rows ``data`` ([U, D+S], in place) with ``grads``
    ([U, D]): by the compiled kernel on a native table where it knows the optimizer and the
    rows are float32 (so that every store of a native table gets the same arithmetic), else by
    :meth:`RowOptimizer.update_rows`."""
    spec = optimizer.native_update(step) if native and data.dtype == grads.dtype == torch.float32 else None
    if spec is None:
        optimizer.update_rows(data, D, grads, step)
    elif data.is_contiguous():
        update_rows_native(data, torch.arange(data.shape[0], device=data.device), grads, spec, check=False)
    else:
        work = data.contiguous()
        update_rows_native(work, torch.arange(work.shape[0], device=data.device), grads, spec, check=False)
        data.copy_(work)


def update_by_step(
    optimizer: RowOptimizer, data: torch.Tensor, D: int, grads: torch.Tensor, steps: list[int], segments: torch.Tensor | None, native: bool
) -> None:
    """:func:`update_rows` with each row at its table's step count (``steps``, one per table;
    ``segments`` [U] the table of each row, None for one table). Tables at different counts
    (restored apart) update apart."""
    if len(set(steps)) == 1:
        update_rows(optimizer, data, D, grads, steps[0], native)
        return
    step_of = torch.tensor(steps, device=data.device).index_select(0, segments)
    for step in sorted(set(steps)):
        sel = (step_of == step).nonzero().squeeze(1)
        if sel.numel():
            part = data.index_select(0, sel)
            update_rows(optimizer, part, D, grads.index_select(0, sel), step, native)
            data.index_copy_(0, sel, part)


def sum_per_key(
    grad: torch.Tensor, inverse: torch.Tensor, grouping: tuple[torch.Tensor, torch.Tensor] | None, workspace: Workspace, name: str, U: int
) -> torch.Tensor:
    """The gradient of N ids [N, D] summed per key [U, D] by ``inverse`` [N] (each id's key), or by
    the de-duplication's ``grouping`` (order [N], starts [U]) where it gave one: one parallel
    gather-sum per key (embedding_bag; a compiled twin writing into a kept buffer was slower,
    perf-log 2026-11-26). Without a grouping the sum goes into ``workspace``'s buffer ``name``
    (a fresh [U, D] page-faults on CPU), which the caller consumes before the next call."""
    if grouping is not None:
        order, starts = grouping
        return F.embedding_bag(order, grad, starts, mode="sum")
    return workspace.get(name, U, (grad.shape[1],), grad.dtype).zero_().index_add_(0, inverse, grad)


def native_update_spec(native: bool, optimizer: RowOptimizer, store: RowStore, grads, steps: set[int], policy: NonFiniteGrads) -> dict | None:
    """The compiled update kernel's step when it can update this batch's rows in the store in
    place (:func:`dynemb.kernels.update.update_rows_native`), else None (then the rows are
    gathered, updated by :func:`update_by_step` and written back): a native table whose rows
    are one float32 tensor (no tiers, no cache), one step count, an optimizer the kernel knows,
    and nonfinite_grads ``skip`` or ``apply`` (``raise`` checks every row before writing any,
    which the one-pass kernel does not). Only ``grads.dtype`` is read (a tensor [U, D] or a
    :class:`dynemb.nn.units.BagGradients`)."""
    if not native or len(steps) != 1 or policy is NonFiniteGrads.RAISE or type(store) is not DeviceRowStore:
        return None
    if store.data.dtype != torch.float32 or grads.dtype != torch.float32 or not store.data.is_contiguous():
        return None
    return optimizer.native_update(next(iter(steps)))


def init_rows_in_place(engine, rows: torch.Tensor, keys: torch.Tensor, segments: torch.Tensor | None) -> bool:
    """Write the initial rows of new keys [n] (of tables ``segments`` [n]) at row ids [n] by
    the compiled kernel, straight into the store (:func:`dynemb.kernels.init.init_rows_native`),
    and say so; False (nothing written) where it cannot: a table not native, rows not one
    float32 tensor, an initializer other than per-key uniform, or an optimizer state that does
    not start at a constant. The rows are bitwise those :meth:`Engine.new_rows` gives."""
    store, optimizer = engine.store, engine.optimizer
    if not engine.index.compiled or type(store) is not DeviceRowStore or store.data.dtype != torch.float32 or not store.data.is_contiguous():
        return False
    state_value = 0.0 if optimizer is None else optimizer.initial_state_value()
    inits = [engine.initializers[members[0]] for members in engine.init_groups]
    if state_value is None or any(i.config.kind is not InitKind.UNIFORM or not i.config.per_key for i in inits):
        return False
    for members, init in zip(engine.init_groups, inits):
        sel = None
        if len(inits) > 1:
            sel = torch.isin(segments, torch.tensor(members, device=keys.device)).nonzero().squeeze(1)
        part_rows, part_keys = (rows, keys) if sel is None else (rows.index_select(0, sel), keys.index_select(0, sel))
        init_rows_native(store.data, part_rows, part_keys, engine.embedding_dim, init.seed, init.low, init.high, state_value)
    return True


def screen_update(
    keys: torch.Tensor,
    grads: torch.Tensor,
    data: torch.Tensor,
    policy: NonFiniteGrads,
    *,
    agree: Callable[[bool], bool] | None = None,
    tables: Callable[[torch.Tensor], list[str]] | None = None,
) -> torch.Tensor | None:
    """The ``nonfinite_grads`` policy on one update, checked after the optimizer updated ``data``
    (a gathered copy, not yet written back): a row is bad when its gradient or its updated row
    (embedding or optimizer state) holds NaN or inf (docs/design/0020-nonfinite-rows.md).

    Args:
        keys (Tensor[int64]): [U] keys of the rows (named by the error).
        grads (Tensor): [U, D] their gradients.
        data (Tensor): [U, D+S] their rows after the update.
        policy: ``apply``: no check, None. ``skip``: the bad rows, or None. ``raise``:
            FloatingPointError naming the keys when any row is bad (nothing was written yet).
        agree: a sharded table's ranks under ``raise``: called with whether this rank found a
            bad row, returns whether any rank did, so that every rank raises together.
        tables: names of the tables of the bad rows (a collection group), for the error.
    Returns:
        Tensor[bool] [U] of the rows not to write, or None when all may be written.
    """
    if policy is NonFiniteGrads.APPLY:
        return None
    # One reduction over gradient and result and one host sync, the sync the gradient check
    # alone made before: the sum is finite whenever every value is (finite values whose sum
    # overflows send it to the exact check, which then finds nothing).
    bad = grad_bad = None
    if not bool(torch.isfinite(grads.sum() + data.sum())):
        grad_bad = ~torch.isfinite(grads).all(1)
        bad = grad_bad | ~torch.isfinite(data).all(1)
        bad = bad if bool(bad.any()) else None
    if policy is NonFiniteGrads.RAISE:
        if agree is not None and agree(bad is not None) and bad is None:
            raise FloatingPointError(
                "non-finite gradient or update for keys owned by another rank (it names them): "
                "no row of this batch was updated on any rank (nonfinite_grads='raise')"
            )
        if bad is not None:
            parts = []
            if bool((bad & grad_bad).any()):
                parts.append(f"non-finite gradient for {_shown(keys[bad & grad_bad])}")
            if bool((bad & ~grad_bad).any()):
                parts.append(
                    f"the update would make the rows of {_shown(keys[bad & ~grad_bad])} non-finite "
                    "(finite gradients: the row or its optimizer state overflowed, or already held NaN or inf)"
                )
            where = "" if tables is None else f" of tables {tables(bad)}"
            raise FloatingPointError(f"{' and '.join(parts)}{where}: no row of this batch was updated (nonfinite_grads='raise')")
    return bad


def leaving_contents(store: RowStore, embedding_dim: int, result: IndexResult) -> dict[str, torch.Tensor]:
    """Contents of the rows of keys leaving the index (read before anything overwrites them):
    ``embeddings`` [E, D], ``optimizer_state`` [E, S], ``scores`` [E]."""
    data = store.gather(result.evicted_rows)
    D = embedding_dim
    return {"embeddings": data[:, :D], "optimizer_state": data[:, D:], "scores": result.evicted_scores}


def with_initial_state(embeddings: torch.Tensor, optimizer: RowOptimizer | None, width: int) -> torch.Tensor:
    """Whole new rows [n, D+S] (``width`` columns): the embeddings [n, D] and the optimizer's
    initial state; the embeddings themselves when there is no state."""
    D = embeddings.shape[1]
    if width == D:
        return embeddings
    rows = torch.empty(embeddings.shape[0], width, dtype=embeddings.dtype, device=embeddings.device)
    rows[:, :D] = embeddings
    optimizer.init_state(rows[:, D:])
    return rows


def device_memory(device: torch.device) -> int | None:
    """Total memory of the device in bytes, or None if unknown."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
