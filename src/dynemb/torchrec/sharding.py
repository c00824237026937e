"""Row-wise sharding of dynemb's TorchRec modules by ``DistributedModelParallel`` (DMP).

W ranks, B samples per rank, F features of a kernel, D_f a feature's dim, N ids a rank receives.

    model = DLRM(embedding_bag_collection=dynemb.torchrec.EmbeddingBagCollection(tables, optimizer=...), ...)
    model = DistributedModelParallel(model, plan=dynemb.torchrec.plan(model, W), sharders=dynemb.torchrec.sharders())

TorchRec routes every raw int64 id to rank ``uint64(id) % W`` with the id kept (its own
``RwSparseFeaturesDist`` with ``keep_original_indices=True`` and a hash size of W per feature,
so the block size is 1). Each rank's kernel (TorchRec's ``customized_kernel``) looks the ids it
receives up in its own unsharded dynemb collection of ``capacity // W`` rows per table, which
updates itself in backward as usual. TorchRec's output dists stay: pooled sums are
reduce-scattered (and divided for MEAN tables), sequence rows are sent back in id order. See
docs/design/0016-torchrec-dmp.md.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torchrec
from torchrec.distributed.embedding import EmbeddingCollectionSharder, ShardedEmbeddingCollection
from torchrec.distributed.embedding_kernel import BaseEmbedding
from torchrec.distributed.embedding_lookup import GroupedEmbeddingsLookup, GroupedPooledEmbeddingsLookup
from torchrec.distributed.embedding_types import EmbeddingComputeKernel, GroupedEmbeddingConfig
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder, ShardedEmbeddingBagCollection
from torchrec.distributed.sharding.rw_sequence_sharding import RwSequenceEmbeddingSharding
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingSharding, RwSparseFeaturesDist
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
from torchrec.distributed.types import ModuleSharder, ParameterSharding, ShardingEnv, ShardingPlan, ShardingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb.config import TableConfig
from dynemb.nn import DynamicEmbeddingBagCollection, DynamicEmbeddingCollection
from dynemb.torchrec.modules import EmbeddingBagCollection, EmbeddingCollection
from dynemb.types import PoolingMode

__all__ = ["ShardedDynamicEmbeddingBagCollection", "ShardedDynamicEmbeddingCollection", "plan", "sharders"]

_KERNEL = EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value
_ROW_WISE = ShardingType.ROW_WISE.value
_META = torch.device("meta")
# The fused_params entry that carries a module's dynemb settings to its kernels.
_SPEC = "dynemb_tables"


class _Spec:
    """One dynemb module's tables (unsharded configs by name), optimizer and update mode, as its
    kernels need them to build their local collections.

    It travels in TorchRec's ``fused_params``, which TorchRec deep-copies per table and uses as
    a grouping key: copies return the object itself (one optimizer, not one per table) and it
    hashes by identity.
    """

    def __init__(self, module: EmbeddingBagCollection | EmbeddingCollection, world_size: int, device: torch.device | None):
        collection = module.collection
        self.tables: dict[str, TableConfig] = dict(zip(collection.table_names, collection.table_configs))
        self.optimizer = collection.optimizer
        self.update = collection.update
        self.world_size = world_size
        self.device = device

    def local_config(self, table: str, pooled: bool) -> TableConfig:
        """One rank's table: ``capacity // W`` rows; bags pool by sum (TorchRec divides MEAN
        bags after the reduce-scatter); on the DMP's device."""
        config = self.tables[table]
        capacity = max(1, config.capacity // self.world_size)
        init = None if config.init_capacity is None else min(config.init_capacity, capacity)
        fields: dict[str, Any] = {"capacity": capacity, "init_capacity": init}
        if pooled:
            fields["pooling"] = PoolingMode.SUM
        if self.device is not None and self.device.type != "meta":
            fields["device"] = self.device
        return dataclasses.replace(config, **fields)

    def __deepcopy__(self, memo) -> _Spec:
        return self

    def __copy__(self) -> _Spec:
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


class DynembKernel(BaseEmbedding):
    """TorchRec's ``customized_kernel`` for one group of tables on one rank: a local (unsharded)
    dynemb collection holding the keys this rank owns.

    ``forward(features)``: the KJT of the group's F features as routed to this rank (raw int64
    ids, stride W * B) -> pooled: ``[W * B, sum D_f]`` per-bag sums; sequence: ``[N, D]`` in the
    order of ``features.values()``. The collection's fused update runs in backward.
    """

    def __init__(self, config: GroupedEmbeddingConfig, pooled: bool):
        super().__init__()
        spec = (config.fused_params or {}).get(_SPEC)
        if not isinstance(spec, _Spec):
            raise ValueError(
                f"tables {config.table_names()}: compute kernel {_KERNEL!r} without dynemb settings; "
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


class _PooledLookup(GroupedPooledEmbeddingsLookup):
    def _create_embedding_kernel(self, config, device, pg, sharding_type, env) -> BaseEmbedding:
        if config.compute_kernel == EmbeddingComputeKernel.CUSTOMIZED_KERNEL:
            return DynembKernel(config, pooled=True)
        return super()._create_embedding_kernel(config, device, pg, sharding_type, env)


class _SequenceLookup(GroupedEmbeddingsLookup):
    def _create_embedding_kernel(self, config, pg, device, env=None) -> BaseEmbedding:
        if config.compute_kernel == EmbeddingComputeKernel.CUSTOMIZED_KERNEL:
            return DynembKernel(config, pooled=False)
        return super()._create_embedding_kernel(config, pg, device, env)


def _raw_key_dist(
    pg, world_size: int, num_features: int, device: torch.device, has_feature_processor: bool, is_sequence: bool, need_pos: bool
) -> RwSparseFeaturesDist:
    """TorchRec's row-wise input dist with a hash size of W per feature (block size 1) and the
    ids kept: id -> rank ``uint64(id) % W``, unchanged. The arguments are the sharding's own
    (its process group, W, feature count, device), which only the sharding subclasses can read."""
    return RwSparseFeaturesDist(
        pg=pg,
        num_features=num_features,
        feature_hash_sizes=[world_size] * num_features,
        device=device,
        is_sequence=is_sequence,
        has_feature_processor=has_feature_processor,
        need_pos=need_pos,
        keep_original_indices=True,
    )


class _RwPooledSharding(RwPooledEmbeddingSharding):
    def create_input_dist(self, device: torch.device | None = None) -> RwSparseFeaturesDist:
        device = device if device is not None else self._device
        return _raw_key_dist(
            self._pg, self._world_size, len(self.feature_names()), device, self._has_feature_processor, is_sequence=False, need_pos=self._need_pos
        )

    def create_lookup(self, device: torch.device | None = None, fused_params: dict | None = None, feature_processor=None) -> _PooledLookup:
        return _PooledLookup(
            grouped_configs=self._grouped_embedding_configs,
            pg=self._pg,
            device=device if device is not None else self._device,
            feature_processor=feature_processor,
            sharding_type=ShardingType.ROW_WISE,
            env=self._env,
        )


class _RwSequenceSharding(RwSequenceEmbeddingSharding):
    def create_input_dist(self, device: torch.device | None = None) -> RwSparseFeaturesDist:
        device = device if device is not None else self._device
        return _raw_key_dist(self._pg, self._world_size, len(self.feature_names()), device, self._has_feature_processor, is_sequence=True, need_pos=False)

    def create_lookup(self, device: torch.device | None = None, fused_params: dict | None = None, feature_processor=None) -> _SequenceLookup:
        return _SequenceLookup(
            grouped_configs=self._grouped_embedding_configs, pg=self._pg, device=device if device is not None else self._device, env=self._env
        )


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
    ) -> _RwPooledSharding:
        return _RwPooledSharding(sharding_infos, env, device, qcomm_codecs_registry=qcomm_codecs_registry)


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
    ) -> _RwSequenceSharding:
        return _RwSequenceSharding(sharding_infos=sharding_infos, env=env, device=device, qcomm_codecs_registry=qcomm_codecs_registry)


