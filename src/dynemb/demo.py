"""Demo: train a small click model on a synthetic click log with dynamic embedding tables.

    python -m dynemb.demo                 # CPU, under a minute on 2 cores
    python -m dynemb.demo --device cuda
    python -m dynemb.demo --tiers         # users' rows: a small device tier over a disk tier
    torchrun --nproc-per-node 2 -m dynemb.demo --distributed    # tables sharded over 2 processes

B samples per batch, K latent dim of the planted signal, D embedding dim, T tags per sample.

The click log is generated on the fly: user and item ids are Zipf-distributed ranks scrambled
into arbitrary int64 keys, from id spaces (10^9 users, 10^8 items) far larger than the tables'
capacities, so tables fill up and evict. Each user and item has a hidden latent vector derived
from its id; a click happens with probability sigmoid(scale * <user, item> + item bias). The
model (a collection of three dynamic tables, one of them read by two features, + an MLP over
their embeddings and the user-item product) learns the head of the distribution; held-out AUC ends well above 0.5 (about 0.67 with the defaults, the
planted signal's own AUC, its ceiling, being printed beside it).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

import dynemb
from dynemb.hashing import init_bits, mix64, unit_uniform

K = 8


def zipf_ranks(n: int, exponent: float, space: int, generator: torch.Generator) -> torch.Tensor:
    """n ranks in [1, space] from a continuous power law approximating Zipf(exponent) ([n] int64)."""
    u = torch.rand(n, generator=generator, dtype=torch.float64)
    a = 1.0 - exponent
    ranks = ((space**a - 1.0) * u + 1.0) ** (1.0 / a)
    return ranks.floor().clamp_(1, space).to(torch.int64)


def latent(keys: torch.Tensor, salt: int) -> torch.Tensor:
    """Hidden unit-variance Gaussian vector of each key ([n] -> [n, K]), fixed by (salt, key)."""
    bits = init_bits(keys, salt, 2 * K)
    u1 = unit_uniform(bits[:, :K], torch.float32).add_(2.0**-24)
    u2 = unit_uniform(bits[:, K:], torch.float32)
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2 * math.pi * u2)


class ClickLog:
    """Endless synthetic click log: (user [B], item [B], previous item [B], tags [B, T], click [B])."""

    def __init__(self, seed: int, num_tags: int = 3, scale: float = 1.5):
        self.gen = torch.Generator().manual_seed(seed)
        self.num_tags = num_tags
        self.scale = scale

    def batch(self, size: int) -> tuple[torch.Tensor, ...]:
        users = mix64(zipf_ranks(size, 1.1, 10**9, self.gen))
        items = mix64(zipf_ranks(size, 1.1, 10**8, self.gen) + (1 << 40))
        # The item the user saw before: another draw from the same catalogue (same table).
        previous = mix64(zipf_ranks(size, 1.1, 10**8, self.gen) + (1 << 40))
        # Tags: a few per item, determined by the item (a bag feature shared by related items).
        tag_ids = (items[:, None] + torch.arange(self.num_tags)) % 5000 + (1 << 50)
        logits = self.planted_logits(users, items)
        clicks = torch.bernoulli(torch.sigmoid(logits), generator=self.gen)
        return users, items, previous, tag_ids, clicks

    def planted_logits(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        dot = (latent(users, 1) * latent(items, 2)).sum(1) / math.sqrt(K)
        bias = latent(items, 3)[:, 0] - 0.5
        return self.scale * dot + bias


class ClickModel(torch.nn.Module):
    """A collection of three dynamic tables (``items`` read by two features) + an MLP over
    [user, item, previous item, tags, user * item] embeddings."""

    def __init__(self, dim: int, device: str, tier_dir: str | None = None):
        super().__init__()
        common = dict(embedding_dim=dim, device=device, check_mode="count", score_strategy="timestamp")
        # --tiers: the users' 2^17 rows live in a 2^13-row device tier over a disk tier.
        users = (
            dict(tiers=[dynemb.Tier("device", rows=1 << 13), dynemb.Tier("disk", rows=(1 << 17) - (1 << 13), path=tier_dir)])
            if tier_dir is not None
            else dict(capacity=1 << 17, init_capacity=1 << 14)
        )
        self.sparse = dynemb.DynamicEmbeddingBagCollection(
            [
                dynemb.TableConfig(name="users", feature_names=["user"], **users, **common),
                dynemb.TableConfig(name="items", feature_names=["item", "previous_item"], capacity=1 << 16, **common),
                dynemb.TableConfig(name="tags", feature_names=["tags"], capacity=1 << 13, pooling="mean", **common),
            ],
            optimizer=dynemb.optim.Adagrad(lr=0.05),
        )
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(5 * dim, 64),
            torch.nn.ReLU(),
            torch.nn.Linear(64, 1),
        ).to(device)

    def forward(self, users, items, previous, tags):
        B, T = tags.shape
        one = torch.ones(B, dtype=torch.int64, device=users.device)
        out = self.sparse(
            {
                "user": (users, one),
                "item": (items, one),
                "previous_item": (previous, one),
                "tags": (tags.reshape(-1), torch.full_like(one, T)),
            }
        )
        u, i = out["user"], out["item"]
        return self.mlp(torch.cat([out.concat, u * i], 1)).squeeze(1)


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve (Mann-Whitney U with average ranks for ties)."""
    order = torch.argsort(scores)
    ranks = torch.empty_like(scores, dtype=torch.float64)
    ranks[order] = torch.arange(1, len(scores) + 1, dtype=torch.float64)
    # Average ranks over ties.
    uniq, inverse = torch.unique(scores, return_inverse=True)
    sums = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inverse, ranks)
    counts = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inverse, torch.ones_like(ranks))
    ranks = (sums / counts)[inverse]
    pos = labels.bool()
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


