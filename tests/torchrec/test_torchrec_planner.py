"""TorchRec's own planner plans dynemb tables (docs/design/0031-torchrec-planner.md):
``EmbeddingShardingPlanner.plan`` / ``collective_plan`` put every table of a dynemb EBC and EC
row-wise on the dynemb kernel, sized as a dynamic table at capacity (index, rows, optimizer
state) on DDR (CPU) or HBM (CUDA); a Topology that cannot hold them raises TorchRec's planner
error; ParameterConstraints are honoured; and DMP with the sharders and no plan trains exactly
like DMP with dynemb.torchrec.plan() (W = 2, gloo processes spawned here).

W ranks, B samples per rank, D embedding dim, C slots of a table at capacity, S optimizer state
columns per row.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
import torchrec
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec import EmbeddingBagConfig, EmbeddingConfig, KeyedJaggedTensor, PoolingType
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs_registry
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.types import PlannerError
from torchrec.distributed.types import ShardingType
from torchrec_testing import ids, kjt

import dynemb
import dynemb.torchrec
from dynemb.table.geometry import index_bytes
from spawning import run_ranks

D = 8
B = 4
STEPS = 3
ROW_WISE = ShardingType.ROW_WISE.value
BAG_FEATURES = ["user", "item"]
SEQ_FEATURES = ["query"]
TIMEOUT_S = 150.0
# S per row of each dynemb optimizer (dynemb/optim/README.md).
STATE = {None: 0, "sgd": 0, "row_wise_adagrad": 1, "adagrad": D, "adam": 2 * D}
OPTIMIZERS = {
    None: lambda: None,
    "sgd": lambda: dynemb.optim.SGD(lr=0.1),
    "row_wise_adagrad": lambda: dynemb.optim.RowWiseAdagrad(lr=0.1),
    "adagrad": lambda: dynemb.optim.Adagrad(lr=0.1),
    "adam": lambda: dynemb.optim.Adam(lr=0.1),
}


@pytest.fixture(autouse=True)
def _quiet_planner():
    # TorchRec's planner logs its plan and topology warnings at WARNING on every call.
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    yield
    logging.disable(previous)


class _Model(torch.nn.Module):
    """A dynemb EBC (SUM and MEAN tables) and EC -> one score per sample."""

    def __init__(self, capacity: int = 256, optimizer=lambda: dynemb.optim.Adagrad(lr=0.1)):
        super().__init__()
        bags = [
            EmbeddingBagConfig(name="t_user", embedding_dim=D, num_embeddings=capacity, feature_names=["user"]),
            EmbeddingBagConfig(name="t_item", embedding_dim=D, num_embeddings=capacity, feature_names=["item"], pooling=PoolingType.MEAN),
        ]
        self.ebc = dynemb.torchrec.EmbeddingBagCollection(bags, optimizer=optimizer())
        self.ec = dynemb.torchrec.EmbeddingCollection(
            [EmbeddingConfig(name="t_query", embedding_dim=D, num_embeddings=capacity, feature_names=["query"])], optimizer=optimizer()
        )
        self.head = torch.nn.Linear(2 * D, 1)

    def forward(self, bags: KeyedJaggedTensor, queries: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.ebc(bags).values()  # [B, 2D]
        rows = self.ec(queries)["query"]
        # Sum of each sample's query rows: [B, D].
        per_sample = torch.zeros(pooled.shape[0], D).index_add_(0, torch.repeat_interleave(torch.arange(pooled.shape[0]), rows.lengths()), rows.values())
        return self.head(pooled) + per_sample.sum(1, keepdim=True)  # [B, 1]


def _table_bytes(module, table: str, state: int, element_size: int = 4) -> int:
    """A dynemb table at capacity: C slots (its stats()) of index and D + S columns."""
    slots = module.stats()[table]["capacity"]
    return index_bytes(slots) + slots * (D + state) * element_size


def _as_float32_rows(nbytes: int) -> int:
    """nbytes rounded up to whole float32 rows of D, as the planner is shown them."""
    return -(-nbytes // (4 * D)) * 4 * D


def _options(model, topology: Topology, sharders, constraints=None) -> dict[str, list]:
    """Table -> its sharding options' shard storages, as TorchRec's planner enumerates them."""
    found = EmbeddingEnumerator(topology, batch_size=512, constraints=constraints).enumerate(model, sharders)
    return {o.name: o for o in found}


class _RowWiseStockSharder(EmbeddingBagCollectionSharder):
    """TorchRec's EBC sharder, row-wise on CPU too (its own leaves ROW_WISE out on CPU)."""

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return [ROW_WISE]


