"""Integrity fuzz: a damaged checkpoint never loads as something else.

A full checkpoint ``F`` and a delta ``D`` on it (five tables, admission, evictions and erasures,
small chunks) are saved once. Each case copies them, applies one seeded random mutation to a file
of ``F`` or ``D`` (flipped bytes, truncation, appended bytes, a deleted, added, swapped or
replaced file, an edited manifest field with its checksum left stale or recomputed, ...) and
loads ``F`` or ``D`` into a trained model. The load must either

* raise ``dynemb.CheckpointError`` naming a path and the problem, with every table of the model
  unchanged, or
* load exactly what the undamaged checkpoint holds (the mutation changed nothing that matters,
  e.g. whitespace in a re-sealed manifest).

Any other exception is a bug. With ``verify=False`` (SHA-256 and the file listing are not
checked) a flipped data byte may load silently; there the fuzz checks only that nothing but
CheckpointError escapes and that a refused load changes nothing.
"""

from __future__ import annotations

import collections
import copy
import hashlib
import json
import random
import shutil
from pathlib import Path

import pytest
from ckpt_models import Model, digest, train

import dynemb
import dynemb.checkpoint as ckpt
from dynemb.checkpoint import files

CASES = 400
CASES_UNVERIFIED = 120
CHUNK_ROWS = 16


def make_model() -> Model:
    return Model("adam", "step", admission=True)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """Directory with F and D, the digest each loads to, and a trained victim model with its
    digest (each case loads into a copy)."""
    root = tmp_path_factory.mktemp("pristine")
    model = make_model()
    train(model, range(6))
    ckpt.save(model, root / "F", chunk_rows=CHUNK_ROWS)
    train(model, range(6, 10))
    model.seq.erase(model.seq.export().__next__()["keys"][:3])
    ckpt.save_delta(model, root / "D", base=root / "F", chunk_rows=CHUNK_ROWS)
    manifest = json.loads((root / "D" / files.MANIFEST).read_text())
    assert sum(t["tombstones"] for t in manifest["tables"].values()) > 0
    expected = {}
    for name in ("F", "D"):
        m = make_model()
        ckpt.load(m, root / name)
        expected[name] = digest(m)
    victim = make_model()
    train(victim, [150])
    return root, expected, victim, digest(victim)


# Each takes (rng, checkpoint dir) and returns a short description; one family per function.


def _files_of(d: Path) -> list[Path]:
    return sorted(p for p in d.rglob("*") if p.is_file())


def _data_files(d: Path) -> list[Path]:
    return [p for p in _files_of(d) if p.suffix == ".safetensors"]


def _pick_file(rng, d: Path) -> Path:
    # Manifest and checksum often; else any data file.
    r = rng.random()
    if r < 0.15:
        return d / files.MANIFEST
    if r < 0.2:
        return d / files.MANIFEST_SHA
    return rng.choice(_data_files(d))


def flip_bytes(rng, d):
    f = _pick_file(rng, d)
    data = bytearray(f.read_bytes())
    n = rng.choice([1, 1, 1, 2, 8])
    # Half the time inside the first 128 bytes (safetensors header, manifest head).
    for _ in range(n):
        i = rng.randrange(min(len(data), 128)) if rng.random() < 0.5 else rng.randrange(len(data))
        data[i] ^= rng.randrange(1, 256)
    f.write_bytes(bytes(data))
    return f"flip {n} byte(s) of {f.relative_to(d)}"


def truncate(rng, d):
    f = _pick_file(rng, d)
    data = f.read_bytes()
    n = rng.choice([0, 1, 8, rng.randrange(len(data)), len(data) - 1])
    f.write_bytes(data[:n])
    return f"truncate {f.relative_to(d)} to {n}"


def append(rng, d):
    f = _pick_file(rng, d)
    extra = rng.choice([b"\0", b" ", b"\n", rng.randbytes(rng.randrange(1, 64))])
    f.write_bytes(f.read_bytes() + extra)
    return f"append {len(extra)} byte(s) to {f.relative_to(d)}"


