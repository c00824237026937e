"""Compiled CPU kernels for the hot loops, each beside its plain-torch twin (docs/design/0037).

One file per operation: ``locate`` (find keys in the index), ``upsert`` (found keys' scores,
missing keys in priority order), ``place`` (new keys into free slots), ``insert`` (a clocked
call's new keys placed, given row ids and put into its result in one pass), ``dedup`` (a batch's
distinct keys, inverse, counts, grouping), ``init`` (new rows into the store), ``update`` (the
optimizer step on the store's rows). Each ``.py`` holds (or names) the plain-torch twin (the CPU
oracle, and what runs on other devices or where the kernels cannot build) and the launcher of
the ``.cpp`` of the same name. A table chooses with its ``backend`` config field:

- ``"torch"``: plain torch everywhere.
- ``"native"``: the compiled kernels: C++ on CPU tables, Triton (:mod:`dynemb.kernels.gpu`:
  locate, update, init) on CUDA tables; ValueError if they cannot run.
- ``"auto"`` (default): the kernels where they run (one warning, once, where they do not);
  the environment variable ``DYNEMB_BACKEND`` (``torch`` or ``native``) decides for "auto".

Tables on other devices run plain torch under every backend.
"""

from __future__ import annotations

import ctypes
import os
import threading
import warnings

import torch

from dynemb.types import Backend

ENV = "DYNEMB_BACKEND"
# The optimizers the update kernels (update.cpp, gpu/update.py) know, by the kind code their
# RowOptimizer.native_update() gives.
UPDATE_KINDS = {"sgd": 0, "adagrad": 1, "rowwise_adagrad": 2, "adam": 3}

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_failure: str | None = None
# The kinds of kernel (CPU, Triton) whose fallback has been warned about, each once.
_warned: set[str] = set()


def check_backend(value, name: str = "backend") -> Backend:
    """The :class:`dynemb.Backend` ``value`` names, else ValueError naming ``name`` and the value."""
    return Backend.parse(value, name)


def _env_backend() -> Backend:
    return check_backend(os.environ.get(ENV) or "auto", f"environment variable {ENV}")


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, built on first use; None when it cannot be built."""
    global _library, _failure
    with _lock:
        if _library is None and _failure is None:
            from dynemb.kernels.build import build

            try:
                _library = build()
            except Exception as error:  # any build failure: the tables fall back to torch
                _failure = f"{type(error).__name__}: {str(error).strip().splitlines()[-1] if str(error).strip() else ''}"
        return _library


def _resolve(backend: Backend | str) -> tuple[bool, bool]:
    """(whether ``backend`` asks for compiled kernels, whether it requires them)."""
    backend = check_backend(backend)
    if backend is Backend.TORCH:
        return False, False
    if backend is Backend.AUTO:
        env = _env_backend()
        return env is not Backend.TORCH, env is Backend.NATIVE
    return True, True


def _unavailable(required: bool, what: str, failure: str | None, fallback: str) -> None:
    """Raise (``required``) or warn once that the kernels ``what`` cannot run."""
    if required:
        raise ValueError(f"backend='native': {what} cannot run here ({failure}); use backend='torch' or 'auto'")
    if what not in _warned:
        _warned.add(what)
        warnings.warn(f"dynemb: {what} unavailable ({failure}); running {fallback}", RuntimeWarning, stacklevel=4)


def uses_native(backend: Backend | str, device: torch.device | str) -> bool:
    """Whether a table of ``backend`` on ``device`` runs the compiled CPU kernels."""
    wanted, required = _resolve(backend)
    if not wanted or torch.device(device).type != "cpu":
        return False
    if library() is not None:
        return True
    _unavailable(required, "dynemb's compiled CPU kernels", _failure, "the plain-torch kernels")
    return False


def uses_triton(backend: Backend | str, device: torch.device | str) -> bool:
    """Whether a table of ``backend`` on ``device`` runs the Triton kernels
    (:mod:`dynemb.kernels.gpu`): CUDA tables whose backend asks for compiled kernels, where
    Triton imports."""
    wanted, required = _resolve(backend)
    if not wanted or torch.device(device).type != "cuda":
        return False
    from dynemb.kernels.gpu import failure

    if failure() is None:
        return True
    _unavailable(required, "dynemb's Triton kernels", failure(), "plain torch on the GPU")
    return False


def ptr(t: torch.Tensor | None) -> int | None:
    """A tensor's data address for a kernel argument (None for an absent optional tensor)."""
    return None if t is None else t.data_ptr()


def slot_step(table: torch.Tensor) -> int:
    """Elements from one slot's entry to the next in a [B, W] table of the index: 1 for a table
    of its own, more where the slots are packed (a view into the packed slots, docs/design/0041).
    The kernels address slot p at ``p * step``, so the view must be flat-addressable."""
    step = table.stride(1)
    if table.shape[0] > 1 and table.stride(0) != step * table.shape[1]:
        raise ValueError(f"index table of shape {tuple(table.shape)} and strides {table.stride()}: its slots are not evenly spaced")
    return step


def slot_args(table_keys: torch.Tensor, tags: torch.Tensor, table_scores: torch.Tensor) -> tuple:
    """The arguments by which several kernels take the index's slots, in their order: the keys'
    address and slot step, the tags', the scores', W, B, the scores' width and slot step."""
    return (
        ptr(table_keys),
        slot_step(table_keys),
        ptr(tags),
        ptr(table_scores),
        table_keys.shape[1],
        table_keys.shape[0],
        table_scores.element_size(),
        slot_step(table_scores),
    )


def move_args(table_keys: torch.Tensor, tags: torch.Tensor, table_rows: torch.Tensor, table_scores: torch.Tensor) -> tuple:
    """The index's slots as the kernels that move keys between them take them, in their order:
    the keys' address and slot step, the tags', the row ids' address, width and slot step, the
    scores' the same, W, B."""
    return (
        ptr(table_keys),
        slot_step(table_keys),
        ptr(tags),
        ptr(table_rows),
        table_rows.element_size(),
        slot_step(table_rows),
        ptr(table_scores),
        table_scores.element_size(),
        slot_step(table_scores),
        table_keys.shape[1],
        table_keys.shape[0],
    )


def threads() -> int:
    """The thread count the kernels may use: torch's intra-op setting."""
    return torch.get_num_threads()
