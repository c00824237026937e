"""TorchRec's ``customized_kernel`` on dynemb: the settings a sharder hands its kernels
(``TablesSpec``, carried in ``fused_params``), the kernel (``DynembKernel``: one rank's local
dynemb collection) and the lookups that create it. See docs/design/0016-torchrec-dmp.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torchrec.distributed.embedding_kernel import BaseEmbedding
from torchrec.distributed.embedding_lookup import GroupedEmbeddingsLookup, GroupedPooledEmbeddingsLookup
from torchrec.distributed.embedding_types import EmbeddingComputeKernel, GroupedEmbeddingConfig
from torchrec.optim.fused import EmptyFusedOptimizer, FusedOptimizerModule
from torchrec.optim.keyed import KeyedOptimizer
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb.config import TableConfig, local_share
from dynemb.nn import DynamicEmbeddingBagCollection, DynamicEmbeddingCollection
from dynemb.optim import RowOptimizer
from dynemb.torchrec.modules import EmbeddingBagCollection, EmbeddingCollection
from dynemb.torchrec.optimizers import DynembFusedOptimizer
from dynemb.types import PoolingMode

KERNEL = EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value
# The fused_params entry that carries a module's dynemb settings to its kernels.
SPEC_KEY = "dynemb_tables"


class TablesSpec:
    """One dynemb module's tables (unsharded configs by name), optimizer and update mode, as its
    kernels need them to build their local collections.

    It travels in TorchRec's ``fused_params``, which TorchRec deep-copies per table and uses as
    a grouping key: copies return the object itself (one optimizer, not one per table) and it
    hashes by identity.
    """

    def __init__(self, module: EmbeddingBagCollection | EmbeddingCollection, world_size: int, device: torch.device | None, optimizer: RowOptimizer | None):
        self.tables: dict[str, TableConfig] = {c.name: c for c in module.dynemb_configs}
        self.optimizer = optimizer
        self.update = module.update_mode
        self.world_size = world_size
        self.device = device

    def local_config(self, table: str, pooled: bool) -> TableConfig:
        """One rank's table: ``capacity // W`` rows (each tier's rows // W); bags pool by sum
        (TorchRec divides MEAN bags after the reduce-scatter); on the DMP's device."""
        config = local_share(self.tables[table], self.world_size)
        fields: dict[str, Any] = {}
        if pooled:
            fields["pooling"] = PoolingMode.SUM
        if self.device is not None and self.device.type != "meta":
            fields["device"] = self.device
        return dataclasses.replace(config, **fields)

    def __deepcopy__(self, memo) -> TablesSpec:
        return self

    def __copy__(self) -> TablesSpec:
        return self

    def __repr__(self) -> str:
        return f"dynemb tables {list(self.tables)} over {self.world_size} ranks"


def _renamed(features: KeyedJaggedTensor, names: list[str], weighted: bool) -> KeyedJaggedTensor:
    """The kernel's KJT under the local collection's feature names (TorchRec's embedding names,
    ``feature@table`` for a shared feature), same values and lengths."""
    if features.variable_stride_per_key():
        raise ValueError(
            "dynemb kernel: variable-batch KeyedJaggedTensor (TorchRec's VBE, stride_per_key_per_rank) is not supported; "
            "pass a KeyedJaggedTensor with one stride for every feature"
        )
    return KeyedJaggedTensor(
        keys=names,
        values=features.values(),
        lengths=features.lengths(),
        weights=features.weights_or_none() if weighted else None,
        stride=features.stride(),
    )


class DynembKernel(BaseEmbedding, FusedOptimizerModule):
    """TorchRec's ``customized_kernel`` for one group of tables on one rank: a local (unsharded)
    dynemb collection holding the keys this rank owns.

    ``forward(features)``: the KJT of the group's F features as routed to this rank (raw int64
    ids, stride W * B) -> pooled: ``[W * B, sum D_f]`` per-bag sums; sequence: ``[N, D]`` in the
    order of ``features.values()``. The collection's fused update runs in backward.
    """

    def __init__(self, config: GroupedEmbeddingConfig, pooled: bool):
        super().__init__()
        spec = (config.fused_params or {}).get(SPEC_KEY)
        if not isinstance(spec, TablesSpec):
            raise ValueError(
                f"tables {config.table_names()}: compute kernel {KERNEL!r} without dynemb settings; "
                "shard dynemb.torchrec modules with dynemb.torchrec.sharders()"
            )
        self._config = config
        self._pooled = pooled
        self._names = config.embedding_names()
        tables = [spec.local_config(t.name, pooled) for t in config.embedding_tables]
        if pooled:
            self.collection = DynamicEmbeddingBagCollection(tables, spec.optimizer, update=spec.update, is_weighted=config.is_weighted)
        else:
            self.collection = DynamicEmbeddingCollection(tables, spec.optimizer, update=spec.update)
        if list(self.collection.feature_names) != self._names:
            raise RuntimeError(f"dynemb kernel orders features {list(self.collection.feature_names)}, TorchRec {self._names}")
        # TorchRec's face of the tables' optimizer: one zero-size stand-in per table weight.
        device = tables[0].device if tables else torch.device("cpu")
        handles = {f"{t.name}.weight": torch.empty(0, t.embedding_dim, device=device) for t in tables}
        self._optim = EmptyFusedOptimizer() if spec.optimizer is None else DynembFusedOptimizer(spec.optimizer, handles)

    @property
    def fused_optimizer(self) -> KeyedOptimizer:
        """The tables' optimizer as TorchRec's ``KeyedOptimizer`` (DMP's ``fused_optimizer`` holds it)."""
        return self._optim

    @property
    def config(self) -> GroupedEmbeddingConfig:
        return self._config

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        """features: KJT of F features x (W * B) bags -> [W * B, sum D_f] (pooled) or [N, D]."""
        renamed = _renamed(features, self._names, self._pooled and self._config.is_weighted)
        if self._pooled:
            return self.collection(renamed).concat.float()  # [W * B, sum D_f]
        out = self.collection(renamed)
        rows = [out[n][0] for n in self._names]
        return (torch.cat(rows) if len(rows) > 1 else rows[0]).float()  # [N, D]

    def named_parameters_by_table(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """None: the rows are the dynemb collection's, not parameters."""
        return iter(())

    def state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False):
        """No entries: TorchRec reads every entry of a lookup's state_dict as ``<table>.weight``
        (docs/design/0016-torchrec-dmp.md, "State")."""
        return {} if destination is None else destination

    def flush(self) -> None:
        pass

    def purge(self) -> None:
        pass


class PooledLookup(GroupedPooledEmbeddingsLookup):
    def _create_embedding_kernel(self, config, device, pg, sharding_type, env) -> BaseEmbedding:
        if config.compute_kernel == EmbeddingComputeKernel.CUSTOMIZED_KERNEL:
            return DynembKernel(config, pooled=True)
        return super()._create_embedding_kernel(config, device, pg, sharding_type, env)


class SequenceLookup(GroupedEmbeddingsLookup):
    def _create_embedding_kernel(self, config, pg, device, env=None) -> BaseEmbedding:
        if config.compute_kernel == EmbeddingComputeKernel.CUSTOMIZED_KERNEL:
            return DynembKernel(config, pooled=False)
        return super()._create_embedding_kernel(config, pg, device, env)