def delete(rng, d):
    f = _pick_file(rng, d)
    f.unlink()
    return f"delete {f.relative_to(d)}"


def add_file(rng, d):
    folder = rng.choice([d, d / "tables", *[p.parent for p in _data_files(d)], d / "tables" / "new"])
    folder.mkdir(parents=True, exist_ok=True)
    name = rng.choice(["rows-000999.safetensors", "x", ".hidden", "manifest.json.bak", "tombstones-000000.safetensors", "dense.safetensors"])
    src = rng.choice(_data_files(d))
    (folder / name).write_bytes(src.read_bytes() if rng.random() < 0.5 else rng.randbytes(rng.randrange(0, 100)))
    return f"add {(folder / name).relative_to(d)}"


def swap_files(rng, d):
    a, b = rng.sample(_data_files(d), 2)
    da, db = a.read_bytes(), b.read_bytes()
    a.write_bytes(db)
    b.write_bytes(da)
    return f"swap {a.relative_to(d)} <-> {b.relative_to(d)}"


def replace_by_dir(rng, d):
    f = _pick_file(rng, d)
    f.unlink()
    f.mkdir()
    return f"replace {f.relative_to(d)} by a directory"


# Manifest edits. "stale": the checksum file is left as it was (must always be refused);
# "sealed": it is recomputed, as if a buggy writer had produced the manifest.

_VALUES = [None, True, False, 0, 1, -1, 2, 1.5, 2**63, "", "x", "../x", "/etc/passwd", [], {}, [1], {"a": 1}, "float64", "bfloat16"]


def _paths(node, prefix=()):
    """Every (path, value) in a JSON tree."""
    yield prefix, node
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, (*prefix, i))


def _get(node, path):
    for k in path:
        node = node[k]
    return node


def _write_manifest(d: Path, manifest, sealed: bool, text: str | None = None) -> None:
    data = (text if text is not None else json.dumps(manifest, indent=1)).encode()
    (d / files.MANIFEST).write_bytes(data)
    if sealed:
        (d / files.MANIFEST_SHA).write_bytes(f"{hashlib.sha256(data).hexdigest()}  {files.MANIFEST}\n".encode())


def _read_manifest(d: Path) -> dict:
    return json.loads((d / files.MANIFEST).read_text())


def _edit_field(rng, d, sealed: bool):
    m = _read_manifest(d)
    # A sealed manifest may legitimately say another step count: counters are the manifest's own
    # data, covered by its checksum only; every other field is checked or ignored by a load.
    candidates = [(p, v) for p, v in _paths(m) if p and not (sealed and "counters" in p)]
    path, value = rng.choice(candidates)
    options = list(_VALUES)
    if isinstance(value, bool):
        options.append(not value)
    elif isinstance(value, int):
        options += [value + 1, value - 1, value * 2, -value]
    elif isinstance(value, str):
        options += [value + "x", value[:-1], value.upper(), rng.choice([v for _, v in _paths(m) if isinstance(v, str)])]
    new = rng.choice([o for o in options if not (type(o) is type(value) and o == value)])
    parent = _get(m, path[:-1])
    parent[path[-1]] = new
    _write_manifest(d, m, sealed)
    return f"{'sealed' if sealed else 'stale'} manifest {'.'.join(map(str, path))}: {value!r} -> {new!r}"


def _delete_field(rng, d, sealed: bool):
    m = _read_manifest(d)
    candidates = [p for p, v in _paths(m) if p and not (sealed and "counters" in p)]
    path = rng.choice(candidates)
    parent = _get(m, path[:-1])
    del parent[path[-1]]
    _write_manifest(d, m, sealed)
    return f"{'sealed' if sealed else 'stale'} manifest: delete {'.'.join(map(str, path))}"


