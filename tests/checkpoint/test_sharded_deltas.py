"""Delta checkpoints of sharded models (issue 15, "Nothing lost").

A model holding a DynamicEmbedding and a collection (two tables in one group, one in another) is
sharded over 2 and 4 ranks, trained and saved, then three deltas are saved on it: new keys only,
updates of existing rows (training and ``insert``), erases and evictions (small tables). Each
rank checks that its files of every delta hold exactly its changes: rows of the keys it owns that
were touched, tombstones of its keys that left (erased or evicted on it, as their owner). The
chains then load at 1 (unsharded), 3 and 4 ranks equal to a full save of the same state: tables
by key (embeddings, optimizer state, scores), counters, one further step, and a delta saved after
the sharded load.

A sharded delta used to be empty (0 rows, 0 tombstones, ``verify`` OK, the chain loaded as its
base): only full sharded saves and unsharded deltas were tested, and those tests compared what
loaded with the live model, which an empty delta on a base that already held the keys (or a
test without erases) can pass. These tests check each delta's own content.

G samples per global step (one id per input), W world size.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from ckpt_models import one_thread  # noqa: F401 (autouse fixture)
from safetensors.torch import load_file

import dynemb
import dynemb.checkpoint
import dynemb.distributed
from dynemb.checkpoint.__main__ import main as cli
from spawning import run_ranks

G = 24
INPUTS = ("seq", "user", "item", "tag")
TABLES = ("seq", "ebc.user", "ebc.item", "ebc.tag")  # checkpoint names; input i feeds TABLES[i]
# Rows per table over all ranks in the saving worlds: nothing is evicted before delta 3, which
# brings about twice as many keys as fit. The loading worlds hold everything at any world size.
SAVE_CAPACITY, LOAD_CAPACITY = 112, 1024
SAVE_WORLDS = (2, 4)
BASE_STEPS = range(0, 3)
# (what the delta holds, its training steps); delta k is delta-<k>.
DELTAS = (("new keys", range(3, 4)), ("updates", range(4, 5)), ("erases and evictions", range(5, 11)))
FURTHER = range(11, 12)
# Key index ranges each step draws from (keys are spread over int64 by _key); the update step
# draws from the keys already in the tables instead.
POOLS = {**dict.fromkeys(BASE_STEPS, (0, 40)), 3: (100, 200), **dict.fromkeys(DELTAS[2][1], (1000, 1600)), FURTHER[0]: (0, 1600)}


def _key(i: torch.Tensor) -> torch.Tensor:
    return (i - 300) * 1_000_000_007


class _Model(torch.nn.Module):
    """seq (a DynamicEmbedding) and ebc (user and item of dim 4 in one group, tag of dim 8), Adam
    everywhere (its step counts enter the update), step scores (deterministic)."""

    def __init__(self, capacity: int):
        super().__init__()
        kw = dict(capacity=capacity, bucket_capacity=8, score_strategy="step", check_mode="count")
        self.seq = dynemb.DynamicEmbedding(4, optimizer=dynemb.optim.Adam(lr=0.05), **kw)
        configs = [dynemb.TableConfig(name=n, feature_names=[n], embedding_dim=d, **kw) for n, d in (("user", 4), ("item", 4), ("tag", 8))]
        self.ebc = dynemb.DynamicEmbeddingBagCollection(configs, dynemb.optim.Adam(lr=0.05))

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        n = batch["seq"].numel()
        pooled = self.ebc({f: (batch[f], torch.ones(n, dtype=torch.int64)) for f in INPUTS[1:]}).concat  # [n, 16]
        out = torch.cat([self.seq(batch["seq"]), pooled], 1)  # [n, 20]
        return ((out * torch.linspace(-1, 1, out.shape[1])).sum(1) - 0.5).square().sum()


def _batch(step: int) -> dict[str, torch.Tensor]:
    """The global batch of ``step``: input -> keys [G]. The update step draws from the keys of the
    earlier steps only (all in the tables then), the others from their pool."""
    g = torch.Generator().manual_seed(500 + step)
    out = {}
    for name in INPUTS:
        if step in DELTAS[1][1]:
            seen = torch.unique(torch.cat([_batch(s)[name] for s in range(step)]))
            out[name] = seen[torch.randint(0, seen.numel(), (G,), generator=g)]
        else:
            out[name] = _key(torch.randint(*POOLS[step], (G,), generator=g))
    if step == 0:
        out["seq"][:2] = torch.tensor([-(2**63), 2**63 - 1])
    return out


def _train(model: _Model, steps, rank: int, world: int) -> None:
    """One fused update per step on this rank's G / world samples of the global batch."""
    n = G // world
    for step in steps:
        model({k: v[rank * n : (rank + 1) * n] for k, v in _batch(step).items()}).backward()