def _check_params(module: torch.nn.Module, tables: list[str], params: dict[str, ParameterSharding]) -> None:
    missing = [t for t in tables if t not in params]
    if missing:
        raise ValueError(f"{type(module).__name__}: the plan has no sharding for tables {missing}; build it with dynemb.torchrec.plan(model, world_size)")
    for t in tables:
        p = params[t]
        if p.sharding_type != _ROW_WISE or p.compute_kernel != _KERNEL:
            raise ValueError(
                f"table {t!r}: sharding_type={p.sharding_type!r}, compute_kernel={p.compute_kernel!r}; dynemb tables shard "
                f"{_ROW_WISE!r} with {_KERNEL!r} only (dynemb.torchrec.plan builds that plan)"
            )


def _check_empty(module: EmbeddingBagCollection | EmbeddingCollection) -> None:
    held = {name: s["size"] for name, s in module.stats().items() if s["size"]}
    if held:
        raise ValueError(
            f"{type(module).__name__}: tables {held} hold keys; the sharded tables start empty (each rank's keys would be lost), so shard an untrained module"
        )


def _spec_params(sharder, module, env: ShardingEnv, device) -> dict[str, Any]:
    return {**(sharder.fused_params or {}), _SPEC: _Spec(module, env.world_size, device)}


class _RowWiseOnDynemb:
    """What both sharders offer TorchRec's planner: row-wise only, on the custom kernel."""

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return [_ROW_WISE]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        return [_KERNEL]


