"""Scratch buffers kept between calls for the large temporaries of hot paths.

On CPU a fresh large tensor pays a page fault per page on first touch (glibc hands big blocks
back to the kernel when freed), so hot paths write their temporaries into views of buffers that
grow as needed and are reused by the next call.

Bound: a buffer shrinks back once it has been more than twice as large as every request of the
last ``SHRINK_WINDOW`` requests for it, so one outsized batch holds its scratch memory for at
most that many further calls. Buffers are created with inference mode off, so a lookup under
``torch.inference_mode()`` never leaves an inference tensor behind for training to write into.

A Workspace is not thread-safe: its owner (a table, under the table's lock) serialises calls.
"""

from __future__ import annotations

import ctypes
import sys

import torch

SHRINK_WINDOW = 64
_POISON = False


def set_poison(enabled: bool) -> None:
    """Fill every new scratch buffer (and new store rows) with NaN / a loud integer, so code that
    reads a value it never wrote fails its tests. For tests only: it costs a write per buffer."""
    global _POISON
    _POISON = bool(enabled)


def poison_enabled() -> bool:
    return _POISON


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` with NaN (floats), True (bool) or a loud constant (integers) if poisoning is on."""
    if _POISON and t.numel():
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype == torch.bool:
            t.fill_(True)
        else:
            loud = {torch.int64: -0x5A5A5A5A5A5A5A5A, torch.int32: -0x5A5A5A5A}
            t.fill_(loud.get(t.dtype, 0x5A))
    return t


HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # Linux's advice number, the same on every architecture


def _libc_madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


_madvise = _libc_madvise()


def huge_pages_zeros(shape: tuple[int, ...], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.zeros`` whose memory, where large and on CPU, Linux is asked to back with 2 MiB
    pages (``madvise(MADV_HUGEPAGE)`` on the 2 MiB-aligned part, before the memory is first
    touched): for tables read at random, such as the index's slots, whose 4 KiB pages would
    miss the TLB on nearly every access (docs/design/0041). Elsewhere, or where the system
    refuses (transparent huge pages off), plain memory."""
    return _huge_pages(torch.empty(shape, dtype=dtype, device=device)).zero_()


def _huge_pages(t: torch.Tensor) -> torch.Tensor:
    """``t``, fresh and untouched, with Linux asked to back the 2 MiB-aligned part of its memory
    with 2 MiB pages where it is on CPU and large (see huge_pages_zeros)."""
    nbytes = t.numel() * t.element_size()
    if _madvise is not None and t.device.type == "cpu" and nbytes >= 2 * HUGE_PAGE:
        first = t.data_ptr()
        start = (first + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
        end = (first + nbytes) & ~(HUGE_PAGE - 1)
        if end > start:
            _madvise(start, end - start, _MADV_HUGEPAGE)  # EINVAL where THP is off: nothing to do
    return t


def empty(shape: tuple[int, ...], *, dtype: torch.dtype, device: torch.device, huge_pages: bool = False) -> torch.Tensor:
    """``torch.empty`` outside inference mode, poisoned in tests: for tensors a table keeps;
    ``huge_pages``: on 2 MiB pages where large (see huge_pages_zeros), for buffers read at
    random and allocated once (a store that fills row by row would fault 2 MiB at a time)."""
    with torch.inference_mode(False):
        t = torch.empty(shape, dtype=dtype, device=device)
        return poison_(_huge_pages(t) if huge_pages else t)


class Workspace:
    """Named buffers on one device; ``get`` returns a [rows, *shape] view valid until the next
    ``get`` of the same name."""

    def __init__(self, device: torch.device):
        self.device = device
        # name -> [buffer, largest request in the current window, requests in the window]
        self._buffers: dict[str, list] = {}

    def get(self, name: str, rows: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        entry = self._buffers.get(name)
        if entry is None or tuple(entry[0].shape[1:]) != shape or entry[0].dtype != dtype:
            entry = self._buffers[name] = [None, 0, 0]
        buf = entry[0]
        entry[1] = max(entry[1], rows)
        entry[2] += 1
        if buf is not None and entry[2] >= SHRINK_WINDOW:
            if buf.shape[0] > 2 * entry[1]:
                buf = None
            entry[1] = entry[2] = 0
        if buf is None or buf.shape[0] < rows:
            # The kernels' scratch is read and written at random (0041, addendum).
            buf = entry[0] = empty((max(rows, 1), *shape), dtype=dtype, device=self.device, huge_pages=True)
        elif _POISON:
            poison_(buf[:rows])
        # The whole buffer when it is the size asked for (a view costs a tensor operation).
        return buf if buf.shape[0] == rows else buf[:rows]

    def nbytes(self) -> int:
        """Bytes held by all buffers."""
        return sum(e[0].numel() * e[0].element_size() for e in self._buffers.values() if e[0] is not None)

    def to(self, device: torch.device) -> None:
        """Drop every buffer and allocate on ``device`` from now on."""
        self.device = device
        self._buffers.clear()


# Number of C++ references to a tensor's storage (tensors, views, storage objects); private to
# torch, so recycling is off where this torch lacks it.
_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _storage_refs(t: torch.Tensor) -> tuple[int, int]:
    """(C++ owners of ``t``'s storage, Python references to its storage object), both counted
    with one temporary storage object alive."""
    st = t.untyped_storage()
    return _storage_use_count(st._cdata), sys.getrefcount(st)


def _unshared_refs() -> tuple[int, int] | None:
    """What an unshared block shows: itself and the temporary storage object (C++), and the
    temporary's own Python references. Measured, as it depends on torch's object bookkeeping:
    on a storage whose Python object is new and on one whose object was made and dropped before
    (a recycled block's state); if they differ, recycling is off (never reuse on a guess)."""
    if _storage_use_count is None:
        return None
    t = torch.empty(1)
    first, again = _storage_refs(t), _storage_refs(t)
    return first if first == again else None


_UNSHARED = _unshared_refs()


class Recycler:
    """Output tensors handed to callers, whose memory is reused once nobody can read them.

    ``get`` returns a fresh tensor (not a view) on a block kept here. At the next ``get`` the
    block is reused only if nothing else can reach its memory: no tensor, view, autograd node,
    numpy array or DLPack capsule (they own the storage in C++), no storage object held in
    Python (``untyped_storage()``, ``storage()``, a saved-tensor hook keeping one), and the
    memory was not moved to shared memory (sent to another process); otherwise a new block is
    made. On CPU this spares a large output the page faults of fresh memory each step. CUDA's
    caching allocator already reuses memory, so there ``get`` allocates plainly.

    Not thread-safe: its owner serialises calls (a collection, under its lock).
    """

    def __init__(self):
        self._blocks: dict[str, torch.Tensor] = {}

    def _reusable(self, block: torch.Tensor | None, n: int, dtype: torch.dtype) -> bool:
        if block is None or block.dtype != dtype or not n <= block.numel() <= 2 * n:
            return False
        st = block.untyped_storage()
        if st.nbytes() < n * block.element_size() or st.is_shared():
            return False
        del st
        return _storage_refs(block) == _UNSHARED

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if device.type != "cpu" or _UNSHARED is None:
            return torch.empty(shape, dtype=dtype, device=device)
        n = 1
        for s in shape:
            n *= s
        block = self._blocks.get(name)
        if not self._reusable(block, n, dtype):
            # A new block each time one is held: drop the old one so it is freed with its users.
            with torch.inference_mode(False):
                block = self._blocks[name] = torch.empty(n, dtype=dtype, device=device)
        poison_(block[:n])
        return torch.empty(0, dtype=dtype, device=device).set_(block.untyped_storage(), 0, shape)

    def clear(self) -> None:
        self._blocks.clear()


class writable:
    """Context for code that writes tensors a table keeps: turns inference mode off (and grad
    mode off with it) when the caller is under ``torch.inference_mode()``, so kept tensors never
    become inference tensors. Outside inference mode it does nothing."""

    def __enter__(self):
        self._guards = []
        if torch.is_inference_mode_enabled():
            # inference_mode(False) alone re-enables grad mode; no_grad keeps it off.
            self._guards = [torch.inference_mode(False), torch.no_grad()]
            for g in self._guards:
                g.__enter__()
        return self

    def __exit__(self, *exc):
        for g in reversed(self._guards):
            g.__exit__(*exc)
        return False
