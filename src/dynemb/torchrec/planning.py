"""What TorchRec's planner (``EmbeddingShardingPlanner``, DMP's default) sees of a dynemb table.

C capacity (slots of the index at its largest), D embedding dim, S optimizer state columns per
row, R rows of the planner's stand-in tensor, W ranks.

TorchRec 1.8 sizes a table from the tensor the sharder's ``shardable_parameters`` returns
(``numel * element_size``, split over the shards in proportion to their rows) and prices it by
the compute kernel's bandwidth, which its estimators know for TorchRec's own kernel names only.
So a dynemb table shows the planner:

- the kernel name ``fused`` (on CPU, CUDA and MTIA the estimators know it; they raise for
  ``customized_kernel``); the sharders map it back to the dynemb kernel (:func:`dynemb_params`);
- a meta float32 tensor ``[R, D]`` whose bytes are the table's memory at capacity (index, rows
  and optimizer state, :func:`table_bytes`) rounded up to a whole row of D floats: the planner
  puts them on HBM for a CUDA topology and on DDR for a CPU one, as the local tables go on the
  DMP's device. See docs/design/0031-torchrec-planner.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.types import ParameterSharding, ShardingType

from dynemb import optim
from dynemb.config import TableConfig
from dynemb.table.geometry import index_bytes, plan_buckets
from dynemb.torchrec.kernel import KERNEL
from dynemb.torchrec.modules import EmbeddingBagCollection, EmbeddingCollection

# The kernel name dynemb tables show TorchRec's planner (its estimators have figures for it).
PLANNER_KERNEL = EmbeddingComputeKernel.FUSED.value
ROW_WISE = ShardingType.ROW_WISE.value
# The element size of the stand-in tensor: the kernels return float32 rows, which is what
# TorchRec's estimators read the tensor's dtype for (output and communication sizes).
_STAND_IN_DTYPE = torch.float32


def state_dim(optimizer: optim.RowOptimizer | None, embedding_dim: int) -> int:
    """S, optimizer state columns per row of a table of D = ``embedding_dim`` columns trained by
    ``optimizer`` (SGD 0, row-wise Adagrad 1, Adagrad D, Adam 2D; frozen 0)."""
    return 0 if optimizer is None else optimizer.state_dim(embedding_dim)


def table_slots(config: TableConfig) -> int:
    """C, slots of a collection table's index at its largest (``stats()["capacity"]`` once grown):
    ``config.capacity`` rounded up to whole buckets, more when ``init_capacity`` doubles past it."""
    return plan_buckets(config.capacity, config.init_capacity, config.bucket_capacity)[1] * config.bucket_capacity


def table_bytes(config: TableConfig, state_dim: int) -> int:
    """Memory of a dynemb table at capacity: its index (``index_bytes``) and its C rows of D
    embedding and S optimizer state columns in the table's dtype."""
    slots = table_slots(config)
    element = torch.empty(0, dtype=config.dtype).element_size()
    return index_bytes(slots) + slots * (config.embedding_dim + state_dim) * element


def stand_in(config: TableConfig, state_dim: int) -> torch.Tensor:
    """The meta float32 tensor ``[R, D]`` the planner sizes the table by:
    R = ceil(table_bytes / (4 D)), so its bytes are the table's at capacity rounded up to a row."""
    row = config.embedding_dim * torch.empty(0, dtype=_STAND_IN_DTYPE).element_size()
    rows = -(-table_bytes(config, state_dim) // row)
    return torch.empty((rows, config.embedding_dim), dtype=_STAND_IN_DTYPE, device="meta")


def stand_ins(module: EmbeddingBagCollection | EmbeddingCollection, fused_params: Mapping[str, Any] | None) -> dict[str, torch.Tensor]:
    """Table name -> :func:`stand_in` of each table of a dynemb module, in table order, with the
    optimizer the module's tables will train with under a sharder of ``fused_params``."""
    optimizer = module.sharding_optimizer(fused_params, warn_default=False)
    return {config.name: stand_in(config, state_dim(optimizer, config.embedding_dim)) for config in module.dynemb_configs}


def dynemb_params(module: torch.nn.Module, tables: list[str], params: Mapping[str, ParameterSharding]) -> dict[str, ParameterSharding]:
    """The plan's shardings of ``tables``, each checked (row-wise, the dynemb kernel under either
    of its names) and naming the dynemb kernel, as TorchRec's sharded modules must see it.

    Raises:
        ValueError: a table has no sharding, or one dynemb tables cannot take.
    """
    missing = [t for t in tables if t not in params]
    if missing:
        raise ValueError(
            f"{type(module).__name__}: the plan has no sharding for tables {missing}; plan the model with "
            "TorchRec's EmbeddingShardingPlanner and dynemb.torchrec.sharders(), or with dynemb.torchrec.plan(model, world_size)"
        )
    out = {}
    for t in tables:
        p = params[t]
        if p.sharding_type != ROW_WISE or p.compute_kernel not in (KERNEL, PLANNER_KERNEL):
            raise ValueError(
                f"table {t!r}: sharding_type={p.sharding_type!r}, compute_kernel={p.compute_kernel!r}; dynemb tables shard "
                f"{ROW_WISE!r} on the dynemb kernel, named {KERNEL!r} (dynemb.torchrec.plan) or {PLANNER_KERNEL!r} (TorchRec's planner)"
            )
        out[t] = p if p.compute_kernel == KERNEL else dataclasses.replace(p, compute_kernel=KERNEL)
    return out