def test_the_planner_plans_every_dynemb_table_row_wise_on_the_dynemb_kernel():
    model = _Model()
    for device in ("cpu", "cuda"):
        planner = EmbeddingShardingPlanner(topology=Topology(world_size=2, compute_device=device))
        result = planner.plan(model, dynemb.torchrec.sharders())
        assert sorted(result.plan) == ["ebc", "ec"]
        tables = {**result.plan["ebc"], **result.plan["ec"]}
        assert sorted(tables) == ["t_item", "t_query", "t_user"]
        for p in tables.values():
            # The name TorchRec's estimators know for the dynemb kernel (the sharders map it back).
            assert (p.sharding_type, p.compute_kernel, p.ranks) == (ROW_WISE, "fused", [0, 1])
            assert [s.placement.device().type for s in p.sharding_spec.shards] == [device, device]


def test_the_planner_plans_torchrecs_own_tables_beside_dynembs():
    model = torch.nn.Module()
    model.dyn = _Model().ebc
    model.stock = torchrec.EmbeddingBagCollection(
        [EmbeddingBagConfig(name="t_stock", embedding_dim=D, num_embeddings=64, feature_names=["stock"])], device=torch.device("meta")
    )
    sharders = [*dynemb.torchrec.sharders(), EmbeddingBagCollectionSharder()]
    result = EmbeddingShardingPlanner(topology=Topology(world_size=2, compute_device="cpu")).plan(model, sharders)
    assert {t: p.sharding_type for t, p in result.plan["dyn"].items()} == {"t_user": ROW_WISE, "t_item": ROW_WISE}
    # TorchRec's sharder on CPU offers no row-wise: its table is placed its own way.
    assert result.plan["stock"]["t_stock"].sharding_type != ROW_WISE


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_the_planner_sizes_a_table_as_index_rows_and_optimizer_state_at_capacity(optimizer):
    # 1000 rows round up to 1008 slots (63 buckets of 16): the figure is the index's, not num_embeddings.
    config = EmbeddingBagConfig(name="t", embedding_dim=D, num_embeddings=1000, feature_names=["f"])
    dyn = dynemb.torchrec.EmbeddingBagCollection([config], optimizer=OPTIMIZERS[optimizer]())
    stock = torchrec.EmbeddingBagCollection([config], device=torch.device("meta"))
    expected = _as_float32_rows(_table_bytes(dyn, "t", STATE[optimizer]))
    assert dyn.stats()["t"]["capacity"] == 1008
    tensor = dynemb.torchrec.sharders()[0].shardable_parameters(dyn)["t"]
    assert (tensor.numel() * tensor.element_size(), tensor.shape[1], tensor.device.type) == (expected, D, "meta")
    for device, memory in (("cpu", "ddr"), ("cuda", "hbm")):
        topology = Topology(world_size=2, compute_device=device)
        mine = _options(dyn, topology, dynemb.torchrec.sharders())["t"]
        theirs = _options(stock, topology, [_RowWiseStockSharder()], {"t": ParameterConstraints(compute_kernels=["fused"])})["t"]
        assert mine.compute_kernel == theirs.compute_kernel == "fused"
        # Same inputs and outputs per shard; the table's part is 1000 x D floats for TorchRec's
        # table and the dynamic table's bytes for dynemb's.
        total = {who: sum(getattr(s.storage, memory) for s in o.shards) for who, o in (("mine", mine), ("theirs", theirs))}
        assert total["mine"] - total["theirs"] == expected - 1000 * D * 4
        other = "hbm" if memory == "ddr" else "ddr"
        assert all(getattr(s.storage, other) == 0 for s in mine.shards)


def test_table_dtype_and_init_capacity_enter_the_figure():
    config = EmbeddingConfig(name="t", embedding_dim=D, num_embeddings=1000, feature_names=["f"])
    options = {"t": {"dtype": torch.bfloat16, "init_capacity": 100}}
    ec = dynemb.torchrec.EmbeddingCollection([config], options=options, optimizer=dynemb.optim.Adam(lr=0.1))
    # The index grows from 100 keys by doubling to at least 1000 slots: its largest size counts.
    slots = ec.stats()["t"]["capacity"]
    assert slots >= 1000
    tensor = dynemb.torchrec.sharders()[1].shardable_parameters(ec)["t"]
    assert tensor.numel() * tensor.element_size() == _as_float32_rows(_table_bytes(ec, "t", 2 * D, element_size=2))


