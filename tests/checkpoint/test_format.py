"""docs/format.md is enough to read a checkpoint without dynemb, and loads check every file.

K keys of a table, D embedding dim, S optimizer state columns.

``read_checkpoint`` below is a loader written from docs/format.md alone: it uses only ``json``,
``hashlib``, ``pathlib`` and ``safetensors.numpy`` (no dynemb, no torch). The tests compare what it
reads with the model's own export.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from ckpt_models import (
    Model,
    admission_state,
    assert_equal,
    contents,
    export,
    one_thread,  # noqa: F401 (autouse fixture)
    stats,
    tables_of,
    train,
)

import dynemb

# A reader written from docs/format.md.


def _manifest(directory: Path) -> dict:
    data = (directory / "manifest.json").read_bytes()
    sha_file = directory / "manifest.sha256"
    if sha_file.exists():
        assert sha_file.read_text() == f"{hashlib.sha256(data).hexdigest()}  manifest.json\n"
    manifest = json.loads(data)
    assert manifest["format"] == "dynemb-checkpoint" and manifest["format_version"] == 1
    return manifest


def _tensors(directory: Path, entry: dict) -> dict:
    from safetensors.numpy import load

    data = (directory / entry["path"]).read_bytes()
    assert len(data) == entry["bytes"] and hashlib.sha256(data).hexdigest() == entry["sha256"], entry["path"]
    return load(data)


def _table_dir(name: str) -> str:
    safe = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")
    return "tables/" + "".join(c if c in safe else "".join(f"%{b:02X}" for b in c.encode()) for c in name)


def read_checkpoint(path) -> tuple[dict, dict]:
    """(manifest of ``path``, per table {key: (embedding, optimizer_state, score)}) for a full
    checkpoint or a delta (its chain followed back to the full checkpoint)."""
    directory = Path(path)
    chain = [(directory, _manifest(directory))]
    while chain[-1][1]["kind"] == "delta":
        d, m = chain[-1]
        base = Path(m["base"]["path"])
        base = base if base.is_absolute() else d.parent / base
        chain.append((base, _manifest(base)))
        assert chain[-1][1]["id"] == m["base"]["id"]
    chain.reverse()
    assert chain[0][1]["kind"] == "full"
    assert chain[-1][1]["chain"] == [m["id"] for _, m in chain[:-1]]
    tables: dict[str, dict] = {}
    for directory, manifest in chain:
        listed = {"manifest.json"} | ({"manifest.sha256"} if (directory / "manifest.sha256").exists() else set())
        for name, entry in manifest["tables"].items():
            rows = tables.setdefault(name, {})
            D, S = entry["embedding_dim"], entry["state_dim"]
            for f in entry["files"]:
                assert f["path"].startswith(_table_dir(name) + "/")
                listed.add(f["path"])
            for f in entry["files"]:
                if f["role"] == "tombstones":
                    for key in _tensors(directory, f)["keys"].tolist():
                        rows.pop(key, None)
            n = 0
            for f in entry["files"]:
                if f["role"] == "rows":
                    t = _tensors(directory, f)
                    assert t["keys"].dtype.name == "int64" and t["scores"].dtype.name == "int64"
                    assert t["embeddings"].shape == (f["rows"], D) and t["optimizer_state"].shape == (f["rows"], S)
                    assert t["embeddings"].dtype.name == entry["dtype"]
                    for i, key in enumerate(t["keys"].tolist()):
                        rows[key] = (t["embeddings"][i], t["optimizer_state"][i], int(t["scores"][i]))
                    n += f["rows"]
            assert n == entry["rows"]
        present = {p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file()}
        assert present == listed | ({"dense.safetensors"} if "dense" in manifest else set())
    return chain[-1][1], tables


# The reader against the model.


STATE_COLUMNS = {"SGD": lambda D: 0, "Adagrad": lambda D: D, "RowWiseAdagrad": lambda D: 1, "Adam": lambda D: 2 * D}


def _check_against_model(path, model) -> None:
    manifest, tables = read_checkpoint(path)
    want = contents(model)
    assert set(tables) == set(want)
    model_stats = stats(model)
    for name, rows in tables.items():
        keys = sorted(rows)
        got = {
            "keys": torch.tensor(keys, dtype=torch.int64),
            "embeddings": torch.stack([torch.from_numpy(rows[k][0].copy()) for k in keys]),
            "optimizer_state": torch.stack([torch.from_numpy(rows[k][1].copy()) for k in keys]),
            "scores": torch.tensor([rows[k][2] for k in keys], dtype=torch.int64),
        }
        assert_equal(got, want[name], name)
        entry = manifest["tables"][name]
        D = entry["embedding_dim"]
        assert entry["state_dim"] == STATE_COLUMNS[entry["optimizer"]["type"]](D)
        assert entry["counters"]["step"] == model_stats[name]["step"]
        assert entry["counters"]["optimizer_step"] == model_stats[name]["optimizer_step"]
        assert entry["counters"]["erased"] == model_stats[name]["erased"]
        module, table = tables_of(model)[name]
        config = module.config if table is None else module.table_configs[module.table_names.index(table)]
        assert entry["config"]["capacity"] == config.capacity and entry["config"]["score_strategy"] == str(config.score_strategy)
        assert entry["kind"] == ("table" if table is None else "collection") and entry["table"] == table
        assert entry["optimizer"]["hyper_parameters"]["lr"] == module.optimizer.param_groups[0]["lr"]


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
def test_a_full_checkpoint_reads_with_json_and_safetensors_only(optimizer, tmp_path):
    model = Model(optimizer, "lfu", True)
    train(model, range(6))
    dynemb.checkpoint.save(model, tmp_path / "ckpt", chunk_rows=16)
    _check_against_model(tmp_path / "ckpt", model)
    manifest, _ = read_checkpoint(tmp_path / "ckpt")
    # Several rows files per table (chunk_rows), admission counts and the generator state.
    dirs = Path(tmp_path / "ckpt")
    for name, (module, table) in tables_of(model).items():
        files = {f["role"]: f for f in manifest["tables"][name]["files"]}
        assert sum(f["role"] == "rows" for f in manifest["tables"][name]["files"]) > 1
        adm = _tensors(dirs, files["admission"])
        live = admission_state(model)[name]
        assert sorted(zip(adm["keys"].tolist(), adm["counts"].tolist())) == sorted(zip(live["keys"].tolist(), live["counts"].tolist()))
        assert int(adm["rejections"]) == stats(model)[name]["admission_rejections"]
        if table is None:
            generator = module.engine.initializer.generator
        else:
            engine, segment, _ = module.location(table)
            generator = engine.initializers[segment].generator
        assert _tensors(dirs, files["generator"])["state"].tobytes() == generator.get_state().numpy().tobytes()


def test_a_delta_chain_reads_with_json_and_safetensors_only(tmp_path):
    model = Model("adam", "step", True)
    train(model, range(6))
    dynemb.checkpoint.save(model, tmp_path / "full")
    base = tmp_path / "full"
    for k in range(3):
        train(model, range(6 + 2 * k, 8 + 2 * k))
        for table in (model.seq, model.bag):
            table.erase(export(table, None)["keys"][:3])
        # Deltas may live elsewhere: the base path is relative to the delta's parent folder.
        path = tmp_path / f"deltas-{k}" / "d"
        dynemb.checkpoint.save_delta(model, path, base=base)
        base = path
    _check_against_model(base, model)
    manifest, _ = read_checkpoint(base)
    assert manifest["kind"] == "delta" and len(manifest["chain"]) == 3
    assert sum(t["tombstones"] for t in manifest["tables"].values()) > 0


def test_names_are_escaped_in_paths(tmp_path):
    configs = [dynemb.TableConfig(name="clicks/day 1", embedding_dim=4, capacity=32), dynemb.TableConfig(name="ünï", embedding_dim=4, capacity=32)]
    model = torch.nn.ModuleDict({"m": dynemb.DynamicEmbeddingBagCollection(configs, dynemb.optim.SGD(lr=0.1))})
    model["m"]({"clicks/day 1": (torch.arange(4), torch.tensor([2, 2])), "ünï": (torch.arange(4), torch.tensor([2, 2]))}).concat.sum().backward()
    dynemb.checkpoint.save(model, tmp_path / "ckpt")
    _, tables = read_checkpoint(tmp_path / "ckpt")
    assert set(tables) == {"m.clicks/day 1", "m.ünï"}
    assert (tmp_path / "ckpt" / "tables" / "m.clicks%2Fday%201").is_dir()
    assert (tmp_path / "ckpt" / "tables" / "m.%C3%BCn%C3%AF").is_dir()
    restored = torch.nn.ModuleDict({"m": dynemb.DynamicEmbeddingBagCollection(configs, dynemb.optim.SGD(lr=0.1))})
    dynemb.checkpoint.load(restored, tmp_path / "ckpt")
    for t in ("clicks/day 1", "ünï"):
        assert_equal(export(restored["m"], t), export(model["m"], t))


def test_a_single_table_at_the_root_is_named_table(tmp_path):
    table = dynemb.DynamicEmbedding(4, 32, optimizer=dynemb.optim.Adagrad(lr=0.1))
    table(torch.arange(5)).sum().backward()
    dynemb.checkpoint.save(table, tmp_path / "ckpt")
    manifest, tables = read_checkpoint(tmp_path / "ckpt")
    assert list(tables) == ["table"] and manifest["tables"]["table"]["module"] == ""


# Integrity: every file is checked before any table changes.


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A full checkpoint and a delta on it, written once; tests corrupt copies."""
    root = tmp_path_factory.mktemp("integrity")
    model = Model("adagrad", "step", True)
    train(model, range(5))
    dynemb.checkpoint.save(model, root / "full")
    train(model, range(5, 7))
    dynemb.checkpoint.save_delta(model, root / "delta", base=root / "full")
    return root


