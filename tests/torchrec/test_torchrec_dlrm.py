"""TorchRec's DLRM, unchanged, on dynemb tables: parity with DLRM on TorchRec's own EBC holding
the same rows (remapped ids), training on the whole int64 range, state_dict round trip, and the
example script.

B samples, F features, D embedding dim.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import io
import pathlib

import torch
import torchrec
from torchrec import EmbeddingBagConfig
from torchrec.models.dlrm import DLRM
from torchrec_testing import ids, kjt, remap, single_ids

import dynemb
import dynemb.torchrec

FEATURES = ["user", "item", "history"]
EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "torchrec_dlrm.py"
bce = torch.nn.functional.binary_cross_entropy_with_logits


def tables() -> list[EmbeddingBagConfig]:
    return [EmbeddingBagConfig(name=f"t_{f}", embedding_dim=8, num_embeddings=256, feature_names=[f]) for f in FEATURES]


def dlrm(ebc) -> DLRM:
    return DLRM(embedding_bag_collection=ebc, dense_in_features=4, dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[16, 1])


def batch(vocab: torch.Tensor, seed: int, size: int = 16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(size, 4, generator=g), kjt(FEATURES, batch=size, vocab=vocab, seed=seed), torch.randint(0, 2, (size,), generator=g).float()


def torchrec_twin(ours: DLRM, vocab: torch.Tensor) -> DLRM:
    """TorchRec's own DLRM holding our DLRM's rows of ``vocab`` [V] at positions 0..V-1 and the
    same dense weights."""
    rows = ours.sparse_arch.embedding_bag_collection(single_ids(FEATURES, vocab))
    twin_tables = [dataclasses.replace(t, num_embeddings=vocab.numel()) for t in tables()]
    ref = dlrm(torchrec.EmbeddingBagCollection(twin_tables))
    with torch.no_grad():
        for t, f in zip(tables(), FEATURES):
            ref.sparse_arch.embedding_bag_collection.embedding_bags[t.name].weight.copy_(rows[f])
        for name, p in ours.named_parameters():
            if not p.is_meta:  # the dynemb tables' handles have no TorchRec twin
                ref.get_parameter(name).copy_(p)
    return ref


def test_dlrm_matches_torchrec_dlrm_step_by_step():
    vocab = ids(100, seed=0)  # 0, -1, int64 min and max among them
    ours = dlrm(dynemb.torchrec.EmbeddingBagCollection(tables(), optimizer=dynemb.optim.SGD(lr=0.2)))
    # TorchRec's twin: the same rows at positions 0..99, the same dense weights.
    ref = torchrec_twin(ours, vocab)
    dense_names = {n for n, _ in ours.named_parameters()}
    ours_opt = torch.optim.SGD(ours.parameters(), lr=0.05)
    # TorchRec's dense embedding weights under plain SGD: the same update as dynemb's fused SGD.
    ref_opt = torch.optim.SGD(
        [{"params": [p for n, p in ref.named_parameters() if n in dense_names], "lr": 0.05},
         {"params": [p for n, p in ref.named_parameters() if n not in dense_names], "lr": 0.2}]
    )  # fmt: skip
    for step in range(5):
        dense, features, label = batch(vocab, seed=step)
        loss_ours = bce(ours(dense, features).squeeze(1), label)
        loss_ref = bce(ref(dense, remap(features, vocab)).squeeze(1), label)
        torch.testing.assert_close(loss_ours, loss_ref)
        for loss, opt in ((loss_ours, ours_opt), (loss_ref, ref_opt)):
            opt.zero_grad()
            loss.backward()
            opt.step()
    after = ours.sparse_arch.embedding_bag_collection(single_ids(FEATURES, vocab))
    for t, f in zip(tables(), FEATURES):
        torch.testing.assert_close(after[f], ref.sparse_arch.embedding_bag_collection.embedding_bags[t.name].weight)


def test_dlrm_state_dict_round_trip():
    vocab = ids(200, seed=1)

    def make():
        return dlrm(dynemb.torchrec.EmbeddingBagCollection(tables(), optimizer=dynemb.optim.Adagrad(lr=0.1)))

    model = make()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(10):
        dense, features, label = batch(vocab, seed=10 + step)
        loss = bce(model(dense, features).squeeze(1), label)
        opt.zero_grad()
        loss.backward()
        opt.step()
    state = model.state_dict()
    # The dynemb tables, no dense [num_embeddings, D] weight.
    assert not any(k.endswith(".weight") and "embedding_bag" in k for k in state)
    assert any(k.startswith("sparse_arch.embedding_bag_collection.collection.") for k in state)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    fresh = make()
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    dense, features, _ = batch(vocab, seed=99, size=64)
    model.eval()
    fresh.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(dense, features), fresh(dense, features))
    assert fresh.sparse_arch.embedding_bag_collection.stats() == model.sparse_arch.embedding_bag_collection.stats()


def test_example_trains_dlrm_and_the_loss_falls(capsys):
    spec = importlib.util.spec_from_file_location("torchrec_dlrm_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    result = example.main(["--steps", "200", "--batch-size", "256", "--device", "cpu", "--log-every", "50"])
    out = capsys.readouterr().out
    assert "step   200" in out and "held-out loss" in out
    # Chance is ~0.69; the planted signal reaches ~0.21 and 200 steps get well below 0.5.
    assert result["held_out_before"] > 0.6
    assert result["held_out_after"] < 0.5
    assert result["last_train_loss"] < result["first_train_loss"] - 0.1
    # The adversarial ids were trained like any other.
    assert example.SPECIAL.tolist() == [0, -1, -(2**63), 2**63 - 1] and result["special_ids_trained"]


def test_dlrm_with_deferred_updates_equals_fused():
    """update="deferred": the sparse rows change at the dynemb optimizer's step(), beside the dense one."""
    vocab = ids(100, seed=2)
    sparse = dynemb.optim.Adagrad(lr=0.1)
    deferred = dlrm(dynemb.torchrec.EmbeddingBagCollection(tables(), optimizer=sparse, update="deferred"))
    fused = dlrm(dynemb.torchrec.EmbeddingBagCollection(tables(), optimizer=dynemb.optim.Adagrad(lr=0.1)))
    fused.load_state_dict(deferred.state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (deferred, fused)]
    for step in range(3):
        dense, features, label = batch(vocab, seed=50 + step)
        for model, opt in zip((deferred, fused), opts):
            opt.zero_grad()
            bce(model(dense, features).squeeze(1), label).backward()
            opt.step()
        sparse.step()
        sparse.zero_grad()
        torch.testing.assert_close(deferred(dense, features), fused(dense, features))
