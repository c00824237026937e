"""Dtype conversions of TorchRec models on dynemb tables against TorchRec's own modules converted
the same way: DLRM's ``.double()`` (forward, backward, step) and the drop-in collections'
``.half()`` (docs/design/0021-dtype-moves.md).

B samples, F features, D embedding dim.
"""

from __future__ import annotations

import torch
from test_torchrec_dlrm import FEATURES, batch, bce, dlrm, tables, torchrec_twin
from test_torchrec_modules import FEATURES as MODULE_FEATURES
from test_torchrec_modules import bag_tables, seq_tables, torchrec_twin_ebc, torchrec_twin_ec
from torchrec_testing import ids, kjt, remap, single_ids

import dynemb
import dynemb.torchrec


def test_dlrm_double_trains_as_torchrecs_dlrm_double():
    vocab = ids(100, seed=3)
    ours = dlrm(dynemb.torchrec.EmbeddingBagCollection(tables(), optimizer=dynemb.optim.SGD(lr=0.2)))
    ebc = ours.sparse_arch.embedding_bag_collection
    # One float32 step first: the conversion meets trained rows.
    dense, features, label = batch(vocab, seed=0)
    bce(ours(dense, features).squeeze(1), label).backward()
    ref = torchrec_twin(ours, vocab)
    dense_names = {n for n, _ in ours.named_parameters()}

    assert ours.double() is ours
    ref.double()
    assert {p.dtype for p in ours.parameters()} == {torch.float64}
    assert [c.dtype for c in ebc.collection.table_configs] == [torch.float64] * len(FEATURES)
    for t, f in zip(tables(), FEATURES):
        chunk = next(ebc.collection.export(t.name))
        assert chunk["embeddings"].dtype == torch.float64
        # float32 -> float64 is exact: the same rows as TorchRec's converted weights.
        torch.testing.assert_close(
            ebc(single_ids(FEATURES, vocab))[f].double(), ref.sparse_arch.embedding_bag_collection.embedding_bags[t.name].weight, rtol=0, atol=0
        )

    ours_opt = torch.optim.SGD(ours.parameters(), lr=0.05)
    # TorchRec's dense embedding weights under plain SGD: the same update as dynemb's fused SGD.
    ref_opt = torch.optim.SGD(
        [{"params": [p for n, p in ref.named_parameters() if n in dense_names], "lr": 0.05},
         {"params": [p for n, p in ref.named_parameters() if n not in dense_names], "lr": 0.2}]
    )  # fmt: skip
    for step in range(1, 5):
        dense, features, label = batch(vocab, seed=step)
        loss_ours = bce(ours(dense.double(), features).squeeze(1), label.double())
        loss_ref = bce(ref(dense.double(), remap(features, vocab)).squeeze(1), label.double())
        assert loss_ours.dtype == torch.float64
        torch.testing.assert_close(loss_ours, loss_ref)
        for loss, opt in ((loss_ours, ours_opt), (loss_ref, ref_opt)):
            opt.zero_grad()
            loss.backward()
            opt.step()
    # TorchRec's EBC hands out float32 (it calls .float() on its pooled rows); so does the drop-in.
    after = ebc(single_ids(FEATURES, vocab))
    for t, f in zip(tables(), FEATURES):
        torch.testing.assert_close(after[f], ref.sparse_arch.embedding_bag_collection.embedding_bags[t.name].weight.float())
        assert next(ebc.collection.export(t.name))["embeddings"].dtype == torch.float64


def coefficients(values: torch.Tensor) -> torch.Tensor:
    """Loss weights like ``values``: multiples of 1/8, so every gradient and every sum of them is
    exact in float16 (dynemb and torch sum a key's gradients in different orders)."""
    n = values.numel()
    return ((torch.arange(n) % 17 - 8) / 8).view(values.shape).to(values.dtype)


def test_drop_in_ebc_half_matches_torchrecs_ebc_half():
    keys = ids(40, seed=4)
    ebc = dynemb.torchrec.EmbeddingBagCollection(bag_tables(), optimizer=dynemb.optim.SGD(lr=0.5))
    twin = torchrec_twin_ebc(ebc, keys)
    ebc.half()
    twin.half()
    assert [c.dtype for c in ebc.collection.table_configs] == [torch.float16] * 3
    ref_opt = torch.optim.SGD(twin.parameters(), lr=0.5)
    for step in range(3):
        features = kjt(MODULE_FEATURES, batch=8, vocab=keys, seed=step)
        ours, ref = ebc(features).values(), twin(remap(features, keys)).values()
        torch.testing.assert_close(ours, ref, rtol=0, atol=0)
        ref_opt.zero_grad()
        (ours * coefficients(ours)).sum().backward()
        (ref * coefficients(ref)).sum().backward()
        ref_opt.step()
    # SGD on float16 rows: torch's (CPU) rounds w - lr * g once, as dynemb's float32 update does.
    ours_rows = ebc(single_ids(MODULE_FEATURES, keys)).to_dict()
    ref_rows = twin(single_ids(MODULE_FEATURES, torch.arange(keys.numel()))).to_dict()
    for name in ours_rows:
        # Sum bags: every gradient is exact, results equal. Mean bags (t2, feature c): a gradient
        # is coefficient / length, rounded in float16 and summed per key in different orders by
        # dynemb and torch: a few float16 roundings apart after three steps.
        tol = dict(rtol=4 * torch.finfo(torch.float16).eps, atol=1e-5) if name == "c" else {}
        torch.testing.assert_close(ours_rows[name].half(), ref_rows[name].half(), **tol)


def test_drop_in_ec_half_matches_torchrecs_ec_half():
    keys = ids(40, seed=5)
    ec = dynemb.torchrec.EmbeddingCollection(seq_tables(), optimizer=dynemb.optim.Adagrad(lr=0.1))
    twin = torchrec_twin_ec(ec, keys)
    ec.half()
    twin.half()
    features = kjt(MODULE_FEATURES, batch=8, vocab=keys, seed=6)
    ours, ref = ec(features), twin(remap(features, keys))
    assert ours.keys() == ref.keys()
    for name in ours:
        torch.testing.assert_close(ours[name].values(), ref[name].values(), rtol=0, atol=0)
    # A training step in float16 runs and moves the rows it read.
    before = {t: next(ec.collection.export(t)) for t in ("e1", "e2")}
    sum(v.values().sum() for v in ours.values()).backward()
    for t in ("e1", "e2"):
        after = next(ec.collection.export(t))
        assert after["embeddings"].dtype == torch.float16 and bool(torch.isfinite(after["embeddings"]).all())
        assert not torch.equal(after["optimizer_state"], before[t]["optimizer_state"])