class DynamicEmbeddingBagCollectionSharder(_RowWiseOnDynemb, EmbeddingBagCollectionSharder):
    """Shards :class:`dynemb.torchrec.EmbeddingBagCollection` (exactly that type) row-wise on dynemb kernels."""

    def shard(
        self,
        module: EmbeddingBagCollection,
        params: dict[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> ShardedDynamicEmbeddingBagCollection:
        configs = module.embedding_bag_configs()
        _check_params(module, [c.name for c in configs], params)
        _check_empty(module)
        # TorchRec's constructor reads dense weights by name; a meta twin with the same configs
        # gives them at no memory (the dynemb module has none).
        twin = torchrec.EmbeddingBagCollection(tables=configs, is_weighted=module.is_weighted(), device=_META)
        return ShardedDynamicEmbeddingBagCollection(
            module=twin,
            table_name_to_parameter_sharding=params,
            env=env,
            fused_params=_spec_params(self, module, env, device),
            device=device,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            module_fqn=module_fqn,
        )

    def shardable_parameters(self, module: EmbeddingBagCollection) -> dict[str, torch.Tensor]:
        """Table name -> its meta dummy weight [num_embeddings, D] (for plan shapes only)."""
        return {c.name: module.embedding_bags[c.name].weight for c in module.embedding_bag_configs()}

    def reshard(self, *args, **kwargs):
        raise NotImplementedError("resharding dynemb tables is not supported")

    @property
    def module_type(self) -> type[EmbeddingBagCollection]:
        return EmbeddingBagCollection

    @property
    def sharded_module_type(self) -> type[ShardedDynamicEmbeddingBagCollection]:
        return ShardedDynamicEmbeddingBagCollection


class DynamicEmbeddingCollectionSharder(_RowWiseOnDynemb, EmbeddingCollectionSharder):
    """Shards :class:`dynemb.torchrec.EmbeddingCollection` (exactly that type) row-wise on dynemb kernels."""

    def shard(
        self,
        module: EmbeddingCollection,
        params: dict[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> ShardedDynamicEmbeddingCollection:
        configs = module.embedding_configs()
        _check_params(module, [c.name for c in configs], params)
        _check_empty(module)
        twin = torchrec.EmbeddingCollection(tables=configs, device=_META, need_indices=module.need_indices())
        return ShardedDynamicEmbeddingCollection(
            module=twin,
            table_name_to_parameter_sharding=params,
            env=env,
            fused_params=_spec_params(self, module, env, device),
            device=device,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            use_index_dedup=False,
            module_fqn=module_fqn,
        )

    def shardable_parameters(self, module: EmbeddingCollection) -> dict[str, torch.Tensor]:
        """Table name -> its meta dummy weight [num_embeddings, D] (for plan shapes only)."""
        return {c.name: module.embeddings[c.name].weight for c in module.embedding_configs()}

    @property
    def module_type(self) -> type[EmbeddingCollection]:
        return EmbeddingCollection

    @property
    def sharded_module_type(self) -> type[ShardedDynamicEmbeddingCollection]:
        return ShardedDynamicEmbeddingCollection


def sharders() -> list[ModuleSharder[torch.nn.Module]]:
    """The sharders of :class:`dynemb.torchrec.EmbeddingBagCollection` and
    :class:`dynemb.torchrec.EmbeddingCollection`, for ``DistributedModelParallel(sharders=...)``.

    DMP picks a sharder by the module's exact type, so these leave TorchRec's own modules alone;
    a model that also holds TorchRec tables passes ``sharders() + get_default_sharders()``.
    """
    return [DynamicEmbeddingBagCollectionSharder(), DynamicEmbeddingCollectionSharder()]


def plan(model: torch.nn.Module, world_size: int, *, local_size: int | None = None, device_type: str = "cpu") -> ShardingPlan:
    """The sharding plan of every dynemb TorchRec module in ``model``: each table row-wise over
    ``world_size`` ranks with TorchRec's ``customized_kernel`` (the dynemb kernel).

    Built by hand with ``construct_module_sharding_plan`` per module, keyed by module path
    (``""`` when ``model`` is itself one). TorchRec's own planner
    (``EmbeddingShardingPlanner``, DMP's default when ``plan`` is not given) rejects the custom
    kernel (its performance estimator has no figures for it), so this helper bypasses it: pass
    the result as ``DistributedModelParallel(model, plan=plan(model, W), sharders=sharders())``.
    Needs no process group. TorchRec modules that are not dynemb's get no entry (plan them
    separately and merge the ``plan`` dicts).

    Args:
        model: the unsharded model (the same on every rank).
        world_size: W, ranks that share every table.
        local_size: ranks per host (default: W, one host).
        device_type: ``"cpu"`` or ``"cuda"``, the DMP's device type.
    Raises:
        ValueError: ``model`` holds no dynemb TorchRec module, or ``world_size`` < 1.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}: must be an int >= 1")
    by_type = {s.module_type: s for s in sharders()}
    plans = {}
    for path, module in model.named_modules():
        sharder = by_type.get(type(module))
        if sharder is None:
            continue
        configs = module.embedding_bag_configs() if isinstance(module, EmbeddingBagCollection) else module.embedding_configs()
        plans[path] = construct_module_sharding_plan(
            module,
            {c.name: row_wise(compute_kernel=_KERNEL) for c in configs},
            sharder=sharder,
            local_size=local_size or world_size,
            world_size=world_size,
            device_type=device_type,
        )
    if not plans:
        raise ValueError(
            f"model={type(model).__name__}: holds no dynemb.torchrec.EmbeddingBagCollection or EmbeddingCollection to plan "
            "(TorchRec's own collections are converted by dynemb.torchrec.convert(model))"
        )
    return ShardingPlan(plan=plans)