class Progress:
    """One-line progress bar with steps/s and loss (plain lines when not on a terminal)."""

    def __init__(self, total: int, every: int = 50):
        self.total, self.every = total, every
        self.start = time.perf_counter()
        self.tty = sys.stderr.isatty()

    def update(self, step: int, loss: float) -> None:
        if not self.tty and step % self.every and step != self.total:
            return
        rate = step / (time.perf_counter() - self.start)
        width = 30
        done = int(width * step / self.total)
        line = f"[{'#' * done}{'.' * (width - done)}] step {step}/{self.total}  {rate:6.1f} steps/s  loss {loss:.4f}"
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)
        if self.tty and step == self.total:
            print(file=sys.stderr)


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--eval-samples", type=int, default=50_000)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--distributed",
        action="store_true",
        help="shard the tables over the processes of torchrun (gloo on CPU, NCCL with --device cuda); --batch-size is per process",
    )
    parser.add_argument("--tiers", action="store_true", help="keep the users table in a small device tier over a disk tier; print the tiers' figures")
    parser.add_argument("--tier-dir", default=None, help="directory of the disk tier (default: a temporary directory)")
    parser.add_argument("--plot", default="dynemb-tiers.png", help="with --tiers: where the plot of hit rate and tier fill goes (needs matplotlib)")
    args = parser.parse_args(argv)
    if args.tiers and args.distributed:
        parser.error("--tiers: run it in one process (the sharded demo keeps every row in memory)")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: CUDA is not available on this machine")

    rank, world = 0, 1
    if args.distributed:
        import torch.distributed as dist

        import dynemb.distributed

        if "RANK" not in os.environ:
            parser.error("--distributed: run under torchrun, e.g. torchrun --nproc-per-node 2 -m dynemb.demo --distributed")
        if args.device.startswith("cuda"):
            args.device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
            torch.cuda.set_device(args.device)
        dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(args.seed)
    # Each process draws its own samples; the planted signal is the same everywhere.
    log = ClickLog(args.seed + 7919 * rank)
    tier_dir = None
    if args.tiers:
        import tempfile

        tier_dir = args.tier_dir or tempfile.mkdtemp(prefix="dynemb-demo-tiers-")
        os.makedirs(tier_dir, exist_ok=True)
    model = ClickModel(args.dim, args.device, tier_dir)
    tier_history: list[tuple[int, list[dict]]] = []
    if args.distributed:
        dynemb.distributed.shard(model.sparse)
        model.mlp = torch.nn.parallel.DistributedDataParallel(model.mlp)
    dense_opt = torch.optim.Adam(model.mlp.parameters(), lr=3e-3)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    where = f"{world} processes x " if args.distributed else ""
    if rank == 0:
        print(f"dynemb demo: {args.steps} steps x {where}{args.batch_size} samples on {args.device}", file=sys.stderr)
    progress = Progress(args.steps) if rank == 0 else None
    smoothed = None
    model.train()
    for step in range(1, args.steps + 1):
        users, items, previous, tags, clicks = (t.to(args.device) for t in log.batch(args.batch_size))
        loss = loss_fn(model(users, items, previous, tags), clicks)
        dense_opt.zero_grad()
        loss.backward()
        dense_opt.step()
        smoothed = loss.item() if smoothed is None else 0.98 * smoothed + 0.02 * loss.item()
        if progress is not None:
            progress.update(step, smoothed)
        if args.tiers and (step % 10 == 0 or step == args.steps):
            tier_history.append((step, model.sparse.stats()["users"]["tiers"]))

    model.eval()
    held_out = ClickLog(args.seed + 1)
    users, items, previous, tags, clicks = held_out.batch(args.eval_samples)
    with torch.no_grad():
        scores = model(*(t.to(args.device) for t in (users, items, previous, tags))).cpu()
    model_auc = auc(scores, clicks)
    ceiling = auc(held_out.planted_logits(users, items), clicks)
    if rank == 0:
        print(f"held-out AUC: {model_auc:.4f}   (0.5 = chance; the planted signal itself scores {ceiling:.4f})")
        print(("rank  " if args.distributed else "") + f"{'table':<8}{'size':>9}{'capacity':>10}{'load':>7}{'inserts':>10}{'evictions':>11}{'failed':>8}")
    for r in range(world):
        # Each rank's shard, in rank order (a sharded table's stats are its rank's).
        if r == rank:
            for name, s in model.sparse.stats().items():
                print(
                    (f"{rank:<6}" if args.distributed else "")
                    + f"{name:<8}{s['size']:>9}{s['capacity']:>10}{s['load_factor']:>7.2f}{s['inserts']:>10}{s['evictions']:>11}{s['failed_inserts']:>8}",
                    flush=True,
                )
        if args.distributed:
            dist.barrier()
    if args.tiers:
        print_tiers(model.sparse.stats()["users"]["tiers"])
        plot_tiers(tier_history, args.plot)
    if args.distributed:
        dist.destroy_process_group()
    return model_auc


