"""Non-finite rows: insert refuses them; an update that would overflow a row follows the table's
``nonfinite_grads`` policy (skip and count, raise before any change, or apply); state_dicts
holding such rows load with a warning (docs/design/0020-nonfinite-rows.md)."""

from __future__ import annotations

import pytest
import torch

import dynemb

D = 4
BIG = 3e38  # finite in float32; times lr 10 (or squared) it is not
OPTIMIZERS = {
    "sgd": lambda: dynemb.optim.SGD(lr=10.0),
    "adagrad": lambda: dynemb.optim.Adagrad(lr=1.0),
    "rowwise_adagrad": lambda: dynemb.optim.RowWiseAdagrad(lr=1.0),
    "adam": lambda: dynemb.optim.Adam(lr=1.0),
}
KEYS = torch.tensor([7, -3, 2**62])


def rows_of(table, keys=KEYS) -> torch.Tensor:
    """Whole rows [N, D+S] (embedding and optimizer state) of keys, by key."""
    chunks = list(table.export())
    all_keys = torch.cat([c["keys"] for c in chunks])
    data = torch.cat([torch.cat([c["embeddings"], c["optimizer_state"]], 1) for c in chunks])
    pos = (all_keys[None, :] == keys[:, None]).nonzero()[:, 1]
    return data.index_select(0, pos)


def overflow_step(table, update="fused"):
    """One lookup of KEYS whose loss gives key -3 a gradient of BIG (finite) and the others 1."""
    out = table(KEYS)
    scale = torch.tensor([[1.0], [BIG], [1.0]])
    (out * scale).sum().backward()
    if update == "deferred":
        table.optimizer.step()


def make(optimizer: str, policy: str, update: str = "fused"):
    table = dynemb.DynamicEmbedding(D, 64, optimizer=OPTIMIZERS[optimizer](), nonfinite_grads=policy, update=update, score_strategy="step")
    table.insert(KEYS, torch.tensor([[0.5] * D, [BIG] * D, [-0.5] * D]))
    return table


@pytest.mark.parametrize("table_kind", ["sequence", "bag"])
@pytest.mark.parametrize(
    "bad_value,dtype", [(float("nan"), torch.float32), (float("inf"), torch.float32), (-float("inf"), torch.float32), (1e300, torch.float64)]
)
def test_insert_refuses_nonfinite_rows_and_changes_nothing(table_kind, bad_value, dtype):
    cls = dynemb.DynamicEmbedding if table_kind == "sequence" else dynemb.DynamicEmbeddingBag
    table = cls(D, 64, optimizer=dynemb.optim.Adam(lr=0.1))
    table.insert(torch.tensor([1]), torch.ones(1, D))
    before = table.state_dict()
    values = torch.zeros(3, D, dtype=dtype)
    values[1, 2] = bad_value
    with pytest.raises(ValueError, match=r"values: the rows of 1 key\(s\) \[5\] hold NaN or inf"):
        table.insert(torch.tensor([4, 5, 6]), values)
    after = table.state_dict()
    assert len(table) == 1 and all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("bag", [False, True], ids=["ec", "ebc"])
def test_collection_insert_refuses_nonfinite_rows(bag):
    tables = [dynemb.TableConfig(name="t", feature_names=["f"], embedding_dim=D, capacity=64)]
    cls = dynemb.DynamicEmbeddingBagCollection if bag else dynemb.DynamicEmbeddingCollection
    col = cls(tables, dynemb.optim.SGD(lr=0.1))
    values = torch.zeros(2, D)
    values[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"the rows of 1 key\(s\) \[8\] hold NaN or inf"):
        col.insert("t", torch.tensor([8, 9]), values)
    assert col.stats()["t"]["size"] == 0


@pytest.mark.parametrize("update", ["fused", "deferred"])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_overflowing_update_is_skipped_and_counted(optimizer, update):
    table = make(optimizer, "skip", update)
    before = rows_of(table)
    overflow_step(table, update)
    after = rows_of(table)
    # The overflowing key keeps its row and optimizer state; the others moved and stay finite.
    assert torch.equal(after[1], before[1])
    assert not torch.equal(after[0], before[0]) and not torch.equal(after[2], before[2])
    assert torch.isfinite(after).all()
    assert table.stats()["nonfinite_grads"] == 1
    # The same rows with a finite gradient train as before (the step count advanced once).
    assert table.engine.optimizer_step == 1