def _lie(rng, d, sealed: bool):
    """Targeted lies: numbers that stay consistent with each other but not with the files."""
    m = _read_manifest(d)
    name = rng.choice(sorted(m["tables"]))
    t = m["tables"][name]
    rows_files = [f for f in t["files"] if f["role"] == "rows"]
    kind = rng.choice(
        [
            "rows",
            "dim",
            "state_dim",
            "dtype",
            "version",
            "kind",
            "base",
            "dotdot",
            "other_table",
            "drop_entry",
            "dup_entry",
            "swap_tables",
            "rename_table",
            "role",
            "format",
        ]
    )
    if kind == "rows" and rows_files:
        f = rng.choice(rows_files)
        delta = rng.choice([1, -1]) if f["rows"] else 1
        f["rows"] += delta
        t["rows"] += delta
    elif kind == "dim":
        t["embedding_dim"] = rng.choice([t["embedding_dim"] + 1, t["embedding_dim"] - 1 or 2, 8 if t["embedding_dim"] == 4 else 4])
    elif kind == "state_dim":
        t["state_dim"] = rng.choice([t["state_dim"] + 1, max(t["state_dim"] - 1, 0), 0])
    elif kind == "dtype":
        t["dtype"] = rng.choice(["float64", "bfloat16"])
    elif kind == "version":
        m["format_version"] = rng.choice([0, 2, "1", None, 1.5])
    elif kind == "format":
        m["format"] = rng.choice(["dynemb", "", None])
    elif kind == "kind":
        m["kind"] = {"full": "delta", "delta": "full"}[m["kind"]]
    elif kind == "base":
        if m["kind"] == "delta":
            m["base"] = rng.choice(
                [{**m["base"], "id": "0" * 32}, {**m["base"], "path": "../nowhere"}, {**m["base"], "path": "D"}, None, {"id": m["base"]["id"]}]
            )
        else:
            m["base"] = {"id": m["id"], "path": "."}
            m["kind"] = "delta"
    elif kind == "dotdot":
        f = rng.choice(t["files"])
        f["path"] = rng.choice([f"{files.table_dir(name)}/../{Path(f['path']).name}", f"{files.table_dir(name)}/x/../{Path(f['path']).name}", "/" + f["path"]])
    elif kind == "other_table":
        other = rng.choice([n for n in m["tables"] if n != name])
        f = rng.choice(t["files"])
        f["path"] = f"{files.table_dir(other)}/{Path(f['path']).name}"
    elif kind == "drop_entry":
        f = t["files"].pop(rng.randrange(len(t["files"])))
        if f["role"] in ("rows", "tombstones"):
            t["rows" if f["role"] == "rows" else "tombstones"] -= f["rows"]
    elif kind == "dup_entry":
        f = rng.choice(t["files"])
        t["files"].append(copy.deepcopy(f))
        if f["role"] in ("rows", "tombstones"):
            t["rows" if f["role"] == "rows" else "tombstones"] += f["rows"]
    elif kind == "swap_tables":
        other = rng.choice([n for n in m["tables"] if n != name])
        m["tables"][name], m["tables"][other] = m["tables"][other], m["tables"][name]
    elif kind == "rename_table":
        m["tables"][name + "x"] = m["tables"].pop(name)
    elif kind == "role":
        f = rng.choice(t["files"])
        f["role"] = rng.choice([r for r in ("rows", "tombstones", "admission", "generator", "layout", "dense") if r != f["role"]])
        if f["role"] in ("rows", "tombstones") and "rows" not in f:
            f["rows"] = 0
    else:
        kind = "none"
    _write_manifest(d, m, sealed)
    return f"{'sealed' if sealed else 'stale'} manifest lie {kind} in {name}"


def _reformat(rng, d, sealed: bool):
    """The same manifest, written otherwise (no-op when sealed)."""
    m = _read_manifest(d)
    text = rng.choice([json.dumps(m), json.dumps(m, indent=4, sort_keys=True), json.dumps(m, indent=1) + "\n"])
    _write_manifest(d, m, sealed, text)
    return f"{'sealed' if sealed else 'stale'} manifest reformatted"


def edit_stale(rng, d):
    return rng.choice([_edit_field, _delete_field, _lie, _reformat])(rng, d, False)