def _table(model: _Model, name: str):
    """(module, collection table name or None) of a checkpoint name."""
    return (model.seq, None) if name == "seq" else (model.ebc, name.split(".")[1])


def _local(model: _Model) -> dict[str, list[torch.Tensor]]:
    """Per table, this rank's keys [K], whole rows [K, D+S] and scores [K], by key."""
    out = {}
    for name in TABLES:
        module, t = _table(model, name)
        chunks = list(module.export() if t is None else module.export(t))
        # Every table holds keys here (an empty one would make cat raise).
        rows = torch.cat([torch.cat([c["embeddings"], c["optimizer_state"]], 1) for c in chunks])
        out[name] = _by_key(torch.cat([c["keys"] for c in chunks]), rows, torch.cat([c["scores"] for c in chunks]))
    return out


def _by_key(keys: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor) -> list[torch.Tensor]:
    order = torch.argsort(keys)
    return [keys[order], rows[order], scores[order]]


def _gathered(model: _Model, world: int) -> dict[str, list[torch.Tensor]]:
    """_local over every rank (``world`` ranks; 1: the model is not sharded)."""
    if world == 1:
        return _local(model)
    everyone = [None] * world
    dist.all_gather_object(everyone, _local(model))
    return {name: _by_key(*(torch.cat([part[name][i] for part in everyone]) for i in range(3))) for name in TABLES}


def _stats(model: _Model) -> dict:
    """Every table's stats() on this rank, without the scratch buffers (a cache, not state)."""
    out = {"seq": model.seq.stats(), **{f"ebc.{t}": s for t, s in model.ebc.stats().items()}}
    return {n: {k: v for k, v in s.items() if k != "scratch_bytes"} for n, s in out.items()}


def _same(got: dict, want: dict) -> None:
    """Equal tables: the same keys and scores, rows equal (assert_close defaults)."""
    for name in TABLES:
        (gk, grows, gs), (wk, wrows, ws) = got[name], want[name]
        assert torch.equal(gk, wk), (name, gk.numel(), wk.numel(), sorted(set(gk.tolist()) ^ set(wk.tolist()))[:6])
        torch.testing.assert_close(grows, wrows, msg=lambda m, name=name: f"{name}: {m}")
        assert torch.equal(gs, ws), name


def _rows(contents: dict) -> int:
    return sum(keys.numel() for keys, _, _ in contents.values())


def _rank_files(path: Path, table: str, rank: int) -> dict[str, set[int]]:
    """Keys of this rank's rows and tombstones files of ``table`` in the checkpoint at ``path``."""
    manifest = json.loads((path / "manifest.json").read_text())
    out = {"rows": set(), "tombstones": set()}
    for f in manifest["tables"][table]["files"]:
        if f["role"] in out and f"-r{rank:05d}-" in f["path"]:
            out[f["role"]].update(load_file(path / f["path"])["keys"].tolist())
    return out


