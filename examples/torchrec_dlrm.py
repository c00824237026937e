"""TorchRec's DLRM, unchanged, on dynemb tables: raw int64 ids, no remapping, no id bound.

    python examples/torchrec_dlrm.py                      # CPU, a few seconds
    python examples/torchrec_dlrm.py --steps 1000 --batch-size 512

B samples per batch, D embedding dim, F sparse features, V ids per feature's vocabulary.

The click task is synthetic. Each feature's vocabulary is V ids scattered over the whole int64
range (0, -1, int64 min and max among them). Every id has a hidden sign taken from a hash of it;
a click happens with probability sigmoid(3 * sign(user) * sign(item) + dense[0]), so the model
must learn per-id embeddings whose interaction recovers the product of signs. The held-out loss
falls from about 0.69 towards the planted signal's own loss (printed beside it).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.models.dlrm import DLRM

import dynemb
import dynemb.torchrec
from dynemb.hashing import mix64

FEATURES = ("user", "item", "history")
SPECIAL = torch.tensor([0, -1, -(2**63), 2**63 - 1])  # adversarial ids, always in the vocabulary
DENSE = 4


def vocabulary(size: int, salt: int) -> torch.Tensor:
    """[V] distinct int64 ids spread over the whole int64 range, the four special ids first."""
    spread = mix64(torch.arange(size - len(SPECIAL), dtype=torch.int64) + (salt << 32))
    return torch.cat([SPECIAL, spread])


def hidden_sign(ids: torch.Tensor, salt: int) -> torch.Tensor:
    """+1 or -1 per id ([N] -> [N] float32), fixed by a hash of the id."""
    return ((mix64(ids ^ salt) >> 17) & 1).float() * 2 - 1


class ClickTask:
    """Endless batches: dense [B, 4], KJT (user, item: one id; history: 0-3 ids), click [B]."""

    def __init__(self, vocab: int, seed: int):
        self.gen = torch.Generator().manual_seed(seed)
        self.users = vocabulary(vocab, 1)
        self.items = vocabulary(vocab, 2)

    def batch(self, size: int) -> tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor, torch.Tensor]:
        g = self.gen
        users = self.users[torch.randint(len(self.users), (size,), generator=g)]
        items = self.items[torch.randint(len(self.items), (size,), generator=g)]
        history_len = torch.randint(0, 4, (size,), generator=g)
        history = self.items[torch.randint(len(self.items), (int(history_len.sum()),), generator=g)]
        dense = torch.randn(size, DENSE, generator=g)
        logit = 3.0 * hidden_sign(users, 11) * hidden_sign(items, 12) + dense[:, 0]
        click = torch.bernoulli(torch.sigmoid(logit), generator=g)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=list(FEATURES),
            values=torch.cat([users, items, history]),
            lengths=torch.cat([torch.ones(size, dtype=torch.int64), torch.ones(size, dtype=torch.int64), history_len]),
        )
        return dense, kjt, click, logit


def build_model(embedding_dim: int, capacity: int, sparse_lr: float, device: str) -> DLRM:
    """TorchRec's DLRM around a dynemb EmbeddingBagCollection (one table per feature)."""
    tables = [EmbeddingBagConfig(name=f"t_{f}", embedding_dim=embedding_dim, num_embeddings=capacity, feature_names=[f]) for f in FEATURES]
    ebc = dynemb.torchrec.EmbeddingBagCollection(tables, optimizer=dynemb.optim.Adagrad(lr=sparse_lr), device=device)
    return DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=DENSE,
        dense_arch_layer_sizes=[32, embedding_dim],
        over_arch_layer_sizes=[32, 1],
        dense_device=torch.device(device),
    )


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--device", default="cpu")
    p.add_argument("--vocab", type=int, default=1000, help="ids per feature")
    p.add_argument("--embedding-dim", type=int, default=16)
    p.add_argument("--capacity", type=int, default=1 << 14, help="rows per table (TorchRec's num_embeddings)")
    p.add_argument("--dense-lr", type=float, default=3e-3)
    p.add_argument("--sparse-lr", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=50)
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    model = build_model(args.embedding_dim, args.capacity, args.sparse_lr, args.device)
    # Dense parameters only: the dynemb tables update themselves in backward (fused).
    dense_opt = torch.optim.Adam(model.parameters(), lr=args.dense_lr)
    task = ClickTask(args.vocab, args.seed)
    dense_h, kjt_h, click_h, logit_h = (t.to(args.device) for t in ClickTask(args.vocab, args.seed + 1).batch(4096))
    bce = torch.nn.functional.binary_cross_entropy_with_logits
    planted = bce(logit_h, click_h).item()

    def held_out() -> float:
        model.eval()
        with torch.no_grad():
            loss = bce(model(dense_h, kjt_h).squeeze(1), click_h).item()
        model.train()
        return loss

    before = held_out()
    print(f"DLRM on dynemb tables, ids over the whole int64 range; held-out loss {before:.4f} (planted signal {planted:.4f})")
    window: list[float] = []
    first = last = float("nan")
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        dense, kjt, click, _ = (t.to(args.device) for t in task.batch(args.batch_size))
        loss = bce(model(dense, kjt).squeeze(1), click)
        dense_opt.zero_grad()
        loss.backward()
        dense_opt.step()
        window.append(loss.item())
        if step % args.log_every == 0 or step == args.steps:
            mean = sum(window) / len(window)
            first = mean if first != first else first
            last = mean
            window.clear()
            rate = step / (time.perf_counter() - start)
            print(f"step {step:5d}  train loss {mean:.4f}  {rate:6.1f} steps/s", flush=True)
    after = held_out()
    ebc = model.sparse_arch.embedding_bag_collection
    sizes = {name: s["size"] for name, s in ebc.stats().items()}
    special = all(bool(ebc.collection.find(f"t_{f}", SPECIAL.to(args.device))[1].all()) for f in FEATURES)
    print(f"held-out loss {before:.4f} -> {after:.4f} (planted signal {planted:.4f}); keys per table {sizes}")
    print(f"ids 0, -1, int64 min and max trained in every table: {special}")
    return {
        "held_out_before": before,
        "held_out_after": after,
        "planted": planted,
        "first_train_loss": first,
        "last_train_loss": last,
        "special_ids_trained": special,
    }


if __name__ == "__main__":
    main(sys.argv[1:])