def test_fused_params_optimizer_decides_the_state_of_a_module_without_one():
    config = EmbeddingBagConfig(name="t", embedding_dim=D, num_embeddings=512, feature_names=["f"])
    unchosen = dynemb.torchrec.EmbeddingBagCollection([config])
    for kind, state in ((EmbOptimType.EXACT_ROWWISE_ADAGRAD, 1), (EmbOptimType.EXACT_ADAGRAD, D), (EmbOptimType.ADAM, 2 * D), (EmbOptimType.EXACT_SGD, 0)):
        sharder = dynemb.torchrec.DynamicEmbeddingBagCollectionSharder(fused_params={"optimizer": kind, "learning_rate": 0.1})
        tensor = sharder.shardable_parameters(unchosen)["t"]
        assert tensor.numel() * 4 == _as_float32_rows(_table_bytes(unchosen, "t", state)), kind
    # The module's own optimizer decides when it has one; fused_params naming another conflict.
    adagrad = dynemb.torchrec.EmbeddingBagCollection([config], optimizer=dynemb.optim.RowWiseAdagrad(lr=0.1))
    assert dynemb.torchrec.sharders()[0].shardable_parameters(adagrad)["t"].numel() * 4 == _as_float32_rows(_table_bytes(adagrad, "t", 1))
    sharder = dynemb.torchrec.DynamicEmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.ADAM})
    with pytest.raises(ValueError, match="optimizer= chose.*RowWiseAdagrad.*fused_params chose.*Adam"):
        sharder.shardable_parameters(adagrad)
    lamb = dynemb.torchrec.DynamicEmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.LAMB})
    with pytest.raises(ValueError, match=r"optimizer=.*LAMB.*not supported"):
        lamb.shardable_parameters(unchosen)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_topology_too_small_for_the_dynamic_table_raises(device):
    # 2**14 keys, Adam: 122 bytes a slot (26 index, 8 + 16 float32 columns) against the
    # 32 of a stock row: 1 MB a rank against 0.26 MB. A cap of 0.6 MB a rank holds TorchRec's
    # own table of this shape, not the dynamic one; 2 MB holds it.
    config = EmbeddingBagConfig(name="t", embedding_dim=D, num_embeddings=2**14, feature_names=["f"])
    dyn = dynemb.torchrec.EmbeddingBagCollection([config], optimizer=dynemb.optim.Adam(lr=0.1))
    stock = torchrec.EmbeddingBagCollection([config], device=torch.device("meta"))
    row_wise = {"t": ParameterConstraints(sharding_types=[ROW_WISE], compute_kernels=["fused"])}

    def planner(cap_bytes: int, constraints=None) -> EmbeddingShardingPlanner:
        cap = {"hbm_cap": cap_bytes} if device == "cuda" else {"ddr_cap": cap_bytes}
        return EmbeddingShardingPlanner(topology=Topology(world_size=2, compute_device=device, **cap), constraints=constraints)

    small, large = 600_000, 2_000_000
    assert planner(small, row_wise).plan(stock, [_RowWiseStockSharder()]).plan[""]["t"].sharding_type == ROW_WISE
    with pytest.raises(PlannerError):
        planner(small).plan(dyn, dynemb.torchrec.sharders())
    assert planner(large).plan(dyn, dynemb.torchrec.sharders()).plan[""]["t"].compute_kernel == "fused"


def test_parameter_constraints_are_honoured():
    model = _Model()
    topology = Topology(world_size=2, compute_device="cpu")
    allowed = {"t_user": ParameterConstraints(sharding_types=[ROW_WISE], compute_kernels=["fused"], pooling_factors=[3.0])}
    assert EmbeddingShardingPlanner(topology=topology, constraints=allowed).plan(model, dynemb.torchrec.sharders()).plan["ebc"]["t_user"].ranks == [0, 1]
    # Placements dynemb's shardings cannot build are refused by TorchRec's enumerator.
    for refused in (
        ParameterConstraints(sharding_types=[ShardingType.TABLE_WISE.value]),
        ParameterConstraints(compute_kernels=["fused_uvm"]),
        ParameterConstraints(sharding_types=[ShardingType.DATA_PARALLEL.value], compute_kernels=["dense"]),
    ):
        with pytest.raises(RuntimeError, match="t_item"):
            EmbeddingShardingPlanner(topology=topology, constraints={"t_item": refused}).plan(model, dynemb.torchrec.sharders())
    # Pooling factors reach the figures: more ids a sample, more input bytes on each shard.
    light = _options(model, topology, dynemb.torchrec.sharders(), {"t_user": ParameterConstraints(pooling_factors=[1.0])})["t_user"]
    heavy = _options(model, topology, dynemb.torchrec.sharders(), {"t_user": ParameterConstraints(pooling_factors=[50.0])})["t_user"]
    assert all(h.storage.ddr > s.storage.ddr for h, s in zip(heavy.shards, light.shards))