def edit_sealed(rng, d):
    return rng.choice([_edit_field, _edit_field, _delete_field, _lie, _lie, _lie, _reformat])(rng, d, True)


MUTATIONS = [flip_bytes, flip_bytes, truncate, append, delete, add_file, swap_files, replace_by_dir, edit_stale, edit_sealed, edit_sealed]


def _case(pristine, tmp_path, rng, verify: bool) -> tuple[str, str]:
    root, expected, template, before = pristine
    # A new directory per case (removing the last one costs more than the case).
    case = tmp_path / f"case{len(list(tmp_path.iterdir()))}"
    shutil.copytree(root, case)
    target = rng.choice(["F", "D", "D"])
    loaded = target if target == "D" else rng.choice(["F", "D"])
    mutation = rng.choice(MUTATIONS)
    what = f"{mutation.__name__} of {target}: " + mutation(rng, case / target)
    victim = copy.deepcopy(template)
    try:
        ckpt.load(victim, case / loaded, verify=verify)
    except dynemb.CheckpointError as e:
        # Unverified, a damaged key may surface only as keys that do not fit (no single file to name).
        assert (e.path or not verify) and e.problem, f"{what}: CheckpointError without a path or a problem: {e!r}"
        assert digest(victim) == before, f"{what}: refused ({e}) but the model changed"
        return "refused", what
    except Exception as e:
        raise AssertionError(f"{what}: load of {loaded} raised {type(e).__name__} (not CheckpointError): {e}") from e
    if verify:
        assert digest(victim) == expected[loaded], f"{what}: load of {loaded} succeeded with other contents (corrupt data loaded silently)"
        return "same", what
    return ("same" if digest(victim) == expected[loaded] else "other"), what


def test_fuzz_verified(pristine, tmp_path):
    rng = random.Random(9_000_001)
    outcomes = collections.Counter()
    by_kind = collections.defaultdict(collections.Counter)
    for _ in range(CASES):
        outcome, what = _case(pristine, tmp_path, rng, verify=True)
        outcomes[outcome] += 1
        by_kind[what.split(":")[0]][outcome] += 1
    # Nearly everything is refused; the rest are no-ops (a sealed reformat, an ignored field).
    assert outcomes["refused"] >= 0.8 * CASES, (outcomes, dict(by_kind))
    for kind, c in by_kind.items():
        if not kind.startswith("edit_sealed"):
            assert c["refused"] > 0, (kind, c)


def test_fuzz_unverified(pristine, tmp_path):
    """verify=False: only CheckpointError escapes, and a refused load changes nothing."""
    rng = random.Random(9_000_002)
    outcomes = collections.Counter()
    for _ in range(CASES_UNVERIFIED):
        outcome, _ = _case(pristine, tmp_path, rng, verify=False)
        outcomes[outcome] += 1
    assert outcomes["refused"] > CASES_UNVERIFIED // 2, outcomes


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: (d / files.MANIFEST_SHA).unlink(),
        lambda d: (d / files.MANIFEST).write_bytes((d / files.MANIFEST).read_bytes().replace(b'"step": ', b'"step": 1', 1)),
        lambda d: (d / "tables" / "seq" / "generator.safetensors").unlink(),
        lambda d: (d / "tables" / "seq" / "rows-000000.safetensors").write_bytes(b""),
        lambda d: (d / "tables" / "seq" / "stray.bin").write_bytes(b"x"),
    ],
    ids=["no-checksum", "step-edited", "missing-file", "empty-file", "extra-file"],
)
def test_named_problems(pristine, tmp_path, mutate):
    """A few mutations by hand: the error names the file concerned."""
    root = pristine[0]
    shutil.copytree(root / "F", tmp_path / "F")
    mutate(tmp_path / "F")
    with pytest.raises(dynemb.CheckpointError) as info:
        ckpt.load(make_model(), tmp_path / "F")
    assert info.value.path.startswith(str(tmp_path / "F")), info.value
