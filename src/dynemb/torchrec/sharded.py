"""TorchRec's sharded EBC / EC for dynemb's modules: every table row-wise on dynemb kernels."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torchrec.distributed.embedding import ShardedEmbeddingCollection
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.distributed.types import ShardingEnv

from dynemb.checkpoint.dcp_sharded import load_table_state, table_state
from dynemb.checkpoint.tables import ShardedTables, entries
from dynemb.distributed.comm import Comm
from dynemb.errors import CheckpointError
from dynemb.nn import DynamicEmbeddingBagCollection, DynamicEmbeddingCollection
from dynemb.torchrec.kernel import DynembKernel
from dynemb.torchrec.routing import RowWisePooledSharding, RowWiseSequenceSharding


class _LocalTables:
    """This rank's shard of each table (both sharded modules), and the tables in the module's
    ``state_dict()`` and in dynemb checkpoints (docs/design/0030-dmp-checkpoints.md)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # The checkpoints' exchanges (every rank builds its sharded modules in the same order).
        group = self._env.process_group
        self._checkpoint_comm = Comm(group) if group is not None and dist.is_initialized() else None

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

    def checkpoint_tables(self) -> ShardedTables:
        """This rank's local collections as ``dynemb.checkpoint`` sees them: each table named as
        in the unsharded module (``<path>.collection.<table>``), each key on rank
        ``owner_of(key, W)`` (the input dists route so)."""
        if self._checkpoint_comm is None:
            raise RuntimeError(f"{type(self).__name__}: checkpoints need the torch.distributed process group this module was sharded over")
        return ShardedTables("collection", {t: self.local_collection(t) for t in self._table_names}, self._checkpoint_comm)

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """TorchRec's entries (none for dynemb tables) and the tables' rows, under the unsharded
        module's names (``collection.<table>.keys``, ``embeddings``, ``optimizer_state``,
        ``scores`` as row-sharded tensors, DCP-ready; see
        :func:`dynemb.checkpoint.dcp_sharded.table_state`). Collective: every rank calls it."""
        out = super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        out.update(table_state(entries(self), prefix))
        return out

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs) -> None:
        """Loads the tables' entries of :meth:`state_dict` (any row blocks on each rank, e.g. a
        DCP load at another world size: each row goes to its key's owner), then TorchRec's.
        Collective: every rank loads."""
        own = prefix + "collection."
        mine = {k: state_dict.pop(k) for k in list(state_dict) if k.startswith(own)}
        try:
            missing, unexpected = load_table_state(entries(self), mine, prefix)
            missing_keys.extend(missing)
            unexpected_keys.extend(unexpected)
        except (ValueError, CheckpointError) as e:
            error_msgs.append(f"{type(self).__name__} at {prefix!r}: {e}; its tables were not changed")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)


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
