"""Deferred updates: the per-key gradient accumulator and clipping over dense and deferred grads.

U keys added in a call, P keys pending (distinct (segment, key) pairs), D embedding dim.

A deferred table (``update="deferred"``, docs/design/0011-deferred-updates.md) sums the gradient
of every backward per key in a :class:`GradAccumulator` and applies it at ``optimizer.step()``.
Collections use the same class for a group of tables by passing each key's table as its segment.
The optimizer side (the deferred-owner protocol, placeholders in ``param_groups``) is in
``dynemb.optim.base``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from dynemb.optim.base import DeferredOwner, RowOptimizer
from dynemb.table.index import unique_pairs
from dynemb.workspace import Workspace


class GradAccumulator:
    """Gradients summed per (segment, key) until drained.

    Args:
        embedding_dim: D.
        dtype: dtype of the gradients (the table's dtype).
        device: where they live.

    After each :meth:`add`, the pending keys are sorted (by segment, then key) and distinct;
    :attr:`grad` [P, D] is their summed gradient, and :attr:`param` a placeholder
    ``torch.nn.Parameter`` of shape [P, D] (zero-stride, no memory) whose ``.grad`` is
    :attr:`grad` itself, the object to register with
    :meth:`dynemb.optim.RowOptimizer.register_deferred`. Scaling :attr:`grad` (or
    ``param.grad``) in place scales what :meth:`drain` returns. Not thread-safe: the owner
    serialises calls (a table under its lock).
    """

    def __init__(self, embedding_dim: int, dtype: torch.dtype, device: torch.device | str):
        self.embedding_dim = embedding_dim
        self.dtype = dtype
        self.device = torch.device(device)
        # The merged gradient is written to the buffer the current one is not in (ping-pong).
        self._workspace = Workspace(self.device)
        self._flip = False
        self._zero = torch.zeros((), dtype=dtype, device=self.device)
        self.param = torch.nn.Parameter(self._zero.expand(0, embedding_dim), requires_grad=False)
        self._reset()

    def _reset(self) -> None:
        D = self.embedding_dim
        self._keys = torch.empty(0, dtype=torch.int64, device=self.device)
        self._segments: torch.Tensor | None = None
        self._set_grad(torch.zeros(0, D, dtype=self.dtype, device=self.device))

    def _set_grad(self, grad: torch.Tensor) -> None:
        self._grad = grad
        # .grad must match the parameter's shape, dtype and device: reshape the placeholder first.
        self.param.grad = None
        self.param.data = self._zero.expand(grad.shape)
        self.param.grad = grad

    def __setstate__(self, state: dict) -> None:
        # A copy's placeholder must hold the copy's gradient.
        self.__dict__.update(state)
        self._set_grad(self._grad)

    def __len__(self) -> int:
        """P, keys pending."""
        return self._keys.numel()

    @property
    def keys(self) -> torch.Tensor:
        """Tensor[int64]: [P] pending keys, sorted by (segment, key)."""
        return self._keys

    @property
    def segments(self) -> torch.Tensor | None:
        """Tensor[int64] | None: [P] segment of each pending key (None when added without)."""
        return self._segments

    @property
    def grad(self) -> torch.Tensor:
        """Tensor: [P, D] the summed gradient of each pending key (the live tensor, not a copy)."""
        return self._grad

    def add(self, keys: torch.Tensor, grads: torch.Tensor, segments: torch.Tensor | None = None) -> None:
        """Add gradients, summing those of equal (segment, key) pairs, pending ones included.

        Args:
            keys (Tensor[int64]): [U] keys (duplicates allowed).
            grads (Tensor): [U, D] their gradients, of the accumulator's dtype and device.
            segments (Tensor[int64] | None): [U] segment of each key (e.g. its table in a
                collection); either always or never given between two clears.
        """
        U, D = keys.numel(), self.embedding_dim
        if keys.dim() != 1 or keys.dtype != torch.int64:
            raise ValueError(f"keys: must be a 1-D int64 tensor, got {keys.dtype} of shape {tuple(keys.shape)}")
        if grads.shape != (U, D) or grads.dtype != self.dtype or grads.device != self.device:
            raise ValueError(f"grads: must be [{U}, {D}] {self.dtype} on {self.device}, got {grads.dtype} {tuple(grads.shape)} on {grads.device}")
        if segments is not None and (segments.shape != keys.shape or segments.dtype != torch.int64):
            raise ValueError(f"segments: must be [{U}] int64 like keys, got {segments.dtype} of shape {tuple(segments.shape)}")
        if len(self) and (segments is None) != (self._segments is None):
            raise ValueError("segments: given in some add() calls and not in others since the last clear")
        if U == 0:
            return
        with torch.no_grad():
            P = len(self)
            all_keys = torch.cat([self._keys, keys]) if P else keys
            if segments is None:
                merged, inverse = torch.unique(all_keys, sorted=True, return_inverse=True)
                merged_segments = None
            else:
                all_segments = torch.cat([self._segments, segments]) if P else segments
                (merged_segments, merged), inverse, _ = unique_pairs(all_segments, all_keys)
            name = "b" if self._flip else "a"
            self._flip = not self._flip
            out = self._workspace.get(name, merged.numel(), (D,), self.dtype).zero_()  # [P', D]
            if P:
                out.index_add_(0, inverse[:P], self._grad)
            out.index_add_(0, inverse[P:], grads)
        self._keys, self._segments = merged, merged_segments
        self._set_grad(out)

    def drain(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The pending ``(keys [P], segments [P] | None, grads [P, D])``, then :meth:`clear`.

        ``grads`` is a view of a reused buffer: valid until the next :meth:`add`.
        """
        out = self._keys, self._segments, self._grad
        self._reset()
        return out

    def clear(self) -> None:
        """Drop every pending gradient (the buffers are kept for reuse)."""
        self._reset()

    def to(self, device: torch.device, dtype: torch.dtype) -> None:
        """Move the pending gradient (and the buffers) to ``device`` / ``dtype``."""
        keys, segments, grad = self._keys.to(device), None if self._segments is None else self._segments.to(device), self._grad.to(device, dtype)
        self.device, self.dtype = torch.device(device), dtype
        self._workspace.to(self.device)
        self._zero = torch.zeros((), dtype=dtype, device=self.device)
        self._keys, self._segments = keys, segments
        self._set_grad(grad)

    def nbytes(self) -> int:
        """Bytes held by the gradient buffers."""
        return self._workspace.nbytes()


def _gradients(obj, seen: set[int], out: list[torch.Tensor]) -> None:
    """Collect the gradients of ``obj`` (see :func:`clip_grad_norm_`), each tensor once."""

    def take(grad: torch.Tensor | list[torch.Tensor] | tuple[torch.Tensor, ...] | None) -> None:
        if isinstance(grad, (list, tuple)):
            for g in grad:
                take(g)
        elif grad is not None and id(grad) not in seen:
            seen.add(id(grad))
            out.append(grad)

    if isinstance(obj, torch.Tensor):
        take(obj.grad)
    elif isinstance(obj, torch.nn.Module):
        for p in obj.parameters():
            take(p.grad)
        for m in obj.modules():
            if isinstance(m, DeferredOwner):
                take(m.deferred_grad())
    elif isinstance(obj, RowOptimizer):
        for owner in obj.deferred_owners():
            take(owner.deferred_grad())
    elif isinstance(obj, torch.optim.Optimizer):
        for group in obj.param_groups:
            for p in group["params"]:
                take(p.grad)
    elif isinstance(obj, DeferredOwner):
        take(obj.deferred_grad())
    elif isinstance(obj, Iterable) and not isinstance(obj, (str, bytes)):
        for item in obj:
            _gradients(item, seen, out)
    else:
        raise TypeError(f"clip_grad_norm_: cannot take gradients from {type(obj).__name__}; pass tensors, modules or optimizers")


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clip dense gradients and deferred tables' pending gradients by one global norm, in place.

    ``torch.nn.utils.clip_grad_norm_`` with deferred tables included: the norm is taken over all
    gradients together, and each is multiplied by ``min(1, max_norm / (norm + 1e-6))``.

    Args:
        parameters: a tensor, an ``nn.Module`` (its parameters' ``.grad`` and the pending gradient
            of every deferred table inside it), an optimizer (a ``torch.optim`` optimizer's
            parameters' ``.grad``; a ``dynemb.optim`` optimizer's deferred tables' pending
            gradient), a deferred table, or an iterable of any of these. A gradient reached twice
            is counted once.
        max_norm: largest norm allowed.
        norm_type: p of the p-norm (``float("inf")`` for the largest absolute value).
        error_if_nonfinite: raise ``RuntimeError`` if the norm is NaN or inf (else the
            gradients are scaled by a non-finite factor, as torch does).
    Returns:
        Tensor: [] the total norm before clipping.

    Example::

        loss.backward()
        dynemb.clip_grad_norm_(model, 1.0)   # dense parameters and deferred tables of model
        dense_opt.step(); table_opt.step()
    """
    grads: list[torch.Tensor] = []
    _gradients(parameters, set(), grads)
    # An empty gradient (a deferred table with nothing pending) adds nothing to any norm.
    grads = [g for g in grads if g.numel()]
    norm_type = float(norm_type)
    if not grads:
        return torch.tensor(0.0)
    with torch.no_grad():
        device = grads[0].device
        norms = [torch.linalg.vector_norm(g, norm_type).to(device) for g in grads]
        total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
        # One host sync, as torch's: the caller asked to fail on a non-finite norm.
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot be clipped. "
                "To disable this error and scale the gradients by the non-finite norm anyway, set `error_if_nonfinite=False`"
            )
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.device))
    return total
