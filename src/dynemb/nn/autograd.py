"""Autograd glue of the fused update: identity-like Functions whose backward hands the per-key
gradient to the table (which runs the optimizer through the functional layer, or accumulates
the gradient for ``optimizer.step()`` when the table's updates are deferred).

N ids, U unique keys, D embedding dim.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class Lookup:
    """What one training forward hands its backward: the module, the unique keys [U], their rows
    [U] (-1 where not in the table), the gathered rows [U, D+S] (None where the forward read
    them from the store in place, see ``DynamicTables._lookup_unique``), the engine version
    then, and for a collection's group its index ``group``, the table of each key ``segments``
    [U] and the grouping (order [N], starts [U]) of the ids by key when the de-duplication gave
    it.

    A fused lookup's gradient is applied once: the fused update changes the table, so a second
    backward through the same graph (``retain_graph=True``) raises instead of applying the
    optimizer twice. A deferred lookup (``repeatable=True``) only accumulates its gradient, so a
    second backward adds it again, as for a dense parameter's ``.grad``.
    """

    __slots__ = ("applied", "data", "group", "grouping", "keys", "repeatable", "rows", "segments", "table", "version")

    def __init__(
        self,
        table,
        keys: torch.Tensor,
        rows: torch.Tensor,
        data: torch.Tensor | None,
        version: int,
        repeatable: bool = False,
        *,
        group: int = 0,
        segments: torch.Tensor | None = None,
        grouping: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        self.table, self.keys, self.rows, self.data, self.version = table, keys, rows, data, version
        self.applied = False
        self.repeatable = repeatable
        self.group, self.segments, self.grouping = group, segments, grouping

    def apply(self, grad_u=None, inverse: torch.Tensor | None = None, grad: torch.Tensor | None = None) -> None:
        """Apply grad_u [U, D] (a tensor, or a bag collection's :class:`dynemb.nn.units.BagGradients`
        that the update sums), or sum grad [N, D] per key by inverse [N] first."""
        if self.applied and not self.repeatable:
            raise RuntimeError(
                "backward ran twice through one dynemb lookup: its fused optimizer update was already applied to "
                "the table by the first backward (retain_graph=True does not make a fused update repeatable). "
                "Run a new forward for each backward."
            )
        self.applied = True
        self.table.apply_lookup_gradients(self, grad_u, inverse, grad)
        # The table no longer needs the rows: free them with the graph's first backward.
        self.data = None


class FusedEmbeddings(torch.autograd.Function):
    """Unique embeddings [U, D] whose backward applies the table's optimizer with their gradient."""

    @staticmethod
    def forward(ctx, trigger, lookup: Lookup, embedding_dim: int):
        ctx.lookup = lookup
        return lookup.data[:, :embedding_dim]

    @staticmethod
    def backward(ctx, grad):
        ctx.lookup.apply(grad_u=grad)
        return None, None, None


class FusedSequence(torch.autograd.Function):
    """Sequence lookup: unique rows expanded to ids' shape [*, D]; backward sums the gradient per
    key and applies the table's optimizer. The rows are copied from ``source`` at ``at`` (default:
    the lookup's gathered rows at ``inverse``; the store's rows at the ids' row ids when the
    lookup read them in place)."""

    @staticmethod
    def forward(
        ctx,
        trigger,
        lookup: Lookup,
        inverse: torch.Tensor,
        embedding_dim: int,
        out: Callable[..., torch.Tensor] | None = None,
        source: torch.Tensor | None = None,
        at: torch.Tensor | None = None,
    ):
        ctx.lookup, ctx.inverse = lookup, inverse
        if source is None:
            source, at = lookup.data, inverse
        return expand_rows(source, at, embedding_dim, out)

    @staticmethod
    def backward(ctx, grad):
        ctx.lookup.apply(inverse=ctx.inverse.reshape(-1), grad=grad.reshape(-1, grad.shape[-1]))
        return None, None, None, None, None, None, None


def expand_rows(data: torch.Tensor, inverse: torch.Tensor, D: int, out: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
    """The first D columns of rows ``data`` [U, >= D] at ``inverse`` [*] -> [*, D]; ``out``, if
    given, makes the [N, D] tensor written into (``out(shape, dtype, device)``, e.g. a
    :class:`dynemb.workspace.Recycler`'s ``get`` bound to a name)."""
    flat = inverse.reshape(-1)
    if out is None:
        return data[:, :D].index_select(0, flat).view(*inverse.shape, D)
    return torch.index_select(data[:, :D], 0, flat, out=out((flat.numel(), D), data.dtype, data.device)).view(*inverse.shape, D)