def test_sharders_take_torchrecs_constructor_arguments():
    registry = get_qcomm_codecs_registry(QCommsConfig(forward_precision=CommType.FP16))
    fused = {"learning_rate": 0.05}
    for cls in (dynemb.torchrec.DynamicEmbeddingBagCollectionSharder, dynemb.torchrec.DynamicEmbeddingCollectionSharder):
        sharder = cls(fused_params=fused, qcomm_codecs_registry=registry)
        assert sharder.fused_params == fused and sharder.qcomm_codecs_registry is registry
        assert cls().fused_params is None and cls().qcomm_codecs_registry is None
    assert {type(s) for s in dynemb.torchrec.sharders()} == {
        dynemb.torchrec.DynamicEmbeddingBagCollectionSharder,
        dynemb.torchrec.DynamicEmbeddingCollectionSharder,
    }
    # The planner reads the codecs' sizes (fp16 forward pooled outputs) from the sharder.
    plan = EmbeddingShardingPlanner(topology=Topology(world_size=2, compute_device="cpu")).plan(
        _Model(), [dynemb.torchrec.DynamicEmbeddingBagCollectionSharder(qcomm_codecs_registry=registry), dynemb.torchrec.sharders()[1]]
    )
    assert sorted(plan.plan) == ["ebc", "ec"]


def _batches(rank: int, step: int) -> tuple[KeyedJaggedTensor, KeyedJaggedTensor]:
    vocab = ids(48, seed=step)
    return kjt(BAG_FEATURES, B, vocab, seed=10 * step + rank), kjt(SEQ_FEATURES, B, vocab, seed=1000 + 10 * step + rank)


def _rows(sharded, table: str) -> dict[int, torch.Tensor]:
    """This rank's rows of ``table`` by key: embedding and optimizer state."""
    out = {}
    for chunk in sharded.local_collection(table).export(table):
        for k, e, s in zip(chunk["keys"].tolist(), chunk["embeddings"], chunk["optimizer_state"]):
            out[k] = torch.cat([e, s])
    return out


def _planned_like_plan_worker(rank: int, world: int) -> None:
    sharders = dynemb.torchrec.sharders()
    # collective_plan: rank 0 plans, every rank gets the same plan.
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=world, compute_device="cpu"))
    collective = planner.collective_plan(_Model(), sharders, dist.group.WORLD)
    summary = {(m, t): (p.sharding_type, p.compute_kernel, tuple(p.ranks)) for m, ps in collective.plan.items() for t, p in ps.items()}
    everyone: list = [None] * world
    dist.all_gather_object(everyone, summary)
    assert all(s == summary for s in everyone)
    assert set(summary.values()) == {(ROW_WISE, "fused", (0, 1))}

    torch.manual_seed(0)
    planned = DistributedModelParallel(_Model(), device=torch.device("cpu"), sharders=dynemb.torchrec.sharders())
    torch.manual_seed(0)
    reference = _Model()
    shortcut = DistributedModelParallel(reference, device=torch.device("cpu"), plan=dynemb.torchrec.plan(reference, world), sharders=dynemb.torchrec.sharders())
    # The plans name the dynemb kernel differently; both models run it (local_collection finds it).
    assert planned.plan.plan["ebc"]["t_user"].compute_kernel == "fused"
    assert shortcut.plan.plan["ebc"]["t_user"].compute_kernel == "customized_kernel"
    for m in (planned, shortcut):
        assert type(m.module.ebc).__name__ == "ShardedDynamicEmbeddingBagCollection"
        assert type(m.module.ec).__name__ == "ShardedDynamicEmbeddingCollection"
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (planned, shortcut)]
    for step in range(STEPS):
        bags, queries = _batches(rank, step)
        losses = [(m(bags, queries) ** 2).mean() for m in (planned, shortcut)]
        # The same kernels in the same order on both models: equal bit for bit.
        torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0, msg=lambda m, step=step: f"step {step}: {m}")
        for loss, opt in zip(losses, opts):
            opt.zero_grad()
            loss.backward()
            opt.step()
    for module, table in (("ebc", "t_user"), ("ebc", "t_item"), ("ec", "t_query")):
        mine, theirs = (_rows(getattr(m.module, module), table) for m in (planned, shortcut))
        assert mine and mine.keys() == theirs.keys(), table
        for key, row in theirs.items():
            torch.testing.assert_close(mine[key], row, rtol=0, atol=0, msg=lambda m, key=key, table=table: f"{table} {key}: {m}")


def test_dmp_without_a_plan_trains_like_dmp_with_the_plan_shortcut():
    run_ranks(_planned_like_plan_worker, 2, timeout_s=TIMEOUT_S)