@pytest.mark.parametrize("update", ["fused", "deferred"])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_overflowing_update_raises_before_any_change(optimizer, update):
    table = make(optimizer, "raise", update)
    before = rows_of(table)
    with pytest.raises(FloatingPointError, match=r"would make the rows of 1 key\(s\) \[-3\] non-finite"):
        overflow_step(table, update)
    assert torch.equal(rows_of(table), before)
    assert table.engine.optimizer_step == 0 and table.stats()["nonfinite_grads"] == 0


@pytest.mark.parametrize("update", ["fused", "deferred"])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_overflowing_update_applies_when_asked(optimizer, update):
    table = make(optimizer, "apply", update)
    overflow_step(table, update)
    after = rows_of(table)
    assert not torch.isfinite(after[1]).all() and torch.isfinite(after[[0, 2]]).all()
    assert table.stats()["nonfinite_grads"] == 0


def test_collection_overflow_is_counted_per_table():
    tables = [dynemb.TableConfig(name=n, feature_names=[n], embedding_dim=D, capacity=64, score_strategy="step") for n in ("a", "b")]
    col = dynemb.DynamicEmbeddingCollection(tables, dynemb.optim.SGD(lr=10.0))
    col.insert("b", torch.tensor([1]), torch.full((1, D), BIG))
    out = col({"a": (torch.tensor([1]), torch.tensor([1])), "b": (torch.tensor([1]), torch.tensor([1]))})
    (out["a"][0].sum() + BIG * out["b"][0].sum()).backward()
    stats = col.stats()
    assert stats["a"]["nonfinite_grads"] == 0 and stats["b"]["nonfinite_grads"] == 1
    assert torch.equal(col.find("b", torch.tensor([1]))[0], torch.full((1, D), BIG))

    raising = dynemb.DynamicEmbeddingCollection(
        [dynemb.TableConfig(name=n, feature_names=[n], embedding_dim=D, capacity=64, nonfinite_grads="raise") for n in ("a", "b")],
        dynemb.optim.SGD(lr=10.0),
    )
    raising.insert("b", torch.tensor([1]), torch.full((1, D), BIG))
    out = raising({"a": (torch.tensor([1]), torch.tensor([1])), "b": (torch.tensor([1]), torch.tensor([1]))})
    before = raising.find("a", torch.tensor([1]))[0]
    with pytest.raises(FloatingPointError, match=r"of tables \['b'\]"):
        (out["a"][0].sum() + BIG * out["b"][0].sum()).backward()
    assert torch.equal(raising.find("a", torch.tensor([1]))[0], before)


def test_state_dict_with_nonfinite_rows_loads_with_a_warning():
    table = make("sgd", "apply")
    overflow_step(table)
    state = table.state_dict()
    other = make("sgd", "apply")
    with pytest.warns(RuntimeWarning, match=r"the rows of 1 key\(s\) \[-3\] hold NaN or inf"):
        other.load_state_dict(state)
    assert torch.equal(rows_of(other), rows_of(table))


def test_collection_state_dict_with_nonfinite_rows_loads_with_a_warning():
    def build():
        tables = [dynemb.TableConfig(name="t", feature_names=["f"], embedding_dim=D, capacity=64, nonfinite_grads="apply")]
        return dynemb.DynamicEmbeddingBagCollection(tables, dynemb.optim.SGD(lr=10.0))

    col = build()
    col.insert("t", torch.tensor([3]), torch.full((1, D), BIG))
    col({"f": (torch.tensor([3]), torch.tensor([1]))}).concat.mul(BIG).sum().backward()
    assert torch.isinf(col.find("t", torch.tensor([3]))[0]).all()
    other = build()
    with pytest.warns(RuntimeWarning, match=r"'t.embeddings'.*\[3\] hold NaN or inf"):
        other.load_state_dict(col.state_dict())
    assert torch.equal(other.find("t", torch.tensor([3]))[0], col.find("t", torch.tensor([3]))[0])


