"""Row-wise sharding of dynemb's TorchRec modules by ``DistributedModelParallel`` (DMP).

W ranks, B samples per rank, F features of a kernel, D_f a feature's dim, N ids a rank receives.

    model = DLRM(embedding_bag_collection=dynemb.torchrec.EmbeddingBagCollection(tables, optimizer=...), ...)
    model = DistributedModelParallel(model, plan=dynemb.torchrec.plan(model, W), sharders=dynemb.torchrec.sharders())
    model = DistributedModelParallel(model, sharders=dynemb.torchrec.sharders())  # TorchRec's planner plans it

Every raw int64 id goes to rank ``dynemb.distributed.owner_of(id, W)`` with the id kept (the
input dists of ``routing.py``, through TorchRec's all-to-all; sequence ids once per feature), as
under dynemb's own sharding, so checkpoints load into either. Each rank's kernel (TorchRec's ``customized_kernel``) looks the ids it
receives up in its own unsharded dynemb collection of ``capacity // W`` rows per table, which
updates itself in backward as usual. TorchRec's output dists stay: pooled sums are
reduce-scattered (and divided for MEAN tables), sequence rows are sent back in id order. See
docs/design/0016-torchrec-dmp.md; TorchRec's planner: 0031-torchrec-planner.md.
"""

from __future__ import annotations

from typing import Any

import torch
import torchrec
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
from torchrec.distributed.types import ModuleSharder, ParameterSharding, ShardingEnv, ShardingPlan

from dynemb.torchrec.kernel import KERNEL, SPEC_KEY, DynembKernel, TablesSpec
from dynemb.torchrec.modules import EmbeddingBagCollection, EmbeddingCollection
from dynemb.torchrec.optimizers import from_fused_params
from dynemb.torchrec.planning import PLANNER_KERNEL, ROW_WISE, dynemb_params, stand_ins
from dynemb.torchrec.sharded import ShardedDynamicEmbeddingBagCollection, ShardedDynamicEmbeddingCollection

__all__ = [
    "DynamicEmbeddingBagCollectionSharder",
    "DynamicEmbeddingCollectionSharder",
    "DynembKernel",
    "ShardedDynamicEmbeddingBagCollection",
    "ShardedDynamicEmbeddingCollection",
    "plan",
    "sharders",
]

_META = torch.device("meta")


def _check_empty(module: EmbeddingBagCollection | EmbeddingCollection) -> None:
    held = module.held_keys()
    if held:
        raise ValueError(
            f"{type(module).__name__}: tables {held} hold keys; the sharded tables start empty (each rank's keys would be lost), so shard an untrained module"
        )


def _spec_params(sharder, module, env: ShardingEnv, device) -> dict[str, Any]:
    """The fused params TorchRec hands the kernels: only the dynemb settings. The sharder's own
    ``fused_params`` choose the optimizer here (with the module's other choices) and go no further."""
    optimizer = module.sharding_optimizer(sharder.fused_params)
    return {SPEC_KEY: TablesSpec(module, env.world_size, device, optimizer)}


class _RowWiseOnDynemb:
    """What both sharders offer TorchRec's planner: row-wise only, on the dynemb kernel under
    the name its estimators know, each table sized at capacity (docs/design/0031-torchrec-planner.md)."""

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return [ROW_WISE]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        return [PLANNER_KERNEL] if sharding_type == ROW_WISE else []

    def shardable_parameters(self, module: EmbeddingBagCollection | EmbeddingCollection) -> dict[str, torch.Tensor]:
        """Table name -> a meta float32 tensor [R, D] of the table's bytes at capacity (index,
        rows, optimizer state), which TorchRec's planner sizes it by (no parameter: there is none)."""
        return stand_ins(module, self.fused_params)


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
        params = dynemb_params(module, [c.name for c in configs], params)
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
        params = dynemb_params(module, [c.name for c in configs], params)
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

    @property
    def module_type(self) -> type[EmbeddingCollection]:
        return EmbeddingCollection

    @property
    def sharded_module_type(self) -> type[ShardedDynamicEmbeddingCollection]:
        return ShardedDynamicEmbeddingCollection


def sharders(fused_params: dict[str, Any] | None = None, qcomm_codecs_registry: dict | None = None) -> list[ModuleSharder[torch.nn.Module]]:
    """The sharders of :class:`dynemb.torchrec.EmbeddingBagCollection` and
    :class:`dynemb.torchrec.EmbeddingCollection`, for ``DistributedModelParallel(sharders=...)``.

    Args:
        fused_params: FBGEMM fused params choosing the tables' optimizer (``optimizer`` as an
            ``EmbOptimType``, ``learning_rate``, ``eps``, ``beta1``, ``beta2``, ``weight_decay``,
            ``weight_decay_mode``), as TorchRec's sharders take them; see
            :func:`dynemb.torchrec.optimizers.from_fused_params`.
        qcomm_codecs_registry: TorchRec's quantized-comms codecs for the output all-to-alls.

    DMP picks a sharder by the module's exact type, so these leave TorchRec's own modules alone;
    a model that also holds TorchRec tables passes ``sharders() + get_default_sharders()``.
    """
    if fused_params is not None:
        from_fused_params(fused_params, "sharders(fused_params=...)")  # fail here, not at DMP
    return [
        DynamicEmbeddingBagCollectionSharder(fused_params=fused_params, qcomm_codecs_registry=qcomm_codecs_registry),
        DynamicEmbeddingCollectionSharder(fused_params=fused_params, qcomm_codecs_registry=qcomm_codecs_registry),
    ]


def plan(model: torch.nn.Module, world_size: int, *, local_size: int | None = None, device_type: str = "cpu") -> ShardingPlan:
    """The sharding plan of every dynemb TorchRec module in ``model``: each table row-wise over
    ``world_size`` ranks with TorchRec's ``customized_kernel`` (the dynemb kernel).

    A shortcut: built by hand with ``construct_module_sharding_plan`` per module, keyed by module
    path (``""`` when ``model`` is itself one), it needs no process group and no topology. TorchRec's
    own planner plans the same tables the same way (row-wise on the dynemb kernel, which it knows
    as ``fused``; docs/design/0031-torchrec-planner.md), so ``DistributedModelParallel(model,
    sharders=sharders())`` without a plan trains like ``DistributedModelParallel(model,
    plan=plan(model, W), sharders=sharders())``; the planner also checks that the tables fit its
    ``Topology`` and honours ``ParameterConstraints``. TorchRec modules that are not dynemb's get
    no entry (plan them separately and merge the ``plan`` dicts).

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
            {c.name: row_wise(compute_kernel=KERNEL) for c in configs},
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