def _save_world(rank: int, world: int, root: str) -> None:
    """Base, three deltas and a full save at the end, checking each rank's part of every delta;
    rank 0 writes the live contents and the counts each delta must hold."""
    d = Path(root) / f"w{world}"
    model = dynemb.distributed.shard(_Model(SAVE_CAPACITY))
    left = {name: set() for name in TABLES}  # keys that left this rank's shard since the last save
    model.seq.register_evict_hook(lambda keys, rows: left["seq"].update(keys.tolist()))
    model.ebc.register_evict_hook(lambda t, keys, rows: left[f"ebc.{t}"].update(keys.tolist()))
    _train(model, BASE_STEPS, rank, world)
    assert not any(left.values()), "the base steps evicted: raise SAVE_CAPACITY"
    dynemb.checkpoint.save(model, d / "base")
    base, expected = d / "base", []
    for k, (what, steps) in enumerate(DELTAS, 1):
        for keys in left.values():
            keys.clear()
        touched = {name: set() for name in TABLES}
        if what == "updates":
            # Every rank writes its own existing keys (rank r: every W-th one from the r-th).
            seen = {name: torch.unique(torch.cat([_batch(s)[i] for s in range(steps[0])])) for name, i in zip(TABLES, INPUTS)}
            for r in range(world):
                touched["seq"].update(seen["seq"][r::world][:3].tolist())
                touched["ebc.tag"].update(seen["ebc.tag"][r::world][:2].tolist())
            assert bool(model.seq.insert(seen["seq"][rank::world][:3], torch.full((3, 4), rank + 1.0)).all())
            assert bool(model.ebc.insert("tag", seen["ebc.tag"][rank::world][:2], torch.full((2, 8), -rank - 1.0)).all())
        erased = set()
        if what == "erases and evictions":
            # Every rank erases 4 keys (owned by any rank) and one that is not there.
            every = torch.unique(torch.cat([_batch(s)["seq"] for s in BASE_STEPS]))
            erased = {key for r in range(world) for key in every[r::world][:4].tolist()}
            found = model.seq.erase(torch.cat([every[rank::world][:4], torch.tensor([12345])]))
            assert found.tolist() == [True] * 4 + [False]
        _train(model, steps, rank, world)
        for s in steps:
            for name, i in zip(TABLES, INPUTS):
                touched[name].update(_batch(s)[i].tolist())
        if what != "erases and evictions":
            assert not any(left.values()), f"delta {k} ({what}) evicted: raise SAVE_CAPACITY"
        else:
            # Keys are evicted on every rank, from every table (the tombstones check below needs them).
            assert all(keys - erased for keys in left.values()), ({n: len(keys - erased) for n, keys in left.items()}, "lower SAVE_CAPACITY")
        path = d / f"delta-{k}"
        dynemb.checkpoint.save_delta(model, path, base=base)
        base = path
        held = {name: set(keys.tolist()) for name, (keys, _, _) in _local(model).items()}
        counts = {}
        for name in TABLES:
            files = _rank_files(path, name, rank)
            # Rows: this rank's keys touched since the last save; tombstones: its keys that left
            # (erased or evicted here, their owner) and are not back.
            assert files["rows"] == touched[name] & held[name], (k, name, len(files["rows"]), len(touched[name] & held[name]))
            assert files["tombstones"] == left[name] - held[name], (k, name, sorted(files["tombstones"] ^ (left[name] - held[name]))[:6])
            counts[name] = [len(files["rows"]), len(files["tombstones"]), len(left[name])]
        everyone = [None] * world
        dist.all_gather_object(everyone, counts)
        expected.append({name: [sum(c[name][j] for c in everyone) for j in range(3)] for name in TABLES})
    dynemb.checkpoint.save(model, d / "full")
    contents = _gathered(model, world)
    if rank == 0:
        torch.save(contents, d / "contents.pt")
        (d / "expected.json").write_text(json.dumps(expected))


def _load_and_compare(rank: int, world: int, root: str) -> int:
    """Load every saved chain and its full save at ``world`` ranks (1: unsharded): equal tables
    and counters, equal after one further step, and a delta saved now continues the chain.
    Returns the number of (table, key) rows compared after loading."""

    def fresh() -> _Model:
        model = _Model(LOAD_CAPACITY)
        return model if world == 1 else dynemb.distributed.shard(model)

    compared = 0
    for saved_at in SAVE_WORLDS:
        d = Path(root) / f"w{saved_at}"
        want = torch.load(d / "contents.pt")
        chain, full = fresh(), fresh()
        dynemb.checkpoint.load(chain, d / f"delta-{len(DELTAS)}")
        dynemb.checkpoint.load(full, d / "full")
        _same(_gathered(chain, world), want)
        _same(_gathered(full, world), want)
        compared += _rows(want)
        assert _stats(chain) == _stats(full)
        _train(chain, FURTHER, rank, world)
        _train(full, FURTHER, rank, world)
        after = _gathered(full, world)
        _same(_gathered(chain, world), after)
        assert _stats(chain) == _stats(full)
        # The loaded tables track their changes: a delta on the chain holds the further step.
        again = d / f"delta-{len(DELTAS) + 1}-at-{world}"
        dynemb.checkpoint.save_delta(chain, again, base=d / f"delta-{len(DELTAS)}")
        resumed = fresh()
        dynemb.checkpoint.load(resumed, again)
        _same(_gathered(resumed, world), after)
    return compared


def _load_world(rank: int, world: int, root: str) -> None:
    """Loads at ``world`` ranks; rank 0 records how many rows they compared."""
    compared = _load_and_compare(rank, world, root)
    if rank == 0:
        (Path(root) / f"loaded-at-{world}.json").write_text(json.dumps(compared))


