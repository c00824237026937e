"""Initial rows of new keys, written into the store: per-key embeddings and the optimizer's
initial state.

n keys, D embedding columns, S state columns. ``init_rows_torch`` is the plain-torch twin (the
table's :class:`dynemb.storage.initializers.RowInitializer`, the optimizer's ``init_state``,
one scatter); ``init_rows_native`` runs ``init.cpp`` for the default initializer (per-key
uniform) and a constant initial state, bitwise the same rows in one pass.
"""

from __future__ import annotations

import functools

import torch

from dynemb.hashing import init_salt_and_columns
from dynemb.kernels import library, ptr, threads


def init_rows_torch(table: torch.Tensor, rows: torch.Tensor, embeddings: torch.Tensor, optimizer) -> None:
    """Write embeddings [n, D] and ``optimizer``'s initial state into ``table``'s rows [n]."""
    D = embeddings.shape[1]
    new = torch.empty(rows.numel(), table.shape[1], dtype=table.dtype, device=table.device)
    new[:, :D] = embeddings
    if table.shape[1] > D:
        optimizer.init_state(new[:, D:])
    table.index_copy_(0, rows, new)


@functools.lru_cache(maxsize=64)
def _salt_and_columns(seed: int, columns: int) -> tuple[int, torch.Tensor]:
    """:func:`init_salt_and_columns` on CPU, made once per (seed, columns) (read-only)."""
    with torch.inference_mode(False):
        return init_salt_and_columns(seed, columns)


def init_rows_native(table: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor, D: int, seed: int, low: float, high: float, state_value: float) -> None:
    """Write the per-key uniform rows of keys [n] on [low, high) (seed ``seed``) and the
    constant ``state_value`` in every state column into ``table`` ([R, D+S] float32,
    contiguous) at ``rows`` [n] (distinct row ids, as new keys' rows always are, in any order:
    the kernel writes them in ascending row order)."""
    if table.is_cuda:
        from dynemb.kernels.gpu.init import init_rows_triton

        return init_rows_triton(table, rows, keys, D, seed, low, high, state_value)
    salt, cols = _salt_and_columns(seed, (D + 1) // 2)
    rows, keys = rows.contiguous(), keys.contiguous()
    n = rows.numel()
    scratch = torch.empty(2 * n, dtype=torch.int64)  # the kernel's row order
    library().dyn_init_rows(ptr(table), table.shape[1], ptr(rows), ptr(keys), n, D, salt, ptr(cols), low, high - low, state_value, ptr(scratch), threads())
