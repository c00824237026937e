"""``python -m dynemb.checkpoint inspect | verify`` (exit 0 ok, 1 CheckpointError, 2 usage) and
the progress bars of save / load.

The end-to-end cases run the module in a subprocess; the detailed ones call its ``main`` in
process (the same code, without paying an interpreter start each).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from ckpt_models import Model, train

import dynemb.checkpoint as ckpt
from dynemb.checkpoint import files
from dynemb.checkpoint.__main__ import main

HERE = Path(__file__).resolve().parent


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dynemb.checkpoint", *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A full checkpoint F and a delta D on it; returns (root, manifest of F, manifest of D)."""
    root = tmp_path_factory.mktemp("cli")
    model = Model("adam", "step", admission=True)
    train(model, range(6))
    ckpt.save(model, root / "F", chunk_rows=16)
    train(model, range(6, 9))
    ckpt.save_delta(model, root / "D", base=root / "F")
    return root, *(json.loads((root / n / files.MANIFEST).read_text()) for n in ("F", "D"))


@pytest.fixture
def copy(saved, tmp_path):
    root = saved[0]
    shutil.copytree(root, tmp_path / "ck")
    return tmp_path / "ck"


def _seal(d: Path, manifest: dict) -> None:
    data = json.dumps(manifest).encode()
    (d / files.MANIFEST).write_bytes(data)
    (d / files.MANIFEST_SHA).write_bytes(f"{hashlib.sha256(data).hexdigest()}  {files.MANIFEST}\n".encode())


def test_inspect_prints_tables_optimizer_steps_and_chain(saved):
    root, full, delta = saved
    r = run_cli("inspect", str(root / "D"))
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert f"delta checkpoint {delta['id']}" in out
    # The chain, full save first, with ids and paths.
    lines = out.splitlines()
    i = lines.index("delta chain (2, full first):")
    assert full["id"] in lines[i + 1] and lines[i + 1].strip().startswith("full") and str(root / "F") in lines[i + 1]
    assert delta["id"] in lines[i + 2] and lines[i + 2].strip().startswith("delta") and str(root / "D") in lines[i + 2]
    for name in ("seq", "bag", "ebc.user", "ebc.item", "ebc.tag"):
        t = delta["tables"][name]
        assert f"  {name}: " in out
        assert f"rows {t['rows']}, tombstones {t['tombstones']}, embedding_dim {t['embedding_dim']}, state_dim {t['state_dim']}, dtype float32" in out
    assert "optimizer: Adam(lr=0.05, betas=[0.9, 0.999], eps=1e-08, weight_decay=0.0)" in out
    assert "step 9, optimizer_step 9," in out
    assert "table 'item' of the collection at 'ebc'" in out


def test_inspect_json(saved, capsys):
    root, full, delta = saved
    assert main(["inspect", str(root / "D"), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert [c["id"] for c in s["chain"]] == [full["id"], delta["id"]]
    assert [c["kind"] for c in s["chain"]] == ["full", "delta"]
    assert s["kind"] == "delta" and s["id"] == delta["id"]
    for name, t in delta["tables"].items():
        got = s["tables"][name]
        assert (got["rows"], got["tombstones"], got["embedding_dim"], got["state_dim"], got["dtype"]) == (
            t["rows"],
            t["tombstones"],
            t["embedding_dim"],
            t["state_dim"],
            t["dtype"],
        )
        assert got["optimizer"] == {"type": "Adam", "hyper_parameters": {"lr": 0.05, "betas": [0.9, 0.999], "eps": 1e-08, "weight_decay": 0.0}}
        assert got["counters"]["step"] == 9 and got["counters"]["optimizer_step"] == 9
        assert got["admission"] and not got["layout"]
    assert main(["inspect", str(root / "F"), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert [c["id"] for c in s["chain"]] == [full["id"]] and all(t["layout"] for t in s["tables"].values())


def test_verify_ok(saved, capsys):
    root = saved[0]
    assert main(["verify", str(root / "D")]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"OK {root / 'D'}: 2 checkpoint(s)")


def test_verify_corrupt_file_exits_1_naming_it(copy):
    victim = sorted((copy / "F" / "tables" / "ebc.item").glob("rows-*.safetensors"))[0]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0x40
    victim.write_bytes(bytes(data))
    r = run_cli("verify", str(copy / "D"))
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert r.stdout == ""
    assert r.stderr.startswith("CheckpointError: ") and str(victim) in r.stderr and "SHA-256" in r.stderr


@pytest.mark.parametrize("problem", ["missing-base", "extra-file", "stale-manifest", "dim-lie", "duplicate-key"])
def test_verify_and_inspect_refuse(copy, capsys, problem):
    d = copy / "D"
    if problem == "missing-base":
        shutil.rmtree(copy / "F")
    elif problem == "extra-file":
        (d / "tables" / "seq" / "notes.txt").write_text("x")
    elif problem == "stale-manifest":
        (d / files.MANIFEST).write_text((d / files.MANIFEST).read_text().replace('"step": 9', '"step": 19'))
    elif problem == "dim-lie":
        # Sealed (checksums agree): only the tensors' shapes give it away.
        m = json.loads((d / files.MANIFEST).read_text())
        m["tables"]["ebc.tag"]["embedding_dim"] = 4
        _seal(d, m)
    else:
        # The same rows file listed under two chunk names: sizes and SHA-256 agree, keys repeat.
        m = json.loads((d / files.MANIFEST).read_text())
        t = m["tables"]["bag"]
        f = next(f for f in t["files"] if f["role"] == "rows")
        twin = {**f, "path": f["path"].replace("rows-000000", "rows-000009")}
        shutil.copy(d / f["path"], d / twin["path"])
        t["files"].append(twin)
        t["rows"] += f["rows"]
        _seal(d, m)
    assert main(["verify", str(d)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("CheckpointError: "), err
    expected_in_inspect = problem in ("missing-base", "stale-manifest")
    assert main(["inspect", str(d)]) == (1 if expected_in_inspect else 0)
    capsys.readouterr()


@pytest.mark.parametrize("args", [[], ["inspect"], ["check", "x"], ["verify", "a", "b"]])
def test_usage_errors_exit_2(args, capsys):
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_usage_error_subprocess():
    r = run_cli("verify")
    assert r.returncode == 2 and "usage:" in r.stderr


def test_progress_bars(tmp_path):
    """save / save_delta / load draw a tqdm bar on stderr with progress=True, nothing without."""
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(HERE)!r})
        import dynemb.checkpoint as ckpt
        from ckpt_models import Model, train
        m = Model("adam", "step", admission=True)
        train(m, range(4))
        ckpt.save(m, {str(tmp_path / "A")!r}, chunk_rows=8)
        ckpt.load(Model("adam", "step", admission=True), {str(tmp_path / "A")!r})
        print("@@", file=sys.stderr, flush=True)
        ckpt.save(m, {str(tmp_path / "B")!r}, chunk_rows=8, progress=True)
        print("@@", file=sys.stderr, flush=True)
        train(m, range(4, 6))
        ckpt.save_delta(m, {str(tmp_path / "C")!r}, base={str(tmp_path / "B")!r}, chunk_rows=8, progress=True)
        print("@@", file=sys.stderr, flush=True)
        ckpt.load(Model("adam", "step", admission=True), {str(tmp_path / "C")!r}, progress=True)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TQDM_DISABLE"}
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    quiet, save, delta, load = r.stderr.split("@@\n")
    assert quiet == "", quiet
    assert "dynemb save" in save and "rows" in save
    assert "dynemb save" in delta
    assert "dynemb" in load
