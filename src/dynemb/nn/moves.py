"""What ``.to()``, ``.cuda()``, ``.cpu()``, ``.half()``, ``.double()``... ask of a table.

``torch.nn.Module`` implements them all as ``_apply(fn)``: ``fn`` maps each parameter and buffer
to its moved or converted copy, children first. Tables and collections hold their rows outside
parameters, so their ``_apply`` asks ``fn`` what it would do to rows of their device and dtype
(this module) and then moves or converts everything they own at once.

Every float dtype a table can hold (float32, float64, bfloat16, float16) is converted to, so a
model's ``.half()`` / ``.bfloat16()`` / ``.double()`` never stops half way: the modules before a
table in the model were already converted when the table's ``_apply`` runs, and nothing can
undo that (docs/design/0021-dtype-moves.md).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dynemb.config import ROW_DTYPES, resolve_device


def conversion_target(fn: Callable[[torch.Tensor], torch.Tensor], device: torch.device, dtype: torch.dtype) -> tuple[torch.device, torch.dtype] | None:
    """Device and dtype that ``fn`` gives rows now on ``device`` in ``dtype``; None when it
    leaves them as they are.

    Raises:
        ValueError: naming the dtype (float8 types, complex) or device (not cpu / cuda) that
            ``fn`` asks for and no table can hold; nothing of the table has changed.
    """
    probe = fn(torch.empty(0, dtype=dtype, device=device))
    if not isinstance(probe, torch.Tensor):
        return None
    new_device, new_dtype = resolve_device(probe.device), probe.dtype
    if new_dtype not in ROW_DTYPES:
        raise ValueError(
            f"dtype={new_dtype}: a dynemb table holds torch.float32, torch.float64, torch.bfloat16 or torch.float16 rows; "
            "this table is unchanged (torch has already converted the modules before it in the model)"
        )
    if (new_device, new_dtype) == (device, dtype):
        return None
    return new_device, new_dtype