def _save_and_load_world(rank: int, world: int, root: str) -> None:
    """The last saving world loads too, at its own world size (a world costs seconds to start)."""
    _save_world(rank, world, root)
    dist.barrier()
    _load_world(rank, world, root)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """Chains saved at 2 and 4 ranks under <root>/w<world>/ (each rank checks its files of every
    delta), then loaded at 4 ranks by the 4-rank world (see _load_and_compare)."""
    root = tmp_path_factory.mktemp("sharded-deltas")
    assert SAVE_WORLDS[-1] == 4
    for world in SAVE_WORLDS[:-1]:
        run_ranks(_save_world, world, str(root))
    run_ranks(_save_and_load_world, 4, str(root))
    return root


@pytest.mark.parametrize("world", SAVE_WORLDS)
def test_delta_manifests_count_every_rank_changes(saved, world):
    """The regression: each delta's manifest counts the rows and tombstones of every rank (the
    ranks checked their own files' keys); delta 1 holds exactly the new keys, delta 2 no
    tombstones, delta 3 tombstones for the erased and the evicted keys."""
    d = saved / f"w{world}"
    expected = json.loads((d / "expected.json").read_text())
    manifests = [json.loads((d / f"delta-{k}" / "manifest.json").read_text()) for k in range(1, len(DELTAS) + 1)]
    for k, (manifest, counts) in enumerate(zip(manifests, expected), 1):
        assert manifest["world_size"] == world and manifest["kind"] == "delta"
        for name in TABLES:
            entry = manifest["tables"][name]
            assert [entry["rows"], entry["tombstones"]] == counts[name][:2], (k, name)
            assert entry["rows"] > 0, (k, name)
    for name, i in zip(TABLES, INPUTS):
        new = torch.unique(torch.cat([_batch(s)[i] for s in DELTAS[0][1]])).numel()
        assert (manifests[0]["tables"][name]["rows"], manifests[0]["tables"][name]["tombstones"]) == (new, 0), name
        assert manifests[1]["tables"][name]["tombstones"] == 0, name
        _, tombstones, left = expected[2][name]
        # Evictions on every table; the seq table's 4 erased keys per rank as well.
        assert tombstones > (4 * world if name == "seq" else 0) and left >= tombstones, (name, expected[2][name])
    # The last delta carries the counters whole: those of the full save at the same state.
    full = json.loads((d / "full" / "manifest.json").read_text())
    for name in TABLES:
        assert manifests[-1]["tables"][name]["counters"] == full["tables"][name]["counters"], name
    assert full["tables"]["seq"]["counters"]["erased"] == 4 * world


def test_cli_reports_the_rows_and_tombstones_of_a_sharded_delta(saved, capsys):
    d = saved / "w2"
    manifest = json.loads((d / "delta-3" / "manifest.json").read_text())
    rows, tombstones = (sum(t[c] for t in manifest["tables"].values()) for c in ("rows", "tombstones"))
    assert rows > 0 and tombstones > 0
    line = f"delta {manifest['id']}  rows {rows}, tombstones {tombstones}"
    r = subprocess.run([sys.executable, "-m", "dynemb.checkpoint", "verify", str(d / "delta-3")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"OK {d / 'delta-3'}: 4 checkpoint(s)") and line in r.stdout, r.stdout
    assert cli(["inspect", str(d / "delta-3")]) == 0
    out = capsys.readouterr().out
    assert line in out
    for name, t in manifest["tables"].items():
        assert f"  {name}: " in out and f"rows {t['rows']}, tombstones {t['tombstones']}, " in out, name


def test_sharded_chains_load_unsharded_equal_a_full_save(saved):
    assert _load_and_compare(0, 1, str(saved)) == _rows_saved(saved)


def _rows_saved(root: Path) -> int:
    return sum(_rows(torch.load(root / f"w{w}" / "contents.pt")) for w in SAVE_WORLDS)


def test_sharded_chains_load_at_three_ranks_equal_a_full_save(saved):
    run_ranks(_load_world, 3, str(saved))
    assert json.loads((saved / "loaded-at-3.json").read_text()) == _rows_saved(saved)


def test_sharded_chains_load_at_four_ranks_equal_a_full_save(saved):
    """The 4-rank world of the fixture loaded both chains (its comparisons raise there); it
    compared every saved row."""
    assert json.loads((saved / "loaded-at-4.json").read_text()) == _rows_saved(saved)