def _copy(checkpoints: Path, tmp_path: Path) -> Path:
    for name in ("full", "delta"):
        shutil.copytree(checkpoints / name, tmp_path / name)
    return tmp_path


def _rows_file(directory: Path, table: str = "bag") -> Path:
    entry = json.loads((directory / "manifest.json").read_text())["tables"][table]
    return directory / next(f["path"] for f in entry["files"] if f["role"] == "rows")


def _edit_manifest(directory: Path, edit) -> None:
    """Rewrite manifest.json through ``edit`` with a matching manifest.sha256: a writer that lies
    consistently, so that the checks below the manifest's own checksum are reached."""
    manifest = json.loads((directory / "manifest.json").read_text())
    edit(manifest)
    data = json.dumps(manifest, indent=1).encode()
    (directory / "manifest.json").write_bytes(data)
    if (directory / "manifest.sha256").exists():
        (directory / "manifest.sha256").write_text(f"{hashlib.sha256(data).hexdigest()}  manifest.json\n")


def _flip(path: Path, at: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0x10
    path.write_bytes(bytes(data))


def _file_entry(manifest: dict, table: str, role: str) -> dict:
    return next(f for f in manifest["tables"][table]["files"] if f["role"] == role)


def _set_rows(manifest: dict) -> None:
    _file_entry(manifest, "bag", "rows")["rows"] += 1
    manifest["tables"]["bag"]["rows"] += 1


CORRUPTIONS = {
    "flipped byte in a rows file": (lambda d: _flip(_rows_file(d)), lambda d: _rows_file(d)),
    "flipped byte in a rows file header": (lambda d: _flip(_rows_file(d), 0.01), lambda d: _rows_file(d)),
    "truncated rows file": (lambda d: _rows_file(d).write_bytes(_rows_file(d).read_bytes()[:-9]), lambda d: _rows_file(d)),
    "missing generator file": (lambda d: (d / "tables/ebc.user/generator.safetensors").unlink(), lambda d: d / "tables/ebc.user/generator.safetensors"),
    "missing admission file": (lambda d: (d / "tables/seq/admission.safetensors").unlink(), lambda d: d / "tables/seq/admission.safetensors"),
    "extra file": (lambda d: (d / "tables/seq/notes.txt").write_text("hi"), lambda d: d / "tables/seq/notes.txt"),
    "extra file at the top": (lambda d: (d / "README").write_text("hi"), lambda d: d / "README"),
    "wrong sha256 in the manifest": (
        lambda d: _edit_manifest(d, lambda m: _file_entry(m, "ebc.item", "rows").update(sha256="0" * 64)),
        lambda d: _rows_file(d, "ebc.item"),
    ),
    "wrong row count in the manifest": (lambda d: _edit_manifest(d, _set_rows), lambda d: _rows_file(d)),
    "wrong format_version": (lambda d: _edit_manifest(d, lambda m: m.update(format_version=2)), lambda d: d / "manifest.json"),
    "manifest edited without its checksum": (
        lambda d: (d / "manifest.json").write_text((d / "manifest.json").read_text().replace('"step": 5', '"step": 6', 1)),
        lambda d: d / "manifest.json",
    ),
    "missing manifest": (lambda d: (d / "manifest.json").unlink(), lambda d: d / "manifest.json"),
}


def _target() -> Model:
    """A model with tables of its own (to see that a failed load leaves them alone)."""
    model = Model("adagrad", "step", True, seed=9)
    train(model, range(20, 23))
    return model


def _snapshot(model) -> dict:
    return {"contents": contents(model), "stats": stats(model), "admission": admission_state(model)}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
@pytest.mark.parametrize("which", ["full", "base of the delta"])
def test_corrupt_checkpoints_raise_naming_the_file_before_any_change(corruption, which, checkpoints, tmp_path):
    root = _copy(checkpoints, tmp_path)
    corrupt, culprit = CORRUPTIONS[corruption]
    corrupt(root / "full")
    target = _target()
    before = _snapshot(target)
    with pytest.raises(dynemb.CheckpointError) as error:
        dynemb.checkpoint.load(target, root / ("full" if which == "full" else "delta"))
    assert error.value.path == str(culprit(root / "full")), str(error.value)
    assert str(culprit(root / "full")) in str(error.value)
    assert_equal(_snapshot(target), before)


@pytest.mark.parametrize("corruption", ["flipped byte in a rows file", "truncated rows file", "wrong row count in the manifest", "extra file"])
def test_corrupt_delta_raises_naming_the_file(corruption, checkpoints, tmp_path):
    root = _copy(checkpoints, tmp_path)
    corrupt, culprit = CORRUPTIONS[corruption]
    corrupt(root / "delta")
    target = _target()
    before = _snapshot(target)
    with pytest.raises(dynemb.CheckpointError) as error:
        dynemb.checkpoint.load(target, root / "delta")
    assert error.value.path == str(culprit(root / "delta")), str(error.value)
    assert_equal(_snapshot(target), before)


def test_verify_false_still_checks_sizes_and_tensors(checkpoints, tmp_path):
    """verify=False skips hashing only: a truncated file or a manifest whose row count lies
    still fails, naming the file."""
    for corruption in ("truncated rows file", "wrong row count in the manifest"):
        root = _copy(checkpoints, tmp_path / corruption.replace(" ", "-"))
        corrupt, culprit = CORRUPTIONS[corruption]
        corrupt(root / "full")
        target = _target()
        before = _snapshot(target)
        with pytest.raises(dynemb.CheckpointError) as error:
            dynemb.checkpoint.load(target, root / "full", verify=False)
        assert error.value.path == str(culprit(root / "full")), str(error.value)
        assert_equal(_snapshot(target), before)


def test_an_intact_copy_loads(checkpoints, tmp_path):
    """The corruption tests' control: the copies load when nothing is changed."""
    root = _copy(checkpoints, tmp_path)
    target = _target()
    dynemb.checkpoint.load(target, root / "delta")
    _, tables = read_checkpoint(root / "delta")
    assert {n: len(t) for n, t in tables.items()} == {n: s["size"] for n, s in stats(target).items()}