def print_tiers(tiers: list[dict]) -> None:
    """The users table's tiers: rows held, capacity, hits, misses, hit rate, promotions, demotions, bytes."""
    print(f"users' tiers:\n{'tier':<8}{'rows':>9}{'capacity':>10}{'hits':>10}{'misses':>10}{'hit rate':>9}{'promoted':>10}{'demoted':>10}{'MiB':>8}")
    for t in tiers:
        looked = t["hits"] + t["misses"]
        rate = t["hits"] / looked if looked else float("nan")
        print(
            f"{t['kind']:<8}{t['rows']:>9}{t['capacity']:>10}{t['hits']:>10}{t['misses']:>10}{rate:>9.3f}"
            f"{t['promotions']:>10}{t['demotions']:>10}{t['bytes'] / 2**20:>8.1f}"
        )


def plot_tiers(history: list[tuple[int, list[dict]]], path: str) -> None:
    """Hit rate of the fastest tier (per interval) and each tier's fill over the steps, to ``path``
    when matplotlib is installed (``pip install dynemb[plot]``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no plot: pip install matplotlib, or dynemb[plot], to draw hit rate and tier fill over steps)")
        return
    steps = [s for s, _ in history]
    rates, previous = [], None
    for _, tiers in history:
        hits, misses = tiers[0]["hits"], tiers[0]["misses"]
        if previous is not None:
            dh, dm = hits - previous[0], misses - previous[1]
            rates.append(dh / (dh + dm) if dh + dm else float("nan"))
        else:
            rates.append(hits / (hits + misses) if hits + misses else float("nan"))
        previous = (hits, misses)
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(7, 6))
    top.plot(steps, rates)
    top.set_ylabel(f"{history[0][1][0]['kind']} tier hit rate")
    top.set_ylim(0, 1)
    for i, tier in enumerate(history[0][1]):
        bottom.plot(steps, [tiers[i]["rows"] / tiers[i]["capacity"] for _, tiers in history], label=tier["kind"])
    bottom.set_ylabel("fill (rows / capacity)")
    bottom.set_xlabel("step")
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot of hit rate and tier fill: {path}")


if __name__ == "__main__":
    main()
