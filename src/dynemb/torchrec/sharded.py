"""TorchRec's sharded EBC / EC for dynemb's modules: every table row-wise on dynemb kernels."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import torch
from torchrec.distributed.embedding import ShardedEmbeddingCollection
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.distributed.types import ShardingEnv

from dynemb.nn import DynamicEmbeddingBagCollection, DynamicEmbeddingCollection
from dynemb.torchrec.kernel import DynembKernel
from dynemb.torchrec.routing import RowWisePooledSharding, RowWiseSequenceSharding


class _LocalTables:
    """This rank's shard of each table (both sharded modules)."""

    def _kernels(self) -> Iterator[DynembKernel]:
        for lookup in self._lookups:
            # A lookup's kernels are its submodules (TorchRec keeps them in a ModuleList).
            for kernel in lookup.modules():
                if isinstance(kernel, DynembKernel):
                    yield kernel

    def local_collection(self, table: str) -> DynamicEmbeddingBagCollection | DynamicEmbeddingCollection:
        """The dynemb collection holding this rank's keys of ``table`` (and of the tables TorchRec
        grouped with it): ``export(table)``, ``find``, ``stats()``, ``state_dict()`` are this rank's."""
        for kernel in self._kernels():
            if table in kernel.collection.table_names:
                return kernel.collection
        raise KeyError(f"table={table!r}: not a table of this module ({self._table_names})")

    def stats(self) -> dict[str, dict]:
        """Table name -> this rank's shard stats (size, capacity, evictions, failed inserts...)."""
        out: dict[str, dict] = {}
        for kernel in self._kernels():
            out.update(kernel.collection.stats())
        return out

    def reset_parameters(self) -> None:
        """No-op: dynemb initialises each key's row when the key first arrives."""

    def state_dict(self, *args, **kwargs):
        """TorchRec's entries (none for these tables): the rows are not in it, so it warns."""
        warnings.warn(
            f"{type(self).__name__}.state_dict() holds no dynemb rows (tables {self._table_names}); each rank's rows are in "
            "local_collection(table) (its state_dict() or export()). See docs/design/0016-torchrec-dmp.md",
            UserWarning,
            stacklevel=2,
        )
        return super().state_dict(*args, **kwargs)


class ShardedDynamicEmbeddingBagCollection(_LocalTables, ShardedEmbeddingBagCollection):
    """TorchRec's ``ShardedEmbeddingBagCollection`` for :class:`dynemb.torchrec.EmbeddingBagCollection`:
    every table row-wise on dynemb kernels (:class:`DynembKernel`)."""

    @classmethod
    def create_embedding_bag_sharding(
        cls, sharding_infos, env: ShardingEnv, device: torch.device | None = None, permute_embeddings: bool = False, qcomm_codecs_registry=None
    ) -> RowWisePooledSharding:
        return RowWisePooledSharding(sharding_infos, env, device, qcomm_codecs_registry=qcomm_codecs_registry)


class ShardedDynamicEmbeddingCollection(_LocalTables, ShardedEmbeddingCollection):
    """TorchRec's ``ShardedEmbeddingCollection`` for :class:`dynemb.torchrec.EmbeddingCollection`:
    every table row-wise on dynemb kernels (:class:`DynembKernel`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # TorchRec's global index-dedup flag linearises ids by num_embeddings: wrong for raw keys.
        self._use_index_dedup = False

    @classmethod
    def create_embedding_sharding(
        cls, sharding_type: str, sharding_infos, env: ShardingEnv, device: torch.device | None = None, qcomm_codecs_registry=None
    ) -> RowWiseSequenceSharding:
        return RowWiseSequenceSharding(sharding_infos=sharding_infos, env=env, device=device, qcomm_codecs_registry=qcomm_codecs_registry)
