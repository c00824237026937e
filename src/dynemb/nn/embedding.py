"""DynamicEmbedding (one vector per id) and DynamicEmbeddingBag (pooled per bag).

N ids, B bags, D embedding dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dynemb.config import TableConfig
from dynemb.nn.collective import collective
from dynemb.nn.inputs import as_ids
from dynemb.nn.module import DynamicTable
from dynemb.optim.base import RowOptimizer
from dynemb.types import PoolingMode, UpdateMode


def _config(embedding_dim, capacity, kwargs) -> TableConfig:
    try:
        return TableConfig(embedding_dim=embedding_dim, capacity=capacity, **kwargs)
    except TypeError as e:
        raise TypeError(f"{e}; see dynemb.TableConfig for the accepted arguments") from None


class DynamicEmbedding(DynamicTable):
    """Embedding table for arbitrary int64 ids: ``ids [*] -> [*, D]``.

    Args:
        embedding_dim: D.
        capacity: most keys held on this device (may be omitted with ``tiers=``: their rows summed).
        optimizer: row-wise optimizer (``dynemb.optim.SGD / Adagrad / RowWiseAdagrad / Adam``);
            ``None`` for a frozen table.
        update: ``"fused"`` (default: backward applies the optimizer) or ``"deferred"``
            (backward accumulates the gradient per key; ``optimizer.step()`` applies it,
            ``optimizer.zero_grad()`` drops it), see :class:`dynemb.types.UpdateMode`.
        **options: any other :class:`dynemb.TableConfig` field (``init_capacity``,
            ``score_strategy``, ``check_mode``, ``initializer``, ``admission``, ``eval_default``,
            ``seed``, ``bucket_capacity``, ``max_load_factor``, ``dtype``, ``device``, ``tiers``).

    Example::

        table = dynemb.DynamicEmbedding(embedding_dim=16, capacity=1 << 16,
                                        optimizer=dynemb.optim.Adam(lr=1e-3))
        out = table(torch.tensor([[3, -7], [2**62, 3]]))   # [2, 2, 16]
        out.sum().backward()                               # rows of 3, -7, 2**62 updated
    """

    def __init__(
        self,
        embedding_dim: int,
        capacity: int | None = None,
        *,
        optimizer: RowOptimizer | None = None,
        store=None,
        update: UpdateMode | str = UpdateMode.FUSED,
        **options,
    ):
        super().__init__(_config(embedding_dim, capacity, options), optimizer, store, update=update)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (Tensor[int64]): [*] -> Tensor [*, D]."""
        return self.lookup_sequence(ids)


class DynamicEmbeddingBag(DynamicTable):
    """Pooled embedding table for arbitrary int64 ids, with torch.nn.EmbeddingBag conventions.

    Args:
        embedding_dim, capacity, optimizer, update, **options: as :class:`DynamicEmbedding`.
        mode: ``"sum"`` or ``"mean"``.
        include_last_offset: offsets has B+1 entries, the last being N.

    ``forward(ids, offsets=None, per_sample_weights=None)``: 1-D ids [N] with offsets [B] (or
    [B+1]) give [B, D]; 2-D ids [B, L] (fixed-length bags, offsets None) give [B, D].
    ``per_sample_weights`` (same shape as ids) needs mode ``"sum"``. Empty bags pool to zeros.
    """

    def __init__(
        self,
        embedding_dim: int,
        capacity: int | None = None,
        *,
        mode: PoolingMode | str = PoolingMode.MEAN,
        include_last_offset: bool = False,
        optimizer: RowOptimizer | None = None,
        store=None,
        update: UpdateMode | str = UpdateMode.FUSED,
        **options,
    ):
        mode = PoolingMode.parse(mode, "mode")
        if mode is PoolingMode.NONE:
            raise ValueError("mode='none': use dynemb.DynamicEmbedding for one vector per id")
        super().__init__(_config(embedding_dim, capacity, options), optimizer, store, update=update)
        self.mode = mode
        self.include_last_offset = bool(include_last_offset)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mode='{self.mode}'"

    def _check_offsets(self, offsets, n: int) -> torch.Tensor:
        """Reject offsets torch would reject, before the lookup changes the table."""
        if isinstance(offsets, (list, tuple)):
            offsets = torch.as_tensor(offsets, dtype=torch.int64, device=self.device)
        if not isinstance(offsets, torch.Tensor) or offsets.dim() != 1 or offsets.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"offsets must be a 1-D int64 tensor, got {offsets!r}")
        if offsets.device != self.device:
            raise ValueError(f"offsets.device={offsets.device}: the table lives on {self.device}")
        if offsets.numel() == 0:
            if self.include_last_offset:
                raise ValueError("offsets is empty: with include_last_offset=True it needs at least one entry (len(ids))")
            if n:
                raise ValueError(f"offsets is empty but ids has {n} entries: offsets needs one start per bag")
            return offsets
        # One host sync: a bad offset would otherwise fail inside embedding_bag after keys were inserted.
        first, last = int(offsets[0]), int(offsets[-1])
        monotone = bool((offsets[1:] >= offsets[:-1]).all())
        if first != 0 or last > n or not monotone:
            raise ValueError(f"offsets={offsets.tolist() if offsets.numel() <= 16 else '...'}: must start at 0, be non-decreasing and not exceed len(ids)={n}")
        if self.include_last_offset and last != n:
            raise ValueError(f"offsets[-1]={last}: with include_last_offset it must equal len(ids)={n}")
        return offsets

    @collective("forward")
    def forward(self, ids: torch.Tensor, offsets: torch.Tensor | None = None, per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        """ids [N] + offsets [B(+1)], or ids [B, L] -> Tensor [B, D]."""
        ids = as_ids(ids, "ids", self.device)
        if ids.dim() == 1 and offsets is None:
            raise ValueError("offsets is required when ids is 1-D (or pass 2-D ids [B, L])")
        if ids.dim() == 2 and offsets is not None:
            raise ValueError("offsets must be None when ids is 2-D [B, L]")
        if ids.dim() not in (1, 2):
            raise ValueError(f"ids.dim()={ids.dim()}: must be 1 (with offsets) or 2")
        if per_sample_weights is not None:
            if self.mode is not PoolingMode.SUM:
                raise ValueError(f"per_sample_weights needs mode='sum', this bag uses mode='{self.mode}'")
            if not isinstance(per_sample_weights, torch.Tensor):
                raise TypeError(f"per_sample_weights must be a tensor, got {type(per_sample_weights).__name__}")
            if per_sample_weights.shape != ids.shape:
                raise ValueError(f"per_sample_weights.shape={tuple(per_sample_weights.shape)} must equal ids.shape={tuple(ids.shape)}")
            if per_sample_weights.dtype != self.config.dtype:
                raise ValueError(f"per_sample_weights.dtype={per_sample_weights.dtype}: must be the table's dtype {self.config.dtype}")
            if per_sample_weights.device != self.device:
                raise ValueError(f"per_sample_weights.device={per_sample_weights.device}: the table lives on {self.device}")
        if offsets is not None:
            offsets = self._check_offsets(offsets, ids.numel())
        emb, inverse = self.lookup(ids)
        return F.embedding_bag(
            inverse,
            emb,
            offsets,
            mode=self.mode.value,
            per_sample_weights=per_sample_weights,
            include_last_offset=self.include_last_offset,
        )
