"""The one engine: a plain table and a group's tables run the same code (docs/design/0024)."""

from __future__ import annotations

import inspect

import pytest
import torch

import dynemb
from dynemb.distributed.engine import ShardedEngine
from dynemb.nn.base import EngineContract
from dynemb.nn.engine import Engine, GroupEngine, TableEngine

D = 4


def config(name: str, seed: int, capacity: int = 256) -> dynemb.TableConfig:
    return dynemb.TableConfig(name=name, embedding_dim=D, capacity=capacity, seed=seed, score_strategy="step")


def test_former_twins_are_one_class():
    assert TableEngine is Engine and GroupEngine is Engine
    assert dynemb.DynamicEmbedding(D, 64).engine.__class__ is dynemb.DynamicEmbeddingCollection(tables=[config("a", 0)]).engines[0].__class__


def contract_names() -> set[str]:
    return {n for n in vars(EngineContract) if not n.startswith("_")} | set(EngineContract.__annotations__)


@pytest.mark.parametrize("cls", [Engine, ShardedEngine])
def test_both_engines_implement_every_name_of_the_contract(cls):
    # A sharded engine once forwarded names through __getattr__: each must be its own now.
    names = contract_names()
    assert {"resolve", "apply_gradients", "find", "write_rows", "erase", "export", "counters", "track_changes", "collective"} <= names
    # A local engine's data attributes are set per instance; a sharded one's are all properties.
    obj = Engine(config("a", 0)) if cls is Engine else cls
    assert sorted(n for n in names if not hasattr(obj, n)) == []
    assert not hasattr(cls, "__getattr__")
    for name in ("resolve", "find", "erase", "apply_gradients", "apply_pending", "write_rows"):
        ours = inspect.signature(getattr(cls, name)).parameters
        theirs = inspect.signature(getattr(EngineContract, name)).parameters
        assert list(theirs) == [p for p in ours if p in theirs], name


def test_an_engine_is_a_contract():
    assert isinstance(Engine(config("a", 0)), EngineContract)


def train(engine: Engine, keys: torch.Tensor, segments: torch.Tensor | None, steps: int = 3) -> list[torch.Tensor]:
    out = []
    for step in range(steps):
        r = engine.resolve(keys, segments, train=True, now=step)
        data = engine.gather(r.rows)
        out.append(data[:, :D].clone())
        grads = (keys.to(torch.float32)[:, None] % 7 + torch.arange(D)) / 10
        engine.apply_gradients(keys, r.rows, grads, segments=segments, data=data, version=engine.version)
    return out


def test_a_plain_engine_and_a_group_of_one_train_alike():
    keys = torch.tensor([-(2**63), -5, 0, 3, 2**40, 2**63 - 1])
    plain = Engine(config("a", 7), dynemb.optim.Adagrad(lr=0.1))
    group = Engine([config("a", 7)], dynemb.optim.Adagrad(lr=0.1))
    for a, b in zip(train(plain, keys, None), train(group, keys, torch.zeros_like(keys))):
        torch.testing.assert_close(a, b)
    assert plain.optimizer_steps == group.optimizer_steps == [3]
    assert plain.counters(0)["index"][:3] == group.counters(0)["index"][:3]


def test_each_table_of_a_group_trains_as_its_own_engine():
    # Two tables, each its own initialiser seed and step count, one index and one update a call.
    keys = torch.tensor([1, 2, 3, 1, 5])
    segments = torch.tensor([0, 0, 0, 1, 1])
    order = torch.argsort(segments * 100 + keys)
    keys, segments = keys[order], segments[order]
    group = Engine([config("a", 1), config("b", 2)], dynemb.optim.SGD(lr=0.5))
    alone = [Engine(config("a", 1), dynemb.optim.SGD(lr=0.5)), Engine(config("b", 2), dynemb.optim.SGD(lr=0.5))]
    together = train(group, keys, segments)
    for s, engine in enumerate(alone):
        mine = segments == s
        for a, b in zip(together, train(engine, keys[mine], None)):
            torch.testing.assert_close(a[mine], b)
    assert group.optimizer_steps == [3, 3]
    exported = {s: torch.cat([c["keys"] for c in group.export(s)]).sort().values for s in range(2)}
    assert exported[0].tolist() == [1, 2, 3] and exported[1].tolist() == [1, 5]


def test_counters_round_trip_through_the_contract():
    engine = Engine([config("a", 1), config("b", 2)], dynemb.optim.SGD(lr=0.1))
    keys, segments = torch.tensor([4, 9]), torch.tensor([0, 1])
    train(engine, keys, segments, steps=2)
    fresh = engine.fresh()
    for s in range(2):
        c = engine.counters(s)
        fresh.set_counters(
            s, optimizer_step=c["optimizer_step"], nonfinite_grads=c["nonfinite_grads"], index=c["index"], generator_state=c["generator"].get_state()
        )
        got = fresh.counters(s)
        assert (got["optimizer_step"], got["nonfinite_grads"], got["index"]) == (c["optimizer_step"], c["nonfinite_grads"], c["index"])
    assert fresh.table_stats(0)["size"] == 0