@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_collection_deferred_overflow_follows_the_policy(policy):
    tables = [dynemb.TableConfig(name=n, feature_names=[n], embedding_dim=D, capacity=64, nonfinite_grads=policy) for n in ("a", "b")]
    col = dynemb.DynamicEmbeddingCollection(tables, dynemb.optim.Adagrad(lr=1.0), update="deferred")
    col.insert("b", torch.tensor([1, 2]), torch.full((2, D), 0.5))
    out = col({"a": (torch.tensor([1]), torch.tensor([1])), "b": (torch.tensor([1, 2]), torch.tensor([2]))})
    # Key 1 of b: gradient 3e38, whose square overflows Adagrad's accumulator; key 2 of b: 1.
    scale = torch.tensor([[BIG], [1.0]])
    (out["a"][0].sum() + (out["b"][0] * scale).sum()).backward()
    # Both tables are one group (same config): one step updates both, or neither.
    a_before, b_before = col.find("a", torch.tensor([1]))[0], col.find("b", torch.tensor([1, 2]))[0]
    if policy == "raise":
        with pytest.raises(FloatingPointError, match=r"would make the rows of 1 key\(s\) \[1\] non-finite .* of tables \['b'\]"):
            col.optimizer.step()
        assert torch.equal(col.find("b", torch.tensor([1, 2]))[0], b_before)
        assert torch.equal(col.find("a", torch.tensor([1]))[0], a_before)
        # The gradient stays pending (0011): zero_grad drops it.
        assert col.pending_keys("b").tolist() == [1, 2]
        return
    col.optimizer.step()
    after = col.find("b", torch.tensor([1, 2]))[0]
    assert torch.equal(after[0], b_before[0]) and not torch.equal(after[1], b_before[1])
    assert not torch.equal(col.find("a", torch.tensor([1]))[0], a_before)
    stats = col.stats()
    assert (stats["a"]["nonfinite_grads"], stats["b"]["nonfinite_grads"]) == (0, 1)


def test_raise_names_gradient_and_overflow_keys_apart():
    table = make("sgd", "raise")
    out = table(KEYS)
    # Key 7: NaN gradient; key -3: finite gradient whose update overflows; key 2**62: fine.
    scale = torch.tensor([[float("nan")], [BIG], [1.0]])
    before = rows_of(table)
    with pytest.raises(FloatingPointError) as info:
        (out * scale).sum().backward()
    message = str(info.value)
    assert "non-finite gradient for 1 key(s) [7]" in message
    assert "the update would make the rows of 1 key(s) [-3] non-finite" in message
    assert str(2**62) not in message
    assert torch.equal(rows_of(table), before)


@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_a_row_already_nonfinite_is_not_updated(policy):
    """A row loaded with NaN (0020: state_dicts load it with a warning) gets no update under
    'skip' (counted every time) and raises under 'raise', though its gradient is finite."""
    source = make("adam", "apply")
    overflow_step(source)
    state = source.state_dict()
    table = make("adam", policy)
    with pytest.warns(RuntimeWarning, match=r"\[-3\] hold NaN or inf"):
        table.load_state_dict(state)
    before = rows_of(table)
    out = table(KEYS)
    if policy == "raise":
        with pytest.raises(FloatingPointError, match=r"rows of 1 key\(s\) \[-3\] non-finite .*already held NaN or inf"):
            out.sum().backward()
        assert torch.equal(rows_of(table).view(torch.uint8), before.view(torch.uint8))
        return
    out.sum().backward()
    after = rows_of(table)
    assert torch.equal(after[1].view(torch.uint8), before[1].view(torch.uint8))
    assert torch.isfinite(after[[0, 2]]).all() and not torch.equal(after[0], before[0])
    assert table.stats()["nonfinite_grads"] == 1


class Frozen(dynemb.optim.RowOptimizer):
    """An optimizer whose update ignores the gradient: a NaN gradient leaves every row finite."""

    def state_dim(self, embedding_dim: int) -> int:
        return 0

    def update(self, weight, state, grad, step):
        weight.mul_(0.5)


@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_a_nonfinite_gradient_is_screened_whatever_the_optimizer_makes_of_it(policy):
    table = dynemb.DynamicEmbedding(D, 64, optimizer=Frozen(lr=1.0), nonfinite_grads=policy)
    table.insert(KEYS, torch.ones(3, D))
    out = table(KEYS)
    scale = torch.tensor([[1.0], [float("inf")], [1.0]])
    if policy == "raise":
        with pytest.raises(FloatingPointError, match=r"non-finite gradient for 1 key\(s\) \[-3\]"):
            (out * scale).sum().backward()
        assert torch.equal(rows_of(table), torch.ones(3, D))
        return
    (out * scale).sum().backward()
    assert torch.equal(rows_of(table), torch.tensor([[0.5] * D, [1.0] * D, [0.5] * D]))
    assert table.stats()["nonfinite_grads"] == 1
