"""Buffers kept between calls for large temporaries of hot paths.

On CPU a fresh large tensor pays a page fault per page on first touch (glibc hands big blocks
back to the kernel when freed), so hot paths write their temporaries into views of buffers that
grow as needed and are reused by the next call.
"""

from __future__ import annotations

import torch


class Workspace:
    """Named buffers on one device; ``get`` returns a [rows, *shape] view valid until the next
    ``get`` of the same name."""

    def __init__(self, device: torch.device):
        self.device = device
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, rows: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        buf = self._buffers.get(name)
        if buf is None or buf.shape[0] < rows or tuple(buf.shape[1:]) != shape or buf.dtype != dtype:
            buf = torch.empty((max(rows, 1), *shape), dtype=dtype, device=self.device)
            self._buffers[name] = buf
        return buf[:rows]
