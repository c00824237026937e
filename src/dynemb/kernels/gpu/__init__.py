"""Triton kernels for CUDA tables, each the GPU twin of the CPU kernel of the same name in
:mod:`dynemb.kernels` (docs/design/0038-triton-kernels.md).

``locate`` (candidates, probe, row ids), ``update`` (the optimizer step on the store's rows)
and ``init`` (new keys' rows). The other steps of an upsert (placement, moves, eviction) and
the batch de-duplication run plain torch on the GPU. Imported only where a CUDA table (or a
test) asks for them: Triton is not a dependency of dynemb, and a machine without it runs the
plain-torch path. Under ``TRITON_INTERPRET=1`` the same kernels run on CPU tensors (the
parity tests use that where no GPU is present).
"""

from __future__ import annotations

import functools


@functools.cache
def failure() -> str | None:
    """Why the Triton kernels cannot run here (None when they can)."""
    try:
        import triton
        import triton.language

        del triton
    except Exception as error:  # any import failure: CUDA tables fall back to plain torch
        return f"{type(error).__name__}: {error}"
    return None


def launch_options() -> dict:
    """Options every launch takes: no fused multiply-add, so that products and sums round as
    the plain-torch twins' (separate) operations do."""
    return {"enable_fp_fusion": False}
