"""Row store in a memory-mapped scratch file: a table's disk tier.

n rows in a call, D + S row width, C capacity.

The file is scratch, never a checkpoint: it is created fresh per store, unlinked as soon as it
is mapped (the kernel frees its blocks when the mapping goes, at garbage collection, at exit or
after a kill -9), and never read back; after a restart the table is what its last checkpoint
says. Files of dead processes left in the directory (a crash between create and unlink) are
removed when the next store is created there. docs/design/0032-tiers.md.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil

import torch

from dynemb.config import ROW_DTYPES, resolve_device

# dynemb-rows-<pid>-<n>.bin: the pid tells a live process's file from a dead one's.
_NAME = re.compile(r"^dynemb-rows-(\d+)-\d+\.bin$")
_serial = itertools.count()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_files(directory: str) -> list[str]:
    """Remove the scratch row files of dead processes in ``directory``; returns their names."""
    removed = []
    for name in os.listdir(directory):
        match = _NAME.match(name)
        if match and int(match.group(1)) != os.getpid() and not _alive(int(match.group(1))):
            try:
                os.unlink(os.path.join(directory, name))
                removed.append(name)
            except FileNotFoundError:
                pass
    return removed


class DiskRowStore:
    """Rows ``[embedding | optimizer state]`` in a [C, D + S] tensor mapped from a scratch file
    under ``path`` (``torch.from_file(shared=True)``: pages live in the page cache, not in the
    process's anonymous memory, and the kernel writes them back as it needs the memory).

    Args:
        width: D + S, columns per row.
        capacity: C, most rows.
        path: directory of the scratch file (must exist).
        dtype: of the rows.
        device: where ``gather`` returns rows and ``scatter`` takes them (the file is on the host).
    """

    def __init__(self, width: int, capacity: int, *, path: str, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        for name, value in (("width", width), ("capacity", capacity)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r}: must be an int >= 1")
        if dtype not in ROW_DTYPES:
            raise ValueError(f"dtype={dtype}: rows must be one of {', '.join(str(d) for d in ROW_DTYPES)}")
        if not isinstance(path, (str, os.PathLike)) or not os.path.isdir(path):
            raise ValueError(f"path={path!r}: the disk tier's directory does not exist")
        self.width, self.capacity, self.dtype = width, capacity, dtype
        self.device = resolve_device(device)
        self.path = os.fspath(path)
        self.reserved = 0
        remove_stale_files(self.path)
        size = capacity * width * torch.empty(0, dtype=dtype).element_size()
        free = shutil.disk_usage(self.path).free
        if size > free:
            raise ValueError(f"path={self.path!r}: a disk tier of {capacity} rows x {width} {dtype} columns needs {size:,} bytes, {free:,} are free there")
        file = os.path.join(self.path, f"dynemb-rows-{os.getpid()}-{next(_serial)}.bin")
        with open(file, "xb") as f:
            # Sparse: blocks are allocated as rows are written.
            f.truncate(size)
        try:
            with torch.inference_mode(False):
                self.data = torch.from_file(file, shared=True, size=capacity * width, dtype=dtype).view(capacity, width)
        finally:
            os.unlink(file)

    def reserve(self, n: int) -> None:
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"n={n!r}: must be an int >= 0")
        if n > self.capacity:
            raise ValueError(f"n={n}: more rows than the store's capacity {self.capacity}")
        self.reserved = max(self.reserved, n)

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        out = self.data.index_select(0, rows.cpu())
        return out if self.device.type == "cpu" else out.to(self.device)

    def scatter(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        if values.dim() != 2 or values.shape[1] > self.width or values.dtype != self.dtype:
            raise ValueError(
                f"values: [{values.shape[0]}, {values.shape[1] if values.dim() == 2 else '?'}] {values.dtype}, must be [n, <= {self.width}] {self.dtype}"
            )
        rows, values = rows.cpu(), values.cpu()
        if rows.numel():
            low, high = (int(v) for v in torch.aminmax(rows))
            if low < 0 or high >= self.reserved:
                raise IndexError(f"rows: ids must lie in [0, {self.reserved}) (reserved rows), got [{low}, {high}]")
        with torch.inference_mode(False):
            if values.shape[1] == self.width:
                self.data.index_copy_(0, rows, values)
            else:
                self.data[:, : values.shape[1]].index_copy_(0, rows, values)

    def _copy_into(self, other: DiskRowStore, chunk_rows: int = 1 << 16) -> DiskRowStore:
        other.reserve(self.reserved)
        for lo in range(0, self.reserved, chunk_rows):
            hi = min(self.reserved, lo + chunk_rows)
            with torch.inference_mode(False):
                other.data[lo:hi] = self.data[lo:hi].to(other.dtype)
        return other

    def to(self, device: torch.device, dtype: torch.dtype) -> DiskRowStore:
        """Rows stay in a file; another dtype copies them into a new one."""
        self.device = resolve_device(device)
        if dtype == self.dtype:
            return self
        return self._copy_into(DiskRowStore(self.width, self.capacity, path=self.path, dtype=dtype, device=self.device))

    def __deepcopy__(self, memo) -> DiskRowStore:
        # A copy gets its own scratch file (a plain deepcopy would read the rows into memory).
        return self._copy_into(DiskRowStore(self.width, self.capacity, path=self.path, dtype=self.dtype, device=self.device))

    def nbytes(self) -> int:
        """Bytes of the rows reserved so far (the file grows as they are written)."""
        return self.reserved * self.width * self.data.element_size()

    def __repr__(self) -> str:
        return f"DiskRowStore({self.capacity} rows x {self.width} {self.dtype} under {self.path!r})"
